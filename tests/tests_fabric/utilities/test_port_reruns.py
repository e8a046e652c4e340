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
"""The port-conflict rerun plugin's rule, run the way suites use it: pytest in a subprocess, real ``TCPStore`` s.

Each suite runs twice, with and without the plugin: everything but the reruns of port conflicts must be the same.

"""

import re
import socket
from datetime import timedelta

import pytest
from lightning_utilities.core.imports import RequirementCache
from torch.distributed import TCPStore

from lightning.fabric.utilities.testing._port_reruns import is_port_conflict
from tests_fabric.helpers.inner_pytest import REGISTER, run_pytest

_XDIST = RequirementCache("pytest-xdist")
_RERUNFAILURES = RequirementCache("pytest-rerunfailures")

#: tests that never lose a port: every way a test can end, an xfail that raises EADDRINUSE included
_KEEP_PORTS = """
    import pytest

    @pytest.fixture
    def broken():
        raise ValueError("a fixture bug")

    def test_passes():
        pass

    def test_fails():
        assert attempt("fails") == 0

    def test_fails_once():
        if attempt("fails_once") == 1:
            raise TimeoutError("rendezvous timed out")

    def test_fixture_error(broken):
        pass

    def test_asserts_while_handling_a_taken_port():  # the test's own verdict, raised while handling a port conflict
        try:
            store_on_busy_port()
        except RuntimeError:
            assert attempt("asserts_while_handling") > 1

    def test_fails_saying_the_address_is_in_use():
        if attempt("fails_saying_in_use") == 1:
            pytest.fail("the server reported: address already in use")

    @pytest.mark.xfail(raises=RuntimeError)
    def test_xfail_on_a_taken_port():
        store_on_busy_port()

    @pytest.mark.skip(reason="not today")
    def test_skipped():
        pass
"""
_FLAKY = """
    @pytest.mark.flaky(reruns=1)
    def test_flaky_marker():
        assert attempt("flaky_marker") > 1
"""
_CRASH = """
    def test_worker_crashes_once():
        if attempt("crashes_once") == 1:
            os._exit(1)
"""
# the store's error in a rerun's summary line: `DistNetworkError` from torch 2.2, a `RuntimeError` before
_STORE_ERROR = r"(torch\.distributed\.DistNetworkError|RuntimeError)"
_no_xdist = pytest.mark.skipif(not _XDIST, reason="needs pytest-xdist")
_no_rerunfailures = pytest.mark.skipif(not _RERUNFAILURES, reason="needs pytest-rerunfailures")


@pytest.mark.timeout(300)
@pytest.mark.parametrize(
    ("args", "ini", "suite", "stdin"),
    [
        pytest.param([], "", _KEEP_PORTS + _FLAKY, "", id="defaults"),
        pytest.param(["-x"], "", _KEEP_PORTS, "", id="-x"),
        pytest.param(["--maxfail", "2"], "", _KEEP_PORTS, "", id="--maxfail"),
        # a debugger session (pytest-rerunfailures refuses --pdb with a flaky marker: left out)
        pytest.param(["--pdb"], "", _KEEP_PORTS, "c\n" * 20, id="--pdb"),
        pytest.param(["--trace"], "", _KEEP_PORTS, "c\n" * 40, id="--trace"),
        pytest.param(["--reruns", "1"], "", _KEEP_PORTS + _FLAKY, "", marks=_no_rerunfailures, id="--reruns"),
        pytest.param(
            ["--reruns", "2", "--only-rerun", "TimeoutError"], "", _KEEP_PORTS, "", marks=_no_rerunfailures, id="only"
        ),
        pytest.param([], "reruns = 1\n", _KEEP_PORTS + _FLAKY, "", marks=_no_rerunfailures, id="ini-reruns"),
        pytest.param(["-p", "no:rerunfailures"], "", _KEEP_PORTS, "", id="no-rerunfailures"),
        # a worker that crashes is xdist's and the suite's business: failed without reruns, rerun with them
        pytest.param(["-n", "2"], "", _KEEP_PORTS + _FLAKY + _CRASH, "", marks=_no_xdist, id="xdist"),
        pytest.param(
            ["-n", "2", "--reruns", "1"], "", _KEEP_PORTS + _CRASH, "", marks=[_no_xdist, _no_rerunfailures], id="xd-r"
        ),
    ],
)
def test_nothing_changes_for_tests_that_keep_their_port(tmp_path, args, ini, suite, stdin):
    runs = {
        plugin: run_pytest(tmp_path / plugin, suite, *args, conftest=conftest, ini=ini, stdin=stdin)
        for plugin, conftest in (("without", ""), ("with", REGISTER))
    }
    without, with_plugin = runs["without"], runs["with"]
    assert with_plugin.outcomes() == without.outcomes(), with_plugin.result.stdout[-3000:]
    assert with_plugin.attempts() == without.attempts()
    assert with_plugin.result.returncode == without.result.returncode, with_plugin.result.stdout[-3000:]
    assert without.outcomes(), without.result.stdout[-3000:]  # the suite ran


