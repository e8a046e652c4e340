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
"""The port Lightning picks for the rendezvous store: kept bound until the store binds it, on Linux.

Every test uses real sockets, real ``TCPStore`` servers and, where processes matter, real processes. Runs of Fabric and
the launchers are in ``test_port_manager_runs.py``.

"""

import inspect
import json
import os
import pickle
import shutil
import socket
import subprocess
import sys
import textwrap
import warnings
from datetime import timedelta
from pathlib import Path
from unittest import mock

import pytest
import torch.distributed
from packaging.version import Version
from torch.distributed import TCPStore

from lightning.fabric.plugins.environments import LightningEnvironment, MPIEnvironment
from lightning.fabric.plugins.environments.lightning import find_free_network_port
from lightning.fabric.utilities import port_manager
from lightning.fabric.utilities.port_manager import PortReservation
from tests_fabric.helpers.ports import bound_only_ports, held_here, plain_bind_succeeds

_TORCH_GREATER_EQUAL_2_4 = Version(torch.__version__).release >= (2, 4)
_LINUX = sys.platform.startswith("linux")
linux_only = pytest.mark.skipif(not _LINUX, reason="ports are kept bound on Linux only")
_DOCS = Path(__file__).parents[3] / "docs" / "source-fabric" / "advanced" / "ports.rst"


def _stores_bind(port: int) -> None:
    """Rank 0's store binds ``port`` and a second rank reaches it, with every store backend this torch has."""
    for kwargs in ({"use_libuv": True}, {"use_libuv": False}) if _TORCH_GREATER_EQUAL_2_4 else ({},):
        server = TCPStore("127.0.0.1", port, 2, True, timeout=timedelta(seconds=10), wait_for_workers=False, **kwargs)
        client = TCPStore("127.0.0.1", port, 2, False, timeout=timedelta(seconds=10), **kwargs)
        server.set("key", "value")
        assert client.get("key") == b"value"
        del client, server


@pytest.fixture
def env(monkeypatch):
    for name in ("MASTER_PORT", "STANDALONE_PORT"):
        monkeypatch.delenv(name, raising=False)
    env = LightningEnvironment()
    yield env
    env.teardown()


@linux_only
def test_picked_port_is_held_until_the_store_binds_it(env):
    port = env.main_port
    assert env.main_port == port
    assert held_here(port)
    # while held, no other socket is given the port: not bind(0), not a plain bind
    assert not plain_bind_succeeds(port)
    assert port not in {find_free_network_port() for _ in range(300)}
    _stores_bind(port)
    env.teardown()
    assert not held_here(port)
    assert plain_bind_succeeds(port)


@linux_only
def test_the_process_group_releases_the_port_once_its_store_is_up(env):
    """``_init_dist_connection`` releases the hold after the store binds: Fabric never calls ``teardown``."""
    from lightning.fabric.utilities.distributed import _init_dist_connection

    port = env.main_port
    _init_dist_connection(env, "gloo", global_rank=0, world_size=1)
    try:
        assert not held_here(port)
        assert env.main_port == port  # the process group lives on it: later reads give the same port
    finally:
        torch.distributed.destroy_process_group()
    assert plain_bind_succeeds(port)


@linux_only
def test_held_port_is_not_given_to_other_processes(env):
    script = "from lightning.fabric.plugins.environments.lightning import find_free_network_port as f\n"
    script += "print(sorted({f() for _ in range(500)}))"
    port = env.main_port
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, check=True).stdout
    assert port not in json.loads(out)


_FORK_CHILD = """
import os, socket, time
from lightning.fabric.plugins.environments import LightningEnvironment

env = LightningEnvironment()
port = env.main_port
read, write = os.pipe()
pid = os.fork()
if pid == 0:  # a forked child, as a DataLoader worker is on Linux: it must not keep its parent's port
    os.write(write, b"1" if held_here(port) else b"0")
    time.sleep(60)
in_child = os.read(read, 1).decode()
env.teardown()  # while the child is still alive
print(in_child, int(plain_bind_succeeds(port)), int(held_here(port)))
os.kill(pid, 9)
os.waitpid(pid, 0)
"""


