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
"""Real launches of Fabric and the Trainer, several scripts started together, stock and fork side by side.

Where users meet ``EADDRINUSE``: two or more training scripts started together on one machine, while other programs
open ephemeral ports. Every cell runs in a private network namespace made for it (``ip netns add``; needs root), with
its own ephemeral port range (``net.ipv4.ip_local_port_range``, set inside the namespace only), its loopback up and
nothing else: no traffic leaves it. In each namespace:

* ``--noise`` processes churn ephemeral ports for the whole cell, as other programs do: listeners on port 0, held for
  a few milliseconds, and connections to a local sink, closed with a reset (so that the noise itself leaves no port in
  TIME_WAIT and the range is not exhausted by it);
* ``--scripts`` copies of a training script start together, ``--rounds`` times one after the other. Each script runs
  ``fits`` fits on 2 CPU processes (gloo) whose inputs differ per rank, with ``MASTER_PORT`` unset at its start.

Cases: ``fabric-ddp_fork``, ``fabric-ddp_spawn``, ``trainer-ddp_spawn`` and ``trainer-ddp`` (the script launcher) run
one fit per script, a fresh pick every time; ``sweep-fabric-ddp_fork`` runs ``--sweep-fits`` fits per script in one
process, where both builds reuse the first fit's ``MASTER_PORT``. A fit counts as ``EADDRINUSE`` when its error names
it ("address already in use" anywhere in the traceback, a spawned rank's included), as another failure otherwise, or as
a timeout (a script still running after ``--timeout`` seconds is killed, and its missing fits count as timeouts).
``TIME_WAIT`` counts the namespace's sockets in TIME_WAIT when the cell's last round has ended.

Run as root from the repository root (not part of the test suite), with two interpreters that have torch::

    python benchmarks/ports/real_launches.py --stock /venv-stock/bin/python --fork /venv-fork/bin/python
    python benchmarks/ports/real_launches.py ... --cases fabric-ddp_spawn --rounds 3     # quicker

"""

import argparse
import contextlib
import json
import os
import signal
import subprocess
import sys
import tempfile
import time

CASES = ("fabric-ddp_fork", "fabric-ddp_spawn", "trainer-ddp_spawn", "trainer-ddp", "sweep-fabric-ddp_fork")

_TRAIN = r"""
import atexit, json, multiprocessing, os, sys, traceback
import torch

def exit_now():  # a gloo group left to the interpreter's exit now and then aborts it (torch #190489)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)

def run(fabric):
    total = fabric.all_reduce(torch.tensor(fabric.global_rank + 1.0), reduce_op="sum").item()  # inputs differ per rank
    if multiprocessing.parent_process() is not None:  # a spawned or forked rank, once the launcher queued its result
        atexit.register(exit_now)
    return total

if sys.argv[1] == "trainer":  # at module level: the spawn launchers pickle the Trainer and its callbacks
    from lightning.pytorch import Callback, Trainer
    from lightning.pytorch.demos.boring_classes import BoringModel

    class ExitWithoutGlooTeardown(Callback):
        def teardown(self, trainer, pl_module, stage):
            if multiprocessing.parent_process() is not None or trainer.global_rank > 0:
                atexit.register(exit_now)

def fit(kind, strategy):
    if kind == "fabric":
        from lightning.fabric import Fabric

        assert Fabric(strategy=strategy, devices=2, accelerator="cpu").launch(run) == 3.0
        return
    trainer = Trainer(
        strategy=strategy, devices=2, accelerator="cpu", max_steps=1, limit_val_batches=0, logger=False,
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
        callbacks=[ExitWithoutGlooTeardown()],
    )
    trainer.fit(BoringModel())

if __name__ == "__main__":
    kind, strategy, fits = sys.argv[1], sys.argv[2], int(sys.argv[3])
    for _ in range(fits):
        try:
            fit(kind, strategy)
            outcome = "ok"
        except BaseException as ex:
            text = "".join(traceback.format_exception(ex)).lower()
            outcome = "eaddrinuse" if "address already in use" in text or "eaddrinuse" in text else "other"
        if os.environ.get("LOCAL_RANK", "0") == "0":
            print(json.dumps({"outcome": outcome}), flush=True)
    if strategy == "ddp":  # the script launcher: exit both ranks without gloo's teardown
        exit_now()
"""

# bench_ports.noise for the seconds given, with resets so that TIME_WAIT counts only the launches' sockets
_NOISE = f"""
import sys, threading
sys.path.insert(0, {os.path.dirname(os.path.abspath(__file__))!r})
from bench_ports import noise
stop = threading.Event()
threading.Timer(float(sys.argv[1]), stop.set).start()
noise(stop, int(sys.argv[2]), max_held=8, reset=True, pause=0.004)
"""


def _netns(name: str, port_range: str) -> None:
    subprocess.run(["ip", "netns", "add", name], check=True)
    subprocess.run(["ip", "netns", "exec", name, "ip", "link", "set", "lo", "up"], check=True)
    if port_range != "default":
        low, high = port_range.split("-")
        subprocess.run(
            ["ip", "netns", "exec", name, "sysctl", "-q", "-w", f"net.ipv4.ip_local_port_range={low} {high}"],
            check=True,
        )