@pytest.mark.timeout(300)
def test_last_failed_selects_the_same_tests(tmp_path):
    for plugin, conftest in (("without", ""), ("with", REGISTER)):
        run_pytest(tmp_path / plugin, _KEEP_PORTS, conftest=conftest, cache=True)
    lf = {
        plugin: run_pytest(tmp_path / plugin, _KEEP_PORTS, "--lf", conftest=c, cache=True)
        for plugin, c in (("without", ""), ("with", REGISTER))
    }
    assert lf["with"].outcomes() == lf["without"].outcomes()
    assert {test for test, _, _ in lf["with"].outcomes()} == {
        "test_inner.py::test_fails",
        "test_inner.py::test_fails_once",
        "test_inner.py::test_fixture_error",
        "test_inner.py::test_asserts_while_handling_a_taken_port",
        "test_inner.py::test_fails_saying_the_address_is_in_use",
    }


_LOSES_PORT_ONCE = """
    def test_loses_its_port_once():
        if attempt("loses_port_once") == 1:
            store_on_busy_port()
"""


@pytest.mark.timeout(300)
@pytest.mark.parametrize(
    ("args", "conftest"),
    [
        ([], REGISTER),
        (["-p", "lightning.fabric.utilities.testing._port_reruns"], ""),
        ([], "pytest_plugins = ['lightning.fabric.utilities.testing._port_reruns']\n"),
        (["-p", "lightning.fabric.utilities.testing._port_reruns"], REGISTER),  # both ways: registered once
    ],
    ids=["register", "-p", "pytest_plugins", "both"],
)
def test_a_test_that_lost_its_port_is_rerun(tmp_path, args, conftest):
    run = run_pytest(tmp_path, _LOSES_PORT_ONCE, *args, conftest=conftest)
    test = "test_inner.py::test_loses_its_port_once"
    # the failed attempt's teardown is not reported: the rerun completes the same test
    first = [(test, "setup", "passed"), (test, "call", "rerun")]
    rerun = [(test, "setup", "passed"), (test, "call", "passed"), (test, "teardown", "passed")]
    assert run.outcomes() == first + rerun, run.result.stdout[-3000:]
    assert run.result.returncode == 0
    assert "rerun after a port conflict" in run.result.stdout
    assert re.search(rf"{re.escape(test)} \(call\): {_STORE_ERROR}: ", run.result.stdout)
    assert "1 passed, 1 rerun" in run.result.stdout


@_no_xdist
@pytest.mark.timeout(300)
def test_a_test_that_lost_its_port_is_rerun_under_xdist(tmp_path):
    run = run_pytest(tmp_path, _LOSES_PORT_ONCE + _KEEP_PORTS, "-n", "2")
    assert run.attempts()["loses_port_once"] == 2
    assert ("test_inner.py::test_loses_its_port_once", "call", "rerun") in run.outcomes()
    assert re.search(rf"test_inner\.py::test_loses_its_port_once \(call\): {_STORE_ERROR}: ", run.result.stdout)


_SUITE_RERUNS_IT = """
    import pytest

    @pytest.mark.flaky(reruns=1, only_rerun=["TimeoutError"])
    def test_flaky_marker_loses_its_port():
        attempt("flaky_marker")
        store_on_busy_port()

    def test_loses_its_port():
        attempt("plain")
        store_on_busy_port()
"""


