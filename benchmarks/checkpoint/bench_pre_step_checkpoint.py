"""Cost of checkpointing the pre-optimizer-step weights under manual optimization (issue #20947).

Compares, in one run and on CPU, a manual-optimization training loop with ``ModelCheckpoint(every_n_train_steps=N,
monitor="train_loss")`` under:

- ``stock``: the installed Lightning (2.6.6), which saves post-step weights;
- ``stock+saved_models``: the installed Lightning with the ``saved_models`` workaround its docstring documents
  (clone the weights every batch, keep the last 10);
- ``fork``: the patched Lightning found at ``--fork-src``, which captures the pre-step weights itself.

Each configuration runs in its own subprocess; the configurations are interleaved and repeated, and the best run of
each is kept. Prints steps per second of wall time and of CPU time (the process's user + system time), their ratios to
``stock``, and the peak RSS.

Throughput ratios between processes vary by 10-15% on a shared machine, more than the effect being measured. So the
fork's runs also account, inside the same run, for the time spent in the pre-step machinery itself (the hook before
each batch and optimizer step, the captures, and the per-save bookkeeping) as a share of the step time. That share does not
depend on how fast the machine happens to be, and ``1 - share`` is the fork's throughput relative to post-step saves.

Usage::

    python benchmarks/checkpoint/bench_pre_step_checkpoint.py --fork-src /path/to/patched/src

The installed ``lightning`` must be the stock release; ``--fork-src`` is put first on ``PYTHONPATH`` for the fork.

"""

import argparse
import json
import os
import subprocess
import sys
import tempfile

WORKER = r"""
import json, resource, sys, tempfile, time, warnings
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset
import lightning
from lightning.pytorch import LightningModule, Trainer, seed_everything
from lightning.pytorch.callbacks import Callback, ModelCheckpoint

cfg = json.loads(sys.argv[1])
torch.set_num_threads(cfg["threads"])
warnings.filterwarnings("ignore")
seed_everything(0, verbose=False)


class Net(LightningModule):
    def __init__(self, workaround):
        super().__init__()
        self.automatic_optimization = False
        h = cfg["hidden"]
        self.layer = nn.Sequential(*[nn.Sequential(nn.Linear(h, h), nn.ReLU()) for _ in range(cfg["layers"])])
        self.workaround = workaround

    def training_step(self, batch, batch_idx):
        (x,) = batch
        loss = self.layer(x).pow(2).mean()
        self.log("train_loss", loss)
        if self.workaround:
            if not hasattr(self, "saved_models"):
                self.saved_models = {}
            self.saved_models[batch_idx] = {k: v.detach().clone() for k, v in self.layer.state_dict().items()}
            if batch_idx > 10:
                del self.saved_models[batch_idx - 10]
        opt = self.optimizers()
        opt.zero_grad()
        self.manual_backward(loss)
        opt.step()

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=1e-4)

    def train_dataloader(self):
        x = torch.randn(cfg["batch"] * 64, cfg["hidden"])
        return DataLoader(TensorDataset(x), batch_size=cfg["batch"])


class Timer(Callback):
    def on_train_batch_start(self, trainer, *args):
        if trainer.global_step == cfg["warmup"]:
            self.start = time.perf_counter()
            self.start_cpu = time.process_time()

    def on_train_end(self, trainer, *args):
        self.elapsed = time.perf_counter() - self.start
        self.elapsed_cpu = time.process_time() - self.start_cpu


def fit(n, pre_step, steps, extra_callbacks=()):
    timer = Timer()
    with tempfile.TemporaryDirectory(dir=cfg["tmp"]) as d:
        kwargs = {} if pre_step is None else {"save_pre_optimizer_step_weights": pre_step}
        ckpt = ModelCheckpoint(
            dirpath=d,
            monitor="train_loss",
            every_n_train_steps=n,
            save_top_k=1,
            save_weights_only=cfg["weights_only"],
            **kwargs,
        )
        trainer = Trainer(
            accelerator="cpu",
            max_steps=cfg["warmup"] + steps,
            callbacks=[ckpt, timer, *extra_callbacks],
            logger=False,
            enable_progress_bar=False,
            enable_model_summary=False,
            default_root_dir=d,
        )
        trainer.fit(Net(cfg["workaround"]))
    return trainer, timer


class Account:
    # CPU time spent inside the fork's pre-step machinery, and the number of captures, during the timed steps

    def __init__(self):
        self.cpu_s, self.captures, self.timing = 0.0, 0, False

    def wrap(self, owner, name, counts=False):
        original = getattr(owner, name)

        def timed(*args, **kwargs):
            if not self.timing:
                return original(*args, **kwargs)
            start = time.process_time()
            try:
                return original(*args, **kwargs)
            finally:
                self.cpu_s += time.process_time() - start
                self.captures += counts

        setattr(owner, name, timed)


account = Account()
try:
    from lightning.pytorch.callbacks import _pre_step_snapshot, model_checkpoint
except ImportError:  # stock Lightning: nothing to account for
    pass
else:
    # `_on_lightning_step` includes the captures it makes; `_capture` is wrapped as well only to count them
    account.wrap(_pre_step_snapshot._PreStepSnapshot, "on_train_batch_start")
    account.wrap(_pre_step_snapshot._PreStepSnapshot, "_on_lightning_step")
    account.wrap(_pre_step_snapshot._PreStepSnapshot, "_on_optimizer_step")
    account.wrap(_pre_step_snapshot._PreStepSnapshot, "state_for_batch")
    account.wrap(model_checkpoint, "_monitor_logged_in_training")
    capture = _pre_step_snapshot._PreStepSnapshot._capture

    def counted_capture(*args, **kwargs):
        account.captures += account.timing
        return capture(*args, **kwargs)

    _pre_step_snapshot._PreStepSnapshot._capture = counted_capture


class StartAccounting(Callback):
    def on_train_batch_start(self, trainer, *args):
        account.timing = trainer.global_step >= cfg["warmup"]


trainer, timer = fit(cfg["n"], None, cfg["steps"], extra_callbacks=[StartAccounting()])
params = sum(p.numel() * p.element_size() for p in trainer.lightning_module.parameters())
print(json.dumps({
    "steps_per_s": cfg["steps"] / timer.elapsed,
    "steps_per_cpu_s": cfg["steps"] / timer.elapsed_cpu,
    "machinery_cpu_s": account.cpu_s,
    "step_cpu_s": timer.elapsed_cpu,
    "captures": account.captures,
    "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
    "param_mb": params / 2**20,
    "lightning": lightning.__file__,
}))
"""


