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
import os
import shutil
import signal
import socket
import stat
import subprocess
import sys
import textwrap
import threading
from datetime import timedelta

import pytest
from torch.distributed import TCPStore

from lightning.fabric.plugins.environments.lightning import find_free_network_port
from lightning.fabric.utilities import port_manager as pm
from lightning.fabric.utilities.imports import _TORCH_GREATER_EQUAL_2_2
from lightning.fabric.utilities.port_manager import PortManager, get_port_manager, parse_port, probe_port

POSIX = sys.platform != "win32"


@pytest.fixture
def registry(tmp_path):
    return str(tmp_path / "registry")


def _free_run(length):
    """A run of ``length`` consecutive ports in the default pool region that are free right now."""
    pool = pm._default_pool() or range(20000, 28000)
    for start in range(pool.start + 200, pool.stop - length, length):
        if all(probe_port(p) for p in range(start, start + length)):
            return range(start, start + length)
    pytest.skip("no run of free ports")


@pytest.mark.parametrize("value", ["abc", "0", "-1", "70000", "", " ", "1.5"])
def test_parse_port_rejects(value):
    with pytest.raises(ValueError, match=rf"MASTER_PORT={value!r}"):
        parse_port(value, "MASTER_PORT")


@pytest.mark.parametrize(("value", "expected"), [("1", 1), ("29500", 29500), (" 65535\n", 65535)])
def test_parse_port_accepts(value, expected):
    assert parse_port(value, "MASTER_PORT") == expected


def test_default_pool_is_below_ephemeral_range(monkeypatch):
    monkeypatch.delenv("LIGHTNING_PORT_POOL", raising=False)
    low, high = pm.ephemeral_port_range()
    pool = pm._default_pool()
    assert 1 <= low <= high <= 65535
    assert pool is not None
    assert pool.stop == low
    assert pool.start >= 1024
    assert len(pool) == min(8192, low - 1024)


@pytest.mark.parametrize(("value", "expected"), [("20000-20009", range(20000, 20010)), ("off", None), ("0", None)])
def test_pool_from_env(monkeypatch, registry, value, expected):
    monkeypatch.setenv("LIGHTNING_PORT_POOL", value)
    assert PortManager(registry_dir=registry).pool == expected


@pytest.mark.parametrize("value", ["20010-20000", "abc", "20000-", "1-70000"])
def test_pool_from_env_invalid(monkeypatch, value):
    monkeypatch.setenv("LIGHTNING_PORT_POOL", value)
    with pytest.raises(ValueError, match="LIGHTNING_PORT_POOL"):
        pm._default_pool()


def test_allocate_leases_a_bindable_pool_port(registry):
    manager = PortManager(registry_dir=registry)
    port = manager.allocate_port()
    assert port in manager.pool
    assert manager.allocated_ports == {port}
    assert os.path.exists(os.path.join(registry, f"{port}.lock"))
    # another manager on the same registry (another process, in real life) cannot get it, even when asking for it
    other = PortManager(registry_dir=registry)
    assert other.allocate_port(preferred_port=port) != port
    other.release_all()
    # the port really is free for rank 0's store
    store = TCPStore("127.0.0.1", port, 1, True, timeout=timedelta(seconds=10))
    store.set("k", "v")
    assert store.get("k") == b"v"
    del store
    manager.release_port(port)
    assert manager.allocated_ports == frozenset()
    assert not os.path.exists(os.path.join(registry, f"{port}.lock"))
    assert other.allocate_port(preferred_port=port) == port


@pytest.mark.parametrize(
    "use_libuv",
    [
        pytest.param(True, marks=pytest.mark.skipif(not _TORCH_GREATER_EQUAL_2_2, reason="libuv TCPStore: torch 2.2+")),
        False,
    ],
)
def test_allocated_ports_bind_real_tcpstores(registry, use_libuv):
    manager = PortManager(registry_dir=registry)
    ports = [manager.allocate_port() for _ in range(4)]
    assert len(set(ports)) == 4
    stores = [
        TCPStore("127.0.0.1", p, 2, True, timeout=timedelta(seconds=10), wait_for_workers=False, use_libuv=use_libuv)
        for p in ports
    ]
    clients = [TCPStore("127.0.0.1", p, 2, False, timeout=timedelta(seconds=10), use_libuv=use_libuv) for p in ports]
    for i in range(len(ports)):
        stores[i].set("nonce", str(i))
        assert clients[i].get("nonce") == str(i).encode()
    # while the stores live, no manager on the machine would hand these ports out
    assert not any(probe_port(p) for p in ports)
    manager.release_all()
    assert manager.allocated_ports == frozenset()


