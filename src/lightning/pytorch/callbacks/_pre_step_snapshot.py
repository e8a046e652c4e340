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
"""Checkpoints that hold the state from before a training batch's first optimizer step."""

from typing import TYPE_CHECKING, Any, Optional

import torch
from torch import Tensor

import lightning.pytorch as pl
from lightning.pytorch.utilities.rank_zero import WarningCache, rank_zero_warn

if TYPE_CHECKING:
    from lightning.pytorch.callbacks.model_checkpoint import ModelCheckpoint

_COUNTERS = ("epoch", "step")  # monitors that `ModelCheckpoint` adds from the trainer's progress

#: Key of a checkpoint that holds the state from before the optimizer steps of the batch at whose end it was saved.
PRE_OPTIMIZER_STEP_KEY = "pre_optimizer_step"


class _PreStepCapture:
    """Copies the state from before a batch's first step once for the checkpoints with the option; the first leads."""

    def __init__(self, trainer: "pl.Trainer", checkpoints: list["ModelCheckpoint"], with_states: bool) -> None:
        self._checkpoints = checkpoints
        # with `train_time_interval`, any batch may save; else those whose steps end on a multiple of N
        if all(c._train_time_interval is None for c in checkpoints):
            self._every_n: Optional[list[int]] = sorted({c._every_n_train_steps for c in checkpoints})
        else:
            self._every_n = None
        # how many optimizer steps the batches that stepped took; one under automatic optimization
        self._steps_per_batch = {1} if trainer.lightning_module.automatic_optimization else set()
        self._logged: dict[ModelCheckpoint, bool] = {}  # whether the batches that saved or deferred logged the monitor
        self._start_step = -1  # the global step at the start of the batch, once one has started
        self._named_params = list(trainer.lightning_module.named_parameters(remove_duplicate=False))
        self._with_states = with_states
        self._warning_cache = WarningCache()
        self._deferred: dict[ModelCheckpoint, Optional[Tensor]] = {}  # monitored value when a save was deferred
        self._free()

    def _free(self) -> None:
        """Drops what a batch held: the copy, and the values and versions read at its start."""
        self.copy: Optional[dict[str, Any]] = None
        self._versions: list[tuple[Tensor, int]] = []
        self._start_values: dict[Optional[str], Optional[Tensor]] = {}
        self._at_step: dict[Optional[str], Optional[Tensor]] = {}
        self._between: set[Optional[str]] = set()

    @classmethod
    def shared_by(cls, trainer: "pl.Trainer", checkpoint: "ModelCheckpoint") -> Optional["_PreStepCapture"]:
        """The capture of this fit, made by the first checkpoint with the option; ``None`` if it cannot work here."""
        sharers = [c for c in trainer.checkpoint_callbacks if getattr(c, "_save_pre_optimizer_step_weights", False)]
        if checkpoint is not sharers[0]:
            return sharers[0]._pre_step
        with_states = any(not c.save_weights_only for c in sharers)
        reason = _unsupported_reason(trainer, with_states)
        if reason is not None:
            rank_zero_warn(f"`save_pre_optimizer_step_weights=True` saves the live weights as if it were off: {reason}")
            return None
        return cls(trainer, sharers, with_states)  # type: ignore[arg-type]

    def start_batch(self, trainer: "pl.Trainer", checkpoint: "ModelCheckpoint") -> None:
        if checkpoint is not self._checkpoints[0]:
            return
        step = trainer.global_step
        if 0 <= self._start_step < step:  # the batch before took optimizer steps
            self._steps_per_batch.add(step - self._start_step)
        self._free()  # if a save the batch before deferred never came
        self._deferred.clear()
        self._start_step = step
        self._stepped = self._outside = self._ended = False
        # a copy is of use if the batch's steps can end on a save: predicted from the steps of the batches before
        steps, every_n = self._steps_per_batch, self._every_n
        self._armed = every_n is None or not steps or any((step + k) % n == 0 for k in steps for n in every_n)
        if self._armed:  # `callback_metrics` builds a dict of every logged value: only where a save can follow
            self._versions = [(p, p._version) for _, p in self._named_params if p.requires_grad]
            self._start_values = {c.monitor: _value(trainer.callback_metrics, c) for c in self._checkpoints}

    def before_optimizer_step(self, trainer: "pl.Trainer", checkpoint: "ModelCheckpoint") -> None:
        if checkpoint is not self._checkpoints[0]:
            return
        if self._stepped:  # a value first logged between two steps was computed after the first (a GAN's loss)
            if self._armed:
                metrics, at_step = trainer.callback_metrics, self._at_step
                self._between.update(
                    c.monitor
                    for c in self._checkpoints
                    if not self._logged_in_batch(c.monitor, at_step[c.monitor])
                    and self._logged_in_batch(c.monitor, _value(metrics, c))
                )
            return
        self._stepped = True
        if not self._armed:
            return
        self._at_step = {c.monitor: _value(trainer.callback_metrics, c) for c in self._checkpoints}
        if not any(self._needs_copy(c, self._at_step[c.monitor]) for c in self._checkpoints):
            return
        self._outside = self._changed()
        if self._outside:
            return  # the state the batch started with is gone
        clones: dict[Tensor, Tensor] = {}  # a tied parameter is copied once
        trained = {p for p, _ in self._versions}  # and those that `toggle_optimizer` froze since the batch started
        with torch.no_grad():
            params = {
                name: (p, clones.setdefault(p, p.detach().clone()))
                for name, p in self._named_params
                if p.requires_grad or p in trained
            }
        states = {}
        if self._with_states:
            states = _clone({
                "optimizer_states": [optimizer.state_dict() for optimizer in trainer.optimizers],
                "lr_schedulers": [config.scheduler.state_dict() for config in trainer.lr_scheduler_configs],
            })
        self.copy = {"global_step": trainer.global_step, "params": params, "states": states}

    def _changed(self) -> bool:
        """Whether a parameter that required grad at the batch start changed in place since then.

        Every in-place update of a tensor, by any optimizer, increases its version counter. Parameters frozen at the
        batch start and at the step (a teacher updated in place, a frozen backbone) are not copied: the file holds them
        live, and their changes do not matter.

        """
        return any(p._version != version for p, version in self._versions)

    def _needs_copy(self, checkpoint: "ModelCheckpoint", value: Optional[Tensor]) -> bool:
        if checkpoint.monitor in _COUNTERS:
            return False  # the trainer's own count ranks the live state
        if value is None or not self._logged_in_batch(checkpoint.monitor, value):
            # it may be logged after the step, unless earlier batches never logged it (a validation score)
            return self._logged.get(checkpoint, True)
        if checkpoint.save_top_k == -1 or len(checkpoint.best_k_models) < checkpoint.save_top_k:
            return True
        monitor_op = {"min": torch.lt, "max": torch.gt}[checkpoint.mode]
        return bool(monitor_op(value, checkpoint.best_k_models[checkpoint.kth_best_model_path]))

    def _logged_in_batch(self, monitor: Optional[str], value: Optional[Tensor]) -> bool:
        """Whether ``value`` was logged since the batch started: every ``self.log`` call stores a new tensor."""
        start = self._start_values.get(monitor)
        return value is not None and (start is None or not _same(value, start))

    def _why_not_copied(self, trainer: "pl.Trainer", checkpoint: "ModelCheckpoint") -> str:
        if not self._armed:
            steps, known = trainer.global_step - self._start_step, sorted(self._steps_per_batch)
            return f"the batch took {steps} optimizer step(s) where those before took {known}, so nothing was copied"
        if self._logged_in_batch(checkpoint.monitor, self._at_step[checkpoint.monitor]):
            return "the value logged before the optimizer step could not enter the top-k, so nothing was copied"
        return f"the batches that could save before had not logged {checkpoint.monitor!r}, so nothing was copied"

    def defer(self, trainer: "pl.Trainer", checkpoint: "ModelCheckpoint") -> None:
        """Notes the monitored value of a save that ``checkpoint`` defers to the end of validation."""
        self._deferred[checkpoint] = value = _value(trainer.callback_metrics, checkpoint)
        self._learn(checkpoint, value)

    def _learn(self, checkpoint: "ModelCheckpoint", value: Optional[Tensor]) -> None:
        """Notes whether the batch logged ``checkpoint``'s monitor: a monitor that none logs needs no copies."""
        if self._armed:  # the values at the batch start are read in these batches only
            logged = self._logged_in_batch(checkpoint.monitor, value)
            self._logged[checkpoint] = self._logged.get(checkpoint, False) or logged

    def end_batch(self, trainer: "pl.Trainer", checkpoint: "ModelCheckpoint", waits_for_validation: bool) -> None:
        """Drops what the batch held once no save can use it: after its batch-end saves and those it deferred.

        At the end of a batch that could save, a monitor it did not log is noted: no batch logs it before saving.

        """
        if not waits_for_validation:
            self._deferred.pop(checkpoint, None)
        if not self._ended and checkpoint is self._checkpoints[-1]:
            self._ended = True
            if self._start_values:
                metrics = trainer.callback_metrics
                for c in self._checkpoints:
                    if not self._logged.get(c) and not self._logged_in_batch(c.monitor, _value(metrics, c)):
                        self._logged[c] = False
        if self._ended and not self._deferred:
            self._free()

    def deferred(self, checkpoint: "ModelCheckpoint") -> bool:
        return checkpoint in self._deferred

    def save_checkpoint(self, trainer: "pl.Trainer", checkpoint: "ModelCheckpoint", filepath: str) -> None:
        """Writes a top-k checkpoint at the end of a batch: with the copy, or with the live weights and a warning."""
        monitor, value = checkpoint.monitor, _value(trainer.callback_metrics, checkpoint)
        if checkpoint in self._deferred:  # at the end of validation: the batch's value, unless validation logged anew
            at_batch_end = self._deferred.pop(checkpoint)
            value = value if at_batch_end is not None and value is not None and _same(value, at_batch_end) else None
        else:
            self._learn(checkpoint, value)
        reason = None  # without a step in the batch, the live weights are the ones it started with
        if monitor in _COUNTERS:
            pass  # the file is ranked by the step or epoch that the live state reached
        elif not self._logged_in_batch(monitor, value):
            reason = f"{monitor!r} was not logged during the batch (an epoch aggregate, a validation score, or a value"
            reason += " logged in an earlier batch)"
        elif monitor in self._between:
            reason = (
                f"{monitor!r} was first logged between two optimizer steps of the batch, so it was computed after the"
                " first (as a GAN's loss computed after the other optimizer's step)"
            )
        elif self.copy is None and (self._outside if self._stepped else self._changed()):
            reason = "the weights changed outside Lightning's optimizer steps (e.g. `use_pl_optimizer=False`)"
        elif self.copy is None and self._stepped:
            reason = self._why_not_copied(trainer, checkpoint)
        written: list[bool] = []
        connector, copied = trainer._checkpoint_connector, self.copy
        if reason is None and copied is not None and monitor not in _COUNTERS:
            connector._checkpoint_transform = lambda c: written.append(_write(copied, c, trainer.lightning_module))
        try:
            trainer.save_checkpoint(filepath, checkpoint.save_weights_only)
        finally:
            connector._checkpoint_transform = None
        if written == [False]:
            reason = "the module's parameters changed during the fit, or its state dict renames them"
            self._named_params = list(trainer.lightning_module.named_parameters(remove_duplicate=False))
        if reason is not None:
            self._warning_cache.warn(
                f"A top-k checkpoint of `ModelCheckpoint(monitor={monitor!r}, save_pre_optimizer_step_weights=True)`"
                f" holds the live weights, after the optimizer step, as without the option: {reason}."
            )


