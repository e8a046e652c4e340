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
import gc
import pickle
import socket
import sys
import warnings
from datetime import timedelta
from unittest import mock

import pytest
from torch.distributed import TCPStore

from lightning.fabric.utilities import reserved_port
from lightning.fabric.utilities.imports import _TORCH_GREATER_EQUAL_2_4
from lightning.fabric.utilities.reserved_port import _ReservedPort
from tests_fabric.helpers.runif import RunIf


def _can_bind(port):
    """Whether a socket without ``SO_REUSEADDR`` can bind the port, which fails while any socket holds it."""
    with socket.socket() as sock:
        try:
            sock.bind(("", port))
        except OSError:
            return False
    return True


@RunIf(linux_only=True)
@pytest.mark.parametrize("use_libuv", [True, False] if _TORCH_GREATER_EQUAL_2_4 else [None])
def test_reserved_port_is_held_until_released_and_the_store_binds_it(use_libuv):
    """Test that no other socket can bind the reserved port, while a store still can."""
    reservation = _ReservedPort()
    assert reservation.held
    assert not _can_bind(reservation.port)

    kwargs = {} if use_libuv is None else {"use_libuv": use_libuv}
    timeout = timedelta(seconds=10)
    server = TCPStore("127.0.0.1", reservation.port, 2, True, timeout=timeout, wait_for_workers=False, **kwargs)
    client = TCPStore("127.0.0.1", reservation.port, 2, False, timeout=timeout, **kwargs)
    server.set("key", "value")
    assert client.get("key") == b"value"
    del client, server

    reservation.release()
    assert not reservation.held
    assert _can_bind(reservation.port)


@RunIf(linux_only=True)
def test_reserved_port_copies_hold_nothing():
    """Test that a copy sent to another process (pickled) does not hold or release the port."""
    reservation = _ReservedPort()
    copy = pickle.loads(pickle.dumps(reservation))
    assert copy.port == reservation.port
    assert not copy.held
    assert reservation.held
    reservation.release()


@RunIf(linux_only=True)
def test_reserved_port_is_released_when_garbage_collected():
    """Test that a reservation dropped without a release closes its socket, without an unclosed-socket warning."""
    reservation = _ReservedPort()
    port = reservation.port
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        del reservation
        gc.collect()
    assert not [w for w in record if issubclass(w.category, ResourceWarning)]
    assert _can_bind(port)


@mock.patch.object(sys, "platform", "linux")
def test_reserved_port_falls_back_to_a_closed_socket_with_one_warning():
    """Test that where the store could not bind next to the held socket, the port is picked as before."""
    reserved_port.warning_cache.clear()
    with (
        mock.patch.object(reserved_port, "_bind_like_tcp_store", side_effect=PermissionError("not permitted")),
        pytest.warns(UserWarning, match="could not keep the port it picked reserved") as record,
    ):
        reservations = [_ReservedPort() for _ in range(3)]
    assert len(record) == 1
    assert not any(reservation.held for reservation in reservations)
    assert all(_can_bind(reservation.port) for reservation in reservations)


@mock.patch.object(sys, "platform", "darwin")
def test_reserved_port_is_not_held_on_other_platforms():
    """Test that on macOS and Windows the port is picked as before."""
    reservation = _ReservedPort()
    assert not reservation.held
    assert _can_bind(reservation.port)
