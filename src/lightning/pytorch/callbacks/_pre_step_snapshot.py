# Copyright The Lightning AI team.
#
# Licensed under the Apache License, Version 2.0 (the "License");
# you may not use this file except in compliance with the License.
# You may obtain a copy of the License at
#
#     http://www.apache.org/licenses/LICENSE-2.0
#
# Unless required by applicable law or agreed to in writing, software
# distributed under the License is distributed on an "AS IS" BASIS,
# WITHOUT WARRANTIES OR CONDITIONS OF ANY KIND, either express or implied.
# See the License for the specific language governing permissions and
# limitations under the License.
"""Pairs each top-k checkpoint saved at the end of a training batch with the weights that produced its score.

A score logged in ``training_step`` was computed by the weights the batch started with, but
:class:`~lightning.pytorch.callbacks.ModelCheckpoint` saves at the end of the batch, after ``optimizer.step()``. With
``ModelCheckpoint(save_pre_optimizer_step_weights=True)``, a :class:`_PreStepCapture` copies, right before each
optimizer's first step in a batch that may save, the trainable parameters that optimizer owns (and its state, when the
checkpoint holds optimizer states), using torch's optimizer step pre-hooks. Everything else is read live when saving.
The copies are written in place of the live values through :meth:`~lightning.pytorch.trainer.trainer.Trainer.
save_checkpoint` and dropped at the end of the batch; the live model is never modified.

"""

import copy
import weakref
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any, Optional

import torch
from torch import Tensor
from torch.optim import Optimizer
from torch.optim.optimizer import register_optimizer_step_pre_hook
from torch.utils.hooks import RemovableHandle

import lightning.pytorch as pl
from lightning.pytorch.utilities.rank_zero import WarningCache, rank_zero_warn

if TYPE_CHECKING:
    from lightning.pytorch.callbacks.model_checkpoint import ModelCheckpoint
    from lightning.pytorch.trainer.connectors.logger_connector.result import _ResultMetric

#: Key of a checkpoint whose weights (and optimizer states) are from before the optimizer steps of its batch.
PRE_OPTIMIZER_STEP_KEY = "pre_optimizer_step"

#: Hooks that run before the optimizer steps of a training batch. A value logged in them was computed by the weights
#: the batch started with (``training_step`` computes its loss before it steps, also under manual optimization).
_PRE_STEP_HOOKS = frozenset({
    "on_train_batch_start",
    "training_step",
    "on_before_backward",
    "on_after_backward",
    "on_before_optimizer_step",
    "on_before_zero_grad",
})

# how the score of a save at the end of a batch pairs with the weights
_PRE = "pre"  # produced by the weights the batch started with: write the captured copies
_LIVE = "live"  # produced by the live weights, or not a training score: save as usual
_EPOCH = "epoch"  # an epoch aggregate, produced by no single set of weights: save as usual, say so once
_UNPAIRED = "unpaired"  # produced by weights that are gone: skip the top-k save
_MISSED = "missed"  # produced by the pre-step weights, which were not copied: save the live weights, say so once


