"""What the installed fork fixes, next to stock Lightning of the same release in the same situation.

Run it after `pip install .`; it exits non-zero if a fix is missing. Stock `lightning` (the release the fork is
pinned to, unpatched, from your index) is installed once without dependencies into the patch set's cache and runs
with this interpreter, so both sides use the same torch. Without an index, only the fork's side is shown.
"""

from __future__ import annotations

import collections
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

PICKERS, PICKS = 6, 60  # processes picking ports at once, ports each (each picker holds all of its picks)


def _manual_model(pause: float = 0.0) -> Any:
    """A one-layer module under manual optimization; it logs `loss`, the loss of its weights before each step."""
    import torch

    from lightning.pytorch import LightningModule

    class Model(LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.automatic_optimization = False
            self.layer = torch.nn.Linear(4, 1)

        def training_step(self, batch: torch.Tensor, batch_idx: int) -> None:
            opt = self.optimizers()
            loss = self.layer(batch).pow(2).mean()
            self.log("loss", loss)  # the score of the weights as they are before this step
            opt.zero_grad()
            self.manual_backward(loss)
            opt.step()
            time.sleep(pause)

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.SGD(self.parameters(), lr=0.5)

    return Model()


def _fit(model: Any, callback: Any, data: Any, batch_size: int, max_steps: int) -> None:
    import warnings

    import torch

    from lightning.pytorch import Trainer

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer = Trainer(
            max_steps=max_steps,
            callbacks=[callback],
            logger=False,
            enable_progress_bar=False,
            enable_model_summary=False,
            accelerator="cpu",
        )
        trainer.fit(model, torch.utils.data.DataLoader(data, batch_size=batch_size))


def checkpoint_case() -> dict[str, Any]:
    """Manual optimization, `every_n_train_steps=1`, `save_top_k=1`: what is in the best file, and its loss."""
    import tempfile

    import torch

    import lightning
    from lightning.pytorch.callbacks import ModelCheckpoint

    torch.manual_seed(0)
    data = torch.randn(8, 4) * torch.tensor([1.0, 1.0, 1.0, 1.0, 0.2, 0.2, 1.0, 1.0]).unsqueeze(1)  # batch 2 is best
    with tempfile.TemporaryDirectory() as tmp:
        # the fork's one option (off by default: the copy costs memory); stock has no such argument
        option = {"save_pre_optimizer_step_state": True} if "+patchset" in lightning.__version__ else {}
        best = ModelCheckpoint(dirpath=tmp, monitor="loss", every_n_train_steps=1, save_top_k=1, **option)
        _fit(_manual_model(), best, data, batch_size=2, max_steps=4)
        saved = torch.load(best.best_model_path, weights_only=False)
    batch = saved["global_step"] - 1  # one optimizer step per batch: the step the file was written after
    probe = _manual_model()
    probe.load_state_dict(saved["state_dict"])
    with torch.no_grad():
        file_loss = float(probe.layer(data[2 * batch : 2 * batch + 2]).pow(2).mean())
    return {"version": lightning.__version__, "batch": batch, "score": float(best.best_model_score), "file": file_loss}


def interval_case() -> dict[str, Any]:
    """Manual optimization, `ModelCheckpoint(train_time_interval=50 ms, save_top_k=-1)`: how many files it writes."""
    import datetime
    import tempfile

    import torch

    import lightning
    from lightning.pytorch.callbacks import ModelCheckpoint

    with tempfile.TemporaryDirectory() as tmp:
        every = ModelCheckpoint(dirpath=tmp, train_time_interval=datetime.timedelta(milliseconds=50), save_top_k=-1)
        # 10 steps of 20 ms or more: the 50 ms interval passes several times
        _fit(_manual_model(pause=0.02), every, torch.randn(40, 4), batch_size=4, max_steps=10)
        return {"version": lightning.__version__, "files": len(os.listdir(tmp))}


def _picker(barrier: Any, results: Any) -> None:
    from lightning.fabric.plugins.environments import LightningEnvironment

    os.environ.pop("MASTER_PORT", None)
    barrier.wait()  # all pickers start together
    envs = [LightningEnvironment() for _ in range(PICKS)]  # each run's launcher picks its rendezvous port
    results.put([env.main_port for env in envs])
    barrier.wait()  # and the runs keep their ports until all have picked, as launchers do until the store binds


def port_race() -> dict[str, Any]:
    """PICKERS processes pick PICKS ports each at the same moment; count the ports handed out twice."""
    import multiprocessing

    import lightning
    from lightning.fabric.plugins.environments import LightningEnvironment  # noqa: F401  (import once, before fork)

    ctx = multiprocessing.get_context("fork" if sys.platform == "linux" else "spawn")  # fork: no re-import of torch
    barrier, results = ctx.Barrier(PICKERS), ctx.Queue()
    procs = [ctx.Process(target=_picker, args=(barrier, results)) for _ in range(PICKERS)]
    for proc in procs:
        proc.start()
    picks = [results.get(timeout=120) for _ in procs]
    for proc in procs:
        proc.join()
    counts = collections.Counter(port for ports in picks for port in ports)
    return {
        "version": lightning.__version__,
        "twice": sum(1 for n in counts.values() if n > 1),
        "picks": len(picks) * PICKS,
    }


def port_value_case() -> dict[str, Any]:
    """`MASTER_PORT=65536`, one process of Fabric's `ddp`: the error, before or from the process group."""
    os.environ["MASTER_PORT"] = "65536"
    import lightning
    from lightning.fabric import Fabric

    try:
        Fabric(accelerator="cpu", devices=1, strategy="ddp").launch()
        error = "none: it ran"
    except Exception as err:  # the error as a user sees it, whichever it is
        error = f"{type(err).__name__}: {str(err).splitlines()[0] if str(err) else ''}"
    return {"version": lightning.__version__, "error": error}


def requires_case() -> dict[str, Any]:
    """What the installed `lightning` requires of the unpatched `pytorch-lightning` distribution."""
    import importlib.metadata

    import lightning

    requires = importlib.metadata.requires("lightning") or []
    return {"version": lightning.__version__, "unpatched": [r for r in requires if r.startswith("pytorch-lightning")]}


def stock_env(version: str) -> dict[str, str] | None:
    """An environment whose `import lightning` is stock `lightning==version` (installed once into the cache).

    `pip install --target` plus `PYTHONPATH` (about 2 s, once) rather than a venv: `--system-site-packages` of a venv
    made from inside another venv would see the base interpreter's packages, not this environment's torch.
    """
    base = os.environ.get("LIGHTNING_PATCHSET_CACHE") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache"), "lightning-patchset"
    )
    target = Path(base) / "stock" / f"lightning-{version}"
    if not (target / "lightning").is_dir():
        partial = target.with_name(target.name + f".part-{os.getpid()}")
        started = time.perf_counter()
        # `===`: exactly the release, never the fork's `2.6.6+patchset.1` that `==2.6.6` would also match
        cmd = [sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", "--only-binary", ":all:"]
        proc = subprocess.run(
            [*cmd, "--target", str(partial), f"lightning==={version}"], capture_output=True, text=True
        )
        if proc.returncode != 0:
            shutil.rmtree(partial, ignore_errors=True)
            reason = (proc.stderr.strip().splitlines() or ["no output"])[-1]
            print(f"stock lightning {version} is not available ({reason}); showing the fork only")
            return None
        os.replace(partial, target)
        print(f"installed stock lightning {version} into {target} in {time.perf_counter() - started:.1f}s (once)")
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(target), *filter(None, [env.get("PYTHONPATH")])])
    return env


