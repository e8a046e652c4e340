"""What ``ModelCheckpoint(save_pre_optimizer_step_state=True)`` costs, against the option off, in one run.

The main model is FULLY TRAINABLE under Adam with the default ``save_weights_only=False``: an MLP of ``--layers``
``Linear(--width, --width)`` + Tanh blocks and a ``Linear(--width, --width)`` head (13.6M parameters by default). The
second column is the same model with the blocks frozen and Adam given only the head. The training loss, logged in
``training_step`` (automatic optimization), is noisy and decreasing. Printed, as one markdown table:

1. bytes per copy: what ``_PreOptimizerStepState._params`` and ``._others`` hold at a top-k save, against the
   parameter bytes; the same with ``save_weights_only=True`` (the only checkpoint, and one of two); their peak with
   1, 2 and 3 checkpoints with the option (saving every 10, 5 and 2 steps: all three after each 10th);
2. peak RSS (``VmHWM``; ``ru_maxrss`` keeps the parent's peak over fork and exec) of a fit, option off and on, with
   1, 2 and 3 checkpoints, each in a fresh subprocess of this interpreter;
3. the wall time of the ``on_before_optimizer_step`` calls that copy, against plain copies of the same bytes in this
   process: one flat ``clone()``, ``dst.copy_(src)`` into a preallocated buffer, ``clone()`` of each tensor copied;
4. fit time, option off and on (``every_n_train_steps=10``, ``save_top_k=3``, files in /dev/shm), alternating fits
   in this process (median of ``--reps``); the copy as a share of a batch and of the fit;
5. batches in which ``_params`` became non-empty against batches that ended on a top-k save.

Torch runs with ``--threads`` threads (1 by default: another job on the machine disturbs it less).

Usage (about 7 minutes on 2 loaded CPU cores)::

    python benchmarks/checkpoint/bench_pre_optimizer_step.py [--width 1024 --layers 12 --batch 64 --steps 100 --reps 3]

"""

import argparse
import gc
import hashlib
import json
import logging
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
import warnings
from functools import partial
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import lightning
from lightning.pytorch import Callback, LightningModule, Trainer, seed_everything
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.callbacks._pre_optimizer_step import _PreOptimizerStepState as State

MB = 1e6


class Net(LightningModule):
    def __init__(self, width: int, layers: int, batch: int, frozen: bool) -> None:
        super().__init__()
        self.width, self.batch = width, batch
        self.body = nn.Sequential(*[nn.Sequential(nn.Linear(width, width), nn.Tanh()) for _ in range(layers)])
        self.head = nn.Linear(width, width)
        if frozen:
            self.body.requires_grad_(False)

    def training_step(self, batch: list[torch.Tensor], batch_idx: int) -> torch.Tensor:
        x, y = batch
        loss = nn.functional.mse_loss(self.head(self.body(x)), y)
        self.log("train_loss", loss)
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.Adam([p for p in self.parameters() if p.requires_grad], lr=1e-4)

    def train_dataloader(self) -> DataLoader:
        g = torch.Generator().manual_seed(0)
        x = torch.randn(self.batch * 32, self.width, generator=g)
        w = torch.randn(self.width, self.width, generator=g) / self.width**0.5
        y = torch.tanh(x @ w) + 0.3 * torch.randn(len(x), self.width, generator=g)
        return DataLoader(TensorDataset(x, y), batch_size=self.batch, shuffle=True, generator=g)


def held(state: State) -> int:
    """Bytes of the copy: the parameters' clones and cloned optimizer states, and the other tensors' values."""
    params = sum(
        clone.nbytes + sum(v.nbytes for v in (opt_state or {}).values() if isinstance(v, torch.Tensor))
        for _, _, clone, opt_state, _ in state._params.values()
    )
    return params + sum(v.nbytes for values in state._others.values() for _, v in values if v is not None)


