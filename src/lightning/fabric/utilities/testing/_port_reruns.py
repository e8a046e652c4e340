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
"""A pytest plugin that reruns a test which failed because a network port it needed was taken (``EADDRINUSE``).

Enable it with ``-p lightning.fabric.utilities.testing._port_reruns``, with ``pytest_plugins`` in a ``conftest.py``,
or with ``_port_reruns.register(config)`` in ``pytest_configure(config)`` of a ``conftest.py``; ``-p no:<this
module>`` disables it.

The rule: a test is rerun, up to ``PL_PORT_CONFLICT_RERUNS`` times (default 2, ``0`` turns reruns off), when its
setup or call failed with a port conflict, as the failure shows it: the exception, or one it was raised from or while
handling, is

* an ``OSError`` with ``errno`` ``EADDRINUSE``;
* an ``Exception`` whose message says ``EADDRINUSE`` or "address already in use": ``TCPStore``'s
  ``DistNetworkError``, gloo's errors, and ``torch.multiprocessing``'s ``ProcessRaisedException``, which carries the
  traceback of a spawned child (``ddp_spawn``, ``mp.spawn``);
* a ``subprocess.CalledProcessError`` or ``TimeoutExpired`` whose captured output (``stderr``, ``output``) says so:
  ``subprocess.run(..., capture_output=True, check=True)``, ``check_output``. Never its command line.

Only lines that do not start with whitespace count (not a traceback's source lines). The test's own verdict ends the
search: an ``AssertionError``, or what is not an ``Exception`` (``pytest.fail``), is never a port conflict. Not
recognised: output the test did not capture or checks itself (``assert subprocess.call(...) == 0``), and a child that
died without a traceback (``ProcessExitedException``). The rerun is
pytest's own protocol run again, as if the test came next: fixtures that the next test would share stay set up,
those that pytest tore down after the failed attempt (it was their last test) are set up again, and a wider-scoped
fixture that failed keeps its error for its scope, as pytest keeps it. Nothing else is changed, and nothing at all
when:

* ``--pdb`` or ``--trace`` is given: a debugging session sees every failure as it is;
* the test is one that pytest-rerunfailures reruns (a ``flaky`` marker, or ``--reruns``, ``--force-reruns`` or the
  ``reruns`` ini option above 0): the suite's own rerun settings decide alone, for port conflicts too.

A worker that crashes under pytest-xdist is not a port conflict: it is left to xdist and the suite's settings. Before
a rerun, the failed attempt is cleaned up, only as far as the test function itself left it: the processes of
Lightning's subprocess launchers that it started and that still run are killed (through their observer's
``kill_children``), a default process group it initialized is destroyed, and environment variables it changed, and
that its teardown did not change again, are put back. Reruns are reported as ``rerun`` (``R``), and listed at the end
of the session, with pytest-xdist too.

"""

import errno
import os
import subprocess
import sys
import threading
from collections.abc import Generator
from typing import Any, Optional

import pytest

_ENV = "PL_PORT_CONFLICT_RERUNS"
_PROPERTY = "port_conflict"  # the user property that marks this plugin's reruns; it reaches xdist's controller
_MESSAGES = ("eaddrinuse", "address already in use", "only one usage of each socket address")  # Linux, macOS, Windows
_EADDRINUSE = {errno.EADDRINUSE, getattr(errno, "WSAEADDRINUSE", errno.EADDRINUSE)}
_reruns_key = pytest.StashKey[int]()
_attempt_key = pytest.StashKey["_Attempt"]()
_reruns_done_key = pytest.StashKey[int]()


def register(config: pytest.Config) -> None:
    """Enable the plugin from ``pytest_configure(config)`` of any ``conftest.py``; registering twice is a no-op."""
    module = sys.modules[__name__]
    if not config.pluginmanager.is_registered(module):
        config.pluginmanager.register(module, __name__)


def is_port_conflict(exception: Optional[BaseException]) -> bool:
    """Whether ``exception``, or one it was raised from or while handling, shows that a port was taken."""
    while exception is not None:
        if isinstance(exception, AssertionError) or not isinstance(exception, Exception):
            return False  # the test's own verdict
        if isinstance(exception, OSError) and exception.errno in _EADDRINUSE:
            return True
        if isinstance(exception, subprocess.SubprocessError):  # its message is its command line: the child's output
            texts = [getattr(exception, "stderr", None), getattr(exception, "output", None)]
        else:
            texts = [str(exception)]
        for text in texts:
            text = text.decode(errors="replace") if isinstance(text, bytes) else text or ""
            lines = [line.lower() for line in text.splitlines() if not line[:1].isspace()]
            if any(message in line for line in lines for message in _MESSAGES):
                return True
        exception = exception.__cause__ or (None if exception.__suppress_context__ else exception.__context__)
    return False


def pytest_configure(config: pytest.Config) -> None:
    """Read the number of reruns: one clear error for a value that is not one."""
    value = os.environ.get(_ENV, "2").strip()
    if not (value.isascii() and value.isdigit()):
        raise pytest.UsageError(f"{_ENV}={value!r}: expected a number of reruns, 0 to turn reruns off.")
    config.stash[_reruns_key] = int(value)


