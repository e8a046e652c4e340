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
"""A pytest plugin that reruns tests which failed because a network port was taken (``EADDRINUSE``).

Enable it with one line in the ``conftest.py`` at the root of your tests (pytest only reads ``pytest_plugins``
there)::

    pytest_plugins = ["lightning.fabric.utilities.testing.port_reruns"]

on the command line with ``-p lightning.fabric.utilities.testing.port_reruns``, or from any ``conftest.py`` with
:func:`register`. It needs `pytest-rerunfailures <https://pypi.org/project/pytest-rerunfailures/>`_; from version 16.7
on, a conflict anywhere in the exception chain counts, before that only the exception the test raised.

What it does:

* At collection, every test without its own ``flaky`` marker gets ``flaky(reruns=N, only_rerun=...)`` matching
  ``EADDRINUSE`` / "address already in use" anywhere in the exception chain. Other failures, including rendezvous
  timeouts, are not rerun. ``N`` is set with ``--port-conflict-reruns`` (default 2, ``0`` disables).
* An autouse fixture restores ``MASTER_PORT`` after each test: a value the test set is removed, a value it changed is
  put back.
* After a test failed with a port conflict, before the rerun: the default process group is destroyed, processes the
  test started and left running (launcher children) are terminated, and the failed port is marked recently released
  so the :class:`~lightning.fabric.utilities.port_manager.PortManager` does not hand it out again.
* Reruns show in pytest's report (``R`` and "N rerun"), and the tests that hit a conflict are listed in a
  "port conflicts" section of the terminal summary.

"""

import contextlib
import os
import re
import signal
import sys
import time
from collections.abc import Generator, Iterator
from typing import Any, Optional, Union

import pytest
from lightning_utilities.core.imports import RequirementCache

from lightning.fabric.utilities.port_manager import get_port_manager

# earlier versions match `only_rerun` against the raised exception only, not the exceptions it was raised from
_RERUNFAILURES_FOLLOWS_CHAINS = RequirementCache("pytest-rerunfailures>=16.7")

#: Matches ``"<ExceptionType>: <message>"`` of a port conflict: the errno name, ``strerror`` on Linux/macOS, and
#: Windows' wording. A failed ``assert`` is never one, even if its message quotes such an error.
PORT_CONFLICT_PATTERN = (
    r"(?is)^(?!AssertionError: ).*(?:EADDRINUSE|address already in use|only one usage of each socket address)"
)
# "... port: 29500" (torch 2.2+), "failed to bind to [::]:29500 (errno: 98 ...)" (torch 2.1)
_PORT_IN_MESSAGE = re.compile(r"\bport:? (\d{1,5})\b|\]:(\d{1,5}) \(errno")
_DEFAULT_RERUNS = 2

_conflicts_key = pytest.StashKey[list[tuple[str, Optional[int]]]]()
_failed_port_key = pytest.StashKey[Optional[int]]()


def _chain(exception: BaseException) -> Iterator[BaseException]:
    """The exception, then those it was raised from (``__cause__``) or while handling (``__context__``)."""
    seen: set[int] = set()
    exc: Optional[BaseException] = exception
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        yield exc
        exc = exc.__cause__ or (None if exc.__suppress_context__ else exc.__context__)


def is_port_conflict(exception: BaseException) -> bool:
    """Whether ``exception``, or an exception it was raised from or during, is a port conflict."""
    pattern = re.compile(PORT_CONFLICT_PATTERN)
    return any(pattern.search(f"{type(exc).__name__}: {exc}") for exc in _chain(exception))


def _failed_port(exception: BaseException) -> Optional[int]:
    """The port named in the conflict's message (``TCPStore`` says ``port: N``, or ``[::]:N (errno`` on torch 2.1)."""
    pattern = re.compile(PORT_CONFLICT_PATTERN)
    for exc in _chain(exception):
        text = f"{type(exc).__name__}: {exc}"
        match = _PORT_IN_MESSAGE.search(text)
        if match and pattern.search(text):
            return int(match.group(1) or match.group(2))
    return None


def register(config: pytest.Config) -> None:
    """Enable the plugin from a ``conftest.py`` below the root, in its ``pytest_configure(config)`` hook.

    Unlike ``pytest_plugins``, this works in any ``conftest.py``, and registering twice is harmless.

    """
    if not config.pluginmanager.has_plugin(__name__):
        config.pluginmanager.register(sys.modules[__name__], __name__)


def _reruns(config: pytest.Config) -> int:
    # the option is missing when the plugin was registered after the command line was parsed
    return config.getoption("port_conflict_reruns", default=_DEFAULT_RERUNS)


def pytest_addoption(parser: pytest.Parser) -> None:
    """Add ``--port-conflict-reruns``."""
    group = parser.getgroup("lightning", "Lightning")
    group.addoption(
        "--port-conflict-reruns",
        type=int,
        default=_DEFAULT_RERUNS,
        help=f"Rerun a test that failed with EADDRINUSE up to this many times (default {_DEFAULT_RERUNS}, 0 disables).",
    )


