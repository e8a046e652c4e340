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

Enable it with ``-p lightning.fabric.utilities.testing._port_reruns``, ``pytest_plugins`` in a ``conftest.py``, or
``_port_reruns.register(config)`` in ``pytest_configure(config)`` of a ``conftest.py``; ``-p no:<module>`` disables it.

A test is rerun, up to ``PL_PORT_CONFLICT_RERUNS`` times (default 2, ``0`` turns reruns off), when its setup or call
failed with a port conflict, as the failure shows it: the exception, or one it was raised from or while handling, is

* an ``OSError`` with ``errno`` ``EADDRINUSE``;
* an ``Exception`` whose message says ``EADDRINUSE`` or "address already in use": ``TCPStore``'s
  ``DistNetworkError``, gloo's errors, and ``torch.multiprocessing``'s ``ProcessRaisedException``, which carries the
  traceback of a spawned child (``ddp_spawn``, ``mp.spawn``);
* a ``subprocess.CalledProcessError`` or ``TimeoutExpired`` whose captured output (``stderr``, ``output``) says so:
  ``subprocess.run(..., capture_output=True, check=True)``, ``check_output``. Never its command line.

Only lines that do not start with whitespace count (not a traceback's source lines). The test's own verdict ends the
search: an ``AssertionError``, or what is not an ``Exception`` (``pytest.fail``). Not recognised: output the test did
not capture or checks itself (``assert subprocess.call(...) == 0``), a child that died without a traceback
(``ProcessExitedException``). A setup failure is rerun only if the fixtures that raised it are torn down after the
attempt: a class- or module-scoped fixture keeps its error for the tests that share it, as pytest keeps it, and the
last of them is rerun with the fixture set up anew.

A rerun is a protocol run of its own, as if the test came next, after the failed attempt is cleaned up as far as the
test function left it: the processes of Lightning's subprocess launchers it started are killed, a default process
group it initialized is destroyed, and environment variables it changed, and that its teardown did not change again,
are put back. The failed attempt's teardown is not reported: JUnit XML has one test case with the last outcome and
the property ``port_conflict_reruns``. Reruns show as ``R``, listed at the end. Nothing changes under ``--pdb`` or
``--trace``, for a test that pytest-rerunfailures reruns (its settings decide alone), and for a test that keeps its
port.

"""

import errno
import os
import subprocess
import sys
import threading
from collections.abc import Generator
from typing import Any, Optional

import pytest

# not public, but pytest-rerunfailures runs its attempts with it too: `log=False` is the one way to run an attempt
# whose reports the plugin logs itself (a rerun's teardown must not reach JUnit XML as a test of its own)
from _pytest.runner import runtestprotocol

_ENV = "PL_PORT_CONFLICT_RERUNS"
_PROPERTY = "port_conflict"  # a rerun's report: the error (it reaches xdist's controller)
_COUNT = "port_conflict_reruns"  # the test's last report, which JUnit XML writes the properties of: how many reruns
_MESSAGES = ("eaddrinuse", "address already in use", "only one usage of each socket address")  # Linux, macOS, Windows
_EADDRINUSE = {errno.EADDRINUSE, getattr(errno, "WSAEADDRINUSE", errno.EADDRINUSE)}
_reruns_key = pytest.StashKey[int]()
_attempt_key = pytest.StashKey["_Attempt"]()
_fixture_errors_key = pytest.StashKey[list[tuple[BaseException, Any]]]()  # port conflicts fixtures raised, and where


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
    """Read the number of reruns (one clear error for a value that is not one) and add the rerunning wrapper."""
    value = os.environ.get(_ENV, "2").strip()
    if not (value.isascii() and value.isdigit()):
        raise pytest.UsageError(f"{_ENV}={value!r}: expected a number of reruns, 0 to turn reruns off.")
    config.stash[_reruns_key] = int(value)
    config.pluginmanager.register(_Reruns(), f"{__name__}.reruns")


class _Reruns:
    @pytest.hookimpl(wrapper=True, tryfirst=True)
    def pytest_runtest_protocol(self, item: pytest.Item, nextitem: Optional[pytest.Item]) -> Generator[None, Any, Any]:
        """Run the protocol; after an attempt that lost its port, clean it up and run the protocol again.

        The outermost wrapper, and left out of the reruns' protocol calls: each attempt is a call of its own, one after
        the other, never nested, and the other plugins' wrappers (pytest-timeout's timer) wrap each anew.

        """
        if not _reruns_allowed(item):
            return (yield)
        stash = item.config.stash
        stash[_attempt_key] = attempt = _Attempt(item, nextitem, reruns=0)
        try:
            result = yield
            rerun = item.config.pluginmanager.subset_hook_caller("pytest_runtest_protocol", [self])
            while attempt.rerun:
                attempt.clean_up()
                stash[_attempt_key] = attempt = _Attempt(item, nextitem, attempt.reruns + 1)
                rerun(item=item, nextitem=nextitem)
        finally:
            del stash[_attempt_key]
        return result


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem: Optional[pytest.Item]) -> Optional[bool]:
    """Run an attempt as pytest's runner does, its reports logged by ``pytest_runtest_makereport`` below."""
    if _attempt(item) is None:
        return None
    item.ihook.pytest_runtest_logstart(nodeid=item.nodeid, location=item.location)
    runtestprotocol(item, nextitem=nextitem, log=False)
    item.ihook.pytest_runtest_logfinish(nodeid=item.nodeid, location=item.location)
    return True


