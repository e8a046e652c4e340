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
"""The state from before a training batch's first optimizer step, for ``ModelCheckpoint``'s top-k files."""

import time
from typing import TYPE_CHECKING, Any, Optional

import torch
from lightning_utilities.core.apply_func import apply_to_collection
from torch import Tensor

import lightning.pytorch as pl
from lightning.pytorch.utilities.rank_zero import WarningCache, rank_zero_warn

if TYPE_CHECKING:
    from lightning.pytorch.callbacks.model_checkpoint import ModelCheckpoint

#: Key of a checkpoint that holds the state from before the first optimizer step of the batch at whose end it was saved.
PRE_OPTIMIZER_STEP_KEY = "pre_optimizer_step"


class _PreOptimizerStepState:
    """The state from before a batch's first optimizer step, for one ``ModelCheckpoint``.

    It is written in place of the live state in the top-k files saved at the end of that batch, when the monitored
    value was logged before that step.
    """

    def __init__(self, trainer: "pl.Trainer", checkpoint: "ModelCheckpoint") -> None:
        self._checkpoint = checkpoint
        self._named_params = list(trainer.lightning_module.named_parameters(remove_duplicate=False))
        # how many optimizer steps the batches took (0 under gradient accumulation); one under automatic optimization
        self._steps_per_batch = {1} if trainer.lightning_module.automatic_optimization else set()
        self._batch_seconds = 0.0  # how long the last batch took, to predict a `train_time_interval` save
        self._warning_cache = WarningCache()
        self._in_batch = self._started = False  # in a batch now; and since the fit started
        self._start_step, self._start_time = 0, 0.0
        self._free()

    def _free(self) -> None:
        self.copy: Optional[dict[str, Any]] = None
        self._versions: list[tuple[Tensor, int]] = []
        self._start_value: Optional[Tensor] = None
        self._step_value: Optional[Tensor] = None  # the monitored value at the batch's first optimizer step
        self._deferred_value: Optional[Tensor] = None  # the value at the end of a batch whose save waits for validation
        self._deferred_reason: Optional[str] = None  # and why its file cannot hold the pre-step state, if it cannot
        self._armed = self._stepped = self._outside = False

    @classmethod
    def for_fit(cls, trainer: "pl.Trainer", checkpoint: "ModelCheckpoint") -> Optional["_PreOptimizerStepState"]:
        """The state holder of ``checkpoint`` for this fit, or ``None`` with a warning if it cannot work here."""
        if (reason := _unsupported_reason(trainer, with_states=not checkpoint.save_weights_only)) is None:
            return cls(trainer, checkpoint)
        rank_zero_warn(f"`save_pre_optimizer_step_state=True` saves the live state, as if it were off: {reason}")
        return None

    def on_train_batch_start(self, trainer: "pl.Trainer") -> None:
        self._free()
        self._in_batch = self._started = True
        self._start_step, self._start_time = trainer.global_step, time.monotonic()
        self._armed = self._can_save(self._steps_per_batch)
        if self._armed:  # `callback_metrics` builds a dict of every logged value: only where a save can follow
            self._versions = [(p, p._version) for _, p in self._named_params if p.requires_grad]
            self._start_value = trainer.callback_metrics.get(self._checkpoint.monitor)  # type: ignore[arg-type]

    def _can_save(self, steps: set[int]) -> bool:
        """Whether the batch can end on a save if it takes one of ``steps`` optimizer steps (any, if none is known)."""
        checkpoint = self._checkpoint
        if checkpoint._train_time_interval is not None:
            # whether the batch ends after the interval, if it takes 1.5 times as long as the one before
            elapsed = self._start_time - (checkpoint._last_time_checked or 0.0) + 1.5 * self._batch_seconds
            return elapsed >= checkpoint._train_time_interval.total_seconds()
        return not steps - {0} or any((self._start_step + k) % checkpoint._every_n_train_steps == 0 for k in steps)

    def on_before_optimizer_step(self, trainer: "pl.Trainer") -> None:
        if not self._started:  # a step outside a batch (in `on_train_epoch_end`) comes after its saves, and is fine
            self._warning_cache.warn(
                "`save_pre_optimizer_step_state=True` saves the live state: `ModelCheckpoint.on_train_batch_start` did"
                " not run (an override that does not call `super()`)."
            )
        if self._stepped or not self._in_batch:
            return
        self._stepped = True
        # the batch steps, so it can end on a save only after as many steps as a batch that stepped took
        self._armed = self._armed and self._can_save(self._steps_per_batch - {0})
        if not self._armed:
            return
        self._step_value = value = trainer.callback_metrics.get(self._checkpoint.monitor)  # type: ignore[arg-type]
        if not self._logged_in_batch(value) or not self._can_enter_top_k(value):  # type: ignore[arg-type]
            return
        self._outside = any(p._version != version for p, version in self._versions)
        if self._outside:  # an in-place update Lightning did not see: the state the batch started with is gone
            return
        trained = {p for p, _ in self._versions}  # with those that `toggle_optimizer` froze since the batch started
        clones: dict[Tensor, Tensor] = {}  # a tied parameter is copied once
        for _, p in self._named_params:
            if (p.requires_grad or p in trained) and p not in clones:
                clones[p] = p.detach().clone()
        states: dict[str, Any] = {}
        if not self._checkpoint.save_weights_only:  # state dicts that hold the live tensors, copied below
            states["optimizer_states"] = [optimizer.state_dict() for optimizer in trainer.optimizers]
            states["lr_schedulers"] = [config.scheduler.state_dict() for config in trainer.lr_scheduler_configs]
        states = apply_to_collection(states, Tensor, torch.clone)
        params = {name: (p, clones[p]) for name, p in self._named_params if p in clones}
        self.copy = {"global_step": trainer.global_step, "params": params, "states": states}

    def _logged_in_batch(self, value: Optional[Tensor]) -> bool:
        """Whether ``value`` was logged since the batch started: every ``self.log`` call stores a new tensor."""
        return value is not None and (self._start_value is None or not _same(value, self._start_value))

    def _can_enter_top_k(self, value: Tensor) -> bool:
        checkpoint = self._checkpoint
        if checkpoint.save_top_k == -1 or len(checkpoint.best_k_models) < checkpoint.save_top_k:
            return True
        monitor_op = {"min": torch.lt, "max": torch.gt}[checkpoint.mode]
        return bool(monitor_op(value, checkpoint.best_k_models[checkpoint.kth_best_model_path]))

    def defer_to_validation(self, trainer: "pl.Trainer") -> None:
        """Keeps the copy for the batch-end save that ``ModelCheckpoint`` defers to the end of validation."""
        self._deferred_value = trainer.callback_metrics.get(self._checkpoint.monitor)  # type: ignore[arg-type]
        self._deferred_reason = self._why_live(trainer, self._deferred_value)

    def on_train_batch_end(self, trainer: "pl.Trainer") -> None:
        """Drops what the batch held, but the copy for a save deferred to the end of validation."""
        steps = trainer.global_step - self._start_step
        if self._stepped or steps == 0:
            self._steps_per_batch.add(steps)
        self._batch_seconds, self._in_batch = time.monotonic() - self._start_time, False
        if self._deferred_value is None:
            self._free()

    def on_validation_end(self) -> None:
        """Drops what a save deferred to the end of validation held."""
        self._free()

    def _why_live(self, trainer: "pl.Trainer", value: Optional[Tensor]) -> Optional[str]:
        """Why a save with ``value`` cannot hold the state from before the batch's first step, or ``None``."""
        monitor, steps = self._checkpoint.monitor, trainer.global_step - self._start_step
        if (value is None and monitor in ("epoch", "step")) or not (self._armed or self._stepped or steps):
            return None  # the trainer's count ranks the live state; or the batch did not step, so it computed the value
        if not self._armed:
            if self._checkpoint._train_time_interval is not None:
                return "the save came sooner than the batch times before predicted, so nothing was copied"
            known = sorted(self._steps_per_batch)
            return f"the batch took {steps} optimizer step(s) where those before took {known}, so nothing was copied"
        if not self._logged_in_batch(value):
            return f"{monitor!r} was not logged during the batch (an epoch aggregate, a validation score, an old value)"
        if self._stepped and (self._step_value is None or not _same(value, self._step_value)):  # type: ignore[arg-type]
            return (
                f"{monitor!r} was logged after the batch's first optimizer step, so the state before it may not have"
                " computed it: log it in `training_step` before the step"
            )
        if self._outside or (not self._stepped and any(p._version != v for p, v in self._versions)):
            return (
                "the weights changed in a step that `on_before_optimizer_step` did not see (`use_pl_optimizer=False`,"
                " or an override of the hook that does not call `super()`)"
            )
        if self._stepped and self.copy is None:
            return "the value logged before the optimizer step was not expected to enter the top-k"
        return None

    def save_checkpoint(self, trainer: "pl.Trainer", filepath: str) -> None:
        """Writes a top-k file: at the end of a batch with the copy, or with the live state and a warning."""
        checkpoint = self._checkpoint
        value = trainer.callback_metrics.get(checkpoint.monitor)  # type: ignore[arg-type]
        # a save outside a batch, or one deferred to validation that validation's value ranks, is as without the option
        deferred = self._deferred_value is not None and value is not None and _same(value, self._deferred_value)
        in_batch = self._in_batch or deferred
        reason = None if not in_batch else self._deferred_reason if deferred else self._why_live(trainer, value)
        if in_batch and reason is None and self.copy is not None:
            with trainer.profiler.profile("save_checkpoint"):  # as `Trainer.save_checkpoint`, with the copy in place
                dumped = trainer._checkpoint_connector.dump_checkpoint(checkpoint.save_weights_only)
                if (reason := _write(self.copy, dumped, trainer.lightning_module)) is not None:
                    self._named_params = list(trainer.lightning_module.named_parameters(remove_duplicate=False))
                trainer.strategy.save_checkpoint(dumped, filepath)
                trainer.strategy.barrier("Trainer.save_checkpoint")
        else:
            trainer.save_checkpoint(filepath, checkpoint.save_weights_only)
        if reason is not None:
            self._warning_cache.warn(
                f"A top-k checkpoint of `ModelCheckpoint(monitor={checkpoint.monitor!r},"
                f" save_pre_optimizer_step_state=True)` holds the live state, after the optimizer step: {reason}."
            )