@linux_only
def test_forked_children_do_not_keep_the_held_port():
    helpers = "".join(inspect.getsource(f) + "\n" for f in (held_here, plain_bind_succeeds))
    env = {k: v for k, v in os.environ.items() if k not in ("MASTER_PORT", "STANDALONE_PORT")}
    result = subprocess.run(
        [sys.executable, "-c", "import os, socket\n" + helpers + _FORK_CHILD], env=env, capture_output=True, text=True
    )
    assert result.returncode == 0, result.stderr
    in_child, free_after_teardown, held_in_parent = result.stdout.split()
    assert in_child == "0"
    assert (free_after_teardown, held_in_parent) == ("1", "0")


def test_user_port_is_used_as_given(monkeypatch):
    with socket.socket() as listener:  # the port is busy: a user's port is still never replaced or probed
        listener.bind(("127.0.0.1", 0))
        busy = listener.getsockname()[1]
        monkeypatch.setenv("MASTER_PORT", f" {busy}\n")
        env = LightningEnvironment()
        assert env.main_port == busy
        assert env._port_reservation is None
        monkeypatch.delenv("MASTER_PORT")
        monkeypatch.setenv("STANDALONE_PORT", str(busy))
        assert LightningEnvironment().main_port == busy
        assert find_free_network_port() == busy


@pytest.mark.parametrize(("value", "expected"), [("+29533", 29533), ("29_533", 29533), ("\uff12\uff19\uff15", 295)])
@pytest.mark.parametrize("name", ["MASTER_PORT", "STANDALONE_PORT"])
def test_port_variables_accept_what_int_accepts(monkeypatch, name, value, expected):
    """As in stock Lightning (``int()``): the launchers write the number back as plain digits."""
    monkeypatch.delenv("MASTER_PORT", raising=False)
    monkeypatch.setenv(name, value)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert LightningEnvironment().main_port == expected


@pytest.mark.parametrize("value", ["abc", "", "29500.0", "65536", "-1", "0x7530"])
@pytest.mark.parametrize("name", ["MASTER_PORT", "STANDALONE_PORT"])
def test_port_variables_that_cannot_work_raise_one_error_naming_the_variable(monkeypatch, name, value):
    monkeypatch.delenv("MASTER_PORT", raising=False)
    monkeypatch.setenv(name, value)
    with pytest.raises(ValueError, match=rf"^{name}={value!r} is not a port number: expected an integer from 0 to"):
        _ = LightningEnvironment().main_port


def test_port_zero_warns_once(monkeypatch):
    """The store binds a port of its own choosing: right for one process, so it works, with one warning."""
    monkeypatch.setenv("MASTER_PORT", "0")
    port_manager._warning_cache.clear()
    with pytest.warns(UserWarning, match="MASTER_PORT=0: .* single process only") as record:
        assert [LightningEnvironment().main_port for _ in range(3)] == [0, 0, 0]
    assert len(record) == 1


@linux_only
def test_ports_come_from_the_ephemeral_range_only(env):
    """The OS picks the port, as ``bind(0)`` does: never 29500/29400, SLURM's range or reserved ports below it."""
    with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
        low, high = (int(v) for v in f.read().split())
    envs = [LightningEnvironment() for _ in range(100)]
    ports = {e.main_port for e in envs}
    for e in envs:
        e.teardown()
    assert len(ports) == 100
    assert all(low <= port <= high for port in ports), sorted(ports)


_IN_NAMESPACE = textwrap.dedent(
    """
    import json
    from lightning.fabric.plugins.environments import LightningEnvironment
    envs = [LightningEnvironment() for _ in range(2)]
    print(json.dumps(sorted(e.main_port for e in envs)))
    """
)


@linux_only
@pytest.mark.skipif(not (shutil.which("unshare") and shutil.which("ip")), reason="needs unshare and ip")
def test_reserved_ports_and_a_narrow_range_are_respected():
    """In a private network namespace whose ephemeral range is 10 ports, 8 of them reserved: only 2 are used."""
    setup = (
        "ip link set lo up && echo '40000 40009' > /proc/sys/net/ipv4/ip_local_port_range &&"
        ' echo \'40000-40007\' > /proc/sys/net/ipv4/ip_local_reserved_ports && exec "$0" -c "$1"'
    )
    result = subprocess.run(
        ["unshare", "-rn", "sh", "-c", setup, sys.executable, _IN_NAMESPACE], capture_output=True, text=True
    )
    if result.returncode and "unshare" in result.stderr + result.stdout:
        pytest.skip(f"no private network namespace here: {result.stderr.strip()}")
    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout.splitlines()[-1]) == [40008, 40009]