class Probe:
    """Wraps methods of the shared `_PreOptimizerStepState` (one per fit) to time and count what it does."""

    def __init__(self) -> None:
        self.reset()
        save, swapped = State.save_checkpoint, State._swapped
        for name in ("on_train_batch_start", "on_before_backward", "on_train_batch_end"):  # the other hooks
            setattr(State, name, self._timed(getattr(State, name)))
        State.on_before_optimizer_step = self._timed(self._copy_probe(State.on_before_optimizer_step))

        def save_checkpoint(state: State, trainer: Trainer, checkpoint: ModelCheckpoint, filepath: str) -> None:
            if id(checkpoint) in state._pending:  # a top-k save at the end of a training batch
                self.save_batches.add(state._start_step)
                self.at_save.append(held(state))
            save(state, trainer, checkpoint, filepath)

        def _swapped(state: State, *args: Any) -> Any:
            self.with_copy += 1
            return swapped(state, *args)

        State.save_checkpoint = save_checkpoint
        State._swapped = _swapped

    def _copy_probe(self, step: Any) -> Any:
        def on_before_optimizer_step(state: State, trainer: Trainer, optimizer: Any) -> None:
            empty, start, times = not state._params, time.perf_counter(), os.times()
            step(state, trainer, optimizer)
            if empty and state._params:  # this call copied
                self.copy_seconds.append(time.perf_counter() - start)
                self.copy_system.append(os.times().system - times.system)
                self.copy_batches.add(state._start_step)
            self.peak = max(self.peak, held(state))

        return on_before_optimizer_step

    def _timed(self, fn: Any) -> Any:
        def timed(*args: Any) -> Any:
            start = time.perf_counter()
            result = fn(*args)
            self.hook_seconds += time.perf_counter() - start
            return result

        return timed

    def reset(self) -> None:
        self.hook_seconds = 0.0  # in the hooks of the state (the copy, the drop at the batch end), not in the saves
        self.copy_seconds: list[float] = []  # of the calls that copied
        self.copy_system: list[float] = []  # their system CPU time (page faults of the new memory)
        self.copy_batches: set[int] = set()  # the global step at the start of each batch that copied
        self.save_batches, self.at_save = set(), []  # the same of the batches that saved; bytes held at each save
        self.with_copy = self.peak = 0


class BatchClock(Callback):
    """Wall time from a batch's start to its end, before the checkpoints' hooks (Lightning runs them last)."""

    times: list[float]

    def on_fit_start(self, *args: Any) -> None:
        self.times = []

    def on_train_batch_start(self, *args: Any) -> None:
        self._start = time.perf_counter()

    def on_train_batch_end(self, *args: Any) -> None:
        self.times.append(time.perf_counter() - self._start)


def fit(
    args: argparse.Namespace,
    frozen: bool,
    option: bool,
    checkpoints: int = 1,
    steps: int = 0,
    weights_only: tuple[bool, ...] = (False,) * 3,
) -> tuple[float, float, list[float], Trainer]:
    """One fit; returns its wall and process CPU seconds, the batch times and the trainer."""
    warnings.filterwarnings("ignore")
    gc.collect()  # the trainers and models of earlier fits
    seed_everything(0, verbose=False)
    model = Net(args.width, args.layers, args.batch, frozen)
    clock = BatchClock()
    with tempfile.TemporaryDirectory(dir="/dev/shm" if os.path.isdir("/dev/shm") else None) as tmp:
        ckpts = [
            ModelCheckpoint(
                # other checkpoints every 5 and 2 steps (a unique `state_key`): all save after each 10th step
                dirpath=os.path.join(tmp, str(i)),
                monitor="train_loss",
                every_n_train_steps=(10, 5, 2)[i],
                save_top_k=3,
                save_weights_only=weights_only[i],
                save_pre_optimizer_step_state=option,
            )
            for i in range(checkpoints)
        ]
        trainer = Trainer(
            max_steps=steps or args.steps,
            callbacks=[clock, *ckpts],
            logger=False,
            enable_progress_bar=False,
            enable_model_summary=False,
            limit_val_batches=0,
            accelerator="cpu",
            devices=1,
        )
        wall, cpu = time.perf_counter(), time.process_time()
        trainer.fit(model)
        wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
    return wall, cpu, clock.times, trainer


def peak_rss(args: argparse.Namespace, frozen: bool, option: bool, checkpoints: int) -> int:
    """Peak RSS in bytes of one fit in a fresh subprocess of this interpreter."""
    cmd = [sys.executable, __file__, "--worker", "--width", str(args.width), "--layers", str(args.layers),
           "--batch", str(args.batch), "--steps", str(args.rss_steps), "--threads", str(args.threads),
           "--checkpoints", str(checkpoints)] + ["--frozen"] * frozen + ["--option"] * option  # fmt: skip
    out = subprocess.run(cmd, check=True, capture_output=True, text=True).stdout
    return json.loads(out.strip().splitlines()[-1])["maxrss"]


