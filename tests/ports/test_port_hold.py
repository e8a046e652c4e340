"""The fork's own checks of the port hold (0002) at the level a user meets it: the environment, the process group,
forked processes, other processes of the machine.

The pull request's tests are the ones it adds to upstream's own test files, which the release's sdist does not ship
(``nox -s upstream -- 0002`` runs them). Fabric runs and a Trainer sweep, in subprocesses, are in
``test_port_hold_runs.py``.

"""

import gc
import json
import os
import socket
import subprocess
import sys
import warnings

import pytest
import torch.distributed
from port_checks import can_bind, free_port, held_here
from torch.utils.data import DataLoader

from lightning.fabric.plugins.environments import LightningEnvironment
from lightning.fabric.plugins.environments.lightning import find_free_network_port
from lightning.fabric.utilities.distributed import _init_dist_connection
from tests_fabric.helpers.runif import RunIf


@pytest.fixture
def env(monkeypatch):
    for name in ("MASTER_PORT", "STANDALONE_PORT"):
        monkeypatch.delenv(name, raising=False)
    env = LightningEnvironment()
    yield env
    env.teardown()


@RunIf(linux_only=True)
def test_picked_port_is_held_until_teardown(env):
    port = env.main_port
    assert env.main_port == port
    assert held_here(port)
    assert not can_bind(port)
    env.teardown()
    assert not held_here(port)
    assert can_bind(port)
    assert env.main_port == port


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
    assert can_bind(port)


@RunIf(linux_only=True)
def test_a_process_group_that_fails_to_start_releases_the_port(env):
    """A user who catches the error and goes on does not keep the port held while the environment lives."""
    port = env.main_port
    with pytest.raises(Exception, match=r"(?i)not-a-backend"):  # torch 2.1 names it in upper case
        _init_dist_connection(env, "not-a-backend", global_rank=0, world_size=1)
    assert not held_here(port)
    assert can_bind(port)


@pytest.mark.slow  # a second interpreter picks 500 ports
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
        assert env._held_socket is None
        monkeypatch.delenv("MASTER_PORT")
        monkeypatch.setenv("STANDALONE_PORT", str(busy))
        assert LightningEnvironment().main_port == busy
        assert find_free_network_port() == busy


@RunIf(linux_only=True)
def test_hosts_without_ipv6_still_hold_the_port(monkeypatch, env):
    monkeypatch.setattr(socket, "has_dualstack_ipv6", lambda: False)  # the store binds IPv4 there
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        port = env.main_port
    assert held_here(port)


def test_find_free_network_port_holds_nothing():
    """Holding it would make callers that bind the number without ``SO_REUSEADDR`` fail: it stays as it was."""
    assert can_bind(find_free_network_port())


@RunIf(linux_only=True)
def test_a_process_group_that_exists_already_releases_the_port(env):
    """A user's ``init_process_group(init_method="tcp://...")`` first: the port a launcher picked is not used."""
    torch.distributed.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
    try:
        port = env.main_port  # read by a launcher before the strategy reaches the process group
        assert held_here(port)
        _init_dist_connection(env, "gloo", global_rank=0, world_size=1)
        assert not held_here(port)
        assert can_bind(port)
    finally:
        torch.distributed.destroy_process_group()


@RunIf(linux_only=True)
def test_a_process_forked_while_the_port_is_held_does_not_keep_it(env):
    """``os.fork`` and a persistent fork-context DataLoader worker: neither keeps the port the environment let go."""
    port = env.main_port
    started, done = os.pipe(), os.pipe()
    pid = os.fork()
    if pid == 0:
        os.write(started[1], b"1")
        os.read(done[0], 1)  # alive until the parent has checked
        os._exit(0)
    os.read(started[0], 1)
    loader = DataLoader(range(4), num_workers=1, persistent_workers=True, multiprocessing_context="fork")
    try:
        assert next(iter(loader)).tolist() == [0]  # the worker has started, and is kept
        env.teardown()
        assert can_bind(port)
    finally:
        os.write(done[1], b"1")
        os.waitpid(pid, 0)
        for fd in (*started, *done):
            os.close(fd)
        del loader


@RunIf(linux_only=True)
def test_an_environment_nothing_released_frees_the_port_when_collected(monkeypatch):
    """DeepSpeed starts its process group itself: the port is closed with the environment, without a ResourceWarning."""
    for name in ("MASTER_PORT", "STANDALONE_PORT"):
        monkeypatch.delenv(name, raising=False)
    env = LightningEnvironment()
    port = env.main_port
    assert not can_bind(port)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        del env
        gc.collect()
    assert can_bind(port)
    assert not [w for w in caught if issubclass(w.category, ResourceWarning)]