def _write(copied: dict[str, Any], checkpoint: dict[str, Any], module: "pl.LightningModule") -> bool:
    """Puts the copy in place of the live values in ``checkpoint``, if it holds exactly the trainable parameters."""
    params, state_dict = copied["params"], checkpoint["state_dict"]
    named = module.named_parameters(remove_duplicate=False)
    if any(p.requires_grad and params.get(name, (None,))[0] is not p for name, p in named):
        return False
    if any(name not in state_dict for name in params):
        return False
    states = copied["states"] if "optimizer_states" in checkpoint else {}
    if states and len(states["optimizer_states"]) != len(checkpoint["optimizer_states"]):
        return False
    state_dict.update({name: clone for name, (_, clone) in params.items()})
    checkpoint.update(states)
    checkpoint[PRE_OPTIMIZER_STEP_KEY] = {"global_step": copied["global_step"]}
    return True


def _same(a: Tensor, b: Tensor) -> bool:
    return a.data_ptr() == b.data_ptr()


def _value(metrics: dict[str, Tensor], checkpoint: "ModelCheckpoint") -> Optional[Tensor]:
    return metrics.get(checkpoint.monitor) if checkpoint.monitor is not None else None


def _clone(obj: Any) -> Any:
    """A copy of a state dict: its tensors cloned, its containers rebuilt."""
    if isinstance(obj, Tensor):
        return obj.detach().clone()
    if isinstance(obj, (dict, list, tuple)):
        items = obj.items() if isinstance(obj, dict) else enumerate(obj)
        cloned = {key: _clone(value) for key, value in items}
        return cloned if isinstance(obj, dict) else type(obj)(cloned.values())
    return obj


def _unsupported_reason(trainer: "pl.Trainer", with_states: bool) -> Optional[str]:
    """Why the pre-step state cannot be written with this trainer, or ``None`` if it can."""
    from lightning.pytorch.callbacks import StochasticWeightAveraging, WeightAveraging
    from lightning.pytorch.strategies import DeepSpeedStrategy, Strategy

    cls = type(trainer.strategy)
    if (
        issubclass(cls, DeepSpeedStrategy)
        or cls.lightning_module_state_dict is not Strategy.lightning_module_state_dict
    ):
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