def _write(copied: dict[str, Any], checkpoint: dict[str, Any], module: "pl.LightningModule") -> Optional[str]:
    """Puts the copy in place of the live values in ``checkpoint``, or says why it cannot."""
    params, state_dict = copied["params"], checkpoint["state_dict"]
    named = module.named_parameters(remove_duplicate=False)
    if any(p.requires_grad and params.get(name, (None,))[0] is not p for name, p in named):
        return "the module's parameters changed during the fit"
    if any(name not in state_dict or state_dict[name].data_ptr() != p.data_ptr() for name, (p, _) in params.items()):
        return "the checkpoint's weights are not the module's parameters (a `state_dict` or `on_save_checkpoint` hook)"
    states = copied["states"] if "optimizer_states" in checkpoint else {}
    if states and len(states["optimizer_states"]) != len(checkpoint["optimizer_states"]):
        return "the number of optimizers changed"
    state_dict.update({name: clone for name, (_, clone) in params.items()})
    checkpoint.update(states)
    checkpoint[PRE_OPTIMIZER_STEP_KEY] = {"global_step": copied["global_step"]}
    return None


def _same(a: Tensor, b: Tensor) -> bool:
    return a.data_ptr() == b.data_ptr()


def _unsupported_reason(trainer: "pl.Trainer", with_states: bool) -> Optional[str]:
    """Why the pre-step state cannot be written with this trainer, or ``None`` if it can."""
    from lightning.pytorch.callbacks import StochasticWeightAveraging, WeightAveraging
    from lightning.pytorch.strategies import DeepSpeedStrategy, Strategy

    cls = type(trainer.strategy)
    if type(trainer).save_checkpoint is not pl.Trainer.save_checkpoint:
        return "`Trainer.save_checkpoint` is overridden, and the file is written without it."
    if issubclass(cls, DeepSpeedStrategy) or cls.lightning_module_state_dict != Strategy.lightning_module_state_dict:
        return f"`{cls.__name__}` builds the checkpoint's weights itself (from shards)."
    if any(isinstance(optimizer, torch.optim.LBFGS) for optimizer in trainer.optimizers):
        return "`LBFGS` runs the closure several times in one step, so the score is from inside the step."
    if any(isinstance(c, (WeightAveraging, StochasticWeightAveraging)) for c in trainer.callbacks):
        return "a weight averaging callback writes averaged weights."
    if with_states and (
        cls.optimizer_state is not Strategy.optimizer_state
        or any(hasattr(optimizer, "consolidate_state_dict") for optimizer in trainer.optimizers)
    ):
        return "the optimizer states are sharded; with `save_weights_only=True`, the pre-step weights can be saved."
    return None
