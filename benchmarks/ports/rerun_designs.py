"""Two designs of the port-conflict rerun plugin, measured on the same suites: which behaviours hold, and their size.

* ``marker``: pytest-rerunfailures does the rerun. Its ``flaky(reruns=2, only_rerun=[port-conflict pattern])`` marker
  goes on a test only where it cannot change what the suite does: never under ``--pdb``/``--trace``, never on a test
  with a ``flaky`` marker of its own, never when the suite reruns every test (``--reruns``, ``reruns`` ini). Written
  here in full (``MARKER_DESIGN``), without a clean-up between attempts.
* ``protocol``: ``lightning.fabric.utilities.testing._port_reruns``, which decides from the failure in
  ``pytest_runtest_makereport`` and reruns through pytest's own ``pytest_runtest_protocol`` hook, each attempt a
  protocol call of its own.

Every suite runs without a plugin and with each design; a behaviour holds when the design's run reports exactly what
the run without a plugin reports (every phase of every test, the attempts, the exit status), or, for the suites that
lose a port, when the test is rerun to a pass, and for the last three, when the run reports as the plugin's tests
require. The suites are those of ``tests/tests_fabric/utilities/test_port_reruns*.py``.

Run from the repository root, with the fork, pytest-rerunfailures and pytest-xdist installed (a few minutes)::

    python benchmarks/ports/rerun_designs.py

"""

import inspect
import io
import sys
import tempfile
import textwrap
import tokenize
import xml.etree.ElementTree as ET
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parents[2] / "tests"))

from lightning.fabric.utilities.testing import _port_reruns
from tests_fabric.helpers.inner_pytest import REGISTER, run_pytest
from tests_fabric.utilities import test_port_reruns as suites
from tests_fabric.utilities import test_port_reruns_evidence as evidence
from tests_fabric.utilities import test_port_reruns_fixtures as fixtures
from tests_fabric.utilities import test_port_reruns_junit as junit

MARKER_DESIGN = """
import contextlib
import pytest

PATTERN = r"(?is)^(?!AssertionError: ).*(?:EADDRINUSE|address already in use|only one usage of each socket address)"

def pytest_collection_modifyitems(config, items):
    if config.getoption("usepdb") or config.getoption("trace") or not config.pluginmanager.hasplugin("rerunfailures"):
        return
    if config.getoption("reruns", None) or config.getoption("force_reruns", None):
        return
    with contextlib.suppress(ValueError, TypeError):
        if int(config.getini("reruns")) > 0:
            return
    for item in items:
        if item.get_closest_marker("flaky") is None:
            item.add_marker(pytest.mark.flaky(reruns=2, only_rerun=[PATTERN]))
"""

KEEP = suites._KEEP_PORTS
SAME = [  # (name, suite, args, ini, stdin): the run must be the same as without a plugin
    ("defaults", KEEP + suites._FLAKY, [], "", ""),
    ("-x", KEEP, ["-x"], "", ""),
    ("--pdb", KEEP, ["--pdb"], "", "c\n" * 20),
    ("--trace", KEEP, ["--trace"], "", "c\n" * 40),
    ("--reruns 1", KEEP + suites._FLAKY, ["--reruns", "1"], "", ""),
    ("--reruns 2 --only-rerun", KEEP, ["--reruns", "2", "--only-rerun", "TimeoutError"], "", ""),
    ("reruns ini", KEEP + suites._FLAKY, [], "reruns = 1\n", ""),
    ("-n 2, a worker crashes", KEEP + suites._FLAKY + suites._CRASH, ["-n", "2"], "", ""),
    ("-n 2 --reruns 1, a worker crashes", KEEP + suites._CRASH, ["-n", "2", "--reruns", "1"], "", ""),
]
RERUN = [("loses its port once", []), ("loses its port once, -n 2", ["-n", "2"])]
TIMED = ["--timeout", "3", "--timeout-method", "signal"]  # the rerun hangs: pytest-timeout must stop it
CHILDREN_FAIL = dict.fromkeys(("command_line", "source_line", "not_captured"), 1)  # not port conflicts: no rerun


def _same(root, name, suite, args, ini, stdin, conftest):
    without = run_pytest(root / name / "without", suite, *args, conftest="", ini=ini, stdin=stdin)
    design = run_pytest(root / name / "design", suite, *args, conftest=conftest, ini=ini, stdin=stdin)
    same = design.outcomes() == without.outcomes() and design.attempts() == without.attempts()
    return same and design.result.returncode == without.result.returncode