@pytest.hookimpl(wrapper=True)
def pytest_fixture_setup(fixturedef: Any, request: pytest.FixtureRequest) -> Generator[None, Any, Any]:
    """Note a port conflict that a fixture raises, which pytest keeps until the fixture's scope ends, and that scope."""
    try:
        return (yield)
    except Exception as error:
        if is_port_conflict(error):
            request.config.stash.setdefault(_fixture_errors_key, []).append((error, request.node))
        raise


@pytest.hookimpl(wrapper=True)
def pytest_runtest_call(item: pytest.Item) -> Generator[None, Any, Any]:
    """Note what exists before the test function runs: its clean-up undoes only what it added."""
    attempt = _attempt(item)
    if attempt is not None:
        attempt.before_call()
    return (yield)


@pytest.hookimpl(wrapper=True, tryfirst=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo) -> Generator[None, Any, Any]:
    """Decide from the failure itself, then log the report where pytest's runner would, but a rerun's teardown."""
    report = yield
    attempt = _attempt(item)
    if attempt is None:
        return report
    if call.when == "teardown":
        if attempt.rerun and report.passed:
            return report  # the attempt ends here for pytest's reporters: the next one completes the same test
        attempt.rerun = False  # a teardown that failed: the test has an error, and is not rerun
        if attempt.reruns:
            report.user_properties.append((_COUNT, attempt.reruns))
    elif attempt.reruns_for(report, call):
        report.outcome = "rerun"  # as pytest-rerunfailures reports an attempt that is run again
        report.user_properties.append((_PROPERTY, call.excinfo.exconly().splitlines()[0][:200]))  # type: ignore[union-attr]
        attempt.rerun = True
        if call.when == "call":
            attempt.environ_after_call = dict(os.environ)
    item.ihook.pytest_runtest_logreport(report=report)
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
    # pytest-rerunfailures' own answer for this test (its marker, or its reruns for the suite)
    suite_reruns = getattr(config.pluginmanager.get_plugin("rerunfailures"), "get_reruns_count", lambda _: None)
    return item.get_closest_marker("flaky") is None and not suite_reruns(item)


def _attempt(item: pytest.Item) -> Optional["_Attempt"]:
    attempt = item.config.stash.get(_attempt_key, None)
    return attempt if attempt is not None and attempt.item is item else None


class _Attempt:
    """One attempt of a test: whether a rerun follows, and what its clean-up needs."""

    def __init__(self, item: pytest.Item, nextitem: Optional[pytest.Item], reruns: int) -> None:
        self.item, self.nextitem, self.reruns = item, nextitem, reruns
        self.rerun = False
        self._threads: set[threading.Thread] = set()
        self._environ: dict[str, str] = {}
        self.environ_after_call: Optional[dict[str, str]] = None
        self._process_group_before = False

    def reruns_for(self, report: pytest.TestReport, call: pytest.CallInfo) -> bool:
        """Whether this failed setup or call is a port conflict that a rerun can retry, set up anew."""
        session = self.item.session
        if not report.failed or call.excinfo is None or self.reruns >= self.item.config.stash[_reruns_key]:
            return False
        if session.shouldfail or session.shouldstop or not is_port_conflict(call.excinfo.value):
            return False
        if call.when == "call":
            return True
        # fixtures raised it (in this attempt, or pytest replays their cached error), and none of them has a scope that
        # the next test shares: pytest tears them all down after this attempt, and sets them up anew for the rerun
        errors = self.item.config.stash.get(_fixture_errors_key, [])
        ends = [node for error, node in errors if error is call.excinfo.value]
        kept = set(self.nextitem.listchain()) if self.nextitem is not None else set()
        return bool(ends) and kept.isdisjoint(ends)

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