@linux_only
def test_copies_in_other_processes_hold_nothing(env):
    port = env.main_port
    copy = pickle.loads(pickle.dumps(env))
    assert copy.main_port == port
    assert not copy._port_reservation.held
    copy.teardown()
    assert held_here(port)  # the original still holds it


def test_falls_back_to_the_old_behaviour_with_one_warning(monkeypatch, env):
    """If the kernel does not let the store bind next to the held socket, the socket is closed: one warning."""

    def refuse(port):
        raise PermissionError(1, "Operation not permitted")

    monkeypatch.setattr(port_manager, "_bind_like_tcp_store", refuse)
    monkeypatch.setattr(sys, "platform", "linux")
    port_manager._warning_cache.clear()
    with pytest.warns(UserWarning, match="could not keep the port it picked reserved") as record:
        ports = [PortReservation().port for _ in range(3)]
    assert len(record) == 1
    assert all(plain_bind_succeeds(port) for port in ports)


@linux_only
def test_hosts_without_ipv6_still_hold_the_port(monkeypatch, env):
    monkeypatch.setattr(socket, "has_dualstack_ipv6", lambda: False)  # the store binds IPv4 there
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        port = env.main_port
    assert held_here(port)


def test_other_platforms_pick_as_before(monkeypatch):
    monkeypatch.setattr(sys, "platform", "darwin")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        reservation = PortReservation()
    assert not reservation.held
    assert plain_bind_succeeds(reservation.port)


def _mpi_environment(rank, monkeypatch):
    import lightning.fabric.plugins.environments.mpi as mpi

    monkeypatch.setattr(mpi, "_MPI4PY_AVAILABLE", True)
    with mock.patch.dict("sys.modules", {"mpi4py": mock.MagicMock()}):
        env = MPIEnvironment()
    env._comm_world.Get_rank.return_value = rank
    env._comm_world.bcast.side_effect = lambda value, root: value if rank == 0 else 12345
    return env


@linux_only
def test_mpi_rank_zero_holds_the_port_until_teardown(monkeypatch):
    monkeypatch.delenv("STANDALONE_PORT", raising=False)
    env = _mpi_environment(0, monkeypatch)
    port = env.main_port
    env._comm_world.bcast.assert_called_once()
    assert held_here(port)
    _stores_bind(port)
    env.teardown()
    assert not held_here(port)
    other = _mpi_environment(1, monkeypatch)
    assert other.main_port == 12345
    assert other._comm_world.bcast.call_args.args[0] is None  # only rank 0 picks


def test_mpi_rank_zero_uses_standalone_port_as_given(monkeypatch):
    monkeypatch.setenv("STANDALONE_PORT", "12321")
    env = _mpi_environment(0, monkeypatch)
    assert env.main_port == 12321
    assert env._port_reservation is None


@linux_only
def test_the_docs_say_how_to_see_a_held_port(env):
    """It is bound, not listening: the usual tools do not list it. What the docs offer instead must work."""
    port = env.main_port
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):  # what lsof -iTCP and netstat read
        with open(table) as f:
            assert f":{port:04X} " not in f.read()
    if shutil.which("ss"):
        assert f":{port} " not in subprocess.run(["ss", "-tan"], capture_output=True, text=True).stdout
    assert not plain_bind_succeeds(port)
    docs = _DOCS.read_text()
    assert "``ss -tanpB`` (``--bound-inactive``)" in docs
    assert "a plain bind of the port fails with ``EADDRINUSE`` while it is held" in docs
    with socket.socket() as bound_only:  # does this kernel report bound-only sockets to `ss --bound-inactive`?
        bound_only.bind(("127.0.0.1", 0))
        if bound_only.getsockname()[1] not in bound_only_ports():
            pytest.skip("this kernel does not report bound-only sockets")
    assert port in bound_only_ports()


def test_find_free_network_port_holds_nothing_and_the_docs_say_who_is_exposed():
    """Holding it would make callers that bind the number without ``SO_REUSEADDR`` fail: it stays as it was."""
    assert plain_bind_succeeds(find_free_network_port())
    docs = " ".join(_DOCS.read_text().split())
    assert "such as Lightning's own ``single_process_pg`` test fixture" in docs
    assert "a held socket makes every later bind of that port without ``SO_REUSEADDR`` fail" in docs
