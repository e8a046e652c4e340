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
"""Stress the pick-a-port-then-bind race of the rendezvous store, and compare ways of picking ports.

K worker processes run R rounds each of: get a port, wait a launcher-like window, bind a real ``TCPStore`` on it as
rank 0, connect a second rank (client) and check a per-trial nonce (a client reaching someone else's store is
cross-talk), release the port. Noise processes meanwhile open ephemeral listeners and make outgoing connections, as
other programs on a CI machine do. Pickers compared in the same run:

* ``stock``: Lightning 2.6.6's ``find_free_network_port`` (bind port 0, close, hand out the number);
* ``deque``: a per-process manager in the style of PR #21309 (bind port 0, skip ports this process holds or released
  recently, a thread lock, nothing shared between processes);
* ``ours-os``: :class:`~lightning.fabric.utilities.port_manager.PortManager` with the pool turned off (cross-process
  leases on ephemeral ports);
* ``ours``: ``PortManager`` with its default pool below the ephemeral range;
* ``ours+hold``: ``ours``, plus a listening socket opened at lease time and handed to ``TCPStore`` through
  ``master_listen_fd`` (no gap at all between lease and bind).

Run from the repository root (not part of the test suite)::

    python benchmarks/ports/bench_ports.py              # both scenarios; the narrowed one needs `unshare` and root
    python benchmarks/ports/bench_ports.py --rounds 50  # quicker

The narrowed scenario re-runs this script in a private network namespace (``unshare --net``) whose ephemeral range is
set to ``--narrow-range`` ports, so that bind(0) pickers and the noise compete for few ports; nothing leaves the
namespace's loopback interface. The default scenario runs on the machine's loopback with its normal range.

"""

import argparse
import contextlib
import os
import queue
import random
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections import deque
from datetime import timedelta
from multiprocessing import get_context

METHODS = ("stock", "deque", "ours-os", "ours", "ours+hold")


def stock_pick() -> int:
    """What ``find_free_network_port`` did in Lightning 2.6.6."""
    s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    s.bind(("", 0))
    port = s.getsockname()[1]
    s.close()
    return port


class DequeManager:
    """A process-local manager in the style of PR #21309."""

    def __init__(self, size: int = 1024) -> None:
        self._lock = threading.Lock()
        self._held: set[int] = set()
        self._recent: deque[int] = deque(maxlen=size)

    def allocate(self) -> int:
        with self._lock:
            for _ in range(1000):
                port = stock_pick()
                if port not in self._held and port not in self._recent:
                    self._held.add(port)
                    return port
        raise RuntimeError("no port")

    def release(self, port: int) -> None:
        with self._lock:
            self._held.discard(port)
            self._recent.append(port)


def _hold_socket(port: int) -> socket.socket:
    """Bind and listen the way TCPStore does, to pass the socket as ``master_listen_fd``."""
    sock = socket.socket(socket.AF_INET6, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 0)
    sock.bind(("::", port))
    sock.listen(128)
    return sock


def worker(method: str, rounds: int, window: float, registry: str, seed: int, out) -> None:
    from torch.distributed import TCPStore

    from lightning.fabric.utilities.port_manager import PortManager

    rng = random.Random(seed)
    if method.startswith("ours"):
        manager = PortManager(registry_dir=registry, pool=range(0) if method == "ours-os" else None)
        allocate, release = manager.allocate_port, manager.release_port
    elif method == "deque":
        manager = DequeManager()
        allocate, release = manager.allocate, manager.release
    else:
        allocate, release = stock_pick, lambda port: None

    pid = os.getpid()
    for r in range(rounds):
        t0 = time.perf_counter()
        try:
            port = allocate()
        except RuntimeError:  # the picker gave up: no port at all
            out.put((pid, "no_port", None, None))
            continue
        latency = time.perf_counter() - t0
        start = time.monotonic()
        held = None
        master = client = None
        outcome = "ok"
        try:
            if method == "ours+hold":
                held = _hold_socket(port)
            time.sleep(rng.uniform(0.5, 1.5) * window)  # the launcher starts the other ranks meanwhile
            kwargs = {"master_listen_fd": held.fileno()} if held is not None else {}
            master = TCPStore(
                "127.0.0.1", port, 2, True, timeout=timedelta(seconds=5), wait_for_workers=False, **kwargs
            )
            if held is not None:
                held.detach()  # the store owns the descriptor now
                held = None
            client = TCPStore("127.0.0.1", port, 2, False, timeout=timedelta(seconds=5))
            nonce = f"{pid}-{r}-{rng.random()}"
            master.set("nonce", nonce)
            if client.get("nonce").decode() != nonce:
                outcome = "crosstalk"
        except Exception as ex:
            text = str(ex)
            if "EADDRINUSE" in text or "address already in use" in text.lower():
                outcome = "eaddrinuse"
            elif "timed out" in text.lower() or "timeout" in text.lower():
                outcome = "hang"
            else:
                outcome = "other"
        finally:
            del client, master
            if held is not None:
                held.close()
            interval = (port, start, time.monotonic(), pid)
            release(port)
        out.put((pid, outcome, latency, interval))
    out.put((pid, "done", None, None))