def _code_lines(source: str) -> int:
    """Lines with code: no blank lines, comments or docstrings."""
    lines = set()
    previous = tokenize.INDENT
    for token in tokenize.generate_tokens(io.StringIO(source).readline):
        if token.type == tokenize.STRING and previous in (tokenize.INDENT, tokenize.NEWLINE, tokenize.DEDENT):
            previous = token.type
            continue  # a docstring
        if token.type not in (tokenize.COMMENT, tokenize.NL, tokenize.NEWLINE, tokenize.INDENT, tokenize.DEDENT):
            lines.add(token.start[0])
        if token.type not in (tokenize.COMMENT, tokenize.NL):
            previous = token.type
    return len(lines)


def main() -> None:
    designs = {"marker": MARKER_DESIGN, "protocol": REGISTER}
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        for name, suite, args, ini, stdin in SAME:
            rows.append([f"same as without a plugin: {name}"])
            for design, conftest in designs.items():
                rows[-1].append(_same(root / design, name, suite, args, ini, stdin, conftest))
                print(name, design, rows[-1][-1], file=sys.stderr, flush=True)
        for name, args in RERUN:
            rows.append([f"rerun to a pass: {name}"])
            for design, conftest in designs.items():
                run = run_pytest(root / design / name, suites._LOSES_PORT_ONCE, *args, conftest=conftest)
                rows[-1].append(run.attempts().get("loses_port_once") == 2 and run.result.returncode == 0)
        rows.append(["a hanging rerun is stopped by pytest-timeout"])
        for design, conftest in designs.items():
            run = run_pytest(root / design / "timed", suites._TIMED, *TIMED, conftest=conftest)
            rows[-1].append(run.attempts().get("hangs") == 2 and "Failed: Timeout" in run.result.stdout)
        rows.append(["JUnit XML: one test case per test, with its last outcome"])
        for design, conftest in designs.items():
            xml = root / design / "junit" / "junit.xml"
            run_pytest(xml.parent, junit._LOSE_PORTS, f"--junitxml={xml}", conftest=conftest)
            cases = [case.find("failure") is not None for case in ET.parse(xml).getroot().iter("testcase")]
            rows[-1].append(sorted(cases) == [False, False, True])
        rows.append(["a script's captured output, never its command line, tells a port conflict"])
        for design, conftest in designs.items():
            run = run_pytest(root / design / "children", evidence._CHILDREN, "-k", "not spawned", conftest=conftest)
            rows[-1].append(run.attempts() == {**dict.fromkeys(("run", "check_output"), 2), **CHILDREN_FAIL})
        rows.append(["a shared fixture: never a replay of its cached error"])
        for design, conftest in designs.items():
            run = run_pytest(root / design / "fixtures", fixtures._SHARED, conftest=conftest)
            reruns = [test for test, _, outcome in run.outcomes() if outcome == "rerun"]
            rows[-1].append(sorted(reruns) == ["test_inner.py::TestClassStore::test_last", "test_inner.py::test_last"])
    parts = {  # the protocol design's code, by what it is for
        "deciding and rerunning": [
            _port_reruns.is_port_conflict,
            _port_reruns._Reruns,
            _port_reruns.pytest_runtest_protocol,
            _port_reruns.pytest_fixture_setup,
            _port_reruns.pytest_runtest_makereport,
            _port_reruns.pytest_report_teststatus,
            _port_reruns._reruns_allowed,
            _port_reruns._attempt,
            _port_reruns._Attempt.__init__,
            _port_reruns._Attempt.reruns_for,
        ],
        "clean-up before a rerun": [
            _port_reruns.pytest_runtest_call,
            _port_reruns._Attempt.before_call,
            _port_reruns._Attempt.clean_up,
            _port_reruns._process_group_initialized,
        ],
        "enabling, settings and summary": [
            _port_reruns.register,
            _port_reruns.pytest_configure,
            _port_reruns.pytest_terminal_summary,
        ],
    }
    sizes = {part: sum(_code_lines(textwrap.dedent(inspect.getsource(f))) for f in fs) for part, fs in parts.items()}
    print("| behaviour | marker | protocol |\n|---|---|---|")
    for label, *held in rows:
        print(f"| {label} | " + " | ".join("holds" if h else "**fails**" for h in held) + " |")
    held = [sum(row[i] for row in rows) for i in (1, 2)]
    print(f"| behaviours that hold | {held[0]} of {len(rows)} | {held[1]} of {len(rows)} |")
    marker = {"deciding and rerunning": str(_code_lines(MARKER_DESIGN))}
    marker["clean-up before a rerun"] = "not written: needs pytest-rerunfailures' count of attempts"
    marker["enabling, settings and summary"] = "not written"
    for part, size in sizes.items():
        print(f"| lines of code: {part} | {marker[part]} | {size} |")


if __name__ == "__main__":
    main()
