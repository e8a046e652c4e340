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
"""The state at a training batch's optimizer steps, for ``ModelCheckpoint(save_pre_optimizer_step_state=True)``."""

import copy
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any, Optional

import torch
from torch import Tensor

import lightning.pytorch as pl
from lightning.pytorch.utilities.rank_zero import WarningCache, rank_zero_warn

if TYPE_CHECKING:
    from lightning.pytorch.callbacks.model_checkpoint import ModelCheckpoint

#: Further values of the tensors that no optimizer steps (buffers, frozen weights) are kept up to this many bytes.
_MORE_VALUES_BYTES = 1 << 20


class _PreOptimizerStepState:
    """The state at each optimizer step of the current training batch, for the checkpoints with the option.

    One instance per fit, owned by the first such ``ModelCheckpoint`` and shared with the others, holds at most one
    copy of the state: each parameter and its optimizer state as before its first update in the batch, and the other
    tensors of the module: buffers as at the batch start, which the forward then updates (BatchNorm's statistics,
    spectral norm's vectors), other weights as at the first step (and either as at later steps, within 1 MiB more).
    """

    def __init__(self, trainer: "pl.Trainer", users: list["ModelCheckpoint"]) -> None:
        self.users = users
        self._with_states = not all(c.save_weights_only for c in users)  # the optimizers' and schedulers' states
        self._warning_cache = WarningCache()
        self._steps_per_batch = {1} if trainer.lightning_module.automatic_optimization else set()
        self._batch_seconds = 0.0
        self._timed_saves = self._timed_live_saves = 0
        # the checkpoints whose monitor no training batch that could save has logged yet, and those it was logged for
        self._unlogged: set[int] = set()
        self._logged_in_training: set[int] = set()
        self._free()

    def _free(self) -> None:
        self._started = self._copying = False  # the batch started; copying in it
        self._filtered = False  # the batch's values, logged before its first step, could not enter any top-k
        self._steps = self._start_step = 0  # the optimizer steps taken in this batch; the global step it started at
        self._start_time = time.monotonic()
        self._losses: list[tuple[Tensor, int]] = []  # each loss backpropagated, and the step that followed it
        self._logged: dict[str, tuple[int, int]] = {}  # a monitor's storage at the batch start and at its first step
        self._serving: list[ModelCheckpoint] = []  # the checkpoints that may save with this batch's copy
        self._params: dict[Tensor, tuple[int, int, Tensor, Optional[dict], torch.optim.Optimizer]] = {}
        # tensors no optimizer steps: (step, value) from the step on (-1: the batch start), None where not kept
        self._others: dict[Tensor, list[tuple[int, Optional[Tensor]]]] = {}
        self._more_bytes = 0
        self._small: list[tuple[list[list[dict]], list[dict]]] = []  # per step: param group options, scheduler states
        self._pending: set[int] = set()  # the checkpoints that may still save with this batch's state
        self._deferred: dict[int, int] = {}  # a checkpoint whose save waits for validation: the monitor's storage

    @classmethod
    def for_fit(cls, trainer: "pl.Trainer", checkpoint: "ModelCheckpoint") -> Optional["_PreOptimizerStepState"]:
        """The instance the first checkpoint with the option owns, or ``None`` with a warning if it cannot work."""
        users = [c for c in trainer.checkpoint_callbacks if getattr(c, "_save_pre_optimizer_step_state", False)]
        if users[0] is not checkpoint:
            return users[0]._pre_optimizer_step
        if (reason := _unsupported_reason(trainer, with_states=not all(c.save_weights_only for c in users))) is None:
            return cls(trainer, users)  # type: ignore[arg-type]
        rank_zero_warn(f"`save_pre_optimizer_step_state=True` saves the live state, as if it were off: {reason}")
        return None

    def on_train_batch_start(self, trainer: "pl.Trainer") -> None:
        self._free()
        self._started, self._start_step = True, trainer.global_step
        self._pending = {id(c) for c in self.users}
        may_save = [c for c in self.users if self._may_save(c, self._steps_per_batch)]
        if may_save:  # `callback_metrics` builds a dict of every logged value: only where a save may follow
            metrics = trainer.callback_metrics
            self._logged = {c.monitor: (_storage(metrics.get(c.monitor)), 0) for c in self.users}  # type: ignore[misc]
        # a checkpoint whose monitor the training batches do not log (a validation score) cannot use a copy
        self._serving = [c for c in may_save if id(c) not in self._unlogged]
        self._copying = bool(self._serving)
        if self._copying:  # before the forward, which updates them
            self._record_others(list(trainer.lightning_module.buffers()), -1)

    def _may_save(self, checkpoint: "ModelCheckpoint", steps: set[int]) -> bool:
        """Whether ``checkpoint`` may save at the end of the batch, if it takes as many steps as those before."""
        if (interval := checkpoint._train_time_interval) is not None:
            # if the batch takes 1.5 times as long as the one before
            elapsed = self._start_time - (checkpoint._last_time_checked or 0.0) + 1.5 * self._batch_seconds
            return elapsed >= interval.total_seconds()
        return not steps - {0} or any((self._start_step + k) % checkpoint._every_n_train_steps == 0 for k in steps)

    def on_before_backward(self, loss: Tensor) -> None:
        if self._copying and loss.numel() == 1:
            self._losses.append((loss.detach().clone(), self._steps))

    def on_before_optimizer_step(self, trainer: "pl.Trainer", optimizer: torch.optim.Optimizer) -> None:
        """Copies what this step is about to change, unless an earlier step of the batch copied it already."""
        step, self._steps = self._steps, self._steps + 1
        if not self._copying:
            return
        module = trainer.lightning_module
        if step == 0:
            metrics = trainer.callback_metrics
            self._logged = {m: (start, _storage(metrics.get(m))) for m, (start, _) in self._logged.items()}
            if all(self._cannot_enter_top_k(c, metrics.get(c.monitor)) for c in self._serving):  # type: ignore[arg-type]
                self._filtered = True
        if self._filtered:
            return
        with torch.no_grad():
            for group in optimizer.param_groups:
                for p in group["params"]:
                    if p in self._params:
                        self._params[p] = (self._params[p][0], step, *self._params[p][2:])
                    else:
                        state = optimizer.state.get(p) if self._with_states else None
                        state = None if state is None else {k: _clone(v) for k, v in state.items()}
                        self._params[p] = (step, step, p.detach().clone(), state, optimizer)
            stepped = {p for opt in trainer.optimizers for group in opt.param_groups for p in group["params"]}
            tensors = [t for t in (*module.parameters(), *module.buffers()) if t not in stepped]
            self._record_others(tensors, step)
        hyperparameters = [
            [{k: v for k, v in g.items() if k != "params"} for g in o.param_groups] for o in trainer.optimizers
        ]
        schedulers = [config.scheduler.state_dict() for config in trainer.lr_scheduler_configs]
        self._small.append(copy.deepcopy((hyperparameters, schedulers)))

    def _record_others(self, tensors: list[Tensor], step: int) -> None:
        """The buffers and weights no optimizer steps, as at ``step``: each value that differs from the last kept."""
        with torch.no_grad():
            for t in tensors:
                values = self._others.setdefault(t, [])
                if values and (values[-1][1] is None or torch.equal(values[-1][1], t)):
                    continue  # unchanged, or no longer known
                if values and self._more_bytes + t.nbytes > _MORE_VALUES_BYTES:
                    values.append((step, None))  # from this step on, its value is not known
                    continue
                self._more_bytes += t.nbytes if values else 0
                values.append((step, t.detach().clone()))

    def _cannot_enter_top_k(self, checkpoint: "ModelCheckpoint", value: Optional[Tensor]) -> bool:
        """Whether the value logged before the step, which the save would rank, cannot enter the top-k."""
        if value is None or _storage(value) == self._logged[checkpoint.monitor][0]:  # type: ignore[index]
            return False  # not logged in this batch yet: a value logged later may pair with a later step
        if checkpoint.save_top_k == -1 or len(checkpoint.best_k_models) < checkpoint.save_top_k:
            return False
        better = {"min": torch.lt, "max": torch.gt}[checkpoint.mode]
        return not better(value, checkpoint.best_k_models[checkpoint.kth_best_model_path])

    def defer_to_validation(self, trainer: "pl.Trainer", checkpoint: "ModelCheckpoint") -> None:
        """Keeps the state for the batch-end save that ``checkpoint`` defers to the end of validation."""
        self._deferred[id(checkpoint)] = _storage(trainer.callback_metrics.get(checkpoint.monitor))  # type: ignore[arg-type]

    def on_train_batch_end(self, trainer: "pl.Trainer", checkpoint: "ModelCheckpoint") -> None:
        """Drops the state once every checkpoint saved with it, or at the end of a validation that one waits for."""
        if checkpoint is self.users[0]:
            metrics = trainer.callback_metrics if self._logged else {}
            for c in self.users:
                if c.monitor in self._logged and self._may_save(c, {trainer.global_step - self._start_step}):
                    if _storage(metrics.get(c.monitor)) != self._logged[c.monitor][0]:  # type: ignore[index]
                        self._logged_in_training.add(id(c))
                        self._unlogged.discard(id(c))
                    elif id(c) not in self._logged_in_training:
                        self._unlogged.add(id(c))
            if not self._started:
                self._warning_cache.warn(
                    "`save_pre_optimizer_step_state=True` saves the live state: `ModelCheckpoint.on_train_batch_start`"
                    " did not run (an override that does not call `super()`)."
                )
            steps = trainer.global_step - self._start_step
            if self._steps or steps == 0:
                self._steps_per_batch.add(steps)
            self._batch_seconds = time.monotonic() - self._start_time
        if id(checkpoint) not in self._deferred:
            self._done(checkpoint)

    def _done(self, checkpoint: "ModelCheckpoint") -> None:
        self._pending.discard(id(checkpoint))
        self._deferred.pop(id(checkpoint), None)
        if not self._pending:
            self._free()

    def on_validation_end(self, checkpoint: "ModelCheckpoint") -> None:
        if id(checkpoint) in self._deferred:
            self._done(checkpoint)

    def on_exception(self) -> None:
        self._free()

    def on_train_end(self) -> None:
        self._free()
        if self._timed_live_saves:
            rank_zero_warn(
                f"{self._timed_live_saves} of {self._timed_saves} top-k checkpoints saved by `train_time_interval` with"
                " `save_pre_optimizer_step_state=True` hold the live state: their batches ended past the interval"
                " sooner than the batch before them predicted, so nothing was copied."
            )

    def save_checkpoint(self, trainer: "pl.Trainer", checkpoint: "ModelCheckpoint", filepath: str) -> None:
        """Writes a top-k file with the state at the step the monitored value pairs with, or the live state."""
        in_batch = id(checkpoint) in self._pending
        step, reason = self._pairing_step(trainer, checkpoint) if in_batch else (None, None)
        state = None
        if step is not None and self._filtered:
            reason = "the value logged before the step was not expected to enter the top-k, so nothing was copied"
        elif step is not None:
            state, reason = self._state_at(trainer, step)
        if state is None:
            trainer.save_checkpoint(filepath, checkpoint.save_weights_only)
        else:
            with self._swapped(trainer, state):
                checkpoint._saving_pre_optimizer_step = {"global_step": self._start_step + step}
                try:
                    trainer.save_checkpoint(filepath, checkpoint.save_weights_only)
                finally:
                    checkpoint._saving_pre_optimizer_step = None
        if checkpoint._train_time_interval is not None and in_batch:
            self._timed_saves += 1
            self._timed_live_saves += reason is not None and not self._copying
        if reason is not None:
            self._warning_cache.warn(
                f"A top-k checkpoint of `ModelCheckpoint(monitor={checkpoint.monitor!r},"
                f" save_pre_optimizer_step_state=True)` holds the live state, after the optimizer step: {reason}."
            )

    def _pairing_step(
        self, trainer: "pl.Trainer", checkpoint: "ModelCheckpoint"
    ) -> tuple[Optional[int], Optional[str]]:
        """The step whose state computed the monitored value; or ``None`` and why the live state is saved."""
        monitor, value = checkpoint.monitor, trainer.callback_metrics.get(checkpoint.monitor)  # type: ignore[arg-type]
        deferred = self._deferred.get(id(checkpoint))
        if value is None or monitor in ("epoch", "step"):
            return None, None  # the trainer's count ranks the live state
        if self._steps == 0:
            if trainer.global_step == self._start_step:
                return None, None  # nothing stepped since the value was computed: the live state computed it
            return None, (
                "the batch stepped without `ModelCheckpoint.on_before_optimizer_step` running (an override that does"
                " not call `super()`)"
            )
        if deferred is not None and _storage(value) != deferred:
            return None, None  # validation logged the value anew: the live state computed it
        start, first_step = self._logged.get(monitor, (0, 0))  # type: ignore[arg-type]
        if monitor in self._logged and _storage(value) == start:
            return (
                None,
                f"{monitor!r} was not logged during the batch (an epoch aggregate, a validation score, an old value)",
            )
        if checkpoint not in self._serving and id(checkpoint) in self._unlogged:
            return (
                None,
                f"{monitor!r} was not logged in the training batches that could save before, so nothing was copied",
            )
        if not self._copying:
            if checkpoint._train_time_interval is not None:
                return None, "the batch ended past `train_time_interval` sooner than predicted, so nothing was copied"
            return (
                None,
                f"the batch took {trainer.global_step - self._start_step} optimizer steps where those before "
                f"took {sorted(self._steps_per_batch)}, so nothing was copied",
            )
        for loss, step in self._losses:
            if torch.equal(loss.to(value), value):
                return (step, None) if step < self._steps else (None, None)  # no step after its backward: it is live
        if _storage(value) == first_step:
            return 0, None
        return None, (
            f"{monitor!r} was logged after the batch's first optimizer step began (in `on_before_optimizer_step`,"
            " after `optimizer.step()` or at the end of the batch) and is not a loss the batch backpropagated (a value"
            " reduced across processes with `sync_dist=True` is not), so which state computed it is unknown"
        )

    def _state_at(self, trainer: "pl.Trainer", step: int) -> tuple[Optional[tuple], Optional[str]]:
        """What to swap in for the state at ``step`` (tensors, optimizer states, small states), or why it is unknown."""
        module = trainer.lightning_module
        tensors_saved = [t for t in module.state_dict(keep_vars=True).values() if isinstance(t, Tensor)]
        if any(t not in self._params and t not in self._others for t in tensors_saved):
            return None, (
                "the module's state dict has tensors that are not the parameters and buffers it had at the step (a"
                " layer swapped in, or a `state_dict` override that adds tensors)"
            )
        buffers = set(module.buffers())
        tensors, states = [], []
        for p, (first, last, value, state, optimizer) in self._params.items():
            if first >= step:
                tensors.append((p, value))
                if self._with_states:
                    states.append((optimizer, p, state))
            elif last >= step:
                return None, (
                    "a parameter that the step after its backward changed was changed by an earlier step of the batch"
                    " too, and only its value before the first is kept"
                )
        for t, values in self._others.items():
            # a buffer as before the forwards that led to the step: those the forward updates computed the value
            known = [value for at, value in values if at <= (step - 1 if t in buffers else step)]
            if not known or known[-1] is None:
                return None, "buffers or frozen weights changed by more than 1 MiB between the batch's steps"
            tensors.append((t, known[-1]))
        return (tensors, states, self._small[step]), None

    @contextmanager
    def _swapped(self, trainer: "pl.Trainer", state: tuple) -> Iterator[None]:
        """The state at the step in place of the live one while the file is written; nothing is copied."""
        tensors, states, (hyperparameters, schedulers) = state
        live_states = [(optimizer, p, optimizer.state.get(p)) for optimizer, p, _ in states]
        live_small = [
            [{k: v for k, v in g.items() if k != "params"} for g in o.param_groups] for o in trainer.optimizers
        ]
        live_schedulers = [config.scheduler.state_dict() for config in trainer.lr_scheduler_configs]
        live_tensors = [(t, t.data) for t, _ in tensors]
        try:
            _put(tensors, states, trainer, hyperparameters, schedulers)
            yield
        finally:
            _put(live_tensors, live_states, trainer, live_small, live_schedulers)


