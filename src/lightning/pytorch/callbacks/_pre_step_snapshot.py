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
"""Snapshots of the training state taken just before the first optimizer step of a training batch.

A score logged in ``training_step`` is computed by the weights the batch started with. When a
:class:`~lightning.pytorch.callbacks.ModelCheckpoint` saves at the end of that batch, the live weights have already
been updated by ``optimizer.step()``. To write the weights that produced the score, the state is copied into reusable
buffers right before the batch's first optimizer step, but only in batches where a save can trigger. The copy is then
written in place of the live state; the live model is never modified.

"""

import copy
import time
from collections import OrderedDict
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any, Optional
from weakref import WeakKeyDictionary, ref

import torch
from torch import Tensor
from torch.optim import Optimizer
from torch.utils.hooks import RemovableHandle

import lightning.pytorch as pl
from lightning.pytorch.utilities.rank_zero import rank_zero_warn

if TYPE_CHECKING:
    from lightning.pytorch.callbacks.model_checkpoint import ModelCheckpoint

#: Key added to a checkpoint whose model (and optimizer) state is from before the optimizer step of its batch.
PRE_OPTIMIZER_STEP_KEY = "pre_optimizer_step"

_POST_STEP_REASON = (
    "`ModelCheckpoint(monitor={monitor!r})` will save the weights *after* the optimizer step of the batch that"
    " produced the score, not the weights that produced it: {reason}"
)

_WARNED: "WeakKeyDictionary[pl.Trainer, set[str]]" = WeakKeyDictionary()


def _warn_once(trainer: "pl.Trainer", message: str) -> None:
    """Warns on rank zero, once per message and trainer."""
    warned = _WARNED.setdefault(trainer, set())
    if message not in warned:
        warned.add(message)
        rank_zero_warn(message)


@dataclass
class _CapturedState:
    """The training state as it was right before the first optimizer step of a batch.

    Attributes:
        state_dict: The module's state dict, copied into reusable buffers.
        optimizer_states: The optimizers' state dicts, or ``None`` when only weights were captured.
        lr_schedulers: The learning-rate schedulers' state dicts, or ``None`` when only weights were captured.
        global_step: ``trainer.global_step`` before the step, i.e. the number of optimizer steps the weights have seen.
        batch_key: Identifies the training batch the state was captured in.
        copied: Recorded after the copies from CUDA to pinned CPU memory were queued, when the state was offloaded.

    """

    state_dict: dict[str, Any]
    optimizer_states: Optional[list[dict[str, Any]]]
    lr_schedulers: Optional[list[dict[str, Any]]]
    global_step: int
    batch_key: int
    copied: Optional["torch.cuda.Event"] = None

    def wait(self) -> None:
        """Blocks until the copies to pinned CPU memory have completed, when the state was offloaded from CUDA."""
        if self.copied is not None:
            self.copied.synchronize()
            self.copied = None

    def mark(self, checkpoint: dict[str, Any]) -> None:
        """Records in ``checkpoint`` that its states were captured before the batch's optimizer step."""
        checkpoint[PRE_OPTIMIZER_STEP_KEY] = {
            "global_step": self.global_step,
            "optimizer_states": "optimizer_states" in checkpoint,
        }

    def for_writing(self) -> "_CapturedState":
        """A view whose containers ``on_save_checkpoint`` hooks may change without touching the buffers."""
        return replace(
            self,
            state_dict=_shallow_copy(self.state_dict),
            optimizer_states=_shallow_copy(self.optimizer_states),
            lr_schedulers=_shallow_copy(self.lr_schedulers),
        )


def _shallow_copy(obj: Any) -> Any:
    """Copies the dicts and lists of a nested state, sharing its tensors."""
    if isinstance(obj, dict):
        out = type(obj)((key, _shallow_copy(value)) for key, value in obj.items())
        if hasattr(obj, "_metadata"):
            out._metadata = obj._metadata
        return out
    if isinstance(obj, list):
        return [_shallow_copy(value) for value in obj]
    return obj


def _batch_key(trainer: "pl.Trainer") -> int:
    """A number that stays the same from ``on_train_batch_start`` to ``on_train_batch_end`` of one training batch."""
    return trainer.fit_loop.epoch_loop.batch_progress.total.ready


