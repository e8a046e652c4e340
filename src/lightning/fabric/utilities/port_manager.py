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
"""Hand out TCP ports for the rendezvous store without two processes of the machine getting the same one.

Picking a port by binding port 0 and closing the socket leaves a gap until rank 0's ``TCPStore`` binds it. Anything
on the machine can take the port in that gap (another pytest worker, the children of another run, any program making
an outgoing connection), and the run fails with ``EADDRINUSE``. The :class:`PortManager` closes that gap for
cooperating processes and narrows it for everything else:

* Every port it hands out is *leased* in a registry shared by all processes of the same user on the machine: one lock
  file per port, held with ``flock`` for as long as the lease lives. The kernel drops the lock when the holder exits,
  even on ``SIGKILL``, so a crashed process never keeps ports. No two live leases on one port can exist.
* Ports come from a pool *below* the operating system's ephemeral range, so outgoing connections and ``bind(0)`` of
  unrelated programs do not compete for them. When the pool is exhausted or unavailable, it falls back to asking the
  OS for an ephemeral port, leased the same way.
* A candidate is probed the way ``TCPStore`` binds: dual-stack where available, with ``SO_REUSEADDR``, bind and
  listen. A port in ``TIME_WAIT`` passes (``TCPStore`` can bind it), a port with a live socket does not.

Configuration (environment variables):

* ``LIGHTNING_PORT_REGISTRY_DIR``: where the lock files live. Defaults to ``<tmp>/lightning-ports-<uid>``. The
  directory is created with mode ``0700``; a directory owned by another user is never used.
* ``LIGHTNING_PORT_POOL``: ``"LOW-HIGH"`` to set the pool, or ``"off"`` to always ask the OS (``bind(0)``).
  Defaults to the 8192 ports just below the ephemeral range (read from ``/proc/sys/net/ipv4/ip_local_port_range`` on
  Linux; the IANA range 49152-65535 is assumed elsewhere).

Platforms: on Linux and macOS the leases use ``fcntl.flock``. On Windows they use ``msvcrt.locking``, which Windows also
drops when the process ends, but lock files are not removed while in use. Where neither works (or the registry
directory cannot be used) the manager warns once and only coordinates the threads of its own process.

"""

import atexit
import contextlib
import errno
import os
import random
import socket
import stat
import sys
import tempfile
import threading
from collections import deque
from collections.abc import Iterator
from typing import Optional

from lightning.fabric.utilities.rank_zero import rank_zero_warn

_REGISTRY_DIR_ENV = "LIGHTNING_PORT_REGISTRY_DIR"
_POOL_ENV = "LIGHTNING_PORT_POOL"
_DEFAULT_POOL_SIZE = 8192
_RECENTLY_RELEASED_SIZE = 1024
# A lease guards the gap between picking a port and binding it. Callers of `find_free_network_port` never release,
# so a process keeps at most this many leases (one open file each); taking another releases the oldest.
_MAX_LEASES = 64
_LOWEST_POOL_PORT = 1024
_IANA_EPHEMERAL_RANGE = (49152, 65535)

try:
    import fcntl
except ImportError:  # Windows
    fcntl = None  # type: ignore[assignment]

try:
    import msvcrt
except ImportError:  # POSIX
    msvcrt = None  # type: ignore[assignment]


def parse_port(value: str, name: str) -> int:
    """Parse a TCP port number given through an environment variable.

    Args:
        value: The raw value of the variable.
        name: The name of the variable, used in the error message.

    Raises:
        ValueError: If the value is not an integer between 1 and 65535.

    """
    try:
        port = int(value.strip())
    except (ValueError, AttributeError):
        port = -1
    if not 1 <= port <= 65535:
        raise ValueError(f"Invalid {name}={value!r}: expected an integer port number between 1 and 65535.")
    return port


def ephemeral_port_range() -> tuple[int, int]:
    """Return the range the operating system picks ephemeral (``bind(0)`` and outgoing) ports from.

    Read from ``/proc/sys/net/ipv4/ip_local_port_range`` on Linux, the IANA range 49152-65535 elsewhere.

    """
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            low, high = (int(part) for part in f.read().split())
        return low, high
    except (OSError, ValueError):
        return _IANA_EPHEMERAL_RANGE


