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
"""The port :class:`~lightning.fabric.plugins.environments.LightningEnvironment` picks, reserved for the store.

Picking a port by binding port 0 and closing the socket leaves a gap, often seconds long while the launcher starts the
other ranks, until rank 0's ``TCPStore`` binds it. Any process of the machine can be given the port in that gap.

On Linux a :class:`_ReservedPort` keeps its socket bound, without listening, through that gap. The kernel then gives
the port to no other socket of the network namespace, in any process: ``bind(0)`` skips it, and so do outgoing
connections. The socket has ``SO_REUSEADDR`` set, like both ``TCPStore`` backends, and Linux lets a socket with it
bind and listen on a port that non-listening sockets with it hold. Elsewhere (macOS and Windows need other socket
options for that, and they would let other programs share the port too) the socket is closed at once: the port is
picked exactly as before.

The environment that picked the port owns the reservation. It ends when the process group has been initialized, when
the processes a spawn launcher started for the port have exited, at the environment's ``teardown()``, or when the
reservation is garbage collected.

"""

import socket
import sys
from typing import Any, Optional

from lightning.fabric.utilities.rank_zero import WarningCache

warning_cache = WarningCache()


class _ReservedPort:
    """A free TCP port, chosen by the operating system and kept bound by this process until :meth:`release`.

    Copies in other processes (pickled to spawned processes) hold nothing.

    """

    def __init__(self) -> None:
        self._socket: Optional[socket.socket] = None
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        try:
            # bound without SO_REUSEADDR: the kernel picks a port with no socket on it at all, as before
            sock.bind(("", 0))
            self.port: int = sock.getsockname()[1]
            if sys.platform.startswith("linux") and _store_can_bind_next_to(sock, self.port):
                self._socket = sock
        finally:
            if self._socket is None:
                sock.close()

    @property
    def held(self) -> bool:
        """Whether this process still keeps the port bound."""
        return self._socket is not None

    def release(self) -> None:
        """Close the socket; the port can be given to others again."""
        sock, self._socket = self._socket, None
        if sock is not None:
            sock.close()

    def __del__(self) -> None:
        self.release()

    def __getstate__(self) -> dict[str, Any]:
        return {"port": self.port, "_socket": None}


def _store_can_bind_next_to(sock: socket.socket, port: int) -> bool:
    """Set ``SO_REUSEADDR`` on ``sock`` and check that a store can bind and listen on ``port`` next to it."""
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        _bind_like_tcp_store(port)
    except OSError as ex:
        warning_cache.warn(
            f"Lightning could not keep the port it picked reserved until the rendezvous store binds it ({ex})."
            " Another process may take the port meanwhile, as it could before Lightning reserved ports."
        )
        return False
    return True


def _bind_like_tcp_store(port: int) -> None:
    """Bind and listen on ``port`` as ``TCPStore`` does (``SO_REUSEADDR``, dual-stack or else IPv4), then close."""
    try:
        socket.create_server(("", port), family=socket.AF_INET6, dualstack_ipv6=True).close()
    except (OSError, ValueError):  # no IPv6 here (ValueError: no dual-stack sockets)
        socket.create_server(("", port)).close()