def _copy_into(src: Any, buffer: Any, offload: bool = False, _seen: Optional[dict] = None) -> Any:
    """Copies ``src`` into ``buffer`` where the tensors match, allocating new tensors only where they do not.

    With ``offload=True``, tensors on an accelerator are copied to CPU memory (pinned for CUDA, without blocking the
    host; see :meth:`_CapturedState.wait`) instead of to the accelerator's memory. Tensors that share memory in
    ``src`` (tied weights) share one copy.

    """
    seen: dict = {} if _seen is None else _seen
    if isinstance(src, Tensor):
        src = src.detach()
        if type(src) is not Tensor and not hasattr(src, "to_local"):
            return src.clone()  # a tensor subclass (e.g. quantized weights) may not support copying into a buffer
        tied = (src.device, src.data_ptr(), src.dtype, src.shape, src.stride()) if type(src) is Tensor else None
        if tied is not None and tied in seen:
            return seen[tied]
        # plain tensors only: distributed tensors keep their placement
        to_host = offload and src.device.type != "cpu" and type(src) is Tensor
        device = torch.device("cpu") if to_host else src.device
        non_blocking = to_host and src.is_cuda
        if not (
            isinstance(buffer, Tensor)
            and buffer.shape == src.shape
            and buffer.dtype == src.dtype
            and buffer.device == device
        ):
            buffer = torch.empty_like(src, device=device, pin_memory=src.is_cuda) if to_host else None
        copied = src.clone() if buffer is None else buffer.copy_(src, non_blocking=non_blocking)
        if tied is not None:
            seen[tied] = copied
        return copied
    if isinstance(src, dict):
        old = buffer if isinstance(buffer, dict) else {}
        out = type(src)() if isinstance(src, OrderedDict) else {}
        for key, value in src.items():
            out[key] = _copy_into(value, old.get(key), offload, seen)
        metadata = getattr(src, "_metadata", None)
        if metadata is not None:
            out._metadata = copy.deepcopy(metadata)
        return out
    if isinstance(src, (list, tuple)):
        old_seq = buffer if isinstance(buffer, (list, tuple)) and len(buffer) == len(src) else [None] * len(src)
        items = [_copy_into(value, old, offload, seen) for value, old in zip(src, old_seq)]
        return items if isinstance(src, list) else type(src)(items)
    if isinstance(src, (int, float, bool, str, bytes, type(None))):
        return src
    return copy.deepcopy(src)


