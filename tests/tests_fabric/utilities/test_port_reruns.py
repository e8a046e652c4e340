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
"""The port-conflict rerun plugin, run the way suites use it: pytest in a subprocess, real sockets and TCPStore."""

import json
import os
import re
import socket
import subprocess
import sys
import textwrap
from datetime import timedelta

import pytest
from torch.distributed import TCPStore

from lightning.fabric.utilities.testing.port_reruns import _is_port_conflict

_CONFTEST = textwrap.dedent(
    """
    import json, os
    from lightning.fabric.utilities.testing import port_reruns

    def pytest_configure(config):
        port_reruns.register(config)

    def pytest_runtest_logreport(report):
        # what pytest-xdist sends to its controller: the report and its user properties
        with open(os.path.join(os.environ["OUT"], "properties.jsonl"), "a") as f:
            f.write(json.dumps([report.when, report.outcome, report.user_properties]) + "\\n")
    """
)

_CONFLICT = textwrap.dedent(
    """
    import socket
    from datetime import timedelta
    from torch.distributed import TCPStore

    def store_on_busy_port():
        with socket.socket() as listener:
            listener.bind(("127.0.0.1", 0))
            listener.listen(1)
            TCPStore("127.0.0.1", listener.getsockname()[1], 1, True, timeout=timedelta(seconds=5))
    """
)