def run_cell(python: str, case: str, port_range: str, args, workdir: str) -> dict:
    sweep = case.startswith("sweep-")
    kind, strategy = case.removeprefix("sweep-").split("-", 1)
    fits = args.sweep_fits if sweep else 1
    rounds = 1 if sweep else args.rounds
    name = f"lpbench-{os.getpid()}"
    _netns(name, port_range)
    started = time.monotonic()
    counts = {"ok": 0, "eaddrinuse": 0, "other": 0, "timeout": 0}
    noise = []
    try:
        budget = rounds * args.timeout + 60
        noise = [
            subprocess.Popen(["ip", "netns", "exec", name, python, "-c", _NOISE, str(budget), str(i)])
            for i in range(args.noise)
        ]
        env = {
            k: v for k, v in os.environ.items() if k not in ("MASTER_PORT", "LOCAL_RANK", "WORLD_SIZE", "PYTHONPATH")
        }
        env["PYTHONWARNINGS"] = "ignore"
        for _ in range(rounds):
            with contextlib.ExitStack() as stack:
                outs = [stack.enter_context(tempfile.TemporaryFile("w+")) for _ in range(args.scripts)]
                scripts = [
                    subprocess.Popen(
                        [
                            "ip",
                            "netns",
                            "exec",
                            name,
                            python,
                            os.path.join(workdir, "train.py"),
                            kind,
                            strategy,
                            str(fits),
                        ],
                        stdout=out,
                        stderr=subprocess.DEVNULL,
                        text=True,
                        env=env,
                        cwd=workdir,
                        start_new_session=True,
                    )
                    for out in outs
                ]
                deadline = time.monotonic() + args.timeout
                for script, out in zip(scripts, outs, strict=True):
                    with contextlib.suppress(subprocess.TimeoutExpired):
                        script.wait(timeout=max(0.0, deadline - time.monotonic()))
                    with contextlib.suppress(ProcessLookupError):  # the script and the ranks it started, nothing else
                        os.killpg(script.pid, signal.SIGKILL)
                    script.wait()
                    out.seek(0)
                    outcomes = [json.loads(line)["outcome"] for line in out if line.startswith("{")]
                    for outcome in outcomes:
                        counts[outcome] += 1
                    counts["timeout"] += fits - len(outcomes)
        ss = subprocess.run(
            ["ip", "netns", "exec", name, "ss", "-tanH", "state", "time-wait"], capture_output=True, text=True
        )
        counts["time_wait"] = len(ss.stdout.splitlines())
    finally:
        for p in noise:
            p.kill()
            p.wait()
        subprocess.run(["ip", "netns", "del", name], check=False)
    counts["fits"] = rounds * args.scripts * fits
    counts["seconds"] = time.monotonic() - started
    return counts


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--stock", required=True, help="an interpreter with stock lightning==2.6.6")
    parser.add_argument("--fork", required=True, help="an interpreter with the fork installed")
    parser.add_argument("--cases", nargs="+", default=list(CASES), choices=CASES)
    parser.add_argument("--ranges", nargs="+", default=["default", "40000-40099"], help="'default' or LOW-HIGH")
    parser.add_argument("--scripts", type=int, default=2, help="scripts started together")
    parser.add_argument("--rounds", type=int, default=8, help="rounds of single-fit scripts per cell")
    parser.add_argument("--sweep-fits", type=int, default=15, help="fits per script in the sweep case")
    parser.add_argument("--noise", type=int, default=2, help="noise processes per namespace")
    parser.add_argument("--timeout", type=float, default=240, help="seconds a script may run")
    args = parser.parse_args()
    if os.geteuid() != 0:
        sys.exit("needs root: it makes a network namespace per cell (ip netns add)")
    builds = {"stock": args.stock, "fork": args.fork}
    for build, python in builds.items():
        version = subprocess.run(
            [python, "-c", "import lightning, torch; print(lightning.__version__, torch.__version__)"],
            capture_output=True,
            text=True,
            check=True,
        ).stdout.strip()
        print(f"{build}: {python}: lightning, torch {version}", file=sys.stderr, flush=True)
    rows = []
    started = time.monotonic()
    with tempfile.TemporaryDirectory() as workdir:
        with open(os.path.join(workdir, "train.py"), "w") as f:
            f.write(_TRAIN)
        for port_range in args.ranges:
            for case in args.cases:
                for build in builds:  # side by side: the same cell for both builds, one after the other
                    counts = run_cell(builds[build], case, port_range, args, workdir)
                    rows.append((port_range, case, build, counts))
                    print(f"  {port_range} {case} {build}: {counts}", file=sys.stderr, flush=True)
    print(
        f"\n{args.scripts} scripts started together, {args.rounds} rounds (sweep: {args.sweep_fits} fits a script),"
        f" {args.noise} noise processes, 2 CPU processes a fit, {time.monotonic() - started:.0f} s in all\n"
    )
    print("| range | case | build | fits | ok | EADDRINUSE | other | timeout | TIME_WAIT after | seconds |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for port_range, case, build, c in rows:
        print(
            f"| {port_range} | {case} | {build} | {c['fits']} | {c['ok']} | {c['eaddrinuse']} | {c['other']} |"
            f" {c['timeout']} | {c['time_wait']} | {c['seconds']:.0f} |"
        )


if __name__ == "__main__":
    main()
