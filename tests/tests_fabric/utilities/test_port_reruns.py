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
from lightning_utilities.core.imports import RequirementCache
from torch.distributed import TCPStore

from lightning.fabric.utilities.testing.port_reruns import _is_port_conflict

#: 16.7 matches ``only_rerun`` against the exception chain and has ``--reruns-mode`` and an ``only_rerun`` ini key
_RERUNFAILURES_16_7 = RequirementCache("pytest-rerunfailures>=16.7")

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


def _run(tmp_path, test_source, *args, env=None, conftest=_CONFTEST, ini=None):
    # the inner suite's own ini file makes `tmp_path` its rootdir, wherever the temp dir is (nox puts it inside the
    # repository, whose pyproject.toml would otherwise be the rootdir and prefix every node id)
    (tmp_path / "pytest.ini").write_text(ini or "[pytest]\n")
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


_MIXED = """
    import os
    from conflict import store_on_busy_port

    def attempt(name):
        with open(os.path.join(os.environ["OUT"], f"attempts-{name}"), "a") as f:
            f.write("x")
        return len(open(os.path.join(os.environ["OUT"], f"attempts-{name}")).read())

    def test_assert_twice():
        assert attempt("assert_twice") > 2

    def test_timeout_once():
        if attempt("timeout_once") == 1:
            raise TimeoutError("rendezvous timed out")

    def test_port_once():
        if attempt("port_once") == 1:
            store_on_busy_port()

    def test_always_fails():
        attempt("always_fails")
        raise ValueError("a real bug")
"""
_NEW_RERUNFAILURES = pytest.mark.skipif(not _RERUNFAILURES_16_7, reason="options of pytest-rerunfailures 16.7")


@pytest.mark.parametrize(
    ("args", "ini", "expected"),
    [
        # no rerun settings of the suite's own: only the port conflict is rerun, with the plugin's count
        ([], None, {"assert_twice": 1, "timeout_once": 1, "port_once": 2, "always_fails": 1}),
        # the suite reruns every failure once: that stays so, port conflicts included
        (["--reruns", "1"], None, {"assert_twice": 2, "timeout_once": 2, "port_once": 2, "always_fails": 2}),
        # the suite reruns assertion failures once: its count and pattern are kept, port conflicts are added
        (
            ["--reruns", "1", "--only-rerun", "AssertionError"],
            None,
            {"assert_twice": 2, "timeout_once": 1, "port_once": 2, "always_fails": 1},
        ),
        pytest.param(
            ["--reruns", "1", "--reruns-mode", "append"],
            None,
            {"assert_twice": 2, "timeout_once": 2, "port_once": 2, "always_fails": 2},
            marks=_NEW_RERUNFAILURES,
        ),
        pytest.param(
            ["--reruns-mode", "append"],
            None,
            {"assert_twice": 1, "timeout_once": 1, "port_once": 2, "always_fails": 1},
            marks=_NEW_RERUNFAILURES,
        ),
        pytest.param(
            [],
            "[pytest]\nreruns = 1\nonly_rerun = TimeoutError\n",
            {"assert_twice": 1, "timeout_once": 2, "port_once": 2, "always_fails": 1},
            marks=_NEW_RERUNFAILURES,
        ),
    ],
    ids=["none", "reruns", "only-rerun", "append", "append-no-reruns", "ini-only-rerun"],
)
def test_suite_rerun_settings_stay_in_force_for_other_failures(tmp_path, args, ini, expected):
    result = _run(tmp_path, _MIXED, *args, ini=ini)
    attempts = {name: len((tmp_path / f"attempts-{name}").read_text()) for name in expected}
    assert attempts == expected, result.stdout[-3000:]


_WRAPPED = """
    import os, socket

    def test_wrapped_conflict():
        attempts = os.path.join(os.environ["OUT"], "attempts")
        with open(attempts, "a") as f:
            f.write("x")
        if len(open(attempts).read()) == 1:
            with socket.socket() as a, socket.socket() as b:
                a.bind(("127.0.0.1", 0))
                a.listen(1)
                try:
                    b.bind(("127.0.0.1", a.getsockname()[1]))
                except OSError as ex:
                    raise RuntimeError("failed to initialize the process group") from ex
"""


def test_wrapped_conflict_is_reported_only_where_it_is_rerun(tmp_path):
    """pytest-rerunfailures matches the exception chain from 16.7 on, only the raised exception below."""
    result = _run(tmp_path, _WRAPPED)
    expected = {"passed": 1, "rerun": 1} if _RERUNFAILURES_16_7 else {"failed": 1}
    assert _outcome(result) == expected, result.stdout[-3000:]
    assert ("port conflicts" in result.stdout) == bool(_RERUNFAILURES_16_7)


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
    assert _is_port_conflict(wrapped) == bool(_RERUNFAILURES_16_7)
    assert not _is_port_conflict(RuntimeError("rendezvous timed out"))
    assert not _is_port_conflict(AssertionError(f"unexpected: {store_error}"))
    suppressed = RuntimeError("other")
    suppressed.__context__, suppressed.__suppress_context__ = store_error, True
    assert not _is_port_conflict(suppressed)