def noise(stop, seed: int) -> None:
    """Churn ephemeral ports: short-lived listeners on port 0 and outgoing connections (left in TIME_WAIT)."""
    rng = random.Random(seed)
    sink = socket.socket()
    sink.bind(("127.0.0.1", 0))
    sink.listen(1024)
    sink.setblocking(False)
    sink_port = sink.getsockname()[1]
    held: list[socket.socket] = []
    parent = os.getppid()
    deadline = time.monotonic() + 1800  # stops by itself, also when the parent died
    while not stop.is_set() and time.monotonic() < deadline and os.getppid() == parent:
        with contextlib.suppress(OSError):
            if rng.random() < 0.5:
                s = socket.socket()
                s.bind(("", 0))
                s.listen(1)
            else:
                s = socket.create_connection(("127.0.0.1", sink_port), timeout=1)
            held.append(s)
        with contextlib.suppress(OSError):
            while True:
                conn, _ = sink.accept()
                conn.close()
        while len(held) > 20 or (held and rng.random() < 0.3):
            held.pop(rng.randrange(len(held))).close()
        time.sleep(rng.uniform(0, 0.002))
    for s in held:
        s.close()


def _double_leases(intervals) -> int:
    """Count pairs of intervals of different processes that held the same port at the same time."""
    by_port: dict[int, list] = {}
    for port, start, end, pid in intervals:
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


def _leaked_leases(registry: str) -> int:
    import fcntl

    leaked = 0
    for name in os.listdir(registry):
        fd = os.open(os.path.join(registry, name), os.O_RDWR)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            leaked += 1
        finally:
            os.close(fd)
    return leaked


def run_method(method: str, args) -> dict:
    # import once here: forked workers start at once instead of importing torch in each
    import torch.distributed  # noqa: F401

    import lightning.fabric.utilities.port_manager  # noqa: F401

    ctx = get_context("fork")
    registry = tempfile.mkdtemp(prefix="bench-ports-")
    stop = ctx.Event()
    noisers = [ctx.Process(target=noise, args=(stop, 1000 + i), daemon=True) for i in range(args.noise)]
    for p in noisers:
        p.start()
    out = ctx.Queue()
    start = time.monotonic()
    workers = [
        ctx.Process(target=worker, args=(method, args.rounds, args.window, registry, i, out))
        for i in range(args.workers)
    ]
    for p in workers:
        p.start()
    total = {"trials": 0, "no_port": 0, "eaddrinuse": 0, "crosstalk": 0, "hang": 0, "other": 0}
    latencies, intervals = [], []
    last_seen = {p.pid: time.monotonic() for p in workers}
    running = set(last_seen)
    while running:
        try:
            pid, outcome, latency, interval = out.get(timeout=1)
        except queue.Empty:
            pid = None
        if pid is not None:
            last_seen[pid] = time.monotonic()
            if outcome == "done":
                running.discard(pid)
                continue
            total["trials"] += 1
            if outcome != "ok":
                total[outcome] += 1
            if latency is not None:
                latencies.append(latency)
                intervals.append(interval)
        for p in workers:
            # a trial stuck past every timeout of the store (5 s each) is a hang: count it and stop that worker
            if p.pid in running and time.monotonic() - last_seen[p.pid] > args.stall:
                p.kill()
                running.discard(p.pid)
                total["trials"] += 1
                total["hang"] += 1
            elif p.pid in running and not p.is_alive() and out.empty():
                running.discard(p.pid)
                total["trials"] += 1
                total["other"] += 1
    for p in workers:
        p.join(timeout=10)
    stop.set()
    for p in noisers:
        p.join(timeout=10)
    elapsed = time.monotonic() - start
    total["double_lease"] = _double_leases(intervals)
    total["leaked"] = _leaked_leases(registry) if method.startswith("ours") else 0
    shutil.rmtree(registry, ignore_errors=True)
    latencies.sort()
    total["p50_ms"] = statistics.median(latencies) * 1e3 if latencies else float("nan")
    total["p99_ms"] = latencies[int(0.99 * (len(latencies) - 1))] * 1e3 if latencies else float("nan")
    total["seconds"] = elapsed
    return total


