"""Patch 0005's rerun rule, as upstream's conftests get it: small pytest sessions in subprocesses.

The rule lives in upstream's ``tests/tests_fabric/conftest.py`` and ``tests/tests_pytorch/conftest.py``, which the
release's sdist does not ship, so the fork's suite cannot import it. These tests take the lines 0005 adds to them from
the patch file itself and write them, with the two imports upstream's conftests already have, as the conftest of a
small suite: what runs here is what the pull request adds, with no copy to drift. The fork's own check, in no pull
request (upstream has no tests of its conftests).

"""

import datetime
import errno
import os
import re
import socket
import subprocess
import sys
import tempfile
import traceback
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest

PATCHES = Path(__file__).parents[2] / "patches"
CONFTESTS = ("tests/tests_fabric/conftest.py", "tests/tests_pytorch/conftest.py")


def _added_lines(conftest: str) -> str:
    """The lines the series' patches add to one of upstream's conftests that mention the rule (0005's)."""
    series = (PATCHES / "series").read_text(encoding="utf-8").split()
    for name in (line for line in series if line.endswith(".patch")):
        text = (PATCHES / name).read_text(encoding="utf-8")
        section = text.partition(f"diff --git a/{conftest} b/{conftest}\n")[2].partition("\ndiff --git ")[0]
        if "_PORT_CONFLICT" in section:
            return "".join(f"{line[1:]}\n" for line in section.splitlines() if line[:1] == "+" and line[:3] != "+++")
    raise AssertionError(f"no patch of the series adds the rerun rule to {conftest}")


RULE = _added_lines(CONFTESTS[0])
CONFTEST = "import os\n\nimport pytest\n" + RULE  # upstream's conftests import these two already

_SUITE = {
    "pytest.ini": "[pytest]\n",  # the suite's own rootdir, away from the fork's pyproject.toml
    "conftest.py": CONFTEST,
    "helpers.py": """
import os, pathlib, socket


def attempt(name):
    path = pathlib.Path(os.environ["ATTEMPTS"], name)
    count = int(path.read_text()) + 1 if path.exists() else 1
    path.write_text(str(count))
    return count


def bind_a_taken_port():
    with socket.socket() as taken, socket.socket() as mine:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        mine.bind(("127.0.0.1", taken.getsockname()[1]))  # EADDRINUSE, from the kernel
""",
    "test_ports.py": """
import errno, os
import pytest
from helpers import attempt, bind_a_taken_port


@pytest.fixture(scope="module")
def module_store():
    if attempt("module_fixture") == 1:
        bind_a_taken_port()


@pytest.fixture(scope="class")
def class_store():
    if attempt("class_fixture") == 1:
        raise OSError(errno.EADDRINUSE, os.strerror(errno.EADDRINUSE))


def test_loses_its_port():
    if attempt("test") == 1:
        bind_a_taken_port()


def test_module_1(module_store):
    attempt("module_1")


def test_module_2(module_store):
    attempt("module_2")


class TestClass:
    def test_1(self, class_store):
        attempt("class_1")

    def test_2(self, class_store):
        attempt("class_2")
""",
    "test_evidence.py": """
import datetime, errno, os, socket, subprocess, sys
import pytest
from helpers import attempt


def _store(port):
    from torch.distributed import TCPStore

    TCPStore("127.0.0.1", port, 1, True, timeout=datetime.timedelta(seconds=10))


def _child(rank, port):
    _store(port)


def test_store_loses_its_port():
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        _store(taken.getsockname()[1] if attempt("store") == 1 else 0)  # DistNetworkError, from TCPStore


def test_spawned_child_loses_its_port():
    import torch.multiprocessing as mp

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1] if attempt("spawn") == 1 else 0
        mp.start_processes(_child, args=(port,), nprocs=1, start_method="fork")  # ProcessRaisedException


def test_gloo_loses_its_port():
    if attempt("gloo") == 1:  # the words gloo's Socket::bind throws, as torch raises them
        raise RuntimeError(
            "[enforce fail at ../third_party/gloo/gloo/transport/tcp/socket.cc:100] rv != -1. -1 vs -1."
            " bind: Address already in use"
        )


def test_a_value_error_that_quotes_the_words():
    attempt("quotes")
    raise ValueError("OSError: [Errno 98] Address already in use (name: EADDRINUSE)")


def test_an_os_error_without_the_errno():
    attempt("no_errno")
    raise OSError("address already in use")


def _child_quotes(rank):
    raise ValueError("OSError: [Errno 98] Address already in use")


def test_a_spawned_child_that_quotes_the_words():
    import torch.multiprocessing as mp

    attempt("child_quotes")
    mp.start_processes(_child_quotes, nprocs=1, start_method="fork")


def test_a_scripts_captured_stderr():
    attempt("script")
    code = "import errno; raise OSError(errno.EADDRINUSE, 'Address already in use')"
    subprocess.run([sys.executable, "-c", code], capture_output=True, check=True)
""",
    "test_markers.py": """
import errno, os
import pytest
from helpers import attempt


@pytest.mark.flaky(reruns=1, only_rerun="AssertionError")
def test_own_marker_that_reruns_assertions_only():
    attempt("own_assertions_only")
    raise OSError(errno.EADDRINUSE, os.strerror(errno.EADDRINUSE))


@pytest.mark.flaky(reruns=1)
def test_own_marker_that_reruns_anything():
    assert attempt("own_anything") > 1


def test_without_marker():
    pass
""",
    "test_crash.py": """
import os
from helpers import attempt


def test_crashes_its_worker():
    attempt("crash")
    os._exit(1)
""",
}