def _run(tmp_path, test_source, *args, env=None, conftest=_CONFTEST):
    (tmp_path / "conftest.py").write_text(conftest)
    (tmp_path / "conflict.py").write_text(_CONFLICT)
    (tmp_path / "test_inner.py").write_text(textwrap.dedent(test_source))
    run_env = {k: v for k, v in os.environ.items() if k not in ("MASTER_PORT", "PL_PORT_CONFLICT_RERUNS")}
    python_path = os.pathsep.join(filter(None, [str(tmp_path), os.environ.get("PYTHONPATH")]))
    run_env.update(OUT=str(tmp_path), PYTHONPATH=python_path, **(env or {}))
    return subprocess.run(
        [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-p", "no:randomly", "-rA", *args, str(tmp_path)],
        cwd=tmp_path,
        env=run_env,
        capture_output=True,
        text=True,
        timeout=240,
    )


def _outcome(result):
    summary = result.stdout.strip().splitlines()[-1]
    return {word: int(n) for n, word in re.findall(r"(\d+) (passed|failed|rerun)", summary)}


_FAIL_ONCE = """
    import os
    from conflict import store_on_busy_port

    def test_flaky():
        attempts = os.path.join(os.environ["OUT"], "attempts")
        with open(attempts, "a") as f:
            f.write("x")
        n = len(open(attempts).read())
        if n == 1:
            raise ConnectionResetError("the peer went away")
        if n == 2:
            store_on_busy_port()
"""


@pytest.mark.parametrize(
    ("args", "expected"),
    [
        # the suite reruns everything twice: a connection reset and then a port conflict are both rerun
        (["--reruns", "2"], {"passed": 1, "rerun": 2}),
        # the suite reruns connection resets only: its pattern is kept, port conflicts are added
        (["--reruns", "1", "--only-rerun", "ConnectionResetError"], {"passed": 1, "rerun": 2}),
        # no rerun settings of its own: only the port conflict would be rerun, the reset fails the test
        ([], {"failed": 1}),
    ],
)
def test_suite_rerun_settings_are_merged_not_overridden(tmp_path, args, expected):
    result = _run(tmp_path, _FAIL_ONCE, *args)
    assert _outcome(result) == expected, result.stdout[-3000:]


_END_TO_END = """
    import os, subprocess, sys
    from conflict import store_on_busy_port

    def test_store_on_taken_port():
        out = os.environ["OUT"]
        first = not os.path.exists(os.path.join(out, "pids"))
        if first:
            sleep = [sys.executable, "-c", "import time; time.sleep(120)"]
            launcher_child = subprocess.Popen(sleep, env={**os.environ, "LOCAL_RANK": "1"})
            helper = subprocess.Popen(sleep)  # started by the test too, but not a launcher child
            with open(os.path.join(out, "pids"), "w") as f:
                f.write(f"{launcher_child.pid} {helper.pid}")
            os.environ["MASTER_PORT"] = "1"
            store_on_busy_port()
        assert "MASTER_PORT" not in os.environ  # put back as it was before the failed attempt
"""


def _alive(pid):
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


@pytest.mark.timeout(300)
@pytest.mark.skipif(sys.platform != "linux", reason="launcher children are found through /proc")
def test_port_conflict_is_rerun_after_cleaning_up_the_failed_attempt(tmp_path):
    result = _run(tmp_path, _END_TO_END)
    launcher_child, helper = (int(pid) for pid in (tmp_path / "pids").read_text().split())
    try:
        assert _outcome(result) == {"passed": 1, "rerun": 1}, result.stdout[-3000:]
        assert not _alive(launcher_child)
        assert _alive(helper)
    finally:
        os.kill(helper, 9)
    assert "port conflicts" in result.stdout
    assert "test_inner.py::test_store_on_taken_port: EADDRINUSE" in result.stdout
    reports = [json.loads(line) for line in (tmp_path / "properties.jsonl").read_text().splitlines()]
    call_reports = [(outcome, props) for when, outcome, props in reports if when == "call"]
    assert call_reports == [("rerun", [["port_conflict", "test_inner.py::test_store_on_taken_port"]]), ("passed", [])]


_ALWAYS_CONFLICT = """
    from conflict import store_on_busy_port

    def test_conflict():
        store_on_busy_port()
"""


@pytest.mark.parametrize(("reruns", "expected"), [("0", {"failed": 1}), ("1", {"failed": 1, "rerun": 1})])
def test_number_of_reruns_from_the_environment_when_registered_from_a_conftest(tmp_path, reruns, expected):
    result = _run(tmp_path, _ALWAYS_CONFLICT, env={"PL_PORT_CONFLICT_RERUNS": reruns})
    assert _outcome(result) == expected, result.stdout[-3000:]


def test_invalid_number_of_reruns_is_a_usage_error(tmp_path):
    result = _run(tmp_path, _ALWAYS_CONFLICT, env={"PL_PORT_CONFLICT_RERUNS": "\uff12"})
    assert result.returncode == 4
    assert "PL_PORT_CONFLICT_RERUNS='\uff12'" in result.stderr


_TOO_OLD = _CONFTEST.replace(
    "def pytest_configure(config):", "def pytest_configure(config):\n    _pretend_too_old()", 1
) + textwrap.dedent(
    """
        def _pretend_too_old():
            from lightning_utilities.core.imports import RequirementCache
            port_reruns._RERUNFAILURES_12 = RequirementCache("pytest-rerunfailures>=999")
        """
)


@pytest.mark.parametrize(
    ("args", "conftest"), [(["-p", "no:rerunfailures"], _CONFTEST), ([], _TOO_OLD)], ids=["disabled", "too-old"]
)
def test_warns_and_marks_nothing_without_a_usable_pytest_rerunfailures(tmp_path, args, conftest):
    """Below 12, the ``flaky`` marker has no ``only_rerun``: marking would rerun every failure."""
    result = _run(tmp_path, _FAIL_ONCE, *args, conftest=conftest)
    assert "cannot rerun tests that hit a port conflict: it needs pytest-rerunfailures>=12" in result.stdout
    assert _outcome(result) == {"failed": 1}, result.stdout[-3000:]


def _store_error():
    with socket.socket() as listener:
        listener.bind(("", 0))
        listener.listen(1)
        try:
            TCPStore("127.0.0.1", listener.getsockname()[1], 1, True, timeout=timedelta(seconds=5))
        except RuntimeError as ex:
            return ex
    raise AssertionError("the store bound a port that has a live listener")


def test_recognizes_real_port_conflicts_only():
    store_error = _store_error()
    assert _is_port_conflict(store_error)
    with socket.socket() as a, socket.socket() as b:
        a.bind(("127.0.0.1", 0))
        a.listen(1)
        with pytest.raises(OSError, match="in use") as bind_error:
            b.bind(("127.0.0.1", a.getsockname()[1]))
    assert _is_port_conflict(bind_error.value)
    wrapped = RuntimeError("launch failed")
    wrapped.__cause__ = store_error
    assert _is_port_conflict(wrapped)
    assert not _is_port_conflict(RuntimeError("rendezvous timed out"))
    assert not _is_port_conflict(AssertionError(f"unexpected: {store_error}"))
    suppressed = RuntimeError("other")
    suppressed.__context__, suppressed.__suppress_context__ = store_error, True
    assert not _is_port_conflict(suppressed)