@pytest.hookimpl(wrapper=True, tryfirst=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem: Optional[pytest.Item]) -> Generator[None, Any, Any]:
    """Run the protocol; after an attempt that lost its port, clean it up and run the protocol again.

    The outermost wrapper, however the plugin was registered: the other wrappers (pytest's warnings capture,
    pytest-timeout's timer) have finished with the failed attempt when its rerun starts, and wrap the rerun anew.

    """
    if not _reruns_allowed(item):
        return (yield)
    attempt = item.stash[_attempt_key] = _Attempt()
    result = yield
    done = item.stash.get(_reruns_done_key, 0)
    if attempt.rerun and not (item.session.shouldfail or item.session.shouldstop):
        attempt.clean_up()
        item.stash[_reruns_done_key] = done + 1
        item.config.hook.pytest_runtest_protocol(item=item, nextitem=nextitem)  # the whole protocol, once more
    return result


@pytest.hookimpl(wrapper=True)
def pytest_runtest_call(item: pytest.Item) -> Generator[None, Any, Any]:
    """Note what exists before the test function runs: its clean-up undoes only what it added."""
    attempt = item.stash.get(_attempt_key, None)
    if attempt is not None:
        attempt.before_call()
    return (yield)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo) -> Generator[None, Any, Any]:
    """Decide from the failure itself: a port conflict in setup or call, with a rerun left, is reported as ``rerun``."""
    report = yield
    attempt = item.stash.get(_attempt_key, None)
    if (
        attempt is not None
        and not attempt.rerun
        and report.failed
        and call.when in ("setup", "call")
        and call.excinfo is not None
        and is_port_conflict(call.excinfo.value)
        and item.stash.get(_reruns_done_key, 0) < item.config.stash[_reruns_key]
    ):
        report.outcome = "rerun"  # as pytest-rerunfailures reports an attempt that is run again
        report.user_properties.append((_PROPERTY, call.excinfo.exconly().splitlines()[0][:200]))
        attempt.rerun = True
        if call.when == "call":
            attempt.environ_after_call = dict(os.environ)
    return report


def pytest_report_teststatus(report: pytest.TestReport) -> Optional[tuple[str, str, Any]]:
    """Show this plugin's reruns as pytest-rerunfailures shows its own (``R``, ``RERUN``)."""
    if report.outcome == "rerun" and any(name == _PROPERTY for name, _ in report.user_properties):
        return "rerun", "R", ("RERUN", {"yellow": True})
    return None


def pytest_terminal_summary(terminalreporter: Any) -> None:
    """List the reruns after a port conflict, with the error that caused each."""
    reruns = [
        f"{report.nodeid} ({report.when}): {value}"
        for report in terminalreporter.stats.get("rerun", [])
        for name, value in report.user_properties
        if name == _PROPERTY
    ]
    if reruns:
        terminalreporter.write_sep("-", f"rerun after a port conflict ({_ENV})")
        for line in reruns:
            terminalreporter.write_line(line)


def _reruns_allowed(item: pytest.Item) -> bool:
    config = item.config
    if not config.stash.get(_reruns_key, 0) or config.getoption("usepdb", False) or config.getoption("trace", False):
        return False
    return item.get_closest_marker("flaky") is None and not _suite_reruns(config)


def _suite_reruns(config: pytest.Config) -> bool:
    """Whether pytest-rerunfailures reruns every test of the suite: ``--reruns``, ``--force-reruns``, ``reruns`` ini."""
    if config.getoption("force_reruns", None) or config.getoption("reruns", None):
        return True
    try:
        return int(config.getini("reruns")) > 0
    except (ValueError, TypeError):  # no such ini option (pytest-rerunfailures is not active), or not set
        return False


class _Attempt:
    """What one attempt of a test needs for its rerun: whether one follows, and what the test function changed."""

    def __init__(self) -> None:
        self.rerun = False
        self._threads: set[threading.Thread] = set()
        self._environ: dict[str, str] = {}
        self.environ_after_call: Optional[dict[str, str]] = None
        self._process_group_before = False

    def before_call(self) -> None:
        self._threads = set(threading.enumerate())
        self._environ = dict(os.environ)
        self._process_group_before = _process_group_initialized()

    def clean_up(self) -> None:
        """Undo what the failed test function left behind, after its teardown: nothing it did not start or change."""
        if self.environ_after_call is None:  # the setup failed: its fixtures' teardown is responsible
            return
        from lightning.fabric.strategies.launchers.subprocess_script import _ChildProcessObserver

        for thread in threading.enumerate():
            if isinstance(thread, _ChildProcessObserver) and thread not in self._threads:
                thread.kill_children()  # the launcher's children that still run; the observer takes it for no failure
        if not self._process_group_before and _process_group_initialized():
            import torch.distributed

            torch.distributed.destroy_process_group()
        for name in self._environ.keys() | self.environ_after_call.keys():
            before, after = self._environ.get(name), self.environ_after_call.get(name)
            if before != after and os.environ.get(name) == after:
                if before is None:
                    del os.environ[name]
                else:
                    os.environ[name] = before


def _process_group_initialized() -> bool:
    import torch.distributed

    return torch.distributed.is_available() and torch.distributed.is_initialized()
