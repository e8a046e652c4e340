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
import socket

import pytest

from lightning.fabric.plugins.environments import LightningEnvironment
from lightning.fabric.utilities import port_manager as pm
from lightning.fabric.utilities.port_manager import PortManager, get_port_manager


@pytest.fixture(autouse=True)
def private_manager(tmp_path, monkeypatch):
    """A process-wide manager with its own registry, and a clean distributed environment."""
    for name in ("MASTER_PORT", "MASTER_ADDR", "WORLD_SIZE", "LOCAL_RANK", "STANDALONE_PORT"):
        monkeypatch.delenv(name, raising=False)
    manager = PortManager(registry_dir=str(tmp_path / "registry"))
    monkeypatch.setattr(pm, "_manager", manager)
    yield manager
    manager.release_all()


@pytest.mark.parametrize("value", ["abc", "0", "-1", "70000", ""])
def test_bad_master_port_raises(monkeypatch, value):
    monkeypatch.setenv("MASTER_PORT", value)
    env = LightningEnvironment()
    with pytest.raises(ValueError, match=rf"MASTER_PORT={value!r}"):
        _ = env.main_port
    assert os.environ["MASTER_PORT"] == value


def test_external_master_port_used_as_given_and_kept(monkeypatch, private_manager):
    with socket.socket() as agent:  # e.g. torchrun's agent already listens on it: no probe, no new port
        agent.bind(("127.0.0.1", 0))
        agent.listen(1)
        port = agent.getsockname()[1]
        monkeypatch.setenv("MASTER_PORT", str(port))
        monkeypatch.setenv("MASTER_ADDR", "10.1.2.3")
        monkeypatch.setenv("WORLD_SIZE", "2")
        env = LightningEnvironment()
        assert env.main_port == port
        assert env.main_address == "10.1.2.3"
        assert private_manager.reserved_ports == {port}
        assert private_manager.allocated_ports == frozenset()
        assert private_manager.allocate_port(preferred_port=port) != port
        env.teardown()
        env.teardown()
    assert os.environ["MASTER_PORT"] == str(port)
    assert os.environ["MASTER_ADDR"] == "10.1.2.3"
    assert "WORLD_SIZE" not in os.environ
    assert env.main_port == port


def test_chosen_port_is_leased_and_torn_down(monkeypatch, private_manager):
    monkeypatch.setenv("WORLD_SIZE", "2")
    env = LightningEnvironment()
    port = env.main_port
    assert env.main_port == port
    assert private_manager.allocated_ports == {port}
    assert os.path.exists(os.path.join(private_manager.registry_dir, f"{port}.lock"))
    os.environ["MASTER_PORT"] = str(port)  # as Lightning's launcher does
    env.teardown()
    assert "MASTER_PORT" not in os.environ
    assert "WORLD_SIZE" not in os.environ
    assert private_manager.allocated_ports == frozenset()
    assert not os.path.exists(os.path.join(private_manager.registry_dir, f"{port}.lock"))
    assert private_manager.recently_released[-1] == port
    # idempotent, and does not touch a MASTER_PORT set since
    monkeypatch.setenv("MASTER_PORT", "29500")
    env.teardown()
    assert os.environ["MASTER_PORT"] == "29500"


def test_teardown_keeps_master_port_changed_by_someone_else(monkeypatch, private_manager):
    env = LightningEnvironment()
    port = env.main_port
    monkeypatch.setenv("MASTER_PORT", str(port + 1 if port < 65535 else port - 1))
    env.teardown()
    assert os.environ["MASTER_PORT"] != str(port)
    assert private_manager.allocated_ports == frozenset()


def test_teardown_releases_only_its_own_lease(private_manager):
    other = private_manager.allocate_port()
    env = LightningEnvironment()
    port = env.main_port
    assert private_manager.allocated_ports == {port, other}
    env.teardown()
    assert private_manager.allocated_ports == {other}


def test_child_with_inherited_master_port_does_nothing(monkeypatch, private_manager):
    monkeypatch.setenv("MASTER_PORT", "23456")
    monkeypatch.setenv("LOCAL_RANK", "1")
    env = LightningEnvironment()
    assert env.creates_processes_externally
    assert env.main_port == 23456
    env.teardown()
    assert os.environ["MASTER_PORT"] == "23456"
    assert private_manager.allocated_ports == frozenset()
    assert private_manager.reserved_ports == {23456}


def test_standalone_port(monkeypatch, private_manager):
    monkeypatch.setenv("STANDALONE_PORT", "23457")
    env = LightningEnvironment()
    assert env.main_port == 23457
    os.environ["MASTER_PORT"] = "23457"
    env.teardown()
    # the port is fixed by CI, not leased by the environment: leave it alone
    assert os.environ["MASTER_PORT"] == "23457"
    assert get_port_manager().allocated_ports == frozenset()


def test_new_port_after_teardown(private_manager):
    env = LightningEnvironment()
    first = env.main_port
    env.teardown()
    second = env.main_port
    assert second != first
    assert private_manager.allocated_ports == {second}
    env.teardown()
