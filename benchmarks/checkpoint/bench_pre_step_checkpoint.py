"""What ``ModelCheckpoint(save_pre_optimizer_step_weights=True)`` costs (issue #20947), against stock behaviour.

The model is a 95%-frozen fine-tuning setup: a frozen backbone, a trainable head holding 5% of the parameters, and an
AdamW optimizer given all parameters (the common pattern; the frozen ones never get a gradient). Its training loss is
noisy and decreasing. Printed, in one run:

1. memory: the peak bytes the copies hold, against the trainable parameters and their optimizer states;
2. captures per 1,000 steps (``every_n_train_steps=1``, ``save_top_k=3``), against the saves whose score enters the
   top-k, when the score is logged before ``optimizer.step()`` (manual optimization: known before the step, so the
   copy is skipped when it cannot enter) and when it is not (automatic optimization: the loss is computed inside the
   step's closure);
3. step time with ``every_n_train_steps=10``, option on and off, in alternating blocks within this one process, so
   that the 10-18% throughput noise between processes does not swamp a 1% effect, counted as this thread's CPU
   time, which other jobs on the machine do not add to; then the CPU time spent in the capture's own code;
4. with ``--stock-python`` (an interpreter with the released ``lightning==2.6.6``): the same blocks there, stock and
   with the ``saved_models`` workaround that 2.6 documented (clone the weights in every batch). These run in another
   process, so compare them with care.

Usage (a few minutes on 2 CPU cores)::

    python benchmarks/checkpoint/bench_pre_step_checkpoint.py [--stock-python /path/to/venv/bin/python]

"""

import argparse
import json
import os
import statistics
import subprocess
import tempfile
import time
import warnings

import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import lightning
from lightning.pytorch import Callback, LightningModule, Trainer, seed_everything
from lightning.pytorch.callbacks import ModelCheckpoint

HIDDEN, LAYERS, OUT, BATCH = 512, 6, 162, 32  # backbone 1.58M parameters, head 83.1k (5.0%)


class FineTune(LightningModule):
    def __init__(self, manual, workaround=False):
        super().__init__()
        self.automatic_optimization = not manual
        self.workaround = workaround
        self.backbone = nn.Sequential(*[nn.Sequential(nn.Linear(HIDDEN, HIDDEN), nn.Tanh()) for _ in range(LAYERS)])
        self.backbone.requires_grad_(False)
        self.head = nn.Linear(HIDDEN, OUT)

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = nn.functional.mse_loss(self.head(self.backbone(x)), y)
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
        return None

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=3e-3)

    def train_dataloader(self):
        g = torch.Generator().manual_seed(0)
        x = torch.randn(BATCH * 50, HIDDEN, generator=g)
        target = nn.Linear(HIDDEN, OUT)
        with torch.no_grad():
            y = target(x) + 0.5 * torch.randn(len(x), OUT, generator=g)
        return DataLoader(TensorDataset(x, y), batch_size=BATCH, shuffle=True, generator=g)


class Meter(Callback):
    """Listed before the checkpoint: sees each batch's copies, and whether its score enters the top-k."""

    def __init__(self, ckpt):
        self.ckpt = ckpt
        self.peak_bytes = 0
        self.captures = 0
        self.entering = 0

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if self.ckpt.check_monitor_top_k(trainer, trainer.callback_metrics.get(self.ckpt.monitor)):
            self.entering += 1
        capture = getattr(self.ckpt, "_pre_step", None)
        if capture is None:
            return
        tensors = list(capture._params.values())
        for per_param in capture._optimizer_states.values():
            for state in per_param.values():
                tensors += [t for t in (state or {}).values() if isinstance(t, torch.Tensor)]
        held = sum(t.nbytes for t in tensors)
        self.captures += held > 0
        self.peak_bytes = max(self.peak_bytes, held)


class StepClock(Callback):
    """Time (wall, or CPU with `clock=time.thread_time`) from one batch start to the next: everything a batch costs."""

    def __init__(self, clock=time.perf_counter):
        self.times = []
        self._last = None
        self._clock = clock

    def on_train_batch_start(self, trainer, *args):
        now = self._clock()
        if self._last is not None:
            self.times.append(now - self._last)
        self._last = now


def fit(model, steps, ckpt_kwargs, extra=()):
    warnings.filterwarnings("ignore")
    with tempfile.TemporaryDirectory(dir="/dev/shm" if os.path.isdir("/dev/shm") else None) as tmp:
        ckpt = ModelCheckpoint(dirpath=tmp, monitor="train_loss", **ckpt_kwargs)
        callbacks = [cb(ckpt) if isinstance(cb, type) else cb for cb in extra]
        trainer = Trainer(
            max_steps=steps,
            callbacks=[*callbacks, ckpt],
            logger=False,
            enable_progress_bar=False,
            enable_model_summary=False,
            enable_checkpointing=True,
            limit_val_batches=0,
        )
        trainer.fit(model)
    return callbacks


