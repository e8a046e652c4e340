"""What ``ModelCheckpoint(save_pre_optimizer_step_state=True)`` costs (issue #20947), against stock behaviour.

The model is a 95%-frozen fine-tuning setup: a frozen backbone, a trainable head holding 5% of the parameters, and an
AdamW optimizer given all parameters (the common pattern; the frozen ones never get a gradient). Its training loss is
noisy and decreasing. Each ``ModelCheckpoint`` with the option copies for itself (there is no copy shared between
checkpoints), at the batch's first optimizer step, and only if its monitored value was logged in the batch before that
step and can enter its top-k; a score logged after ``optimizer.step()`` gets the live state and a warning, and takes
no copy. Printed, in one run:

1. memory: the peak bytes the copies hold at once, with one checkpoint and with two, against the trainable parameters
   and their optimizer states;
2. copies vs saves entering the top-k, per 1,000 steps (``every_n_train_steps=1``, ``save_top_k=3``), under automatic
   optimization and under manual optimization with the score logged before and after ``optimizer.step()`` (after it,
   about none should be taken); and the same with ``every_n_train_steps=10``;
3. step time with ``every_n_train_steps=10``, option on and off, in alternating blocks within this one process, so
   that the 10-18% throughput noise between processes does not swamp a small effect, counted as this thread's CPU
   time, which other jobs on the machine do not add to; then the CPU time spent in the capture's own code (its hooks,
   the copy, writing it into the checkpoint; not the save itself, which stock does too);
4. with ``--stock-python`` (an interpreter with the released ``lightning==2.6.6``): the same blocks there, stock and
   with the ``saved_models`` workaround that 2.6 documented (clone the weights in every batch). These run in another
   process, so compare them with care.

Usage (a few minutes on 2 CPU cores)::

    python benchmarks/checkpoint/bench_pre_optimizer_step.py [--stock-python /path/to/venv/bin/python]

"""

import argparse
import json
import os
import statistics
import subprocess
import tempfile
import time
import warnings
from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import lightning
from lightning.pytorch import Callback, LightningModule, Trainer, seed_everything
from lightning.pytorch.callbacks import ModelCheckpoint

HIDDEN, LAYERS, OUT, BATCH = 512, 6, 162, 32  # backbone 1.58M parameters, head 83.1k (5.0%)
STEP_SECONDS = 3.5e-3  # a step of this model on a quiet machine, what the time target is a share of


class FineTune(LightningModule):
    def __init__(self, manual: bool, workaround: bool = False, log_after_step: bool = False) -> None:
        super().__init__()
        self.automatic_optimization = not manual
        self.workaround = workaround
        self.log_after_step = log_after_step
        self.backbone = nn.Sequential(*[nn.Sequential(nn.Linear(HIDDEN, HIDDEN), nn.Tanh()) for _ in range(LAYERS)])
        self.backbone.requires_grad_(False)
        self.head = nn.Linear(HIDDEN, OUT)

    def training_step(self, batch: list[torch.Tensor], batch_idx: int) -> torch.Tensor | None:
        x, y = batch
        loss = nn.functional.mse_loss(self.head(self.backbone(x)), y)
        if not self.log_after_step:
            self.log("train_loss", loss)
        if self.automatic_optimization:
            return loss
        if self.workaround:  # what Lightning 2.6 documented: clone the weights before every step, keep 10
            if not hasattr(self, "saved_models"):
                self.saved_models = {}
            self.saved_models[batch_idx] = {k: v.detach().clone() for k, v in self.state_dict().items()}
            self.saved_models.pop(batch_idx - 10, None)
        opt = self.optimizers()
        opt.zero_grad()
        self.manual_backward(loss)
        opt.step()
        if self.log_after_step:
            self.log("train_loss", loss.detach())
        return None

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=3e-3)

    def train_dataloader(self) -> DataLoader:
        g = torch.Generator().manual_seed(0)
        x = torch.randn(BATCH * 50, HIDDEN, generator=g)
        target = nn.Linear(HIDDEN, OUT)
        with torch.no_grad():
            y = target(x) + 0.5 * torch.randn(len(x), OUT, generator=g)
        return DataLoader(TensorDataset(x, y), batch_size=BATCH, shuffle=True, generator=g)