class _PreStepSnapshot:
    """Captures the training state before the first optimizer step of a batch, once per batch, for all consumers.

    One instance exists per :class:`~lightning.pytorch.trainer.trainer.Trainer` while at least one
    :class:`~lightning.pytorch.callbacks.ModelCheckpoint` needs it. It hooks into
    :meth:`~lightning.pytorch.core.optimizer.LightningOptimizer.step` and, to detect steps that bypass it, into the
    wrapped optimizers' step pre-hooks.

    """

    def __init__(self, trainer: "pl.Trainer") -> None:
        self._trainer = ref(trainer)
        self._consumers: list[ModelCheckpoint] = []
        self._handles: list[RemovableHandle] = []
        self._installed = False
        self._buffers: dict[str, Any] = {}
        self._captured: Optional[_CapturedState] = None
        # batch bookkeeping, reset in `on_train_batch_start`
        self._batch: Optional[int] = None  # key of the current batch
        self._plan: Optional[bool] = None  # capture before the first step (with optimizer states if True)
        self._stepped = False  # whether an optimizer stepped in the current batch
        self._bypassed: Optional[str] = None  # the optimizer whose direct step was the batch's first step
        self._steps_in_batch = 0
        self._max_steps_per_batch: Optional[int] = None
        # per consumer: whether its monitored metric was logged before the optimizer step at its last save
        self._monitor_before_step: dict[ModelCheckpoint, bool] = {}

    # ------------------------------------------------------------------------------------------------------------
    # registration
    # ------------------------------------------------------------------------------------------------------------
    @classmethod
    def register(cls, trainer: "pl.Trainer", consumer: "ModelCheckpoint") -> Optional["_PreStepSnapshot"]:
        """Registers ``consumer`` with the trainer's snapshot, creating and installing it on first use.

        Returns ``None`` and warns once when pre-step weights cannot be captured with this trainer.

        """
        reason = _unsupported_reason(trainer)
        if reason is not None:
            _warn_once(trainer, _POST_STEP_REASON.format(monitor=consumer.monitor, reason=reason))
            return None
        snapshot = _SNAPSHOTS.get(trainer)
        if snapshot is None:
            snapshot = _SNAPSHOTS[trainer] = cls(trainer)
        if consumer not in snapshot._consumers:
            snapshot._consumers.append(consumer)
        snapshot._monitor_before_step.pop(consumer, None)
        snapshot._install()
        return snapshot

    def unregister(self, consumer: "ModelCheckpoint") -> None:
        """Removes ``consumer``; the hooks and buffers are released with the last one."""
        if consumer in self._consumers:
            self._consumers.remove(consumer)
        self._monitor_before_step.pop(consumer, None)
        if not self._consumers:
            self._uninstall()
            self._buffers = {}
            self._captured = None
            trainer = self._trainer()
            if trainer is not None and _SNAPSHOTS.get(trainer) is self:
                del _SNAPSHOTS[trainer]

    def _install(self) -> None:
        if self._installed:
            return
        trainer = self._trainer()
        assert trainer is not None
        for lightning_optimizer in trainer.strategy._lightning_optimizers:
            lightning_optimizer._on_before_update = self._on_lightning_step
        for optimizer in trainer.optimizers:
            if isinstance(optimizer, Optimizer):
                self._handles.append(optimizer.register_step_pre_hook(self._on_optimizer_step))
        self._installed = True

    def _uninstall(self) -> None:
        from lightning.pytorch.core.optimizer import do_nothing_closure

        trainer = self._trainer()
        if trainer is not None:
            for lightning_optimizer in trainer.strategy._lightning_optimizers:
                if getattr(lightning_optimizer, "_on_before_update", None) == self._on_lightning_step:
                    lightning_optimizer._on_before_update = do_nothing_closure
        for handle in self._handles:
            handle.remove()
        self._handles = []
        self._installed = False

    # ------------------------------------------------------------------------------------------------------------
    # hooks
    # ------------------------------------------------------------------------------------------------------------
    def on_train_batch_start(self, trainer: "pl.Trainer") -> None:
        """Plans the batch: whether to capture before its first optimizer step, decided once and on every rank.

        Called by each consumer's ``on_train_batch_start``, which every rank runs, so that decisions that communicate
        across ranks (the ``train_time_interval`` broadcast) never depend on whether a rank steps its optimizers.

        """
        key = _batch_key(trainer)
        if key == self._batch:
            return
        if self._batch is not None:
            self._max_steps_per_batch = max(self._max_steps_per_batch or 0, self._steps_in_batch)
        self._batch, self._stepped, self._bypassed, self._steps_in_batch = key, False, None, 0
        self._plan = None
        if trainer.sanity_checking:
            return
        # ask every consumer (no short-circuit: time-based triggers make their per-batch decision here)
        max_steps = self._max_steps_per_batch
        needs = [
            _pre_step_state_needed(consumer, trainer, max_steps, self._monitor_before_step.get(consumer))
            for consumer in self._consumers
        ]
        wanted = [consumer for consumer, need in zip(self._consumers, needs) if need]
        if wanted:
            self._plan = any(not consumer.save_weights_only for consumer in wanted)

    def _on_lightning_step(self) -> None:
        """Called by ``LightningOptimizer.step`` before the strategy runs the optimizer step."""
        trainer = self._batch_trainer()
        if trainer is None:
            return
        self._steps_in_batch += 1
        if self._stepped:
            return
        self._stepped = True
        if self._plan is not None:
            self._capture(trainer, with_optimizers=self._plan)

    def _on_optimizer_step(self, optimizer: Optimizer, args: Any, kwargs: Any) -> None:
        """Step pre-hook of the wrapped optimizers: detects a first step that did not go through ``LightningOptimizer``.

        A step through ``LightningOptimizer`` has already been seen by :meth:`_on_lightning_step` when this runs.

        """
        if self._stepped or self._batch_trainer() is None:
            return
        # the batch's first step changes the weights before anything could capture them
        self._stepped = True
        self._bypassed = type(optimizer).__name__

    def _batch_trainer(self) -> Optional["pl.Trainer"]:
        """The trainer, if it is inside the training batch that :meth:`on_train_batch_start` planned."""
        from lightning.pytorch.trainer.states import TrainerFn

        trainer = self._trainer()
        if (
            trainer is None
            or trainer.state.fn != TrainerFn.FITTING
            or trainer.sanity_checking
            or _batch_key(trainer) != self._batch
        ):
            return None
        return trainer

    # ------------------------------------------------------------------------------------------------------------
    # capture
    # ------------------------------------------------------------------------------------------------------------
    @torch.no_grad()
    def _capture(self, trainer: "pl.Trainer", with_optimizers: bool) -> None:
        strategy = trainer.strategy
        offload = any(consumer._pre_optimizer_step_offload for consumer in self._consumers)
        module_state, optimizer_states = _states_to_capture(strategy, with_optimizers, offload)
        self._buffers["state_dict"] = _copy_into(module_state, self._buffers.get("state_dict"), offload)
        lr_schedulers = None
        if optimizer_states is not None:
            optimizer_states = self._buffers["optimizer_states"] = _copy_into(
                optimizer_states, self._buffers.get("optimizer_states"), offload
            )
            lr_schedulers = [copy.deepcopy(config.scheduler.state_dict()) for config in trainer.lr_scheduler_configs]
        else:
            self._buffers.pop("optimizer_states", None)
        assert self._batch is not None
        self._captured = _CapturedState(
            state_dict=self._buffers["state_dict"],
            optimizer_states=optimizer_states,
            lr_schedulers=lr_schedulers,
            global_step=trainer.global_step,
            batch_key=self._batch,
        )
        root_device = strategy.root_device
        if offload and root_device.type == "cuda":
            # the copies run on the current stream, ahead of the optimizer step; the host waits for them only at save
            self._captured.copied = torch.cuda.Event()
            self._captured.copied.record(torch.cuda.current_stream(root_device))

    def state_for_batch(self, trainer: "pl.Trainer", consumer: "ModelCheckpoint") -> Optional[_CapturedState]:
        """The state captured in the current training batch, for a top-k save of ``consumer`` at the end of it.

        Returns ``None`` when the live state is the one to save: the monitored score was not logged before the
        optimizer step (it comes from validation, or from a hook after the step), or no optimizer stepped in this
        batch. Warns once when an optimizer stepped but the state the save needs could not be captured.

        """
        assert consumer.monitor is not None
        before_step = _monitor_logged_before_step(trainer, consumer.monitor)
        previously_before_step = self._monitor_before_step.get(consumer)
        self._monitor_before_step[consumer] = before_step
        key = _batch_key(trainer)
        if not before_step or key != self._batch or not self._stepped:
            return None  # not a training score, or no optimizer step in this batch: the live weights produced it
        captured = self._captured if self._captured is not None and self._captured.batch_key == key else None
        if captured is not None and (consumer.save_weights_only or captured.optimizer_states is not None):
            _warn_legacy_workaround(trainer, trainer.lightning_module)
            captured.wait()
            return captured
        if self._bypassed is not None:
            reason = (
                f"`{self._bypassed}.step()` was called directly instead of through the `LightningOptimizer` returned"
                " by `self.optimizers()`, so the weights could not be captured before they changed. Step the"
                " optimizers returned by `self.optimizers()` (with `use_pl_optimizer=True`) to checkpoint the weights"
                " that produced the score."
            )
        elif captured is not None:
            reason = (
                "the optimizer had no state yet, and reading a sharded optimizer state would have initialized it."
                if self._plan
                else "only the weights were captured in this batch, not the optimizer states this checkpoint also"
                " holds, because no save with optimizer states was expected in it."
            )
        elif previously_before_step is False:
            reason = (
                f"`{consumer.monitor}` was not logged during training at the previous save, so the weights were not"
                " captured in this batch."
            )
        else:
            reason = (
                f"batch {trainer.fit_loop.epoch_loop.batch_idx} of epoch {trainer.current_epoch} took more optimizer"
                " steps than any batch before it, so no save was expected before its first step."
            )
        _warn_once(trainer, _POST_STEP_REASON.format(monitor=consumer.monitor, reason=reason))
        return None


