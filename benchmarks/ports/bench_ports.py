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
"""Stress the pick-a-port-then-bind race of the rendezvous store, and compare ways of picking the port.

Worker processes repeat trials: pick a port, wait a launcher-like window (the launcher starts the other ranks), bind
the rank-0 store on it, keep it for a short run, close it and release the pick. Noise processes meanwhile open
ephemeral listeners and make outgoing connections, as other programs on a CI machine do. Pickers, in the same run:

* ``stock``: Lightning 2.6.6's ``find_free_network_port`` (bind port 0, close, hand out the number);
* ``find_free_network_port``: the fork's function of that name, called directly as scripts and test fixtures call it
  before setting ``MASTER_PORT``; it holds nothing (see the docs for why);
* ``per-process``: a manager in the style of PR #21309 (bind port 0, skip ports this process holds or released
  recently, a thread lock, nothing shared between processes);
* ``name-lease``: bind port 0, then lease the port under an abstract UNIX socket name ``\\0lightning-port-<port>``
  (Linux; EADDRINUSE on the name means another process leased it: pick again), close the TCP socket, keep the name
  until the run ends. This coordinates the pickers but not the noise;
* ``held`` (this patch): the fork's ``LightningEnvironment``, whose pick stays bound (``SO_REUSEADDR``, not
  listening) until the store is bound, where ``_release_port()`` ends the hold as ``_init_dist_connection`` does;
* ``sweep``: several fits in one process, each worker's trials one after the other. Both builds' spawn launchers
  leave the ``MASTER_PORT`` they wrote, so every fit after the first reuses that port, unheld, after a gap. (An earlier
  version of the fork put ``MASTER_PORT`` back after each fit, so that every fit picked and held a port of its own:
  real launches then left more ports in TIME_WAIT than stock and ran out of a narrow range; see
  ``real_launches.py``.)

These are stand-ins: the stores accept no connection, so they never leave a port in TIME_WAIT. ``real_launches.py``
measures real launches of Fabric and the Trainer.

The store is bound as ``TCPStore``'s server binds (both backends): a dual-stack socket where available,
``SO_REUSEADDR``, bind, listen. That bind fails with ``EADDRINUSE`` under exactly the conditions the store's does, so
the trials use it instead of a full ``TCPStore`` (``real_launches.py`` runs real stores). A trial fails when the bind
fails ("EADDRINUSE"); "shared" counts pairs of trials of different processes that were handed the same port while both
were alive.

Run from the repository root, with the fork installed (not part of the test suite)::

    python benchmarks/ports/bench_ports.py                  # default range, then a narrowed one in a private netns
    python benchmarks/ports/bench_ports.py --trials 500     # quicker

The narrowed scenario re-runs this script in a private network namespace (``unshare -rn``) whose ephemeral range is
set to ``--narrow-range``; nothing leaves its loopback interface.

"""

import argparse
import contextlib
import errno
import json
import os
import random
import shutil
import socket
import statistics
import struct
import subprocess
import sys
import threading
import time
from collections import deque
from collections.abc import Callable
from multiprocessing import get_context

PICKERS = ("stock", "find_free_network_port", "per-process", "name-lease", "held", "sweep")


def _stock() -> tuple[int, None]:
    s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    s.bind(("", 0))
    port = s.getsockname()[1]
    s.close()
    return port, None