def tensor_bytes(obj: Any) -> int:
    """Bytes of the tensors in a nested structure of dicts and lists."""
    if isinstance(obj, torch.Tensor):
        return obj.nbytes
    if isinstance(obj, dict):
        return sum(tensor_bytes(v) for v in obj.values())
    if isinstance(obj, (list, tuple)):
        return sum(tensor_bytes(v) for v in obj)
    return 0


class Meter(Callback):
    """Listed before the checkpoints (Lightning runs them last): sees at each batch end the copies they took before
    they save, and whether the first one's save enters its top-k (stock's decision, `check_monitor_top_k`)."""

    def __init__(self, ckpts: list[ModelCheckpoint]) -> None:
        self.ckpts = ckpts
        self.peak_bytes = 0  # of the copies held at once, by all the checkpoints
        self.copies = 0  # batches in which the first checkpoint took a copy
        self.entering = 0  # saves of the first checkpoint whose score enters its top-k

    def on_train_batch_end(self, trainer: Trainer, *args: Any) -> None:
        ckpt = self.ckpts[0]
        value = trainer.callback_metrics.get(ckpt.monitor or "")
        if trainer.global_step % ckpt._every_n_train_steps == 0 and ckpt.check_monitor_top_k(trainer, value):
            self.entering += 1
        states = [c._pre_optimizer_step for c in self.ckpts]
        copies = [state.copy for state in states if state is not None and state.copy is not None]
        if states[0] is not None and states[0].copy is not None:
            self.copies += 1
        # each copy holds (live parameter, its clone) pairs, the global step and the cloned optimizer states
        held = sum(sum(clone.nbytes for _, clone in c["params"].values()) + tensor_bytes(c["states"]) for c in copies)
        self.peak_bytes = max(self.peak_bytes, held)


class StepClock(Callback):
    """Time (wall, or CPU with `clock=time.thread_time`) from one batch start to the next: everything a batch costs."""

    def __init__(self, clock: Callable[[], float] = time.perf_counter) -> None:
        self.times: list[float] = []
        self._last: float | None = None
        self._clock = clock

    def on_train_batch_start(self, trainer: Trainer, *args: Any) -> None:
        now = self._clock()
        if self._last is not None:
            self.times.append(now - self._last)
        self._last = now


def fit(
    model: LightningModule, steps: int, ckpt_kwargs: dict[str, Any], extra: tuple | list = (), n_checkpoints: int = 1
) -> list[Callback]:
    warnings.filterwarnings("ignore")
    with tempfile.TemporaryDirectory(dir="/dev/shm" if os.path.isdir("/dev/shm") else None) as tmp:
        ckpts = [
            # the second saves half as often (a different `state_key`), into its own directory
            ModelCheckpoint(
                dirpath=os.path.join(tmp, str(i)),
                monitor="train_loss",
                **{
                    **ckpt_kwargs,
                    "every_n_train_steps": ckpt_kwargs["every_n_train_steps"] * (i + 1),
                },
            )
            for i in range(n_checkpoints)
        ]
        callbacks = [cb(ckpts) if isinstance(cb, type) else cb for cb in extra]
        trainer = Trainer(
            max_steps=steps,
            callbacks=[*callbacks, *ckpts],
            logger=False,
            enable_progress_bar=False,
            enable_model_summary=False,
            enable_checkpointing=True,
            limit_val_batches=0,
        )
        trainer.fit(model)
    return callbacks