def _default_pool() -> Optional[range]:
    value = os.environ.get(_POOL_ENV, "").strip().lower()
    if value in ("off", "none", "0"):
        return None
    if value:
        low_str, sep, high_str = value.partition("-")
        low = parse_port(low_str, _POOL_ENV)
        high = parse_port(high_str, _POOL_ENV) if sep else -1
        if high < low:
            raise ValueError(f"Invalid {_POOL_ENV}={value!r}: expected 'LOW-HIGH' with LOW <= HIGH, or 'off'.")
        return range(low, high + 1)
    ephemeral_low, _ = ephemeral_port_range()
    high = ephemeral_low - 1
    low = max(_LOWEST_POOL_PORT, high - _DEFAULT_POOL_SIZE + 1)
    return range(low, high + 1) if high >= low else None


def _default_registry_dir() -> str:
    if os.environ.get(_REGISTRY_DIR_ENV):
        return os.environ[_REGISTRY_DIR_ENV]
    user = str(os.getuid()) if hasattr(os, "getuid") else os.environ.get("USERNAME", "user")
    return os.path.join(tempfile.gettempdir(), f"lightning-ports-{user}")


def _prepare_registry_dir(path: str) -> None:
    """Create the registry directory private to the user, and refuse one that another user could tamper with."""
    os.makedirs(path, mode=0o700, exist_ok=True)
    if not hasattr(os, "getuid"):
        return
    st = os.lstat(path)
    if not stat.S_ISDIR(st.st_mode):
        raise NotADirectoryError(f"the port registry {path!r} is not a directory")
    if st.st_uid != os.getuid():
        raise PermissionError(f"the port registry {path!r} is owned by another user")
    if st.st_mode & 0o077:
        os.chmod(path, 0o700)


def probe_port(port: int) -> bool:
    """Return whether a ``TCPStore`` server could bind ``port`` right now.

    Binds the wildcard address (dual-stack where available) with ``SO_REUSEADDR`` and listens, as both ``TCPStore``
    backends do, then closes the socket. A port in ``TIME_WAIT`` passes, a port with a live socket does not.

    """
    if socket.has_dualstack_ipv6():
        family, address = socket.AF_INET6, ("::", port)
    else:
        family, address = socket.AF_INET, ("", port)
    try:
        with socket.socket(family, socket.SOCK_STREAM) as sock:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            if family == socket.AF_INET6:
                sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 0)
            sock.bind(address)
            sock.listen(1)
    except OSError as ex:
        if ex.errno in (errno.EMFILE, errno.ENFILE):
            raise  # out of file descriptors, not a busy port
        return False
    return True


def _ask_os_for_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("", 0))
        return sock.getsockname()[1]


class _Lease:
    """An exclusive, cross-process lease on one port: an open lock file the process holds a lock on."""

    def __init__(self, port: int, fd: int, path: str) -> None:
        self.port = port
        self._fd: Optional[int] = fd
        self._path = path

    @classmethod
    def try_acquire(cls, registry_dir: str, port: int) -> Optional["_Lease"]:
        """Lock the port's file without blocking; ``None`` if another live lease holds it."""
        path = os.path.join(registry_dir, f"{port}.lock")
        flags = os.O_RDWR | os.O_CREAT | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_BINARY", 0)
        fd = os.open(path, flags, 0o600)
        try:
            if fcntl is not None:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                # The previous holder unlinks the file on release. If we locked a file that is no longer at `path`,
                # someone else may lock the new one: treat the port as taken.
                if os.fstat(fd).st_ino != os.stat(path).st_ino:
                    raise BlockingIOError(errno.EWOULDBLOCK, "stale lock file")
                os.ftruncate(fd, 0)
                os.write(fd, f"{os.getpid()}\n".encode())
            else:
                msvcrt.locking(fd, msvcrt.LK_NBLCK, 1)
        except OSError:  # held by someone else (BlockingIOError/PermissionError) or the file vanished
            os.close(fd)
            return None
        return cls(port, fd, path)

    def release(self) -> None:
        """Unlock and close; the lock file is removed so the registry does not grow."""
        fd, self._fd = self._fd, None
        if fd is None:
            return
        if fcntl is not None:
            # unlink while still holding the lock; a process that opened the old file notices via the inode check
            with contextlib.suppress(OSError):
                os.unlink(self._path)
            fcntl.flock(fd, fcntl.LOCK_UN)
            os.close(fd)
        else:
            with contextlib.suppress(OSError):
                msvcrt.locking(fd, msvcrt.LK_UNLCK, 1)
            os.close(fd)
            with contextlib.suppress(OSError):
                os.unlink(self._path)

    def forget(self) -> None:
        """Close the descriptor without unlocking: used in a forked child, where the parent still owns the lock."""
        fd, self._fd = self._fd, None
        if fd is not None:
            os.close(fd)