def _leave_time_wait(reuse_addr):
    """Close a server-side connection first so that its port is left in TIME_WAIT; return the port."""
    with socket.socket() as listener:
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, int(reuse_addr))
        listener.bind(("127.0.0.1", 0))
        listener.listen(1)
        port = listener.getsockname()[1]
        assert not probe_port(port)  # a live listener
        client = socket.create_connection(("127.0.0.1", port))
        conn, _ = listener.accept()
        conn.close()
        client.close()
    return port


def _store_binds(port):
    try:
        store = TCPStore("127.0.0.1", port, 1, True, timeout=timedelta(seconds=10))
    except RuntimeError as ex:
        if "EADDRINUSE" not in str(ex):
            raise
        return False
    del store
    return True


@pytest.mark.skipif(sys.platform != "linux", reason="Linux TIME_WAIT semantics")
@pytest.mark.skipif(not _TORCH_GREATER_EQUAL_2_2, reason="torch 2.1's TCPStore does not bind a port in TIME_WAIT")
def test_probe_agrees_with_tcpstore_on_time_wait():
    # TIME_WAIT left by a socket with SO_REUSEADDR (as a previous TCPStore's): both the probe and a new store bind
    port = _leave_time_wait(reuse_addr=True)
    assert probe_port(port)
    assert _store_binds(port)
    # TIME_WAIT left by a socket without SO_REUSEADDR: Linux refuses both
    port = _leave_time_wait(reuse_addr=False)
    assert not probe_port(port)
    assert not _store_binds(port)


def test_preferred_port(registry):
    manager = PortManager(registry_dir=registry)
    (port,) = _free_run(1)
    assert manager.allocate_port(preferred_port=port) == port
    # already leased by this manager: another port
    assert manager.allocate_port(preferred_port=port) != port
    manager.release_all()
    # a live socket on the preferred port: another port
    with socket.socket() as sock:
        sock.bind(("", port))
        sock.listen(1)
        assert manager.allocate_port(preferred_port=port) != port
    with pytest.raises(ValueError, match="preferred_port"):
        manager.allocate_port(preferred_port=70000)
    with pytest.raises(ValueError, match="max_attempts"):
        manager.allocate_port(max_attempts=0)


def test_recently_released_not_handed_out_again(registry):
    ports = _free_run(3)
    manager = PortManager(registry_dir=registry, pool=ports, recently_released_size=2)
    first = manager.allocate_port()
    manager.release_port(first)
    assert manager.recently_released == (first,)
    second = manager.allocate_port()
    assert second != first
    manager.release_port(second)
    third = manager.allocate_port()
    assert third not in (first, second)
    assert {first, second, third} == set(ports)
    manager.release_port(third)
    # `first` dropped off the 2-slot queue, so it is the only pool port allowed again
    assert manager.recently_released == (second, third)
    assert manager.allocate_port() == first
    manager.release_all()


def test_pool_exhausted_falls_back_to_os(registry):
    ports = _free_run(2)
    manager = PortManager(registry_dir=registry, pool=ports)
    taken = {manager.allocate_port(), manager.allocate_port()}
    assert taken == set(ports)
    extra = manager.allocate_port()
    assert extra not in ports
    low, high = pm.ephemeral_port_range()
    assert low <= extra <= high
    manager.release_all()


def test_release_all_and_unknown_port(registry):
    manager = PortManager(registry_dir=registry)
    ports = {manager.allocate_port() for _ in range(5)}
    manager.reserve_existing_port(29999)
    manager.release_port(1)  # not held: no error, but remembered
    assert manager.recently_released == (1,)
    manager.release_all()
    assert manager.allocated_ports == frozenset()
    assert manager.reserved_ports == frozenset()
    assert os.listdir(registry) == []
    assert set(manager.recently_released) == ports | {1, 29999}


def test_reserve_existing_port(registry):
    manager = PortManager(registry_dir=registry)
    (port,) = _free_run(1)
    assert manager.reserve_existing_port(port)
    assert not manager.reserve_existing_port(port)
    assert manager.reserved_ports == {port}
    # never handed out, not probed, no cross-process lease
    assert manager.allocate_port(preferred_port=port) != port
    assert not os.path.exists(os.path.join(registry, f"{port}.lock"))
    leased = next(iter(manager.allocated_ports))
    assert not manager.reserve_existing_port(leased)
    manager.release_port(port)
    assert manager.reserved_ports == frozenset()
    with pytest.raises(ValueError, match="65535"):
        manager.reserve_existing_port(0)
    manager.release_all()