def _put(tensors: list, states: list, trainer: "pl.Trainer", hyperparameters: list, schedulers: list) -> None:
    for t, value in tensors:
        t.data = value
    for optimizer, p, state in states:
        if state is None:
            optimizer.state.pop(p, None)
        else:
            optimizer.state[p] = state
    for optimizer, groups in zip(trainer.optimizers, hyperparameters):
        for group, options in zip(optimizer.param_groups, groups):
            group.update(options)
    for config, scheduler_state in zip(trainer.lr_scheduler_configs, schedulers):
        config.scheduler.load_state_dict(scheduler_state)


def _clone(value: Any) -> Any:
    return value.detach().clone() if isinstance(value, Tensor) else copy.deepcopy(value)


def _storage(value: Optional[Tensor]) -> int:
    """Where a logged value is stored: each ``self.log`` call stores a new tensor."""
    return 0 if value is None else value.data_ptr()


def _unsupported_reason(trainer: "pl.Trainer", with_states: bool) -> Optional[str]:
    """Why the state at a step cannot be written with this trainer, or ``None`` if it can."""
    from lightning.pytorch.callbacks import StochasticWeightAveraging, WeightAveraging
    from lightning.pytorch.strategies import DeepSpeedStrategy, Strategy

    cls = type(trainer.strategy)
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
        return "the optimizer states are sharded; with `save_weights_only=True`, the weights can be saved."
    return None
