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

Enable it with ``port_reruns.register(config)`` in ``pytest_configure(config)`` of any ``conftest.py``; it needs
pytest-rerunfailures 12 or newer. The suite's rerun settings stay in force for other failures: if it reruns all
failures, port conflicts are rerun with them. Otherwise tests without a ``flaky`` marker get one that reruns port
conflicts (from 16.7 on anywhere in the exception chain) up to ``PL_PORT_CONFLICT_RERUNS`` times (default 2, ``0``
turns it off), or, if the suite reruns ``only_rerun`` patterns, its count and patterns plus port conflicts. Before a
rerun, the failed attempt's launcher children (started during it with ``LOCAL_RANK`` set; Linux) get SIGKILL, the
process group is destroyed and ``MASTER_PORT`` is put back. Conflicts go into the report's ``user_properties`` as
``("port_conflict", nodeid)``, which reach the pytest-xdist controller, and into the terminal summary.

"""

import contextlib
import os
import re
import signal
import time
from collections.abc import Callable, Generator
from typing import Any

import pytest
from lightning_utilities.core.imports import RequirementCache

from lightning.fabric.utilities.distributed import _destroy_dist_connection

#: Matches ``"<ExceptionType>: <message>"`` of a port conflict on Linux, macOS and Windows; never a failed ``assert``.
PORT_CONFLICT_PATTERN = (
    r"(?is)^(?!AssertionError: ).*(?:EADDRINUSE|address already in use|only one usage of each socket address)"
)
_NAME = "lightning_port_reruns"
_ENV = "PL_PORT_CONFLICT_RERUNS"
_RERUNFAILURES_12 = RequirementCache("pytest-rerunfailures>=12")
_RERUNFAILURES_CHAINS = RequirementCache("pytest-rerunfailures>=16.7")  # ``only_rerun`` matches the whole chain
_attempt_key = pytest.StashKey[tuple[float, Any]]()


def register(config: pytest.Config) -> None:
    """Enable the plugin from ``pytest_configure(config)`` of any ``conftest.py``; registering twice is a no-op."""
    if not config.pluginmanager.has_plugin(_NAME):
        config.pluginmanager.register(_PortConflictReruns(config), _NAME)


class _PortConflictReruns:
    def __init__(self, config: pytest.Config) -> None:
        value = os.environ.get(_ENV, "2").strip()
        if not (value.isascii() and value.isdigit()):
            raise pytest.UsageError(f"{_ENV}={value!r}: expected a number of reruns, 0 to turn reruns off.")
        self.reruns = int(value)
        self.conflicts: list[str] = []
        if self.reruns and not (_RERUNFAILURES_12 and config.pluginmanager.hasplugin("rerunfailures")):
            self.reruns = 0
            message = f"{__name__} cannot rerun tests that hit a port conflict: it needs pytest-rerunfailures>=12."
            config.issue_config_time_warning(pytest.PytestConfigWarning(message), stacklevel=2)

    def pytest_collection_modifyitems(self, config: pytest.Config, items: list[pytest.Item]) -> None:
        if not self.reruns:
            return
        user_reruns = config.getoption("force_reruns", None) or _user_setting(config, "reruns", int) or 0
        only_rerun = _user_setting(config, "only_rerun", list) or []
        if user_reruns and not only_rerun:  # the suite reruns every failure, port conflicts included
            return
        patterns = [*only_rerun, PORT_CONFLICT_PATTERN] if user_reruns else [PORT_CONFLICT_PATTERN]
        kwargs: dict[str, Any] = {"reruns": user_reruns or self.reruns, "only_rerun": patterns}
        if config.getoption("reruns_mode", None) == "append":  # the marker's count is added to the suite's
            kwargs["reruns"] -= user_reruns
        for name in ("reruns_delay", "reruns_delay_backoff_factor"):  # the marker hides the suite's settings
            if (value := _user_setting(config, name, float)) is not None:
                kwargs[name] = value
        for item in items:
            if item.get_closest_marker("flaky") is None:
                item.add_marker(pytest.mark.flaky(**kwargs))

    @pytest.hookimpl(tryfirst=True)
    def pytest_runtest_setup(self, item: pytest.Item) -> None:
        item.stash[_attempt_key] = (_clock(), os.environ.get("MASTER_PORT"))

    @pytest.hookimpl(wrapper=True)
    def pytest_runtest_makereport(self, item: pytest.Item, call: pytest.CallInfo) -> Generator[None, Any, Any]:
        report = yield
        if report.failed and call.excinfo is not None and _is_port_conflict(call.excinfo.value):
            report.user_properties.append(("port_conflict", item.nodeid))
            started, master_port = item.stash.get(_attempt_key, (None, None))
            _kill_launcher_children_since(started or 0)
            _destroy_dist_connection()
            if master_port is None:
                os.environ.pop("MASTER_PORT", None)
            else:
                os.environ["MASTER_PORT"] = master_port
        return report

    def pytest_runtest_logreport(self, report: pytest.TestReport) -> None:
        self.conflicts += [str(value) for name, value in report.user_properties if name == "port_conflict"]

    def pytest_terminal_summary(self, terminalreporter: Any) -> None:
        if self.conflicts:
            terminalreporter.write_sep("-", "port conflicts")
            for nodeid in self.conflicts:
                terminalreporter.write_line(f"{nodeid}: EADDRINUSE")


def _user_setting(config: pytest.Config, name: str, convert: Callable[[Any], Any]) -> Any:
    value = config.getoption(name, None)
    if value is None:
        with contextlib.suppress(ValueError, TypeError):  # an unknown or empty ini key
            value = convert(config.getini(name))
    return value


def _is_port_conflict(exception: BaseException | None) -> bool:
    """Whether pytest-rerunfailures' ``only_rerun`` would match the port-conflict pattern."""
    while exception is not None:
        if re.search(PORT_CONFLICT_PATTERN, f"{type(exception).__name__}: {exception}"):
            return True
        if not _RERUNFAILURES_CHAINS:
            return False
        exception = exception.__cause__ or (None if exception.__suppress_context__ else exception.__context__)
    return False


def _clock() -> float:
    """Clock ticks since boot, the unit of a process's start time in ``/proc``; 0 where that is not available."""
    return time.clock_gettime(time.CLOCK_BOOTTIME) * os.sysconf("SC_CLK_TCK") if hasattr(time, "CLOCK_BOOTTIME") else 0


def _kill_launcher_children_since(started: float) -> None:
    """SIGKILL the children of this process started since ``started`` with ``LOCAL_RANK`` in their environment."""
    for entry in os.listdir("/proc") if started else []:
        with contextlib.suppress(OSError, IndexError, ValueError):
            with open(f"/proc/{entry}/stat") as f:
                # after "pid (comm)": state, ppid, ... and the start time in clock ticks at index 19
                fields = f.read().rsplit(")", 1)[1].split()
            with open(f"/proc/{entry}/environ", "rb") as f:
                environ = b"\0" + f.read()
            if int(fields[1]) == os.getpid() and int(fields[19]) >= int(started) and b"\0LOCAL_RANK=" in environ:
                os.kill(int(entry), signal.SIGKILL)
                os.waitpid(int(entry), 0)