class OwnTime:
    """Accounts the CPU time this thread spends in the capture's own code (hooks, copies, pairing, the swap into the
    file): unlike wall time, it does not grow when other processes share the machine."""

    def __init__(self):
        self.seconds = 0.0
        try:
            from lightning.pytorch.callbacks import _pre_step_snapshot as module
        except ImportError:  # released Lightning: nothing to account for
            return
        for cls, names in (
            (module._PreStepCapture, ("start_batch", "end_batch", "end_epoch", "_on_step", "_on_any_step")),
            (module._Pairing, ("_write",)),
        ):
            for name in names:
                setattr(cls, name, self._timed(getattr(cls, name)))

    def _timed(self, fn):
        def timed(*args, **kwargs):
            start = time.thread_time()
            try:
                return fn(*args, **kwargs)
            finally:
                self.seconds += time.thread_time() - start

        return timed


def block_times(kinds, blocks, steps, every_n):
    """Per-batch CPU time of this thread for each kind (label -> fit kwargs): the median over alternating blocks, in
    this process, of each block's mean (which includes its saves and copies). With one torch thread, the batch's
    compute, the capture and the save all run in this thread."""
    per_kind = {label: [] for label in kinds}
    for block in range(blocks + 1):  # the first round warms up and is not counted
        for label, (manual, workaround, pre_step) in kinds.items():
            seed_everything(0, verbose=False)
            clock = StepClock(time.thread_time)  # CPU time: other processes on the machine do not add to it
            kwargs = {"every_n_train_steps": every_n, "save_top_k": 1}
            if pre_step:
                kwargs["save_pre_optimizer_step_weights"] = True
            fit(FineTune(manual, workaround), steps, kwargs, extra=[clock])
            if block:
                per_kind[label].append(statistics.fmean(clock.times[10:]))
    return {label: statistics.median(times) for label, times in per_kind.items()}


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=1000, help="steps of the capture count")
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
    share = f"{trainable / 2**10:.1f} KiB trainable ({trainable / total:.1%})"
    print(f"\nmodel: {total / 2**20:.2f} MiB of parameters, {share}")

    # 1 + 2: memory and captures per 1,000 steps
    for manual in (True, False):
        seed_everything(0, verbose=False)
        (meter,) = fit(
            FineTune(manual),
            args.steps,
            {"every_n_train_steps": 1, "save_top_k": 3, "save_pre_optimizer_step_weights": True},
            extra=[Meter],
        )
        # AdamW keeps two tensors like each trainable parameter, and a scalar step per parameter tensor
        n_trainable = sum(1 for p in model.parameters() if p.requires_grad)
        state = 2 * trainable + n_trainable * torch.tensor(0.0).nbytes
        target = trainable + state + 2**20
        kind = "manual, score logged before the step" if manual else "automatic, score computed inside the step"
        print(f"\n{kind}:")
        print(
            f"  peak extra memory {meter.peak_bytes / 2**10:.1f} KiB; target <= trainable + optimizer state + 1 MiB"
            f" = {target / 2**10:.1f} KiB: {'met' if meter.peak_bytes <= target else 'MISSED'}"
        )
        per_1000 = 1000 / args.steps
        print(
            f"  captures per 1,000 steps: {meter.captures * per_1000:.0f}; saves entering the top-k:"
            f" {meter.entering * per_1000:.0f}; target captures <= entering saves + saves scored after the step"
            f" ({meter.entering * per_1000:.0f} + {0 if manual else args.steps * per_1000:.0f}):"
            f" {'met' if meter.captures <= meter.entering + (0 if manual else args.steps) else 'MISSED'}"
        )

    # 3: step time, every 10 steps, option on and off, alternating in this process; then the time spent in the
    # capture's own code, measured inside a run, which does not depend on what else the machine is doing
    kinds = {
        "manual, option off": (True, False, False),
        "manual, option on": (True, False, True),
        "automatic, option off": (False, False, False),
        "automatic, option on": (False, False, True),
    }
    times = block_times(kinds, args.blocks, args.block_steps, every_n=10)
    blocks = f"{args.blocks} alternating blocks of {args.block_steps} steps"
    print(f"\nstep CPU time, every_n_train_steps=10, median of {blocks}:")
    for mode in ("manual", "automatic"):
        off, on = times[f"{mode}, option off"], times[f"{mode}, option on"]
        overhead = on / off - 1
        print(
            f"  {mode:<9}: off {off * 1e3:.3f} ms, on {on * 1e3:.3f} ms, overhead {overhead:+.2%}"
            f" (target <= 1%: {'met' if overhead <= 0.01 else 'MISSED'})"
        )
    own = OwnTime()
    for mode, manual in (("manual", True), ("automatic", False)):
        own.seconds = 0.0
        seed_everything(0, verbose=False)
        clock = StepClock(time.thread_time)  # this thread's CPU time per batch, the capture's share of it
        kwargs = {"every_n_train_steps": 10, "save_top_k": 1, "save_pre_optimizer_step_weights": True}
        fit(FineTune(manual), 1000, kwargs, extra=[clock])
        share = own.seconds / sum(clock.times)
        print(
            f"  {mode:<9}: {own.seconds / len(clock.times) * 1e6:.1f} us of CPU per step in the capture's own code,"
            f" {share:.2%} of the step time (target <= 1%: {'met' if share <= 0.01 else 'MISSED'})"
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
