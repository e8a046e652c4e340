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

Every test uses real sockets, real ``TCPStore`` servers and, where processes matter, real processes.

"""

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
from unittest import mock

import pytest
import torch.distributed
from packaging.version import Version
from torch.distributed import TCPStore

from lightning.fabric.plugins.environments import LightningEnvironment, MPIEnvironment
from lightning.fabric.plugins.environments.lightning import find_free_network_port
from lightning.fabric.utilities import port_manager
from lightning.fabric.utilities.port_manager import PortReservation

_TORCH_GREATER_EQUAL_2_4 = Version(torch.__version__).release >= (2, 4)
_LINUX = sys.platform.startswith("linux")
linux_only = pytest.mark.skipif(not _LINUX, reason="ports are kept bound on Linux only")


def _plain_bind_succeeds(port: int) -> bool:
    """Whether a socket without ``SO_REUSEADDR`` can bind ``port``: false while anyone holds it."""
    with socket.socket() as sock:
        try:
            sock.bind(("", port))
        except OSError:
            return False
    return True


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
def test_picked_port_is_held_until_teardown_and_the_store_binds_it(env):
    port = env.main_port
    assert env.main_port == port
    # while held, no other socket is given the port: not bind(0), not a plain bind
    assert not _plain_bind_succeeds(port)
    assert port not in {find_free_network_port() for _ in range(300)}
    _stores_bind(port)
    env.teardown()
    assert _plain_bind_succeeds(port)


@linux_only
def test_held_port_is_not_given_to_other_processes(env):
    script = "from lightning.fabric.plugins.environments.lightning import find_free_network_port as f\n"
    script += "print(sorted({f() for _ in range(500)}))"
    port = env.main_port
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, check=True).stdout
    assert port not in json.loads(out)


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


@pytest.mark.parametrize("value", ["1_000", "\uff12\uff19\uff15\uff10\uff10", "29500.0", "abc", "", "0", "65536", "-1"])
@pytest.mark.parametrize("name", ["MASTER_PORT", "STANDALONE_PORT"])
def test_port_variables_accept_only_ascii_port_numbers(monkeypatch, name, value):
    """``int()`` accepted "1_000" and full-width digits; the error names the variable."""
    monkeypatch.delenv("MASTER_PORT", raising=False)
    monkeypatch.setenv(name, value)
    with pytest.raises(ValueError, match=f"Invalid {name}="):
        _ = LightningEnvironment().main_port


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


_HOLD_AND_REPORT = textwrap.dedent(
    """
    import sys, warnings
    from lightning.fabric.plugins.environments import LightningEnvironment
    warnings.simplefilter("error")
    env = LightningEnvironment()
    print(env.main_port, flush=True)
    sys.stdin.read()  # hold until the test is done
    """
)


@linux_only
def test_processes_with_private_temp_dirs_get_distinct_ports(tmp_path):
    """Coordination does not depend on TMPDIR: the kernel's port table is shared by the network namespace."""
    procs = []
    for i in range(4):
        tmpdir = tmp_path / f"tmp{i}"
        tmpdir.mkdir()
        env = {**os.environ, "TMPDIR": str(tmpdir)}
        env.pop("MASTER_PORT", None)
        procs.append(
            subprocess.Popen(
                [sys.executable, "-c", _HOLD_AND_REPORT], env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE
            )
        )
    try:
        ports = [int(p.stdout.readline()) for p in procs]
    finally:
        for p in procs:
            p.communicate(b"")
    assert all(p.returncode == 0 for p in procs)
    assert len(set(ports)) == 4, ports
    # nothing was written to disk, not even into the temp dirs
    assert not [path for path in tmp_path.rglob("*") if path.is_file()]


_SURVIVES_TMP_CLEANER = textwrap.dedent(
    """
    import os, shutil, tempfile, warnings
    from lightning.fabric.plugins.environments import LightningEnvironment
    warnings.simplefilter("error")
    first = LightningEnvironment()
    first.main_port
    shutil.rmtree(os.environ["TMPDIR"])  # a tmp cleaner, or a per-job TMPDIR that is gone
    second = LightningEnvironment()
    assert second.main_port != first.main_port
    print("ok")
    """
)