class OwnTime:
    """Accounts the CPU time of this thread spent in the capture's own code: the hooks of `_PreOptimizerStepState`,
    the copy and writing it into the checkpoint, but not the save itself, which stock runs too: inside the capture's
    `save_checkpoint`, the outermost of `Trainer.save_checkpoint` (a file with the live state),
    `_CheckpointConnector.dump_checkpoint` and `Strategy.save_checkpoint` (a file with the copy) is subtracted. CPU
    time, as the blocks: a wall clock would count the times other processes preempt these spans. `time.thread_time`
    costs about 0.7 us a call on a VM, a few us a step over the spans, so what a span of an empty function measures
    is taken off each span."""

    def __init__(self) -> None:
        from lightning.pytorch.callbacks import _pre_optimizer_step as module
        from lightning.pytorch.strategies import Strategy  # `SingleDeviceStrategy` does not override `save_checkpoint`
        from lightning.pytorch.trainer.connectors.checkpoint_connector import _CheckpointConnector

        self.seconds, self.bias = 0.0, 0.0
        self._depth = 0  # 1 inside a hook of the capture, 2 inside a save step it runs
        empty = self._timed(lambda: None, own=True)
        for _ in range(10_000):
            empty()
        self.bias, self.seconds = self.seconds / 10_000, 0.0
        hooks = ("on_train_batch_start", "on_before_optimizer_step", "on_train_batch_end", "defer_to_validation")
        cls = module._PreOptimizerStepState
        for name in (*hooks, "on_validation_end", "save_checkpoint"):
            setattr(cls, name, self._timed(getattr(cls, name), own=True))
        for owner, name in (
            (Trainer, "save_checkpoint"),
            (_CheckpointConnector, "dump_checkpoint"),
            (Strategy, "save_checkpoint"),
        ):
            setattr(owner, name, self._timed(getattr(owner, name), own=False))

    def _timed(self, fn: Callable[..., Any], own: bool) -> Callable[..., Any]:
        def timed(*args: Any, **kwargs: Any) -> Any:
            if not own and self._depth != 1:  # a save outside the capture, or a step of a save already subtracted
                return fn(*args, **kwargs)
            self._depth += 1
            start = time.thread_time()
            try:
                return fn(*args, **kwargs)
            finally:
                elapsed = time.thread_time() - start - self.bias
                self._depth -= 1
                self.seconds += elapsed if own else -elapsed

        return timed


def block_times(kinds: dict[str, tuple[bool, bool, bool]], blocks: int, steps: int, every_n: int) -> dict[str, float]:
    """Per-batch CPU time of this thread for each kind (label -> fit kwargs): the median over alternating blocks, in
    this process, of each block's mean (which includes its saves and copies). With one torch thread, the batch's
    compute, the capture and the save all run in this thread."""
    per_kind: dict[str, list[float]] = {label: [] for label in kinds}
    for block in range(blocks + 1):  # the first round warms up and is not counted
        for label, (manual, workaround, pre_step) in kinds.items():
            seed_everything(0, verbose=False)
            clock = StepClock(time.thread_time)  # CPU time: other processes on the machine do not add to it
            kwargs: dict[str, Any] = {"every_n_train_steps": every_n, "save_top_k": 1}
            if pre_step:
                kwargs["save_pre_optimizer_step_state"] = True
            fit(FineTune(manual, workaround), steps, kwargs, extra=[clock])
            if block:
                per_kind[label].append(statistics.fmean(clock.times[10:]))
    return {label: statistics.median(times) for label, times in per_kind.items()}


