"""What ``ModelCheckpoint(save_pre_optimizer_step_weights=True)`` costs (issue #20947), against stock behaviour.

The model is a 95%-frozen fine-tuning setup: a frozen backbone, a trainable head holding 5% of the parameters, and an
AdamW optimizer given all parameters (the common pattern; the frozen ones never get a gradient). Its training loss is
noisy and decreasing. Printed, in one run:

1. memory: the peak bytes the copy holds, with one checkpoint and with two, against the trainable parameters and
   their optimizer states;
2. copies per 1,000 steps (``every_n_train_steps=1``, ``save_top_k=3``) against the saves whose score enters the
   top-k, plus those whose score is logged after the step, under automatic optimization and under manual optimization
   with the score logged before and after ``optimizer.step()``; and the copies with ``every_n_train_steps=10``;
3. step time with ``every_n_train_steps=10``, option on and off, in alternating blocks within this one process, so
   that the 10-18% throughput noise between processes does not swamp a small effect, counted as this thread's CPU
   time, which other jobs on the machine do not add to; then the CPU time spent in the capture's own code (its
   hooks, the copy, writing it into the checkpoint; not the save itself, which stock does too);
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
    def __init__(self, manual, workaround=False, log_after_step=False):
        super().__init__()
        self.automatic_optimization = not manual
        self.workaround = workaround
        self.log_after_step = log_after_step
        self.backbone = nn.Sequential(*[nn.Sequential(nn.Linear(HIDDEN, HIDDEN), nn.Tanh()) for _ in range(LAYERS)])
        self.backbone.requires_grad_(False)
        self.head = nn.Linear(HIDDEN, OUT)

    def training_step(self, batch, batch_idx):
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

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=3e-3)

    def train_dataloader(self):
        g = torch.Generator().manual_seed(0)
        x = torch.randn(BATCH * 50, HIDDEN, generator=g)
        target = nn.Linear(HIDDEN, OUT)
        with torch.no_grad():
            y = target(x) + 0.5 * torch.randn(len(x), OUT, generator=g)
        return DataLoader(TensorDataset(x, y), batch_size=BATCH, shuffle=True, generator=g)


def tensor_bytes(obj):
    """Bytes of the tensors in a nested structure of dicts and lists."""
    if isinstance(obj, torch.Tensor):
        return obj.nbytes
    if isinstance(obj, dict):
        return sum(tensor_bytes(v) for v in obj.values())
    if isinstance(obj, (list, tuple)):
        return sum(tensor_bytes(v) for v in obj)
    return 0


class Meter(Callback):
    """Listed before the checkpoints: sees each batch's copy before they save, and whether the score enters the top-k
    of the first checkpoint (the decision stock makes, without the reduction across ranks)."""

    def __init__(self, ckpts):
        self.ckpts = ckpts
        self.peak_bytes = 0
        self.copies = 0
        self.entering = 0

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        ckpt = self.ckpts[0]
        if trainer.global_step % ckpt._every_n_train_steps == 0 and ckpt._pre_step._needs_copy(
            ckpt, trainer.callback_metrics.get(ckpt.monitor)
        ):
            self.entering += 1
        copied = ckpt._pre_step.copy
        if copied is not None:
            self.copies += 1
            # the copy holds (live parameter, its clone) pairs, the global step and the cloned state dicts
            clones = sum(clone.nbytes for _, clone in copied["params"].values())
            self.peak_bytes = max(self.peak_bytes, clones + tensor_bytes(copied["states"]))


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


def fit(model, steps, ckpt_kwargs, extra=(), n_checkpoints=1):
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
    """Accounts the time spent in the capture's own code: its hooks, the copy and writing the copy into the checkpoint,
    but not `Trainer.save_checkpoint` itself, which stock runs too. It uses `time.perf_counter` (about 0.1 us a call):
    `time.thread_time` costs about 0.8 us a call on a VM, which would inflate the figure by a few us a step. The spans
    are microseconds long, so other processes rarely preempt them."""

    def __init__(self):
        self.seconds = 0.0
        from lightning.pytorch.callbacks import _pre_step_snapshot as module

        cls = module._PreStepCapture
        for name in ("start_batch", "before_optimizer_step", "defer", "save_checkpoint"):
            setattr(cls, name, self._timed(getattr(cls, name), sign=1))
        # inside `save_checkpoint`: the save itself is not the capture's, the copy's write into it is
        Trainer.save_checkpoint = self._timed(Trainer.save_checkpoint, sign=-1)
        module._write = self._timed(module._write, sign=1)

    def _timed(self, fn, sign):
        def timed(*args, **kwargs):
            start = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self.seconds += sign * (time.perf_counter() - start)

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


def met(ok):
    return "met" if ok else "MISSED"


def main():
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

    # 1: memory, with one checkpoint and with two
    print("\npeak extra memory (the copy), every_n_train_steps=1, save_top_k=3:")
    for n in (1, 2):
        seed_everything(0, verbose=False)
        kwargs = {"every_n_train_steps": 1, "save_top_k": 3, "save_pre_optimizer_step_weights": True}
        (meter,) = fit(FineTune(True), args.steps // 4, kwargs, extra=[Meter], n_checkpoints=n)
        print(
            f"  {n} checkpoint{'s' if n > 1 else ''}: {meter.peak_bytes / 2**10:.1f} KiB; target <= trainable +"
            f" optimizer state + 1 MiB = {target / 2**10:.1f} KiB: {met(meter.peak_bytes <= target)}"
        )

    # 2: copies per 1,000 steps
    per_1000 = 1000 / args.steps
    for every_n in (1, 10):
        print(f"\ncopies per 1,000 steps, every_n_train_steps={every_n}, save_top_k=3:")
        for label, manual, after in (
            ("automatic (loss logged in the closure)", False, False),
            ("manual, logged before the step", True, False),
            ("manual, logged after the step", True, True),
        ):
            seed_everything(0, verbose=False)
            kwargs = {"every_n_train_steps": every_n, "save_top_k": 3, "save_pre_optimizer_step_weights": True}
            (meter,) = fit(FineTune(manual, log_after_step=after), args.steps, kwargs, extra=[Meter])
            copies, entering = meter.copies * per_1000, meter.entering * per_1000
            after_step = args.steps // every_n * per_1000 if after else 0
            print(
                f"  {label:<40}: {copies:5.0f} copies; saves entering the top-k {entering:.0f}, saves logged after the"
                f" step {after_step:.0f}; copies <= their sum + 1% of the steps:"
                f" {met(copies <= entering + after_step + 10)}"
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
    print(
        f"\nstep CPU time, every_n_train_steps=10, median of {args.blocks} alternating blocks"
        f" of {args.block_steps} steps:"
    )
    for mode in ("manual", "automatic"):
        off, on = times[f"{mode}, option off"], times[f"{mode}, option on"]
        print(f"  {mode:<9}: off {off * 1e3:.3f} ms, on {on * 1e3:.3f} ms, {on / off - 1:+.2%}")
    own = OwnTime()
    for mode, manual in (("manual", True), ("automatic", False)):
        own.seconds = 0.0
        seed_everything(0, verbose=False)
        clock = StepClock()  # wall time per batch, the capture's share of it
        kwargs = {"every_n_train_steps": 10, "save_top_k": 1, "save_pre_optimizer_step_weights": True}
        fit(FineTune(manual), 1000, kwargs, extra=[clock])
        share = own.seconds / sum(clock.times)
        print(
            f"  {mode:<9}: {own.seconds / len(clock.times) * 1e6:.1f} us of CPU per step in the capture's own code,"
            f" {share:.2%} of the step time (target <= 0.5%: {met(share <= 0.005)})"
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
