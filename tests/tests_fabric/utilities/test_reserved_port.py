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
the launchers are in ``test_reserved_port_runs.py``.

"""

import json
import os
import pickle
import socket
import subprocess
import sys
import warnings
from datetime import timedelta

import pytest
import torch.distributed
from packaging.version import Version
from torch.distributed import TCPStore

from lightning.fabric.plugins.environments import LightningEnvironment
from lightning.fabric.plugins.environments.lightning import find_free_network_port
from lightning.fabric.strategies.launchers.multiprocessing import _launching_on_port
from lightning.fabric.utilities import reserved_port
from lightning.fabric.utilities.distributed import _init_dist_connection
from lightning.fabric.utilities.reserved_port import _ReservedPort
from tests_fabric.helpers.ports import held_here, plain_bind_succeeds
from tests_fabric.helpers.runif import RunIf

_TORCH_GREATER_EQUAL_2_4 = Version(torch.__version__).release >= (2, 4)


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


@RunIf(linux_only=True)
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


@RunIf(linux_only=True)
def test_the_process_group_releases_the_port_once_its_store_is_up(env):
    """``_init_dist_connection`` releases the hold after the store binds: Fabric never calls ``teardown``."""
    other = LightningEnvironment()
    other_port = other.main_port  # another environment's port: released by its owner only
    port = env.main_port
    _init_dist_connection(env, "gloo", global_rank=0, world_size=1)
    try:
        assert not held_here(port)
        assert env.main_port == port  # the process group lives on it: later reads give the same port
        assert held_here(other_port)
    finally:
        torch.distributed.destroy_process_group()
        other.teardown()
    assert plain_bind_succeeds(port)


@RunIf(linux_only=True)
def test_a_process_group_that_fails_to_start_releases_the_port(env):
    """A user who catches the error and goes on does not keep the port held while the environment lives."""
    port = env.main_port
    with pytest.raises(Exception, match=r"(?i)not-a-backend"):  # torch 2.1 names it in upper case
        _init_dist_connection(env, "not-a-backend", global_rank=0, world_size=1)
    assert not held_here(port)
    assert plain_bind_succeeds(port)


@RunIf(linux_only=True)
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
        assert env._reserved_port is None
        monkeypatch.delenv("MASTER_PORT")
        monkeypatch.setenv("STANDALONE_PORT", str(busy))
        assert LightningEnvironment().main_port == busy
        assert find_free_network_port() == busy


@RunIf(linux_only=True)
def test_copies_in_other_processes_hold_nothing(env):
    port = env.main_port
    copy = pickle.loads(pickle.dumps(env))
    assert copy.main_port == port
    assert not copy._reserved_port.held
    copy.teardown()
    assert held_here(port)  # the original still holds it


def test_falls_back_to_the_old_behaviour_with_one_warning(monkeypatch, env):
    """If the kernel does not let the store bind next to the held socket, the socket is closed: one warning."""

    def refuse(port):
        raise PermissionError(1, "Operation not permitted")

    monkeypatch.setattr(reserved_port, "_bind_like_tcp_store", refuse)
    monkeypatch.setattr(sys, "platform", "linux")
    reserved_port.warning_cache.clear()
    with pytest.warns(UserWarning, match="could not keep the port it picked reserved") as record:
        ports = [_ReservedPort().port for _ in range(3)]
    assert len(record) == 1
    assert all(plain_bind_succeeds(port) for port in ports)


@RunIf(linux_only=True)
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
        reservation = _ReservedPort()
    assert not reservation.held
    assert plain_bind_succeeds(reservation.port)


def test_find_free_network_port_holds_nothing():
    """Holding it would make callers that bind the number without ``SO_REUSEADDR`` fail: it stays as it was."""
    assert plain_bind_succeeds(find_free_network_port())


@RunIf(linux_only=True)
def test_the_spawn_launchers_context_releases_its_environments_port_and_puts_master_port_back(env, monkeypatch):
    port = env.main_port  # picked and held: no MASTER_PORT was set
    monkeypatch.setenv("MASTER_PORT", "1234")  # set afterwards, as by an earlier launch
    with _launching_on_port(env):
        assert os.environ["MASTER_PORT"] == str(port)
        assert held_here(port)
    assert not held_here(port)
    assert os.environ["MASTER_PORT"] == "1234"
    with _launching_on_port(env):  # a second launch on the port, released by now (fit, then test): as before
        assert os.environ["MASTER_PORT"] == str(port)
    assert os.environ["MASTER_PORT"] == "1234"  # put back all the same: the next environment picks its own
    monkeypatch.delenv("MASTER_PORT")
    fresh = LightningEnvironment()
    with pytest.raises(RuntimeError, match="launch failed"), _launching_on_port(fresh):
        raise RuntimeError("launch failed")
    assert not held_here(fresh.main_port)
    assert "MASTER_PORT" not in os.environ


def test_the_spawn_launchers_context_leaves_a_port_it_did_not_hold_as_before(monkeypatch):
    """``STANDALONE_PORT``, a user's port or a platform without the hold: ``MASTER_PORT`` stays set, as before."""
    monkeypatch.delenv("MASTER_PORT", raising=False)
    monkeypatch.setenv("STANDALONE_PORT", "4321")
    env = LightningEnvironment()
    with _launching_on_port(env):
        assert os.environ["MASTER_PORT"] == "4321"
    assert os.environ["MASTER_PORT"] == "4321"