def met(ok: bool) -> str:
    return "met" if ok else "MISSED"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=1000, help="steps of the copy counts")
    parser.add_argument("--blocks", type=int, default=30, help="blocks per variant in the throughput comparison")
    parser.add_argument("--block-steps", type=int, default=100)
    parser.add_argument("--stock-python", help="an interpreter with the released lightning==2.6.6")
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    args = parser.parse_args()
    torch.set_num_threads(1)
    torch.set_grad_enabled(True)

    if args.worker:  # the stock interpreter's side of section 4
        kinds = {"stock": (True, False, False), "stock + saved_models": (True, True, False)}
        print(json.dumps(block_times(kinds, args.blocks, args.block_steps, every_n=10)))
        return

    print(f"lightning {lightning.__version__}, torch {torch.__version__}, 1 thread")
    model = FineTune(manual=True)
    trainable = sum(p.nbytes for p in model.parameters() if p.requires_grad)
    total = sum(p.nbytes for p in model.parameters())
    print(
        f"\nmodel: {total / 2**20:.2f} MiB of parameters,"
        f" {trainable / 2**10:.1f} KiB trainable ({trainable / total:.1%})"
    )
    # AdamW keeps two tensors like each trainable parameter, and a scalar step per parameter tensor
    n_trainable = sum(1 for p in model.parameters() if p.requires_grad)
    target = trainable + 2 * trainable + n_trainable * torch.tensor(0.0).nbytes + 2**20

    # 1: memory, with one checkpoint and with two (each holds its own copy)
    print("\npeak extra memory (the copies held at once), every_n_train_steps=1, save_top_k=3:")
    for n in (1, 2):
        seed_everything(0, verbose=False)
        kwargs = {"every_n_train_steps": 1, "save_top_k": 3, "save_pre_optimizer_step_state": True}
        (meter,) = fit(FineTune(True), args.steps // 4, kwargs, extra=[Meter], n_checkpoints=n)
        print(
            f"  {n} checkpoint{'s' if n > 1 else ''}: {meter.peak_bytes / 2**10:.1f} KiB; target <= trainable +"
            f" optimizer state + 1 MiB = {target / 2**10:.1f} KiB: {met(meter.peak_bytes <= target)}"
        )

    # 2: copies vs saves entering the top-k, per 1,000 steps
    per_1000 = 1000 / args.steps
    for every_n in (1, 10):
        print(f"\ncopies vs saves entering the top-k per 1,000 steps, every_n_train_steps={every_n}, save_top_k=3:")
        for label, manual, after in (
            ("automatic (loss logged in the closure)", False, False),
            ("manual, logged before the step", True, False),
            ("manual, logged after the step", True, True),
        ):
            seed_everything(0, verbose=False)
            kwargs = {"every_n_train_steps": every_n, "save_top_k": 3, "save_pre_optimizer_step_state": True}
            (meter,) = fit(FineTune(manual, log_after_step=after), args.steps, kwargs, extra=[Meter])
            copies, entering = meter.copies * per_1000, meter.entering * per_1000
            after_step = entering if after else 0  # this model logs the score after the step in every batch or none
            line = (
                f"  {label:<38}: {copies:5.0f} copies; saves entering the top-k {entering:.0f}, of them with the"
                f" score logged after the step {after_step:.0f}; copies <= their sum + 1% of the steps:"
                f" {met(copies <= entering + after_step + 10)}"
            )
            if after:  # they hold the live state, with a warning, and take no copy
                line += f"; copies ~0 (<= 1% of the steps): {met(copies <= 10)}"
            print(line)

    # 3: step time, every 10 steps, option on and off, alternating in this process; then the CPU time spent in the
    # capture's own code, measured inside a run, which does not depend on what else the machine is doing
    kinds = {
        "manual, option off": (True, False, False),
        "manual, option on": (True, False, True),
        "automatic, option off": (False, False, False),
        "automatic, option on": (False, False, True),
    }
    times = block_times(kinds, args.blocks, args.block_steps, every_n=10)
    print(
        f"\nstep CPU time, every_n_train_steps=10, median of {args.blocks} alternating blocks"
        f" of {args.block_steps} steps (target: on - off <= 0.5% of a {STEP_SECONDS * 1e3} ms step):"
    )
    for mode in ("manual", "automatic"):
        off, on = times[f"{mode}, option off"], times[f"{mode}, option on"]
        print(
            f"  {mode:<9}: off {off * 1e3:.3f} ms, on {on * 1e3:.3f} ms, {on / off - 1:+.2%};"
            f" on - off {(on - off) * 1e6:+.1f} us, {(on - off) / STEP_SECONDS:+.2%} of a {STEP_SECONDS * 1e3} ms"
            f" step: {met(on - off <= 0.005 * STEP_SECONDS)}"
        )
    own = OwnTime()
    for mode, manual in (("manual", True), ("automatic", False)):
        own.seconds = 0.0
        seed_everything(0, verbose=False)
        clock = StepClock(time.thread_time)  # CPU time per batch, the capture's share of it
        kwargs = {"every_n_train_steps": 10, "save_top_k": 1, "save_pre_optimizer_step_state": True}
        fit(FineTune(manual), 1000, kwargs, extra=[clock])
        per_step = own.seconds / len(clock.times)
        print(
            f"  {mode:<9}: {per_step * 1e6:.1f} us of CPU per step in the capture's own code,"
            f" {own.seconds / sum(clock.times):.2%} of this run's {statistics.fmean(clock.times) * 1e3:.2f} ms steps,"
            f" {per_step / STEP_SECONDS:.2%} of a {STEP_SECONDS * 1e3} ms step"
            f" (target <= 0.5%: {met(per_step <= 0.005 * STEP_SECONDS)})"
        )

    # 4: stock and the workaround, in the stock interpreter
    if args.stock_python:
        block_args = ["--block-steps", str(args.block_steps)]
        out = subprocess.run(
            [args.stock_python, __file__, "--worker", "1", "--blocks", str(args.blocks), *block_args],
            check=True,
            capture_output=True,
            text=True,
        )
        stock = json.loads(out.stdout.strip().splitlines()[-1])
        print("\nreleased lightning 2.6.6 (another process), manual optimization, every_n_train_steps=10:")
        for label, value in stock.items():
            print(f"  {label:<21}: {value * 1e3:.3f} ms per step, {value / stock['stock'] - 1:+.2%} vs stock")


if __name__ == "__main__":
    main()