def test_allocated_port_context_manager(registry):
    manager = PortManager(registry_dir=registry)
    with manager.allocated_port() as port:
        assert manager.allocated_ports == {port}
    assert manager.allocated_ports == frozenset()
    with pytest.raises(RuntimeError, match="boom"), manager.allocated_port() as port:
        raise RuntimeError("boom")
    assert manager.allocated_ports == frozenset()
    assert manager.recently_released[-1] == port


def test_unusable_registry_fails_after_max_attempts(registry):
    manager = PortManager(registry_dir=registry)
    shutil.rmtree(registry)
    with pytest.raises(RuntimeError, match="after 5 attempts"):
        manager.allocate_port(max_attempts=5)


@pytest.mark.skipif(not POSIX, reason="POSIX permissions")
def test_registry_dir_is_private(tmp_path, monkeypatch):
    path = tmp_path / "new"
    monkeypatch.setenv("LIGHTNING_PORT_REGISTRY_DIR", str(path))
    assert PortManager().registry_dir == str(path)
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o700
    loose = tmp_path / "loose"
    loose.mkdir()
    os.chmod(loose, 0o777)  # noqa: S103 - the manager must tighten it
    assert PortManager(registry_dir=str(loose)).registry_dir == str(loose)
    assert stat.S_IMODE(os.stat(loose).st_mode) == 0o700


@pytest.mark.skipif(not POSIX, reason="symlinks")
def test_registry_dir_symlink_is_not_used(tmp_path):
    target = tmp_path / "target"
    target.mkdir(mode=0o700)
    link = tmp_path / "link"
    link.symlink_to(target)
    with pytest.warns(UserWarning, match="not a directory"):
        manager = PortManager(registry_dir=str(link))
    assert manager.registry_dir is None


@pytest.mark.skipif(not POSIX or os.geteuid() != 0, reason="needs root to create a directory owned by another user")
def test_registry_dir_of_another_user_is_not_used(tmp_path):
    foreign = tmp_path / "foreign"
    foreign.mkdir()
    os.chown(foreign, 65534, 65534)
    with pytest.warns(UserWarning, match="port registry is unavailable"):
        manager = PortManager(registry_dir=str(foreign))
    assert manager.registry_dir is None
    # still works, coordinated within the process only
    with manager.allocated_port() as port:
        assert probe_port(port)
    assert os.listdir(foreign) == []