def print_table(title: str, rows: dict) -> None:
    print(f"\n{title}")
    columns = ("no_port", "eaddrinuse", "crosstalk", "hang", "other", "double_lease")
    print(
        "| picker | trials | no port /1k | EADDRINUSE /1k | cross-talk /1k | hangs /1k | other /1k"
        " | two live leases /1k | leaked leases | alloc p50 ms | alloc p99 ms |"
    )
    print("|" + "|".join("---" for _ in range(11)) + "|")
    for method, t in rows.items():
        per_k = " | ".join(f"{1000 * t[k] / max(t['trials'], 1):.1f}" for k in columns)
        print(
            f"| {method} | {t['trials']} | {per_k} | {t['leaked']} | {t['p50_ms']:.3f} | {t['p99_ms']:.3f} |",
            flush=True,
        )


def run_scenario(args) -> None:
    with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
        low, high = f.read().split()
    rows = {}
    for method in args.methods:
        rounds = args.rounds * args.ours_factor if method == "ours" else args.rounds
        rows[method] = run_method(method, argparse.Namespace(**{**vars(args), "rounds": rounds}))
        print(f"  {args.title}: {method} done in {rows[method]['seconds']:.1f}s", file=sys.stderr, flush=True)
    print_table(
        f"{args.title}: ephemeral range {low}-{high}, {args.workers} workers, {args.noise} noise processes,"
        f" window {args.window * 1e3:.0f} ms",
        rows,
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workers", type=int, default=4)
    parser.add_argument("--rounds", type=int, default=250, help="rounds per worker")
    parser.add_argument("--ours-factor", type=int, default=5, help="run `ours` this many times more rounds")
    parser.add_argument("--window", type=float, default=0.01, help="mean seconds between pick and bind")
    parser.add_argument("--noise", type=int, default=2)
    parser.add_argument("--stall", type=float, default=60, help="seconds without progress that count as a hang")
    parser.add_argument("--narrow-range", default="40000 40299")
    parser.add_argument("--methods", nargs="+", default=list(METHODS), choices=METHODS)
    parser.add_argument("--scenario", choices=("both", "narrow", "default", "_inside"), default="both")
    parser.add_argument("--title", default="default range")
    args = parser.parse_args()

    if args.scenario == "_inside":
        run_scenario(args)
        return
    if args.scenario in ("both", "narrow"):
        if shutil.which("unshare") and shutil.which("ip") and os.geteuid() == 0:
            forwarded = [
                f"--workers={args.workers}",
                f"--rounds={args.rounds}",
                f"--ours-factor={args.ours_factor}",
                f"--window={args.window}",
                f"--noise={args.noise}",
                f"--stall={args.stall}",
                "--methods",
                *args.methods,
            ]
            inner = " ".join(
                [
                    "ip link set lo up &&",
                    f"echo '{args.narrow_range}' > /proc/sys/net/ipv4/ip_local_port_range &&",
                    f"{sys.executable} {os.path.abspath(__file__)} --scenario _inside",
                    "--title 'private namespace, narrowed range'",
                    *forwarded,
                ]
            )
            subprocess.run(["unshare", "--net", "sh", "-c", inner], check=True)
        else:
            print("\nSkipping the narrowed-range scenario: it needs root, `unshare` and `ip`.")
    if args.scenario in ("both", "default"):
        run_scenario(args)


if __name__ == "__main__":
    main()