def test_picking_a_port_never_depends_on_the_temp_dir(tmp_path):
    """A removed, full or read-only temp dir never costs the run its port, and no warning is given."""
    tmpdir = tmp_path / "tmp"
    tmpdir.mkdir()
    env = {**os.environ, "TMPDIR": str(tmpdir)}
    env.pop("MASTER_PORT", None)
    result = subprocess.run([sys.executable, "-c", _SURVIVES_TMP_CLEANER], env=env, capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "ok"


@linux_only
def test_copies_in_other_processes_hold_nothing(env):
    port = env.main_port
    copy = pickle.loads(pickle.dumps(env))
    assert copy.main_port == port
    assert copy._port_reservation._socket is None
    copy.teardown()
    assert not _plain_bind_succeeds(port)  # the original still holds it


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
    assert all(_plain_bind_succeeds(port) for port in ports)


@linux_only
def test_hosts_without_ipv6_still_hold_the_port(monkeypatch, env):
    monkeypatch.setattr(socket, "has_dualstack_ipv6", lambda: False)  # the store binds IPv4 there
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        port = env.main_port
    assert not _plain_bind_succeeds(port)


def test_other_platforms_pick_as_before(monkeypatch):
    monkeypatch.setattr(sys, "platform", "darwin")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        reservation = PortReservation()
    assert reservation._socket is None
    assert _plain_bind_succeeds(reservation.port)


@linux_only
def test_mpi_rank_zero_holds_the_port(monkeypatch):
    import lightning.fabric.plugins.environments.mpi as mpi

    monkeypatch.setattr(mpi, "_MPI4PY_AVAILABLE", True)
    for rank in (0, 1):
        with mock.patch.dict("sys.modules", {"mpi4py": mock.MagicMock()}):
            env = MPIEnvironment()
        env._comm_world.Get_rank.return_value = rank
        env._comm_world.bcast.side_effect = lambda value, root, rank=rank: value if rank == 0 else 12345
        port = env.main_port
        env._comm_world.bcast.assert_called_once()
        if rank == 0:
            assert env._port_reservation.port == port
            assert not _plain_bind_succeeds(port)
            _stores_bind(port)
        else:
            assert env._comm_world.bcast.call_args.args[0] is None
            assert env._port_reservation is None
            assert port == 12345


def test_mpi_rank_zero_uses_standalone_port_as_given(monkeypatch):
    import lightning.fabric.plugins.environments.mpi as mpi

    monkeypatch.setattr(mpi, "_MPI4PY_AVAILABLE", True)
    monkeypatch.setenv("STANDALONE_PORT", "12321")
    with mock.patch.dict("sys.modules", {"mpi4py": mock.MagicMock()}):
        env = MPIEnvironment()
    env._comm_world.Get_rank.return_value = 0
    env._comm_world.bcast.side_effect = lambda value, root: value
    assert env.main_port == 12321
    assert env._port_reservation is None


_DDP_SCRIPT = textwrap.dedent(
    """
    import json, os, sys
    import torch
    from lightning.fabric import Fabric

    def run(fabric):
        env = fabric.strategy.cluster_environment
        total = fabric.all_reduce(torch.tensor(fabric.global_rank + 1.0), reduce_op="sum")
        result = {"sum": total.item(), "port": env.main_port, "master_port": int(os.environ["MASTER_PORT"])}
        with open(os.path.join(sys.argv[1], f"rank{fabric.global_rank}.json"), "w") as f:
            json.dump(result, f)
        # as torch asks: without it, gloo's threads can abort the exit ("terminate called without an active exception")
        torch.distributed.destroy_process_group()

    if __name__ == "__main__":
        fabric = Fabric(strategy=sys.argv[2], devices=2, accelerator="cpu")
        fabric.launch(run)
        if fabric.global_rank == 0:
            reservation = fabric.strategy.cluster_environment._port_reservation
            print("held", reservation is not None and reservation._socket is not None, flush=True)
    """
)


@linux_only
@pytest.mark.timeout(240)
@pytest.mark.parametrize("strategy", ["ddp", "ddp_spawn"])
def test_ddp_runs_on_the_held_port(tmp_path, strategy):
    """Two CPU processes (gloo): rank 0's store binds the port the launcher holds; spawned copies hold nothing."""
    script = tmp_path / "train.py"
    script.write_text(_DDP_SCRIPT)
    env = {k: v for k, v in os.environ.items() if k not in ("MASTER_PORT", "LOCAL_RANK", "WORLD_SIZE")}
    result = subprocess.run(
        [sys.executable, str(script), str(tmp_path), strategy], env=env, capture_output=True, text=True, timeout=200
    )
    assert result.returncode == 0, result.stderr[-3000:]
    results = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    assert [r["sum"] for r in results] == [3.0, 3.0]
    assert results[0]["port"] == results[0]["master_port"] == results[1]["master_port"]
    if strategy == "ddp":  # the launcher process is rank 0 and holds the port through the run
        assert "held True" in result.stdout