def test_thread_safety(registry):
    manager = PortManager(registry_dir=registry)
    results, errors = [], []

    def work():
        try:
            for _ in range(8):  # 8 threads x 8: exactly the leases one process may hold
                results.append(manager.allocate_port())
        except Exception as ex:  # pragma: no cover - would fail the assertion below
            errors.append(ex)

    threads = [threading.Thread(target=work) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []
    assert len(results) == 64
    assert len(set(results)) == 64
    assert manager.allocated_ports == set(results)
    manager.release_all()


def test_get_port_manager_is_a_thread_safe_singleton(monkeypatch):
    monkeypatch.setattr(pm, "_manager", None)
    seen = []
    barrier = threading.Barrier(8)

    def get():
        barrier.wait()
        seen.append(get_port_manager())

    threads = [threading.Thread(target=get) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(seen) == 8
    assert all(m is seen[0] for m in seen)
    assert isinstance(seen[0], PortManager)


_HOLDER = textwrap.dedent(
    """
    import sys
    from lightning.fabric.utilities.port_manager import PortManager

    manager = PortManager(registry_dir=sys.argv[1], pool=range(int(sys.argv[2]), int(sys.argv[3])))
    print("ready", flush=True)
    sys.stdin.readline()  # start together with the others
    ports = [manager.allocate_port() for _ in range(int(sys.argv[4]))]
    print(" ".join(map(str, ports)), flush=True)
    sys.stdin.readline()  # hold the leases until told to go
    """
)


def _start_holders(registry, pool, count, n):
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", _HOLDER, registry, str(pool.start), str(pool.stop), str(n)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        for _ in range(count)
    ]
    for p in procs:
        assert p.stdout.readline().strip() == "ready"
    for p in procs:
        p.stdin.write("go\n")
        p.stdin.flush()
    return procs


@pytest.mark.timeout(180)
@pytest.mark.skipif(not POSIX, reason="flock and SIGKILL")
def test_processes_leasing_at_once_never_overlap_and_sigkill_frees(registry):
    # 3 processes x 60 ports (within the 64 leases a process keeps) from a pool of 240: they contend for the same
    # ports, and some fall back to the OS
    pool = _free_run(240)
    procs = _start_holders(registry, pool, count=3, n=60)
    try:
        leased = [set(map(int, p.stdout.readline().split())) for p in procs]
        assert [len(s) for s in leased] == [60] * 3
        everything = set.union(*leased)
        assert len(everything) == 180
        assert sorted(int(f.split(".")[0]) for f in os.listdir(registry)) == sorted(everything)
        # this process is refused every one of them while they are held
        manager = PortManager(registry_dir=registry)
        for port in sorted(everything)[::15]:
            assert manager.allocate_port(preferred_port=port) != port
        manager.release_all()

        # a holder killed with SIGKILL cannot clean up, yet its leases are gone with it
        procs[0].send_signal(signal.SIGKILL)
        procs[0].wait(timeout=60)
        assert procs[0].returncode == -signal.SIGKILL
        assert len(os.listdir(registry)) == 180  # its lock files stay, but nobody holds them
        killed, alive = sorted(leased[0]), sorted(leased[1] | leased[2])
        manager = PortManager(registry_dir=registry)
        assert [manager.allocate_port(preferred_port=port) for port in killed[::10]] == killed[::10]
        for port in alive[::20]:
            assert manager.allocate_port(preferred_port=port) != port
        manager.release_all()
    finally:
        for p in procs[1:]:
            p.communicate("\n", timeout=60)
        for p in procs:
            if p.poll() is None:
                p.kill()
    assert [p.returncode for p in procs[1:]] == [0, 0]
    # the holders are gone, and so are their leases
    manager = PortManager(registry_dir=registry)
    for port in alive[::20]:
        assert manager.allocate_port(preferred_port=port) == port
    manager.release_all()


@pytest.mark.skipif(not POSIX, reason="fork")
def test_forked_child_does_not_inherit_or_drop_leases(registry, monkeypatch):
    monkeypatch.setenv("LIGHTNING_PORT_REGISTRY_DIR", registry)
    monkeypatch.setattr(pm, "_manager", None)
    port = get_port_manager().allocate_port()
    pid = os.fork()
    if pid == 0:  # pragma: no cover - child
        ok = get_port_manager().allocated_ports == frozenset() and get_port_manager().allocate_port() != port
        os._exit(0 if ok else 1)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0
    # the child closing its copy did not release the parent's lease
    other = PortManager(registry_dir=registry)
    assert other.allocate_port(preferred_port=port) != port
    other.release_all()
    get_port_manager().release_all()


def test_find_free_network_port_leases(registry, monkeypatch):
    monkeypatch.delenv("STANDALONE_PORT", raising=False)
    monkeypatch.setattr(pm, "_manager", PortManager(registry_dir=registry))
    port = find_free_network_port()
    assert port in get_port_manager().allocated_ports
    assert os.path.exists(os.path.join(registry, f"{port}.lock"))
    get_port_manager().release_all()


def test_find_free_network_port_standalone(registry, monkeypatch):
    monkeypatch.setattr(pm, "_manager", PortManager(registry_dir=registry))
    monkeypatch.setenv("STANDALONE_PORT", "12345")
    assert find_free_network_port() == 12345
    assert find_free_network_port() == 12345
    assert get_port_manager().reserved_ports == {12345}
    assert get_port_manager().allocated_ports == frozenset()
    monkeypatch.setenv("STANDALONE_PORT", "port")
    with pytest.raises(ValueError, match="STANDALONE_PORT='port'"):
        find_free_network_port()


def test_a_process_keeps_a_bounded_number_of_leases(tmp_path):
    """Callers of `find_free_network_port` never release: the oldest lease goes, instead of one open file per call."""
    registry = tmp_path / "registry"
    manager = PortManager(registry_dir=str(registry), pool=range(0))
    fds_before = len(os.listdir("/proc/self/fd"))
    ports = [manager.allocate_port() for _ in range(200)]
    assert len(set(ports)) == 200
    assert manager.allocated_ports == frozenset(ports[-64:])
    assert sorted(os.listdir(registry)) == sorted(f"{p}.lock" for p in ports[-64:])
    assert len(os.listdir("/proc/self/fd")) <= fds_before + 64
    manager.release_all()
    assert os.listdir(registry) == []


def test_running_out_of_file_descriptors_is_not_reported_as_no_free_port(tmp_path):
    code = f"""
import errno, os, resource
from lightning.fabric.utilities.port_manager import PortManager
manager = PortManager(registry_dir={str(tmp_path / "registry")!r}, pool=range(0))
hard = resource.getrlimit(resource.RLIMIT_NOFILE)[1]
resource.setrlimit(resource.RLIMIT_NOFILE, (len(os.listdir("/proc/self/fd")) + 6, hard))
try:
    for _ in range(60):
        manager.allocate_port()
except OSError as err:
    print("EMFILE" if err.errno == errno.EMFILE else f"other {{err}}")
"""
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert proc.stdout.strip() == "EMFILE", proc.stdout + proc.stderr