@_no_rerunfailures
@pytest.mark.timeout(300)
@pytest.mark.parametrize("args", [[], ["--reruns", "1", "--only-rerun", "AssertionError"]], ids=["marker", "suite"])
def test_tests_the_suite_reruns_itself_are_left_to_its_settings(tmp_path, args):
    """pytest-rerunfailures decides alone for a test it reruns, port conflicts included."""
    without = run_pytest(tmp_path / "without", _SUITE_RERUNS_IT, *args, conftest="")
    with_plugin = run_pytest(tmp_path / "with", _SUITE_RERUNS_IT, *args)
    assert with_plugin.attempts()["flaky_marker"] == without.attempts()["flaky_marker"] == 1
    expected_plain = 1 if args else 3  # --reruns: rerunfailures' test; otherwise this plugin's, 2 reruns
    assert with_plugin.attempts()["plain"] == expected_plain


@pytest.mark.timeout(300)
@pytest.mark.parametrize(("reruns", "attempts"), [("0", 1), ("1", 2), ("3", 4)])
def test_number_of_reruns_from_the_environment(tmp_path, reruns, attempts):
    run = run_pytest(tmp_path, _SUITE_RERUNS_IT, "-k", "test_loses_its_port", env={"PL_PORT_CONFLICT_RERUNS": reruns})
    assert run.attempts() == {"plain": attempts}
    assert run.result.returncode == 1


def test_invalid_number_of_reruns_is_a_usage_error(tmp_path):
    run = run_pytest(tmp_path, _LOSES_PORT_ONCE, env={"PL_PORT_CONFLICT_RERUNS": "\uff12"})
    assert run.result.returncode == 4
    assert "PL_PORT_CONFLICT_RERUNS='\uff12': expected a number of reruns" in run.result.stderr


_SCOPES = """
    import pytest

    @pytest.fixture(scope="module")
    def module_resource():
        attempt("module_setup")
        yield

    def test_first(module_resource):
        if attempt("first") == 1:
            store_on_busy_port()

    def test_last(module_resource):
        if attempt("last") == 1:
            store_on_busy_port()
"""


@pytest.mark.timeout(300)
def test_a_rerun_runs_as_if_the_test_came_next(tmp_path):
    """Fixtures the next test shares are kept for the rerun; the last test's module fixture is set up again."""
    run = run_pytest(tmp_path, _SCOPES)
    assert run.attempts() == {"module_setup": 2, "first": 2, "last": 2}, run.result.stdout[-3000:]
    assert run.result.returncode == 0


_TIMED = """
    import time

    def test_loses_its_port_then_hangs():
        if attempt("hangs") == 1:
            store_on_busy_port()
        time.sleep(30)
"""


@pytest.mark.timeout(300)
@pytest.mark.parametrize(
    ("args", "conftest"), [([], REGISTER), (["-p", "lightning.fabric.utilities.testing._port_reruns"], "")]
)
def test_a_rerun_is_timed_as_any_attempt(tmp_path, args, conftest):
    """The rerun goes through every hook of the protocol again: pytest-timeout's timer stops a hanging rerun."""
    run = run_pytest(tmp_path, _TIMED, *args, "--timeout", "3", "--timeout-method", "signal", conftest=conftest)
    assert run.attempts() == {"hangs": 2}
    assert "1 failed, 1 rerun" in run.result.stdout, run.result.stdout[-3000:]
    assert "Failed: Timeout" in run.result.stdout


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
    assert is_port_conflict(store_error)
    with socket.socket() as a, socket.socket() as b:
        a.bind(("127.0.0.1", 0))
        a.listen(1)
        with pytest.raises(OSError, match="in use") as bind_error:
            b.bind(("127.0.0.1", a.getsockname()[1]))
    assert is_port_conflict(bind_error.value)
    wrapped = RuntimeError("launch failed")
    wrapped.__cause__ = store_error
    assert is_port_conflict(wrapped)
    assert not is_port_conflict(RuntimeError("rendezvous timed out"))
    assert not is_port_conflict(ConnectionRefusedError(111, "Connection refused"))
    assert not is_port_conflict(AssertionError(f"unexpected: {store_error}"))
    verdict = AssertionError("wrong port")
    verdict.__context__ = store_error  # an assertion that failed while handling a port conflict
    assert not is_port_conflict(verdict)
    with pytest.raises(pytest.fail.Exception) as failed:
        pytest.fail("address already in use")
    assert not is_port_conflict(failed.value)
    suppressed = RuntimeError("other")
    suppressed.__context__, suppressed.__suppress_context__ = store_error, True
    assert not is_port_conflict(suppressed)