_SNAPSHOTS: "WeakKeyDictionary[pl.Trainer, _PreStepSnapshot]" = WeakKeyDictionary()


def _unsupported_reason(trainer: "pl.Trainer") -> Optional[str]:
    """Why pre-step weights cannot be captured with this trainer, or ``None`` if they can."""
    from lightning.pytorch.callbacks.stochastic_weight_avg import StochasticWeightAveraging
    from lightning.pytorch.callbacks.weight_averaging import WeightAveraging
    from lightning.pytorch.strategies import DeepSpeedStrategy, FSDPStrategy, ModelParallelStrategy

    strategy = trainer.strategy
    if isinstance(strategy, DeepSpeedStrategy):
        return "the DeepSpeed engine writes its own checkpoint from the live weights."
    if isinstance(strategy, FSDPStrategy):
        return (
            "capturing the weights with `FSDPStrategy` is not supported yet. `ModelParallelStrategy` with"
            " `save_distributed_checkpoint=True` (FSDP2) captures each rank's local shards."
        )
    if isinstance(strategy, ModelParallelStrategy) and not strategy._save_distributed_checkpoint:
        return (
            "`ModelParallelStrategy(save_distributed_checkpoint=False)` would have to gather the full weights in every"
            " batch that saves. With `save_distributed_checkpoint=True`, each rank's local shards are captured."
        )
    for callback in trainer.callbacks:
        if isinstance(callback, (WeightAveraging, StochasticWeightAveraging)):
            return (
                f"`{type(callback).__name__}` writes averaged weights into the checkpoint, which are not the"
                " weights of any single step."
            )
    return None