class PortManager:
    """Allocates TCP ports with a lease that other processes of the same user on the machine respect.

    Use :func:`get_port_manager` for the process-wide instance; separate instances (for example with another
    ``registry_dir`` in tests) coordinate only with managers using the same registry.

    Args:
        registry_dir: Directory holding one lock file per leased port. Defaults to ``LIGHTNING_PORT_REGISTRY_DIR`` or
            ``<tmp>/lightning-ports-<uid>``. ``None`` after a failure to set it up means process-local leases only.
        pool: Ports to hand out first. Defaults to ``LIGHTNING_PORT_POOL`` or the ports just below the ephemeral
            range. Pass an empty range to always ask the OS.
        recently_released_size: How many released ports to keep from being handed out again by this manager.

    """

    def __init__(
        self,
        registry_dir: Optional[str] = None,
        pool: Optional[range] = None,
        recently_released_size: int = _RECENTLY_RELEASED_SIZE,
    ) -> None:
        self._lock = threading.RLock()
        self._leases: dict[int, Optional[_Lease]] = {}
        self._reserved: set[int] = set()
        self._recently_released: deque[int] = deque(maxlen=recently_released_size)
        self._pool = pool if pool is not None else _default_pool()
        registry_dir = registry_dir if registry_dir is not None else _default_registry_dir()
        self._registry_dir: Optional[str] = registry_dir
        if fcntl is None and msvcrt is None:
            self._disable_registry("no file locking available on this platform")
        else:
            try:
                _prepare_registry_dir(registry_dir)
            except OSError as ex:
                self._disable_registry(str(ex))

    def _disable_registry(self, reason: str) -> None:
        rank_zero_warn(
            f"Lightning's port registry is unavailable ({reason}). Ports are only coordinated within this process;"
            f" set {_REGISTRY_DIR_ENV} to a private, writable directory to coordinate across processes."
        )
        self._registry_dir = None

    @property
    def registry_dir(self) -> Optional[str]:
        """The directory of cross-process leases, or ``None`` if leases are process-local."""
        return self._registry_dir

    @property
    def pool(self) -> Optional[range]:
        """The ports handed out before falling back to the OS's ephemeral ports."""
        return self._pool

    @property
    def allocated_ports(self) -> frozenset[int]:
        """The ports this manager currently leases."""
        with self._lock:
            return frozenset(self._leases)

    @property
    def reserved_ports(self) -> frozenset[int]:
        """The ports recorded with :meth:`reserve_existing_port`."""
        with self._lock:
            return frozenset(self._reserved)

    @property
    def recently_released(self) -> tuple[int, ...]:
        """The ports released most recently, oldest first. They are not handed out until they drop off the queue."""
        with self._lock:
            return tuple(self._recently_released)

    def allocate_port(self, preferred_port: Optional[int] = None, max_attempts: int = 1000) -> int:
        """Lease a free port and return it.

        The port stays leased, and no cooperating process is given it, until :meth:`release_port` (or
        :meth:`release_all`) or the end of this process. A process holds at most 64 leases: taking another releases
        the oldest, whose port has long been bound (or abandoned) by then.

        Args:
            preferred_port: Try this port first; used if it is free and not already leased by anyone, even if recently
                released. Otherwise a port is allocated as usual.
            max_attempts: How many candidates to try from the pool, and then how many from the OS. When all that is
                free was released recently, the port released longest ago is reused rather than failing.

        Raises:
            RuntimeError: If no port could be leased.

        """
        if max_attempts < 1:
            raise ValueError(f"`max_attempts` must be positive, got {max_attempts}")
        with self._lock:
            if preferred_port is not None:
                if not 1 <= preferred_port <= 65535:
                    raise ValueError(f"`preferred_port` must be between 1 and 65535, got {preferred_port}")
                if self._try_take(preferred_port, skip_recent=False):
                    return preferred_port
            if self._pool:
                start = random.randrange(len(self._pool))  # noqa: S311 - spreads processes over the pool, not security
                for i in range(min(max_attempts, len(self._pool))):
                    port = self._pool[(start + i) % len(self._pool)]
                    if self._try_take(port):
                        return port
            recent_hits = 0
            for _ in range(max_attempts):
                port = _ask_os_for_port()
                if port in self._recently_released and port not in self._leases and port not in self._reserved:
                    recent_hits += 1
                    if recent_hits >= 32:  # the OS keeps offering recently released ports only
                        break
                    continue
                if self._try_take(port):
                    return port
            # Everything free was released recently (a small pool and a narrow ephemeral range): rather than fail,
            # reuse the port released longest ago.
            for port in list(self._recently_released):
                if self._try_take(port, skip_recent=False):
                    return port
        raise RuntimeError(
            f"Could not lease a free port after {max_attempts} attempts. Free ports or raise `max_attempts`; the"
            f" registry of leases is {self._registry_dir!r}."
        )

    def _try_take(self, port: int, skip_recent: bool = True) -> bool:
        if port in self._leases or port in self._reserved:
            return False
        if skip_recent and port in self._recently_released:
            return False
        lease = None
        if self._registry_dir is not None:
            try:
                lease = _Lease.try_acquire(self._registry_dir, port)
            except OSError as ex:
                if ex.errno in (errno.EMFILE, errno.ENFILE):
                    raise  # out of file descriptors: trying other ports cannot help, and the cause must show
                return False  # the registry became unusable (for example deleted): treat as taken, try another
            if lease is None:
                return False
        if not probe_port(port):
            if lease is not None:
                lease.release()
            return False
        self._leases[port] = lease
        while len(self._leases) > _MAX_LEASES:  # the oldest lease has long been bound, or abandoned
            oldest = next(iter(self._leases))
            old_lease = self._leases.pop(oldest)
            if old_lease is not None:
                old_lease.release()
            self._recently_released.append(oldest)
        return True

    def release_port(self, port: int) -> None:
        """Give up the lease or reservation of ``port`` (a no-op for ports this manager does not hold).

        The port is also remembered as recently released, so this manager does not hand it out again soon, even if it
        did not hold it: pass a port that just failed to bind to keep it out of the next allocations.

        """
        with self._lock:
            lease = self._leases.pop(port, None)
            if lease is not None:
                lease.release()
            self._reserved.discard(port)
            if port in self._recently_released:
                self._recently_released.remove(port)
            self._recently_released.append(port)

    def release_all(self) -> None:
        """Give up every lease and reservation of this manager."""
        with self._lock:
            for port in list(self._leases) + list(self._reserved):
                self.release_port(port)

    def reserve_existing_port(self, port: int) -> bool:
        """Record a port chosen elsewhere (for example a user-set ``MASTER_PORT``) so this manager never hands it out.

        The port is not probed and no cross-process lease is taken: the port legitimately belongs to someone else, such
        as the ``torchrun`` agent. The record lasts until :meth:`release_port` or :meth:`release_all`.

        Returns:
            ``True`` if the port was newly recorded, ``False`` if this manager already held or reserved it.

        """
        if not 1 <= port <= 65535:
            raise ValueError(f"`port` must be between 1 and 65535, got {port}")
        with self._lock:
            if port in self._leases or port in self._reserved:
                return False
            self._reserved.add(port)
            return True

    @contextlib.contextmanager
    def allocated_port(self, preferred_port: Optional[int] = None, max_attempts: int = 1000) -> Iterator[int]:
        """Context manager that leases a port (see :meth:`allocate_port`) and releases it on exit.

        Example::

            with get_port_manager().allocated_port() as port:
                store = TCPStore("127.0.0.1", port, is_master=True)

        """
        port = self.allocate_port(preferred_port=preferred_port, max_attempts=max_attempts)
        try:
            yield port
        finally:
            self.release_port(port)

    def _forget_after_fork(self) -> None:
        # the parent still owns its leases: drop them here without unlocking
        self._lock = threading.RLock()
        for lease in self._leases.values():
            if lease is not None:
                lease.forget()
        self._leases.clear()
        self._reserved.clear()


_manager: Optional[PortManager] = None
_manager_lock = threading.Lock()


def get_port_manager() -> PortManager:
    """Return the process-wide :class:`PortManager`, creating it on first use (thread-safe).

    Its leases are released when the process exits; a forked child starts without the parent's leases.

    """
    global _manager
    if _manager is None:
        with _manager_lock:
            if _manager is None:
                _manager = PortManager()
                atexit.register(_manager.release_all)
    return _manager


def _after_fork_in_child() -> None:
    global _manager_lock
    _manager_lock = threading.Lock()
    if _manager is not None:
        _manager._forget_after_fork()


if sys.platform != "win32":
    os.register_at_fork(after_in_child=_after_fork_in_child)
