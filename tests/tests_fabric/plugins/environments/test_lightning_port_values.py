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
"""The values of ``MASTER_PORT`` and ``STANDALONE_PORT`` that ``LightningEnvironment`` accepts, and the error for
the others."""

import socket
import warnings

import pytest

from lightning.fabric.plugins.environments import LightningEnvironment
from lightning.fabric.plugins.environments import lightning as lightning_environment
from lightning.fabric.plugins.environments.lightning import find_free_network_port


@pytest.fixture(autouse=True)
def _no_port_variables(monkeypatch):
    for name in ("MASTER_PORT", "STANDALONE_PORT"):
        monkeypatch.delenv(name, raising=False)
    lightning_environment.warning_cache.clear()


@pytest.mark.parametrize(("value", "expected"), [("+29533", 29533), (" 29533\n", 29533), ("29_533", 29533)])
@pytest.mark.parametrize("name", ["MASTER_PORT", "STANDALONE_PORT"])
def test_port_variables_accept_what_int_accepts(monkeypatch, name, value, expected):
    """As before (``int()``): the launchers write the number back as plain digits."""
    monkeypatch.setenv(name, value)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert LightningEnvironment().main_port == expected


@pytest.mark.parametrize("value", ["abc", "", "29500.0", "65536", "-1", "0x7530"])
@pytest.mark.parametrize("name", ["MASTER_PORT", "STANDALONE_PORT"])
def test_port_variables_that_cannot_work_raise_one_error_naming_the_variable(monkeypatch, name, value):
    monkeypatch.setenv(name, value)
    with pytest.raises(ValueError, match=rf"^{name}={value!r} is not a port number: expected an integer from 0 to"):
        _ = LightningEnvironment().main_port
    if name == "STANDALONE_PORT":
        with pytest.raises(ValueError, match=rf"^{name}={value!r} is not a port number"):
            find_free_network_port()


def test_port_zero_works_for_one_process_and_warns_once(monkeypatch):
    """The store binds a port of its own choosing: right for one process, so it works, with one warning."""
    monkeypatch.setenv("MASTER_PORT", "0")
    with pytest.warns(UserWarning, match="MASTER_PORT=0: .* single process only") as record:
        assert [LightningEnvironment().main_port for _ in range(3)] == [0, 0, 0]
    assert len(record) == 1


def test_a_busy_port_given_by_the_user_is_used_as_given(monkeypatch):
    with socket.socket() as listener:  # a user's port is never replaced or probed, even while it is busy
        listener.bind(("127.0.0.1", 0))
        busy = listener.getsockname()[1]
        monkeypatch.setenv("MASTER_PORT", str(busy))
        assert LightningEnvironment().main_port == busy