def _states_to_capture(
    strategy: "pl.strategies.Strategy", with_optimizers: bool, offload: bool
) -> tuple[dict[str, Any], Optional[list[dict[str, Any]]]]:
    """The module's and, if requested, the optimizers' states as the strategy checkpoints them, without a gather.

    ``ModelParallelStrategy`` returns each rank's local shards. Its own state dicts are offloaded to the CPU in fresh
    memory; unless ``offload`` asks for exactly that, they are read on the device so that the copy into the buffers is
    the only copy. An optimizer that has no state yet would be initialized by reading its sharded state (a step with
    zero learning rate), so optimizer states are then not captured.

    """
    from lightning.pytorch.strategies import ModelParallelStrategy

    optimizers = [getattr(optimizer, "_optimizer", optimizer) for optimizer in strategy.optimizers]
    if not isinstance(strategy, ModelParallelStrategy):
        module_state = strategy.lightning_module_state_dict()
        return module_state, [strategy.optimizer_state(opt) for opt in optimizers] if with_optimizers else None

    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict, get_optimizer_state_dict

    assert strategy.model is not None
    options = StateDictOptions(full_state_dict=False, cpu_offload=offload)
    module_state = get_model_state_dict(strategy.model, options=options)
    uninitialized = any(
        not opt.state and all(p.grad is None for group in opt.param_groups for p in group["params"])
        for opt in optimizers
    )
    if not with_optimizers or uninitialized:
        return module_state, None
    return module_state, [get_optimizer_state_dict(strategy.model, opt, options=options) for opt in optimizers]


def _save_captured_checkpoint(trainer: "pl.Trainer", filepath: str, weights_only: bool, state: _CapturedState) -> None:
    """Like :meth:`~lightning.pytorch.trainer.trainer.Trainer.save_checkpoint`, but writes the captured state."""
    with trainer.profiler.profile("save_checkpoint"):
        checkpoint = trainer._checkpoint_connector.dump_checkpoint(weights_only, captured_state=state.for_writing())
        trainer.strategy.save_checkpoint(checkpoint, filepath)
        trainer.strategy.barrier("Trainer.save_checkpoint")


def _hooks_logging(trainer: "pl.Trainer", monitor: str) -> set[str]:
    """The training hooks (e.g. ``training_step``) that logged ``monitor`` in the current epoch."""
    from lightning.pytorch.trainer.connectors.logger_connector.result import _ResultMetric

    hooks = set()
    for result_metric in trainer.fit_loop.epoch_loop._results.values():
        if isinstance(result_metric, _ResultMetric):
            meta = result_metric.meta
            if monitor in (meta.name, meta.forked_name(True), meta.forked_name(False)):
                hooks.add(meta.fx)
    return hooks


def _monitor_logged_in_training(trainer: "pl.Trainer", monitor: str) -> bool:
    """Whether ``monitor`` was logged from a training hook (e.g. ``training_step``) in the current epoch."""
    return bool(_hooks_logging(trainer, monitor))


#: Hooks that run before the optimizer steps of a training batch: a metric logged in them was computed (unless the
#: module stepped before computing it) by the weights the batch started with.
_PRE_STEP_HOOKS = frozenset(
    {
        "on_train_batch_start",
        "training_step",
        "on_before_backward",
        "on_after_backward",
        "on_before_optimizer_step",
        "on_before_zero_grad",
    }
)