@pytest.fixture(scope="module")
def suite(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("suite")
    for name, text in _SUITE.items():
        (root / name).write_text(text, encoding="utf-8")
    return root


def _run(suite: Path, tmp_path: Path, *args: str, env: dict | None = None, stdin: str = ""):
    """Run pytest on ``suite``: its exit code, each test's attempts (by the suite's names) and JUnit XML test cases."""
    work = Path(tempfile.mkdtemp(dir=tmp_path))
    attempts = work / "attempts"
    attempts.mkdir()
    environ = {k: v for k, v in os.environ.items() if not k.startswith(("PYTEST_", "PL_", "COV_CORE"))}
    environ.update(ATTEMPTS=str(attempts), **(env or {}))
    junit = work / "junit.xml"
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", f"--junitxml={junit}", *args]
    proc = subprocess.run(cmd, cwd=suite, env=environ, input=stdin, capture_output=True, text=True, timeout=300)
    counts = {path.name: int(path.read_text()) for path in attempts.iterdir()}
    cases = []
    if junit.exists():
        for case in ET.parse(junit).iter("testcase"):
            outcome = next((child.tag for child in case if child.tag in ("failure", "error", "skipped")), "passed")
            cases.append((f"{case.get('classname')}.{case.get('name')}", outcome))
    return proc, counts, cases


def test_both_conftests_get_the_same_lines():
    assert _added_lines(CONFTESTS[1]) == RULE
    assert "def pytest_runtest_protocol" in RULE
    assert "def pytest_runtest_setup" in RULE


def _evidence(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}"  # what pytest-rerunfailures matches `only_rerun` against


def test_the_pattern_tells_a_port_conflict_by_the_exception_that_carries_it():
    import torch.distributed
    from torch.multiprocessing.spawn import ProcessRaisedException

    pattern = {}
    exec(compile(CONFTEST, "conftest.py", "exec"), pattern)  # the lines 0005 adds
    pattern = pattern["_PORT_CONFLICT"]
    spawned = "\n\n-- Process 0 terminated with the following error:\n{}"  # what torch.multiprocessing reports
    conflicts, others = [], []
    with socket.socket() as taken, socket.socket() as mine:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        try:
            mine.bind(("127.0.0.1", port))
        except OSError as exc:
            conflicts.append(exc)
        try:
            torch.distributed.TCPStore("127.0.0.1", port, 1, True, timeout=datetime.timedelta(seconds=10))
        except RuntimeError as exc:  # DistNetworkError, a RuntimeError; torch 2.1 raises a plain RuntimeError
            conflicts.append(exc)
            conflicts.append(ProcessRaisedException(spawned.format("".join(traceback.format_exception(exc))), 0, 1))
    conflicts.append(RuntimeError("[enforce fail at gloo/transport/tcp/socket.cc:1] bind: Address already in use"))
    conflicts.append(RuntimeError("failed to bind to [::]:29500 (errno: 98 - Address already in use)."))  # torch 2.1
    assert len(conflicts) == 5
    words = "[Errno 98] Address already in use, name: EADDRINUSE"
    others.append(ValueError(f"OSError: {words}"))
    others.append(AssertionError("RuntimeError: bind: Address already in use"))
    others.append(OSError("address already in use"))  # no errno
    others.append(OSError(errno.ECONNREFUSED, os.strerror(errno.ECONNREFUSED)))
    others.append(RuntimeError(f"a test's message: {words.lower()}"))
    quoted = "".join(traceback.format_exception(ValueError(f"OSError: {words}")))
    others.append(ProcessRaisedException(spawned.format(quoted), 0, 1))
    others.append(subprocess.CalledProcessError(1, ["python", "-c", "raise OSError(98, 'Address already in use')"]))
    assert [bool(re.search(pattern, _evidence(exc))) for exc in conflicts] == [True] * len(conflicts)
    assert [bool(re.search(pattern, _evidence(exc))) for exc in others] == [False] * len(others)


@pytest.mark.slow
@pytest.mark.parametrize("xdist", [[], ["-n", "2"]], ids=["serial", "xdist"])
def test_a_test_and_its_fixtures_that_lose_their_port_pass_with_one_test_case_each(suite, tmp_path, xdist):
    proc, attempts, cases = _run(suite, tmp_path, "test_ports.py", *xdist)
    assert proc.returncode == 0, proc.stdout
    assert attempts["test"] == 2
    assert attempts["module_fixture"] >= 2  # set up anew for the rerun (per xdist worker that runs its tests)
    assert attempts["class_fixture"] >= 2
    names = [name for name, _ in cases]
    assert len(names) == len(set(names)), names  # one per test (pytest-rerunfailures 16.6.1 and later: one per attempt)
    assert len(cases) == 5
    assert {outcome for _, outcome in cases} == {"passed"}


@pytest.mark.slow
def test_only_the_evidence_an_exception_carries_counts(suite, tmp_path):
    proc, attempts, cases = _run(suite, tmp_path, "test_evidence.py")
    rerun_then_passed = {"store": 2, "spawn": 2, "gloo": 2}
    failed_once = {"quotes": 1, "no_errno": 1, "child_quotes": 1, "script": 1}
    assert attempts == {**rerun_then_passed, **failed_once}, proc.stdout
    outcomes = dict(cases)
    assert sum(outcome == "passed" for outcome in outcomes.values()) == 3
    assert sum(outcome == "failure" for outcome in outcomes.values()) == 4
    assert len(cases) == 7


@pytest.mark.slow
@pytest.mark.parametrize(
    ("args", "env", "stdin"),
    [
        ([], {"PL_PORT_CONFLICT_RERUNS": "0"}, ""),
        ([], {"PL_PORT_CONFLICT_RERUNS": "-1"}, ""),  # not `flaky(reruns=-1)`, which runs no test at all
        (["--pdb"], {}, "c\n" * 5),
    ],
    ids=["PL_PORT_CONFLICT_RERUNS=0", "PL_PORT_CONFLICT_RERUNS=-1", "--pdb"],
)
def test_turned_off(suite, tmp_path, args, env, stdin):
    proc, attempts, _ = _run(suite, tmp_path, "test_ports.py::test_loses_its_port", *args, env=env, stdin=stdin)
    assert proc.returncode == 1, proc.stdout + proc.stderr  # failed, not refused ("--reruns incompatible with --pdb")
    assert attempts == {"test": 1}


@pytest.mark.slow
def test_the_tests_own_marker_and_the_command_line_win(suite, tmp_path):
    proc, attempts, _ = _run(suite, tmp_path, "test_markers.py")
    assert attempts == {"own_assertions_only": 1, "own_anything": 2}, proc.stdout  # rerun by its own marker only
    quotes = "test_evidence.py::test_a_value_error_that_quotes_the_words"
    proc, attempts, _ = _run(suite, tmp_path, quotes, "--reruns", "1")
    assert attempts == {"quotes": 2}, proc.stdout  # `--reruns 1` reruns any failure, as without the rule
    cmd = [sys.executable, "-m", "pytest", "--collect-only", "-q", "-m", "flaky", "test_markers.py"]
    selected = subprocess.run(cmd, cwd=suite, capture_output=True, text=True, check=False).stdout
    assert selected.count("::test_own_marker") == 2, selected  # `-m` sees the markers the tests have, no others
    assert "test_without_marker" not in selected, selected


@pytest.mark.slow
def test_a_crashed_xdist_worker_fails_its_test_after_one_attempt(suite, tmp_path):
    proc, attempts, cases = _run(suite, tmp_path, "test_crash.py", "-n", "2")
    assert proc.returncode == 1, proc.stdout
    assert attempts == {"crash": 1}, proc.stdout  # pytest-rerunfailures alone reschedules it twice
    assert cases == [("test_crash.test_crashes_its_worker", "error")]  # as pytest-xdist reports a crash