class _PerProcess:
    """PR #21309's idea: remember ports held and recently released, in this process only."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._held: set[int] = set()
        self._recent: deque[int] = deque(maxlen=1024)

    def pick(self) -> tuple[int, int]:
        with self._lock:
            for _ in range(1000):
                port, _ = _stock()
                if port not in self._held and port not in self._recent:
                    self._held.add(port)
                    return port, port
        raise RuntimeError("no port")

    def release(self, port: int) -> None:
        with self._lock:
            self._held.discard(port)
            self._recent.append(port)


def _name_lease() -> tuple[int, socket.socket]:
    for _ in range(1000):
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            s.bind(("", 0))
            port = s.getsockname()[1]
            lease = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            try:
                lease.bind(f"\0lightning-port-{port}")
                return port, lease
            except OSError as ex:
                lease.close()
                if ex.errno != errno.EADDRINUSE:
                    raise
    raise RuntimeError("no port")


def _bind_store(port: int) -> socket.socket:
    if socket.has_dualstack_ipv6():
        sock = socket.socket(socket.AF_INET6, socket.SOCK_STREAM)
        sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 0)
        address = ("::", port)
    else:
        sock, address = socket.socket(socket.AF_INET, socket.SOCK_STREAM), ("", port)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(address)
        sock.listen(128)
    except OSError:
        sock.close()
        raise
    return sock


def _pick(picker: str, per_process: _PerProcess) -> tuple[int, Callable[[], None], Callable[[], None]]:
    """The picked port, what to call once the store is bound, and what to call when the run has ended."""
    from lightning.fabric.plugins.environments import LightningEnvironment
    from lightning.fabric.plugins.environments.lightning import find_free_network_port

    nothing = lambda: None  # noqa: E731
    if picker == "stock":
        return _stock()[0], nothing, nothing
    if picker == "find_free_network_port":
        return find_free_network_port(), nothing, nothing
    if picker == "per-process":
        port = per_process.pick()[0]
        return port, nothing, lambda: per_process.release(port)
    if picker == "name-lease":
        port, lease = _name_lease()
        return port, nothing, lease.close
    if picker == "sweep":  # LightningEnvironment.main_port, and the launchers' MASTER_PORT, left set (both builds)
        port = int(os.environ["MASTER_PORT"]) if "MASTER_PORT" in os.environ else _stock()[0]
        os.environ["MASTER_PORT"] = str(port)
        return port, nothing, nothing
    env = LightningEnvironment()
    return env.main_port, env._release_port, env.teardown


def worker(picker: str, trials: int, window: float, seed: int, out) -> None:
    os.environ.pop("MASTER_PORT", None)
    rng = random.Random(seed)
    per_process = _PerProcess()
    results = []
    for _ in range(trials):
        t0 = time.perf_counter()
        try:
            port, bound, done = _pick(picker, per_process)
        except (RuntimeError, OSError):
            results.append(("no_port", None, None, None, None))
            continue
        latency = time.perf_counter() - t0
        start = time.monotonic()
        time.sleep(rng.uniform(0.5, 1.5) * window)  # the launcher starts the other ranks meanwhile
        outcome = "ok"
        try:
            store = _bind_store(port)
        except OSError as ex:
            outcome = "eaddrinuse" if ex.errno == errno.EADDRINUSE else "other"
        else:
            bound()
            time.sleep(rng.uniform(0, window))  # the run
            store.close()
        done()
        results.append((outcome, latency, port, start, time.monotonic()))
    out.put((os.getpid(), results))


def noise(stop, seed: int, max_held: int = 20, reset: bool = False, pause: float = 0.002) -> None:
    """Churn ephemeral ports: short-lived listeners on port 0 and outgoing connections.

    With ``reset``, connections end with a reset (``SO_LINGER`` 0) rather than in ``TIME_WAIT``, so that what remains
    in ``TIME_WAIT`` afterwards is the launches' own (``real_launches.py`` counts it).
    """
    rng = random.Random(seed)
    sink = socket.socket()
    sink.bind(("127.0.0.1", 0))
    sink.listen(1024)
    sink.setblocking(False)
    held: list[socket.socket] = []
    while not stop.is_set():
        with contextlib.suppress(OSError):
            if rng.random() < 0.5:
                s = socket.socket()
                s.bind(("", 0))
                s.listen(1)
            else:
                s = socket.create_connection(sink.getsockname(), timeout=1)
                if reset:
                    s.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
            held.append(s)
        with contextlib.suppress(OSError):
            while True:
                accepted = sink.accept()[0]
                if reset:
                    accepted.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
                accepted.close()
        while len(held) > max_held or (held and rng.random() < 0.3):
            held.pop(rng.randrange(len(held))).close()
        time.sleep(rng.uniform(0, pause))


def _shared(intervals: list) -> int:
    """Pairs of trials of different processes handed the same port while both were alive."""
    by_port: dict[int, list] = {}
    for pid, port, start, end in intervals:
        by_port.setdefault(port, []).append((start, end, pid))
    count = 0
    for spans in by_port.values():
        spans.sort()
        for i, (_, end, pid) in enumerate(spans):
            for other_start, _, other_pid in spans[i + 1 :]:
                if other_start >= end:
                    break
                count += other_pid != pid
    return count


def run_picker(picker: str, args) -> dict:
    ctx = get_context("fork")
    stop = ctx.Event()
    noisers = [ctx.Process(target=noise, args=(stop, 1000 + i), daemon=True) for i in range(args.noise)]
    for p in noisers:
        p.start()
    out = ctx.Queue()
    per_worker = -(-args.trials // args.workers)
    started = time.monotonic()
    workers = [ctx.Process(target=worker, args=(picker, per_worker, args.window, i, out)) for i in range(args.workers)]
    for p in workers:
        p.start()
    rows = [(pid, r) for pid, results in (out.get(timeout=900) for _ in workers) for r in results]
    for p in workers:
        p.join()
    stop.set()
    for p in noisers:
        p.join(timeout=10)
    outcomes = [r[0] for _, r in rows]
    latencies = sorted(r[1] for _, r in rows if r[1] is not None)
    return {
        "trials": len(rows),
        "no_port": outcomes.count("no_port"),
        "eaddrinuse": outcomes.count("eaddrinuse"),
        "other": outcomes.count("other"),
        "shared": _shared([(pid, r[2], r[3], r[4]) for pid, r in rows if r[2] is not None]),
        "p50_ms": statistics.median(latencies) * 1e3,
        "p99_ms": latencies[int(0.99 * (len(latencies) - 1))] * 1e3,
        "seconds": time.monotonic() - started,
    }


def run_scenario(args) -> dict:
    with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
        port_range = "-".join(f.read().split())
    rows = {}
    for picker in args.pickers:
        rows[picker] = run_picker(picker, args)
        print(f"  {port_range}: {picker} done in {rows[picker]['seconds']:.0f}s", file=sys.stderr, flush=True)
    return {"range": port_range, "rows": rows}


def print_table(scenarios: list) -> None:
    print("| range | picker | trials | EADDRINUSE | no port | other | shared | pick p50 ms | pick p99 ms |")
    print("|---|---|---|---|---|---|---|---|---|")
    for scenario in scenarios:
        for picker, t in scenario["rows"].items():
            print(
                f"| {scenario['title']} {scenario['range']} | {picker} | {t['trials']} | {t['eaddrinuse']} |"
                f" {t['no_port']} | {t['other']} | {t['shared']} | {t['p50_ms']:.3f} | {t['p99_ms']:.3f} |"
            )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--trials", type=int, default=5000, help="trials per picker and scenario")
    parser.add_argument("--workers", type=int, default=4)
    parser.add_argument("--window", type=float, default=0.01, help="mean seconds between pick and bind")
    parser.add_argument("--noise", type=int, default=2)
    parser.add_argument("--narrow-range", default="40000 40299")
    parser.add_argument("--pickers", nargs="+", default=list(PICKERS), choices=PICKERS)
    parser.add_argument("--inside", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    import lightning.fabric.plugins.environments.lightning  # noqa: F401  (imported once, before the workers fork)

    if args.inside:
        print(json.dumps(run_scenario(args)))
        return
    started = time.monotonic()
    scenarios = [{"title": "default", **run_scenario(args)}]
    if shutil.which("unshare") and shutil.which("ip"):
        forwarded = [f"--trials={args.trials}", f"--workers={args.workers}", f"--window={args.window}"]
        forwarded += [f"--noise={args.noise}", "--pickers", *args.pickers, "--inside"]
        inner = (
            f"ip link set lo up && echo '{args.narrow_range}' > /proc/sys/net/ipv4/ip_local_port_range"
            f' && exec "$0" {os.path.abspath(__file__)} "$@"'
        )
        result = subprocess.run(
            ["unshare", "-rn", "sh", "-c", inner, sys.executable, *forwarded], stdout=subprocess.PIPE, text=True
        )
        if result.returncode == 0:
            scenarios.append({"title": "narrowed, private netns", **json.loads(result.stdout.splitlines()[-1])})
        else:
            print("the narrowed scenario failed: no private network namespace here?", file=sys.stderr)
    else:
        print("skipping the narrowed scenario: it needs `unshare` and `ip`", file=sys.stderr)
    print(
        f"\n{args.workers} workers, {args.noise} noise processes, window {args.window * 1e3:.0f} ms,"
        f" {time.monotonic() - started:.0f} s in all, torch-free store binds (see the docstring)\n"
    )
    print_table(scenarios)


if __name__ == "__main__":
    main()