def _monitor_logged_before_step(trainer: "pl.Trainer", monitor: str) -> bool:
    """Whether ``monitor`` was logged in the current epoch from a hook that runs before the optimizer step."""
    return not _hooks_logging(trainer, monitor).isdisjoint(_PRE_STEP_HOOKS)


def _validation_will_run_after_batch(trainer: "pl.Trainer") -> bool:
    """Whether validation runs right after the current batch, as the last batch of an epoch that validates."""
    if not trainer.enable_validation or not trainer.fit_loop.epoch_loop.batch_progress.is_last_batch:
        return False
    num_val_batches = (
        sum(trainer.num_val_batches) if isinstance(trainer.num_val_batches, list) else trainer.num_val_batches
    )
    if not num_val_batches:
        return False
    every_n_epochs = trainer.check_val_every_n_epoch
    return every_n_epochs is None or (trainer.current_epoch + 1) % every_n_epochs == 0


def _warn_resume_from_pre_step(trainer: "pl.Trainer", checkpoint: dict[str, Any]) -> None:
    """Warns once when training resumes from a checkpoint marked with :data:`PRE_OPTIMIZER_STEP_KEY`."""
    from lightning.pytorch.trainer.states import TrainerFn

    marker = checkpoint.get(PRE_OPTIMIZER_STEP_KEY)
    if marker is None or trainer.state.fn != TrainerFn.FITTING:
        return
    _warn_once(
        trainer,
        "You are resuming from a checkpoint that holds the weights from before the optimizer step of the batch that"
        f" produced its monitored score (global step {marker.get('global_step')}). The training progress in it counts"
        " that batch as done, so that batch's update will not be applied. Resume from a `last.ckpt` to continue"
        " exactly where training stopped.",
    )


def _warn_legacy_workaround(trainer: "pl.Trainer", pl_module: "pl.LightningModule") -> None:
    if hasattr(pl_module, "saved_models"):
        _warn_once(
            trainer,
            "Your LightningModule has a `saved_models` attribute, the workaround documented in Lightning 2.6 for"
            " checkpointing the weights from before `optimizer.step()`. It is no longer needed and is not used:"
            " `ModelCheckpoint` now captures those weights itself. You can remove it to save memory.",
        )


@dataclass
class _TimeTrigger:
    """Makes the ``train_time_interval`` decision once per batch, consistently across ranks."""

    decided_batch: Optional[int] = None
    is_due: bool = False

    def due(self, trainer: "pl.Trainer", checkpoint: "ModelCheckpoint") -> bool:
        """Whether ``checkpoint``'s ``train_time_interval`` has elapsed, decided at the first call in a batch."""
        key = _batch_key(trainer)
        if self.decided_batch == key:
            return self.is_due
        interval = checkpoint._train_time_interval
        due = False
        if interval is not None:
            now = time.monotonic()
            previous = checkpoint._last_time_checked
            due = previous is not None and (now - previous) >= interval.total_seconds()
            # time differs across ranks: take rank 0's decision to avoid hangs
            due = trainer.strategy.broadcast(due)
            if due:
                checkpoint._last_time_checked = now
        self.decided_batch, self.is_due = key, due
        return due


def _pre_step_state_needed(
    checkpoint: "ModelCheckpoint",
    trainer: "pl.Trainer",
    max_steps_per_batch: Optional[int],
    monitor_before_step: Optional[bool],
) -> bool:
    """Whether ``checkpoint`` may save a score logged in the current batch at its end, asked as the batch starts.

    ``monitor_before_step`` says whether the monitored metric was logged before the optimizer step at the checkpoint's
    last save (``None`` before the first): a metric that only validation logs never needs the pre-step state.

    """
    if trainer.fast_dev_run or checkpoint.save_top_k == 0 or monitor_before_step is False:
        return False
    if checkpoint._train_time_interval is not None and checkpoint._time_trigger.due(trainer, checkpoint):
        return True
    every_n = checkpoint._every_n_train_steps
    if every_n < 1:
        return False
    if max_steps_per_batch is None:
        return True  # unknown yet how many steps a batch takes: capture to be safe
    next_multiple = (trainer.global_step // every_n + 1) * every_n
    return next_multiple <= trainer.global_step + max(max_steps_per_batch, 1)
