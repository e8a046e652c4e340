"""mypy and ruff as upstream runs them: real tools in a venv the tool makes, on a branch and its base in real git."""

import json
import sys
from pathlib import Path

import pytest
from patchset_helpers import git, write
from test_upstream_ci import CODE_CHECKS, PRE_COMMIT

from patchset.upstream_checks import Finding, attribute, parse_mypy, parse_ruff_check, parse_ruff_format
from patchset.upstream_envs import cached_venv, installed_version, ruff_environment
from patchset.upstream_record import Context, caused_count
from patchset.upstream_tests import _check_job


def test_mypy_errors_are_findings_and_notes_are_not():
    output = (
        'src/a.py:3: error: Incompatible return value type (got "int", expected "str")  [return-value]\n'
        "src/a.py:3: note: See https://mypy.readthedocs.io\n"
        "src/b.py:10:5: error: Name 'x' is not defined  [name-defined]\n"
        "Found 2 errors in 2 files (checked 3 source files)\n"
    )
    assert parse_mypy(output) == [
        Finding("src/a.py", 3, "return-value", 'Incompatible return value type (got "int", expected "str")'),
        Finding("src/b.py", 10, "name-defined", "Name 'x' is not defined"),
    ]


def test_a_finding_is_the_patchs_unless_the_base_has_it_wherever_its_line_moved():
    old = Finding("src/a.py", 3, "F401", "`os` imported but unused")
    base = [old, Finding("src/a.py", 9, "E501", "Line too long")]
    moved = Finding("src/a.py", 5, "F401", "`os` imported but unused")  # two lines added above it
    again = Finding("src/a.py", 7, "F401", "`os` imported but unused")  # a second one of the same kind
    assert attribute([moved, again], base) == [(moved, False), (again, True)]


def test_ruff_output_is_parsed_relative_to_the_checkout(tmp_path: Path):
    report = [
        {"code": "F401", "message": "`os` imported but unused", "filename": str(tmp_path / "src/a.py"),
         "location": {"row": 1, "column": 8}, "fix": {"applicability": "safe"}},
        {"code": None, "message": "SyntaxError: bad", "filename": str(tmp_path / "b.py"), "location": {"row": 2}},
    ]  # fmt: skip
    assert parse_ruff_check(json.dumps(report), tmp_path) == [
        Finding("src/a.py", 1, "F401", "`os` imported but unused (fixable)"),
        Finding("b.py", 2, "syntax", "SyntaxError: bad"),
    ]
    assert parse_ruff_format("Would reformat: src/a.py\n1 file would be reformatted\n") == [
        Finding("src/a.py", 0, "format", "would be reformatted")
    ]


@pytest.fixture(scope="module")
def linters(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """ruff at the version the hooks pin and mypy, in a venv the tool's own mechanism makes (a small real install)."""
    return cached_venv("lint-test", [b"mypy"], sys.executable, [["install", "-q", "ruff==0.15.9", "mypy"]])


@pytest.mark.slow
def test_mypy_and_ruff_on_the_branch_and_the_base_attribute_each_finding(linters: Path, tmp_path: Path):
    onto = tmp_path / "upstream"
    write(onto / ".github/workflows/code-checks.yml", CODE_CHECKS)
    write(onto / ".pre-commit-config.yaml", PRE_COMMIT)
    write(onto / "pyproject.toml", '[tool.ruff]\nline-length = 120\n\n[tool.mypy]\nfiles = ["src/pkg"]\n')
    write(onto / "src/pkg/__init__.py", "import os\n\n\ndef old() -> str:\n    return 1\n")  # F401, return-value
    write(onto / "docs/conf.py", "import sys\n")  # tracked Python outside src/ is checked too
    git(tmp_path, "init", "-q", "-b", "master", str(onto))
    git(onto, "add", "-A")
    git(onto, "commit", "-qm", "upstream")
    base = git(onto, "rev-parse", "HEAD")
    # the patch adds a line above the old findings (they move) and one finding of each tool
    write(onto / "src/pkg/__init__.py", "import os\nimport json\n\n\ndef old() -> str:\n    return 1\n\n\n"
          'def new() -> int:\n    return "x"\n')  # fmt: skip
    write(onto / "src/pkg/ugly.py", "X = [1,2]\n")
    git(onto, "add", "-A")
    git(onto, "commit", "-qm", "the patch")
    context = Context("0002-x.patch", "0" * 40, base, "upstream")

    def on_base() -> None:
        git(onto, "checkout", "-q", "--detach", base)

    ruff, _ = _check_job("ruff", context, onto, linters, on_base)
    assert sorted((f.path, f.code) for f in ruff.caused) == [
        ("src/pkg/__init__.py", "F401"),  # json
        ("src/pkg/ugly.py", "format"),
    ]
    assert {(f.path, f.code) for f in ruff.on_base} == {("src/pkg/__init__.py", "F401"), ("docs/conf.py", "F401")}
    section = ruff.markdown()
    assert caused_count(section) == 2
    assert "| `src/pkg/ugly.py` | **the patch** | `format` would be reformatted |" in section
    assert "on the 3 tracked Python files" in section
    assert "| installed as | ruff 0.15.9 (`.pre-commit-config.yaml` pins 0.15.9) |" in section

    git(onto, "checkout", "-q", "master")
    mypy, _ = _check_job("mypy", context, onto, linters, on_base)
    assert [(f.path, f.line, f.code) for f in mypy.caused] == [("src/pkg/__init__.py", 10, "return-value")]
    assert [(f.path, f.line, f.code) for f in mypy.on_base] == [("src/pkg/__init__.py", 5, "return-value")]
    rows = [line for line in mypy.markdown().splitlines() if line.startswith("| `src")]
    assert rows == [
        '| `src/pkg/__init__.py:10` | **the patch** | `return-value` Incompatible return value type (got "str",'
        ' expected "int") |',
        "| `src/pkg/__init__.py:6` | pre-existing (on the base too) | `return-value` Incompatible return value type"
        ' (got "int", expected "str") |',
    ]
    assert git(onto, "status", "--porcelain") == ""  # nothing of either tool is left in the checkout


@pytest.mark.slow
def test_the_ruff_venv_holds_the_release_the_hooks_pin():
    python = ruff_environment("0.15.9")
    assert installed_version(python, "ruff") == "0.15.9"
    assert ruff_environment("0.15.9") == python  # made once