def pytest_configure(config: pytest.Config) -> None:
    """Set up the record of conflicts and warn if reruns cannot work."""
    config.stash[_conflicts_key] = []
    if _reruns(config) <= 0:
        return
    if not config.pluginmanager.hasplugin("rerunfailures"):
        message = "needs pytest-rerunfailures to rerun tests: `pip install pytest-rerunfailures`"
    elif not _RERUNFAILURES_FOLLOWS_CHAINS:
        message = "reruns chained port conflicts only with pytest-rerunfailures>=16.7"
    else:
        return
    config.issue_config_time_warning(pytest.PytestConfigWarning(f"{__name__} {message}."), stacklevel=2)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Mark every test without its own ``flaky`` marker to be rerun on port conflicts only."""
    reruns = _reruns(config)
    if reruns <= 0 or not config.pluginmanager.hasplugin("rerunfailures"):
        return
    for item in items:
        if item.get_closest_marker("flaky") is None:
            item.add_marker(pytest.mark.flaky(reruns=reruns, only_rerun=[PORT_CONFLICT_PATTERN]))


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo) -> Generator[None, Any, pytest.TestReport]:
    """Record a failure caused by a port conflict, for the cleanup and the summary."""
    report = yield
    if report.failed and call.excinfo is not None and is_port_conflict(call.excinfo.value):
        port = _failed_port(call.excinfo.value)
        item.stash[_failed_port_key] = port
        item.config.stash[_conflicts_key].append((item.nodeid, port))
    return report


def pytest_terminal_summary(terminalreporter: Any, config: pytest.Config) -> None:
    """List the tests that hit a port conflict, and the port."""
    conflicts = config.stash.get(_conflicts_key, [])
    if not conflicts:
        return
    terminalreporter.write_sep("-", "port conflicts")
    for nodeid, port in conflicts:
        terminalreporter.write_line(f"{nodeid}: EADDRINUSE" + (f" on port {port}" if port is not None else ""))


@pytest.fixture(autouse=True)
def _restore_master_port(request: pytest.FixtureRequest) -> Generator[None, None, None]:
    """Put ``MASTER_PORT`` back as it was before the test, and clean up after a port conflict."""
    before = os.environ.get("MASTER_PORT")
    started = _clock()
    yield
    after = os.environ.get("MASTER_PORT")
    if after != before:
        if before is None:
            del os.environ["MASTER_PORT"]
        else:
            os.environ["MASTER_PORT"] = before
        if after is not None and after.strip().isdigit() and 0 < int(after) <= 65535:
            # the port the test used goes to the back of the queue, whether or not this process leased it
            get_port_manager().release_port(int(after))
    if _failed_port_key in request.node.stash:
        failed_port = request.node.stash[_failed_port_key]
        del request.node.stash[_failed_port_key]
        _destroy_process_group()
        _terminate(_children_started_since(started))
        if failed_port is not None and 0 < failed_port <= 65535:
            get_port_manager().release_port(failed_port)


def _destroy_process_group() -> None:
    import torch.distributed

    if torch.distributed.is_available() and torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()


def _clock() -> Union[int, set[int]]:
    """Clock ticks since boot on Linux, cheap to read; elsewhere the current :mod:`multiprocessing` children."""
    try:
        with open("/proc/uptime") as f:
            return int(float(f.read().split()[0]) * os.sysconf("SC_CLK_TCK"))
    except (OSError, ValueError):
        import multiprocessing

        return {p.pid for p in multiprocessing.active_children() if p.pid is not None}


def _children_started_since(started: Union[int, set[int]]) -> set[int]:
    """The live children of this process started since ``started`` (from :func:`_clock`)."""
    if isinstance(started, set):
        import multiprocessing

        return {p.pid for p in multiprocessing.active_children() if p.pid is not None} - started
    me, pids = os.getpid(), set()
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                # after "pid (comm)": state, ppid, ..., starttime (in clock ticks since boot) at index 19
                fields = f.read().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue
        if fields[0] != "Z" and int(fields[1]) == me and int(fields[19]) >= started:
            pids.add(int(entry))
    return pids


def _terminate(pids: set[int], timeout: float = 5.0) -> None:
    """Send SIGTERM to ``pids``, then SIGKILL to those still alive after ``timeout`` seconds."""
    for sig in (signal.SIGTERM, getattr(signal, "SIGKILL", signal.SIGTERM)):
        for pid in pids:
            with contextlib.suppress(OSError):
                os.kill(pid, sig)
        deadline = time.monotonic() + timeout
        while pids and time.monotonic() < deadline:
            pids = {pid for pid in pids if _alive(pid)}
            time.sleep(0.05)
        if not pids:
            return


def _alive(pid: int) -> bool:
    try:
        done, _ = os.waitpid(pid, os.WNOHANG)
        if done == pid:
            return False
    except ChildProcessError:
        pass
    except OSError:
        return False
    try:
        os.kill(pid, 0)
    except OSError:
        return False
    return True