def median_seconds(fn: Any, reps: int = 5) -> float:
    """The median of ``reps`` calls; each result is dropped before the next call."""
    return statistics.median(seconds(fn) for _ in range(reps))


def seconds(fn: Any) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def measure(args: argparse.Namespace, probe: Probe, frozen: bool) -> dict[str, str]:
    model = Net(args.width, args.layers, args.batch, frozen)
    param_bytes = sum(p.nbytes for p in model.parameters())
    trainable = sum(p.nbytes for p in model.parameters() if p.requires_grad)
    col = {
        "parameters": f"{param_bytes / 4e6:.1f}M, {param_bytes / MB:.1f} MB ({trainable / param_bytes:.1%} trainable)"
    }

    # 4 (and 1, 3, 5): alternating fits, option off and on, every_n_train_steps=10, save_top_k=3
    walls, cpus = {False: [], True: []}, {False: [], True: []}
    batch_off, copies, copy_system, at_save, copy_in_fit = [], [], [], [], []
    copy_batches = save_batches = with_copy = 0
    stray = 0  # copies taken in batches that did not end on a top-k save
    fit(args, frozen, False, steps=10)  # warm-up, not counted
    for _ in range(args.reps):
        for option in (False, True):
            probe.reset()
            wall, cpu, times, trainer = fit(args, frozen, option)
            walls[option].append(wall)
            cpus[option].append(cpu)
            if not option:
                batch_off += times[1:]
                continue
            copies += probe.copy_seconds
            copy_system += probe.copy_system
            copy_in_fit.append((sum(probe.copy_seconds) / wall, sum(probe.copy_seconds), probe.hook_seconds))
            copy_batches += len(probe.copy_batches)
            save_batches += len(probe.save_batches)
            stray += len(probe.copy_batches - probe.save_batches)
            with_copy += probe.with_copy
            at_save += probe.at_save
    copy_bytes = statistics.median(at_save)
    col["bytes per copy at a save (median)"] = f"{copy_bytes / MB:.1f} MB = {copy_bytes / param_bytes:.2f}x parameters"

    # 1: weights-only, and the peak with 1, 2, 3 checkpoints with the option (all saving after the same batches)
    wo = []
    for checkpoints, weights_only in ((1, (True,)), (2, (True, False))):
        probe.reset()
        fit(args, frozen, True, checkpoints, steps=args.rss_steps, weights_only=weights_only)
        wo.append(statistics.median(probe.at_save))
    col["bytes per copy with `save_weights_only=True`: the only checkpoint / 1 of 2 checkpoints"] = " / ".join(
        f"{b / MB:.1f} MB = {b / param_bytes:.2f}x" for b in wo
    )
    peaks = []
    for n in (1, 2, 3):
        probe.reset()
        fit(args, frozen, True, checkpoints=n, steps=args.rss_steps)
        peaks.append(probe.peak)
    col["peak bytes held in `_params`/`_others`, 1 / 2 / 3 checkpoints"] = (
        " / ".join(f"{p / MB:.1f}" for p in peaks) + " MB"
    )

    # 2: peak RSS, each fit in a fresh subprocess
    rss = [(peak_rss(args, frozen, False, n), peak_rss(args, frozen, True, n)) for n in (1, 2, 3)]
    col["peak RSS of a fit, off → on, with 1 / 2 / 3 checkpoints"] = (
        " / ".join(f"{off / MB:.0f} → {on / MB:.0f}" for off, on in rss) + " MB"
    )
    col["peak RSS on - off, 1 / 2 / 3 checkpoints (in copies)"] = " / ".join(
        f"{(on - off) / MB:+.0f} MB ({(on - off) / copy_bytes:.2f})" for off, on in rss
    )

    # 3: the copy against plain copies of the same bytes, in this process
    copy_s = statistics.median(copies)
    flat = torch.ones(int(copy_bytes), dtype=torch.uint8)
    dst = torch.ones_like(flat)
    clone_flat = median_seconds(flat.clone)
    memcpy = median_seconds(partial(dst.copy_, flat))
    del flat, dst
    optimizer = trainer.optimizers[0]
    tensors = [p for group in optimizer.param_groups for p in group["params"]]
    tensors += [v for s in optimizer.state.values() for v in s.values() if isinstance(v, torch.Tensor)]
    tensors += [p for p in trainer.lightning_module.parameters() if not p.requires_grad]
    clone_each = median_seconds(lambda: [t.clone() for t in tensors])
    col["copy: `on_before_optimizer_step` that copies (median of its calls)"] = (
        f"{copy_s * 1e3:.1f} ms ({len(copies)} calls), system CPU {statistics.median(copy_system) * 1e3:.0f} ms"
    )
    plain = "plain copies of those bytes: one flat `clone()` / `copy_` into a preallocated buffer / `clone()` of each"
    col[plain + " tensor"] = f"{clone_flat * 1e3:.1f} / {memcpy * 1e3:.1f} / {clone_each * 1e3:.1f} ms"
    col["copy / plain copy (target <= 1.5x)"] = (
        f"{copy_s / clone_flat:.2f}x / {copy_s / memcpy:.2f}x / {copy_s / clone_each:.2f}x"
    )

    # 4: shares
    batch = statistics.median(batch_off)
    col["batch with the option off (median)"] = f"{batch * 1e3:.1f} ms"
    col["copy / that batch"] = f"{copy_s / batch:.1%}"
    off_w, on_w = statistics.median(walls[False]), statistics.median(walls[True])
    off_c, on_c = statistics.median(cpus[False]), statistics.median(cpus[True])
    col[f"fit of {args.steps} steps, off / on, wall (median of {args.reps})"] = (
        f"{off_w:.2f} / {on_w:.2f} s, {on_w / off_w - 1:+.1%}"
    )
    col["the same, process CPU time"] = f"{off_c:.2f} / {on_c:.2f} s, {on_c / off_c - 1:+.1%}"
    share, copying, hooks = (statistics.median(x) for x in zip(*copy_in_fit, strict=True))
    col["copy time / fit wall time (median over fits)"] = f"{share:.1%}"
    col["per fit: time copying / in all the state's hooks (copies, drops; not the saves), medians"] = (
        f"{copying:.2f} / {hooks:.2f} s"
    )

    # 5: copies vs saves
    col[f"batches that copied / ended on a top-k save / saves writing the copy ({args.reps} fits)"] = (
        f"{copy_batches} / {save_batches} / {with_copy}; copies in batches without a save: {stray}"
    )
    return col


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--width", type=int, default=1024)
    parser.add_argument("--layers", type=int, default=12)
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--steps", type=int, default=100, help="steps of each timed fit")
    parser.add_argument("--rss-steps", type=int, default=30, help="steps of the memory fits (3 saves)")
    parser.add_argument("--reps", type=int, default=3, help="timed fits per variant, alternating off and on")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--no-frozen", action="store_true", help="skip the frozen-backbone column")
    for hidden in ("--worker", "--frozen", "--option"):  # a worker's: one fit for its peak RSS
        parser.add_argument(hidden, action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--checkpoints", type=int, default=1, help=argparse.SUPPRESS)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    logging.getLogger("lightning.pytorch").setLevel(logging.ERROR)

    if args.worker:
        fit(args, args.frozen, args.option, checkpoints=args.checkpoints)
        with open("/proc/self/status") as f:
            hwm = [int(line.split()[1]) * 1024 for line in f if line.startswith("VmHWM:")]
        print(json.dumps({"maxrss": hwm[0] if hwm else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024}))
        return

    source = Path(sys.modules[State.__module__].__file__).read_bytes()  # the code measured, named as git names it
    blob = hashlib.sha1(b"blob %d\0" % len(source) + source).hexdigest()[:10]
    print(
        f"lightning {lightning.__version__} (_pre_optimizer_step.py blob {blob}), torch {torch.__version__},"
        f" {args.threads} torch thread(s), {os.cpu_count()} cores, load average {os.getloadavg()[0]:.2f}\n"
    )
    probe = Probe()
    cols = {"fully trainable, Adam": measure(args, probe, frozen=False)}
    if not args.no_frozen:
        cols["frozen blocks, Adam on the head"] = measure(args, probe, frozen=True)
    print("| measure | " + " | ".join(cols) + " |")
    print("|---|" + "---:|" * len(cols))
    for row in next(iter(cols.values())):
        print(f"| {row} | " + " | ".join(col[row] for col in cols.values()) + " |")
    print(f"\nload average at the end {os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
    main()