class _PreStepCapture:
    """Captures, for one :class:`~lightning.pytorch.callbacks.ModelCheckpoint`, the weights a batch started with.

    Created in ``on_train_start`` by :meth:`start`, re-armed in every ``on_train_batch_start``, read and emptied in
    ``on_train_batch_end`` and stopped in ``on_train_end``, ``on_exception`` or ``teardown``, whichever comes first.

    """

    def __init__(self, trainer: "pl.Trainer", checkpoint: "ModelCheckpoint") -> None:
        self._trainer = trainer
        self._checkpoint = checkpoint
        self._warning_cache = WarningCache()
        self._with_optimizer_states = not checkpoint.save_weights_only
        # torch calls global step pre-hooks for every optimizer, also for those Lightning does not know
        self._global_handle: Optional[RemovableHandle] = register_optimizer_step_pre_hook(self._on_any_step)
        self._hooked: list[Optimizer] = []
        self._hooked_ids: set[int] = set()
        self._handles: list[RemovableHandle] = []
        # automatic optimization steps at most once per batch; manual optimization, as the module does
        self._max_steps_per_batch: Optional[int] = 1 if trainer.lightning_module.automatic_optimization else None
        self._enabled = True
        # the monitored metric's cached step value, to tell whether it was logged during a batch
        self._cache_at_start: Any = None
        self._logged_last_batch = False
        self._logged_in_last_batch_of_epoch = False  # noted before the epoch's results are reset
        self._kind: Optional[str] = None  # how the score paired at the end of the previous batch
        self._metric_key: Optional[tuple[int, int]] = None
        self._metric: Optional[_ResultMetric] = None
        self._module_param_set: Optional[set[Tensor]] = None
        # whether an optimizer owns trainable module parameters; weak, as the global hook sees optimizers of any owner
        self._changes_module: weakref.WeakKeyDictionary[Optimizer, bool] = weakref.WeakKeyDictionary()
        self._reset_batch(trainer.global_step)

    @classmethod
    def start(cls, trainer: "pl.Trainer", checkpoint: "ModelCheckpoint") -> Optional["_PreStepCapture"]:
        """Returns a capture for ``checkpoint``, or ``None`` with a warning when this trainer does not support it."""
        reason = _unsupported_reason(trainer, with_optimizer_states=not checkpoint.save_weights_only)
        if reason is not None:
            rank_zero_warn(
                f"`ModelCheckpoint(monitor={checkpoint.monitor!r}, save_pre_optimizer_step_weights=True)` saves the"
                f" live weights, after the optimizer step, as if the option were off: {reason}"
            )
            return None
        return cls(trainer, checkpoint)

    def stop(self) -> None:
        """Removes the hooks and drops the copies."""
        for handle in self._handles:
            handle.remove()
        if self._global_handle is not None:
            self._global_handle.remove()
        self._handles, self._hooked, self._hooked_ids, self._global_handle = [], [], set(), None
        self._module_param_set = None
        self._changes_module.clear()
        self._enabled = False
        self._reset_batch(self._trainer.global_step)

    # ------------------------------------------------------------------------------------------------------------
    # per batch
    # ------------------------------------------------------------------------------------------------------------
    def _reset_batch(self, global_step: int) -> None:
        self._armed = False
        self._stepped = False  # an optimizer stepped trainable parameters of the module in this batch
        self._reread = False  # the module's parameters were read again in this batch
        self._params: dict[Tensor, Tensor] = {}  # parameter -> its value before the batch's steps
        self._optimizer_states: dict[Optimizer, dict[Tensor, Optional[dict[str, Any]]]] = {}
        # each optimizer's param group hyperparameters (`lr`, ...) and the schedulers' states that set them
        self._param_groups: dict[Optimizer, list[dict[str, Any]]] = {}
        self._lr_schedulers: Optional[list[dict[str, Any]]] = None
        self._global_step = global_step

    def start_batch(self, trainer: "pl.Trainer") -> None:
        """Re-arms the capture: in every batch in which a save may trigger, and with the optimizers of this batch."""
        global_step = trainer.global_step
        self._reset_batch(global_step)
        metric = self._monitored_metric(trainer)
        cache = None if metric is None else metric._forward_cache
        if cache is None and metric is not None and metric.has_reset:
            self._logged_last_batch = self._logged_in_last_batch_of_epoch  # a new epoch reset the results
        else:
            self._logged_last_batch = cache is not None and cache is not self._cache_at_start
        self._logged_in_last_batch_of_epoch = False
        self._cache_at_start = cache
        if not self._enabled:
            return
        optimizers = list(trainer.optimizers)
        if len(optimizers) != len(self._hooked) or any(a is not b for a, b in zip(optimizers, self._hooked)):
            # the optimizers changed (or this is the first batch): hook the new ones
            for handle in self._handles:
                handle.remove()
            self._handles = [optimizer.register_step_pre_hook(self._on_step) for optimizer in optimizers]
            self._hooked, self._hooked_ids = optimizers, {id(optimizer) for optimizer in optimizers}
            self._module_param_set = None
        if self._kind in (_LIVE, _EPOCH) or (
            metric is None and self._checkpoint.monitor in trainer._logger_connector._callback_metrics
        ):
            return  # the score does not pair with the pre-step weights: a validation score, say
        self._armed = self._save_may_trigger(global_step)

    def end_epoch(self, trainer: "pl.Trainer") -> None:
        """Notes whether the monitored value was logged in the epoch's last batch, before the results are reset."""
        metric = self._monitored_metric(trainer)
        cache = None if metric is None else metric._forward_cache
        self._logged_in_last_batch_of_epoch = cache is not None and cache is not self._cache_at_start

    def _save_may_trigger(self, global_step: int) -> bool:
        checkpoint = self._checkpoint
        if checkpoint._train_time_interval is not None:
            return True  # the clock decides at the end of the batch
        every_n = checkpoint._every_n_train_steps
        if not self._max_steps_per_batch:
            return True  # how many steps a batch takes is not known yet (or no batch has stepped so far)
        next_multiple = (global_step // every_n + 1) * every_n
        return next_multiple <= global_step + self._max_steps_per_batch

    def _on_any_step(self, optimizer: Optimizer, args: Any, kwargs: Any) -> None:
        if id(optimizer) in self._hooked_ids:
            return  # handled by its own hook, `_on_step`
        if self._fitting():
            self._on_step(optimizer, args, kwargs)

    def _fitting(self) -> bool:
        """Whether this fit is training.

        A hook left behind by a fit that raised (a callback's ``on_exception`` raised before ``ModelCheckpoint``'s)
        must do nothing.

        """
        from lightning.pytorch.trainer.states import RunningStage, TrainerStatus

        state = self._trainer.state
        return state.stage is RunningStage.TRAINING and state.status is TrainerStatus.RUNNING

    def _on_step(self, optimizer: Optimizer, args: Any, kwargs: Any) -> None:
        """Runs before ``optimizer.step()``: copies what this step is about to change, once per batch."""
        if not self._armed:
            if not self._stepped and self._enabled:
                # not capturing: only note whether the module changes in this batch
                changes = self._changes_module.get(optimizer)
                if changes is None:
                    changes = self._changes_module[optimizer] = any(True for _ in self._trainable(optimizer))
                self._stepped = changes
            return
        if not self._fitting():
            return
        with torch.no_grad():
            self._copy_before(optimizer)

    def _copy_before(self, optimizer: Optimizer) -> None:
        trainer = self._trainer
        known = self._with_optimizer_states and any(optimizer is opt for opt in trainer.optimizers)
        states = self._optimizer_states.get(optimizer, {})
        # a parameter shared with an optimizer that stepped before is copied once, its state once per optimizer
        params = [p for p in self._trainable(optimizer) if p not in self._params or (known and p not in states)]
        if not params:
            return  # nothing of the module, or copied before this optimizer's first step in the batch
        if not self._stepped:
            self._stepped = True
            if self._score_cannot_enter_top_k(trainer):
                self._armed = False
                return
            if self._with_optimizer_states:
                # the schedulers and the learning rates they set, as they are before the batch's first step
                self._lr_schedulers = [copy.deepcopy(c.scheduler.state_dict()) for c in trainer.lr_scheduler_configs]
                self._param_groups = {opt: _hyperparameters(opt) for opt in trainer.optimizers}
        for p in params:
            if p not in self._params:
                self._params[p] = p.detach().clone()
        if known:
            states = self._optimizer_states.setdefault(optimizer, {})
            for p in params:
                states[p] = _clone_state(optimizer.state.get(p))

    def _trainable(self, optimizer: Optimizer) -> Iterator[Tensor]:
        """The parameters of the module that ``optimizer`` may change: those that require gradients."""
        module_params = self._module_params()
        for group in optimizer.param_groups:
            for p in group["params"]:
                if p.requires_grad and p not in module_params and not self._reread:
                    # new to the module since it was read (`add_param_group`, a swapped layer): read it again, once
                    self._reread, self._module_param_set = True, None
                    module_params = self._module_params()
                if p.requires_grad and p in module_params:
                    yield p

    def _module_params(self) -> set[Tensor]:
        if self._module_param_set is None:
            self._module_param_set = set(self._trainer.lightning_module.parameters())
            self._changes_module.clear()
        return self._module_param_set

    def _score_cannot_enter_top_k(self, trainer: "pl.Trainer") -> bool:
        """Whether the score that the save will rank is already known, before the step, and cannot enter the top-k.

        Only in a single process: with several, the decision would have to be agreed on by all ranks.

        """
        if trainer.world_size > 1:
            return False
        kind, value = self._pairing(trainer)
        if kind != _PRE or value is None:
            return False
        return not self._checkpoint.check_monitor_top_k(trainer, value)

    # ------------------------------------------------------------------------------------------------------------
    # pairing
    # ------------------------------------------------------------------------------------------------------------
    def _pairing(self, trainer: "pl.Trainer") -> tuple[Optional[str], Optional[Tensor]]:
        """How the monitored value, as it is now, pairs with the weights, and the value if it is known."""
        monitor = self._checkpoint.monitor
        metric = self._monitored_metric(trainer)
        if metric is None:
            return None, None  # not logged in training: a validation score, saved with the live weights as usual
        meta = metric.meta
        if not meta.on_step or (meta.forked and monitor == meta.forked_name(False)):
            return _EPOCH, None
        value = metric._forward_cache
        fresh = value is not None and value is not self._cache_at_start
        if meta.fx in _PRE_STEP_HOOKS:
            # logged in this batch before its steps: the weights the batch started with produced it
            return (_PRE, value) if fresh else (_UNPAIRED, None)
        if fresh:
            return _LIVE, None  # logged after the steps, before this save (e.g. a callback listed before it)
        # logged after the steps of the previous batch, e.g. in the module's `on_train_batch_end`: by the weights
        # this batch started with
        return (_PRE, value) if self._logged_last_batch else (_UNPAIRED, None)

    def end_batch(self, trainer: "pl.Trainer") -> Optional["_Pairing"]:
        """Decides how a top-k save at the end of this batch pairs its score with weights, and hands over the copies.

        Called at the start of every ``ModelCheckpoint.on_train_batch_end``; ``None`` when no save can trigger there.

        """
        global_step = trainer.global_step
        steps = global_step - self._global_step
        self._max_steps_per_batch = max(self._max_steps_per_batch or 0, steps)
        checkpoint = self._checkpoint
        if checkpoint._train_time_interval is None and global_step % checkpoint._every_n_train_steps:
            self._reset_batch(global_step)  # not a multiple of `every_n_train_steps`: this batch does not save
            return None
        kind, _ = self._pairing(trainer)
        self._kind = kind
        if kind == _PRE and not self._stepped:
            kind = _LIVE  # no step in this batch: the live weights are the ones it started with
        elif kind == _PRE and not self._armed:
            kind = _MISSED  # not captured: e.g. the batch took more optimizer steps than the batches before it
        pairing = _Pairing(
            self, kind, self._params, self._optimizer_states, self._param_groups, self._lr_schedulers, self._global_step
        )
        self._reset_batch(global_step)  # the copies now live only as long as the pairing
        return pairing

    def _monitored_metric(self, trainer: "pl.Trainer") -> Optional["_ResultMetric"]:
        """The metric logged during training under the monitored name, if any; looked up again when one is added."""
        results = trainer.fit_loop.epoch_loop._results
        key = (id(results), len(results))
        if self._metric_key != key:
            from lightning.pytorch.trainer.connectors.logger_connector.result import _ResultMetric

            monitor, found = self._checkpoint.monitor, None
            for metric in results.values():
                if isinstance(metric, _ResultMetric):
                    meta = metric.meta
                    if monitor in (meta.name, meta.forked_name(True), meta.forked_name(False)):
                        found = metric
            self._metric_key, self._metric = key, found
        return self._metric

    def warn(self, message: str) -> None:
        self._warning_cache.warn(message)


class _Pairing:
    """How a top-k save at the end of a batch pairs its score with weights, holding the copies it may write."""

    def __init__(
        self,
        capture: _PreStepCapture,
        kind: Optional[str],
        params: dict[Tensor, Tensor],
        optimizer_states: dict[Optimizer, dict[Tensor, Optional[dict[str, Any]]]],
        param_groups: dict[Optimizer, list[dict[str, Any]]],
        lr_schedulers: Optional[list[dict[str, Any]]],
        global_step: int,
    ) -> None:
        self.capture = capture
        self.kind = kind
        self._params = params
        self._optimizer_states = optimizer_states
        self._param_groups = param_groups
        self._lr_schedulers = lr_schedulers
        self._global_step = global_step
        self._written = False

    def save_topk(self, trainer: "pl.Trainer", checkpoint: "ModelCheckpoint", candidates: dict[str, Tensor]) -> None:
        """Runs the top-k save of ``checkpoint``, writing the pre-step weights where they produced the score."""
        capture, monitor = self.capture, checkpoint.monitor
        if self.kind == _EPOCH:
            capture.warn(
                f"`ModelCheckpoint(monitor={monitor!r}, save_pre_optimizer_step_weights=True)`: {monitor!r} is an"
                " epoch aggregate, produced by no single set of weights, so its checkpoints hold the live weights, as"
                " without the option. Log the value with `on_step=True` to pair it with the weights that produced it."
            )
        elif self.kind == _UNPAIRED:
            if checkpoint.check_monitor_top_k(trainer, candidates.get(monitor)):
                capture.warn(
                    f"`ModelCheckpoint(monitor={monitor!r}, save_pre_optimizer_step_weights=True)` skips top-k"
                    f" saves whose score it cannot pair: the weights that produced the {monitor!r} value it"
                    " would rank are gone. This happens when the value was not logged in this batch (or, from"
                    " `on_train_batch_end`, in the previous one)."
                )
            return
        if self.kind == _MISSED and checkpoint.check_monitor_top_k(trainer, candidates.get(monitor)):
            capture.warn(
                f"`ModelCheckpoint(monitor={monitor!r}, save_pre_optimizer_step_weights=True)` did not copy the weights"
                f" from before the optimizer steps of a batch whose {monitor!r} value enters the top-k, so its"
                " checkpoint holds the live weights, as without the option, and has no `pre_optimizer_step` key. This"
                " happens when a batch takes more optimizer steps than the batches before it, or when a value logged"
                " before the step could not enter the top-k and a new one logged after the step can."
            )
        if self.kind != _PRE:
            checkpoint._save_topk_checkpoint(trainer, candidates)
            return
        checkpoint._pre_step_pairing = self
        try:
            checkpoint._save_topk_checkpoint(trainer, candidates)
        finally:
            checkpoint._pre_step_pairing = None

    def save(self, trainer: "pl.Trainer", filepath: str, weights_only: bool) -> bool:
        """Writes a checkpoint holding the copies through ``trainer.save_checkpoint``; whether they were written."""
        connector = trainer._checkpoint_connector
        self._written = False
        connector._checkpoint_transform = self._write
        try:
            trainer.save_checkpoint(filepath, weights_only)
        finally:
            connector._checkpoint_transform = None
        if not self._written:
            self.capture.warn(
                f"A checkpoint of `ModelCheckpoint(monitor={self.capture._checkpoint.monitor!r},"
                " save_pre_optimizer_step_weights=True)` holds the live weights, after the optimizer step:"
                " `Trainer.save_checkpoint` did not build it with `dump_checkpoint`, or the module's state dict does"
                " not name its parameters as `named_parameters()` does."
            )
        return self._written

    def _write(self, checkpoint: dict[str, Any]) -> None:
        """Puts the copies in place of the live values in ``checkpoint``, only if all of them fit."""
        module = self.capture._trainer.lightning_module
        state_dict = checkpoint["state_dict"]
        replace = {}
        for name, param in module.named_parameters(remove_duplicate=False):
            value = self._params.get(param)
            if value is None:
                continue
            live = state_dict.get(name)
            if not isinstance(live, Tensor) or live.shape != value.shape or live.dtype != value.dtype:
                return
            replace[name] = value
        optimizer_states = checkpoint.get("optimizer_states")
        new_optimizer_states = None
        if optimizer_states is not None:
            optimizers = self.capture._trainer.optimizers
            if len(optimizer_states) != len(optimizers):
                return
            new_optimizer_states = [
                _with_captured_state(
                    state, optimizer, self._optimizer_states.get(optimizer), self._param_groups.get(optimizer)
                )
                for state, optimizer in zip(optimizer_states, optimizers)
            ]
            if any(state is None for state in new_optimizer_states):
                return
        state_dict.update(replace)
        if new_optimizer_states is not None:
            checkpoint["optimizer_states"] = new_optimizer_states
            if self._lr_schedulers is not None and len(self._lr_schedulers) == len(checkpoint["lr_schedulers"]):
                checkpoint["lr_schedulers"] = copy.deepcopy(self._lr_schedulers)
        checkpoint[PRE_OPTIMIZER_STEP_KEY] = {"global_step": self._global_step}
        self._written = True


def _with_captured_state(
    state: dict[str, Any],
    optimizer: Optimizer,
    captured: Optional[dict[Tensor, Optional[dict[str, Any]]]],
    hyperparameters: Optional[list[dict[str, Any]]],
) -> Optional[dict[str, Any]]:
    """``optimizer.state_dict()`` output ``state`` with what was captured before the step put back.

    That is the per-parameter states and each param group's hyperparameters. Returns ``None`` if the param groups
    changed since.

    """
    packed_groups = state["param_groups"]
    if hyperparameters is not None and len(hyperparameters) != len(packed_groups):
        return None
    if not captured and hyperparameters is None:
        return state
    per_param = dict(state["state"])
    for group, packed in zip(optimizer.param_groups, packed_groups):
        for param, index in zip(group["params"], packed["params"]):
            if captured and param in captured:
                before = captured[param]
                if before is None:
                    per_param.pop(index, None)  # the step created it
                else:
                    per_param[index] = before
    if hyperparameters is not None:
        packed_groups = [{**packed, **before} for packed, before in zip(packed_groups, hyperparameters)]
    return {**state, "state": per_param, "param_groups": packed_groups}


def _hyperparameters(optimizer: Optimizer) -> list[dict[str, Any]]:
    """Each param group's hyperparameters (``lr``, ``betas``, ...), without its parameters."""
    return [
        {key: copy.deepcopy(value) for key, value in group.items() if key != "params"}
        for group in optimizer.param_groups
    ]


def _clone_state(state: Optional[dict[str, Any]]) -> Optional[dict[str, Any]]:
    if not state:
        return None
    return {
        key: value.detach().clone() if isinstance(value, Tensor) else copy.deepcopy(value)
        for key, value in state.items()
    }


def _unsupported_reason(trainer: "pl.Trainer", with_optimizer_states: bool) -> Optional[str]:
    """Why the pre-step weights cannot be written with this trainer, or ``None`` if they can."""
    from lightning.pytorch.callbacks.stochastic_weight_avg import StochasticWeightAveraging
    from lightning.pytorch.callbacks.weight_averaging import WeightAveraging
    from lightning.pytorch.strategies import DeepSpeedStrategy, Strategy

    strategy = trainer.strategy
    if isinstance(strategy, DeepSpeedStrategy) or (
        type(strategy).lightning_module_state_dict is not Strategy.lightning_module_state_dict
    ):
        return f"`{type(strategy).__name__}` builds the checkpoint's weights itself (e.g. from shards)."
    for optimizer in trainer.optimizers:
        if isinstance(optimizer, torch.optim.LBFGS):
            return (
                "`LBFGS` evaluates the closure several times in one step, so the logged score comes from weights in"
                " the middle of the step."
            )
    for callback in trainer.callbacks:
        if isinstance(callback, (WeightAveraging, StochasticWeightAveraging)):
            return f"`{type(callback).__name__}` writes averaged weights, not the weights of any single step."
    if with_optimizer_states:
        if type(strategy).optimizer_state is not Strategy.optimizer_state:
            return f"`{type(strategy).__name__}` builds the checkpoint's optimizer states itself."
        for optimizer in trainer.optimizers:
            if hasattr(optimizer, "consolidate_state_dict") or type(optimizer).state_dict is not Optimizer.state_dict:
                return (
                    f"`{type(optimizer).__name__}` has its own state dict format. With `save_weights_only=True`,"
                    " the pre-step weights can be saved."
                )
    return None