def run(part: str, env: dict[str, str] | None = None) -> dict[str, Any]:
    """Run one case in a new process (``env``: stock's), and return what it found."""
    cmd = [sys.executable, os.path.abspath(__file__), part]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd="/", timeout=600)
    if proc.returncode != 0:
        raise RuntimeError(f"{part} failed:\n{proc.stderr[-2000:]}")
    return dict(json.loads(proc.stdout.strip().splitlines()[-1]))


def _row(side: str, version: str, width: int, text: str) -> None:
    print(f"     {side:5} {version:{width}} {text}")


def main() -> None:
    """Each fix at work, next to stock."""
    try:
        import lightning
    except ImportError as err:
        raise SystemExit(f"demo/fixes.py: no lightning here ({err}): install the fork first, `pip install .`") from None
    if "+patchset." not in lightning.__version__:
        raise SystemExit(
            f"demo/fixes.py: this lightning is {lightning.__version__}, not the patch set's fork (a `+patchset`"
            " version): install the fork first, `pip install .`"
        )
    print(f"fork: lightning {lightning.__version__} from {lightning.__file__}")
    stock = stock_env(lightning.__version__.split("+")[0])
    width = len(lightning.__version__)  # stock's version is its prefix

    print("0001 build: what `lightning` requires of the unpatched `pytorch-lightning` distribution")
    fork = run("--requires-case")
    for side, row in [*([("stock", run("--requires-case", stock))] if stock else []), ("fork", fork)]:
        _row(side, row["version"], width, ", ".join(row["unpatched"]) or "nothing")
    assert not fork["unpatched"], "the fork's lightning pulls the unpatched pytorch-lightning"
    print()

    print("0004 pytorch: manual optimization, ModelCheckpoint(monitor='loss', every_n_train_steps=1, save_top_k=1)")
    print("     (the fork with save_pre_optimizer_step_state=True)")
    print("     the best score was logged at one batch; the loss there of the weights in the best file:")
    fork = run("--checkpoint-case")
    rows = [("stock", run("--checkpoint-case", stock))] if stock else []
    for side, row in [*rows, ("fork", fork)]:
        same = abs(row["file"] - row["score"]) < 1e-6
        scored = "the weights that were scored" if same else "other weights (stock saves after the step)"
        text = f"best_model_score {row['score']:.4f} (batch {row['batch']}); the file's weights give {row['file']:.4f}"
        _row(side, row["version"], width, f"{text}: {scored}")
    assert abs(fork["file"] - fork["score"]) < 1e-6, "the fork's best file holds weights other than the scored ones"

    print("\n0003 pytorch: manual optimization, ModelCheckpoint(train_time_interval=50 ms), 10 steps of 20 ms or more")
    interval = run("--interval-case")
    for side, row in [*([("stock", run("--interval-case", stock))] if stock else []), ("fork", interval)]:
        _row(side, row["version"], width, f"{row['files']} checkpoint files written")
    assert interval["files"] > 0, "the fork wrote no checkpoint with train_time_interval under manual optimization"

    print(f"\n0002 fabric: {PICKERS} processes pick a rendezvous port (LightningEnvironment().main_port) {PICKS} times")
    for side, env in [*([("stock", stock)] if stock else []), ("fork", None)]:
        race = run("--port-race", env)
        text = f"{race['twice']} of {race['picks']} ports handed out twice while held"
        _row(side, race["version"], width, text + (": whichever binds second fails" if race["twice"] else ""))
    # on macOS and Windows the fork picks as stock does (docs/ports.md)
    assert race["twice"] == 0 or sys.platform != "linux", "the fork handed one port to two processes"

    print("\n0006 fabric: MASTER_PORT=65536, Fabric(strategy='ddp', devices=1).launch(): the error")
    fork = run("--port-value-case")
    for side, row in [*([("stock", run("--port-value-case", stock))] if stock else []), ("fork", fork)]:
        _row(side, row["version"], width, row["error"])
    assert fork["error"].startswith("ValueError: MASTER_PORT=65536 "), "the fork's error does not name MASTER_PORT"

    print("\n0005 tests: changes upstream's own test suites (their conftests), nothing in the installed fork;")
    print("     the README's section on test suites shows the same reruns as a pytest command line")


if __name__ == "__main__":
    cases = {
        "--checkpoint-case": checkpoint_case,
        "--interval-case": interval_case,
        "--port-race": port_race,
        "--port-value-case": port_value_case,
        "--requires-case": requires_case,
    }
    if sys.argv[1:2] and sys.argv[1] in cases:
        print(json.dumps(cases[sys.argv[1]]()))
    else:
        main()