def run(cfg, fork_src):
    env = dict(os.environ)
    env.pop("PYTHONPATH", None)
    if fork_src:
        env["PYTHONPATH"] = fork_src
    out = subprocess.run(
        [sys.executable, "-c", WORKER, json.dumps(cfg)], env=env, capture_output=True, text=True, check=False
    )
    if out.returncode != 0:
        raise RuntimeError(out.stderr[-3000:])
    return json.loads(out.stdout.strip().splitlines()[-1])


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--fork-src", required=True, help="the patched tree's `src` directory")
    parser.add_argument("--hidden", type=int, default=1536)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--warmup", type=int, default=10)
    parser.add_argument("--repeats", type=int, default=3, help="runs per configuration; the best is reported")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--weights-only", action="store_true", help="save weights only (no optimizer state)")
    parser.add_argument("--every-n", type=int, nargs="+", default=[1, 10, 100])
    args = parser.parse_args()
    tmp = "/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir()

    variants = [("stock", False, None), ("stock+saved_models", True, None), ("fork", False, args.fork_src)]
    # interleave the configurations so that a slow phase of the machine hits all of them alike; keep the best run
    runs = {}
    for _ in range(args.repeats):
        for n in args.every_n:
            for name, workaround, src in variants:
                cfg = {
                    "n": n,
                    "workaround": workaround,
                    "hidden": args.hidden,
                    "layers": args.layers,
                    "batch": args.batch,
                    "steps": args.steps,
                    "warmup": args.warmup,
                    "threads": args.threads,
                    "weights_only": args.weights_only,
                    "tmp": tmp,
                }
                runs.setdefault((n, name), []).append(run(cfg, src))
                print(f"done: N={n} {name} {runs[(n, name)][-1]}", file=sys.stderr, flush=True)
    rows = []
    for n in args.every_n:
        best = {name: max(runs[(n, name)], key=lambda r: r["steps_per_s"]) for name, *_ in variants}
        best_cpu = {name: max(r["steps_per_cpu_s"] for r in runs[(n, name)]) for name, *_ in variants}
        rss = {name: min(r["peak_rss_mb"] for r in runs[(n, name)]) for name, *_ in variants}
        for name, *_ in variants:
            rows.append(
                (
                    n,
                    name,
                    best[name]["steps_per_s"],
                    best[name]["steps_per_s"] / best["stock"]["steps_per_s"],
                    best_cpu[name],
                    best_cpu[name] / best_cpu["stock"],
                    rss[name],
                    rss[name] - rss["stock"],
                )
            )
        param_mb = best["stock"]["param_mb"]

    print(
        f"model: {param_mb:.1f} MiB of parameters, SGD, {args.steps} timed steps, {args.threads} thread(s),"
        f" best of {args.repeats}"
    )
    header = (
        f"| {'N':>4} | {'variant':<20} | {'steps/s':>8} | {'vs stock':>8} | {'steps/cpu-s':>11} | {'vs stock':>8}"
        f" | {'peak RSS MiB':>12} | {'+ MiB':>7} |"
    )
    print(header)
    print("|" + "|".join("-" * len(c) for c in header.split("|")[1:-1]) + "|")
    for n, name, sps, ratio, cps, cratio, rss, extra in rows:
        print(
            f"| {n:>4} | {name:<20} | {sps:>8.2f} | {ratio:>8.3f} | {cps:>11.2f} | {cratio:>8.3f}"
            f" | {rss:>12.0f} | {extra:>+7.0f} |"
        )
    print()
    print("fork, CPU time inside the pre-step machinery during the timed steps, per run (median over runs):")
    print("|    N | captures | machinery ms/step | step ms (CPU) | share of step | fork vs post-step |")
    print("|------|----------|-------------------|---------------|---------------|-------------------|")
    for n in args.every_n:
        fork_runs = runs[(n, "fork")]
        shares = sorted(r["machinery_cpu_s"] / r["step_cpu_s"] for r in fork_runs)
        share = shares[len(shares) // 2]
        run_ = next(r for r in fork_runs if r["machinery_cpu_s"] / r["step_cpu_s"] == share)
        print(
            f"| {n:>4} | {run_['captures']:>8} | {run_['machinery_cpu_s'] / args.steps * 1e3:>17.2f}"
            f" | {run_['step_cpu_s'] / args.steps * 1e3:>13.1f} | {share * 100:>12.2f}% | {1 - share:>17.3f} |"
        )


if __name__ == "__main__":
    main()
