"""Checks of who holds a port, for the tests of the port Lightning picks for the rendezvous store."""

import os
import socket


def held_here(port: int) -> bool:
    """Whether this process has a socket bound to ``port`` that neither listens nor is connected: a held port."""
    for fd in os.listdir("/proc/self/fd"):
        try:
            if not os.readlink(f"/proc/self/fd/{fd}").startswith("socket:"):
                continue
            with socket.socket(fileno=os.dup(int(fd))) as sock:
                if sock.family not in (socket.AF_INET, socket.AF_INET6) or sock.getsockname()[1] != port:
                    continue
                if sock.getsockopt(socket.SOL_SOCKET, socket.SO_ACCEPTCONN):
                    continue
                try:
                    sock.getpeername()
                except OSError:  # not connected
                    return True
        except OSError:  # closed meanwhile, or not a socket Python can wrap
            continue
    return False


def can_bind(port: int) -> bool:
    """Whether a socket without ``SO_REUSEADDR`` can bind ``port``: not while any socket of any process holds it."""
    with socket.socket() as sock:
        try:
            sock.bind(("", port))
        except OSError:
            return False
    return True


def free_port() -> int:
    """A port no socket is bound to right now, for a test that sets ``MASTER_PORT`` itself."""
    with socket.socket() as sock:
        sock.bind(("", 0))
        return sock.getsockname()[1]
