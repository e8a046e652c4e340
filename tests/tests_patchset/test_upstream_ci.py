"""What upstream's CI runs, read from its workflow files; the oldest job's pins and warning filters, really applied."""

import subprocess
import sys
from pathlib import Path

import pytest
from patchset_helpers import write

from patchset import PatchsetError
from patchset.upstream_ci import (
    mypy_job,
    oldest_constraints,
    oldest_filterwarnings,
    oldest_job,
    ruff_version,
)
from patchset.upstream_envs import find_python, oldest_files

# Workflow and hook files shaped as upstream's (the parts the tool reads), in words of our own.
CODE_CHECKS = """name: Code check
jobs:
  mypy:
    runs-on: ubuntu-22.04
    steps:
      - name: Install uv and set Python version
        with:
          python-version: "3.11"
      - name: Install dependencies
        run: |
          uv pip install '.[pytorch-all,fabric-all]' -r requirements/typing.txt
      - name: Check typing
        run: mypy
  other:
    steps:
      - name: Check typing
        run: something else
"""
TESTS_WORKFLOW = """name: Test Fabric
jobs:
  fabric-cpu:
    strategy:
      matrix:
        config:
          - { pkg-name: "fabric", python-version: "3.12", pytorch-version: "2.9" }
          - { pkg-name: "fabric", pytorch-version: "2.1", requires: "oldest" }
    steps:
      - name: Install uv and set Python version
        with:
          python-version: ${{ matrix.config.python-version || '3.10' }}
      - name: Set min. dependencies
        if: ${{ matrix.config.requires == 'oldest' }}
        run: |
          python -m lightning_utilities.cli requirements set-oldest \\
            --req_files "['requirements/fabric/base.txt', 'requirements/fabric/test.txt']"
"""
PRE_COMMIT = """repos:
  - repo: https://github.com/pre-commit/pre-commit-hooks
    rev: v6.0.0
  - repo: https://github.com/astral-sh/ruff-pre-commit
    rev: v0.15.9
    hooks:
      - id: ruff
"""
BASE = """# a comment with >= in it
torch >=2.1.0, <2.10.0
fsspec[http] >=2022.5.0, <2026.4.0
packaging >=23.0, <=26.0  # strict
typing-extensions >4.5.0, <4.16.0
"""
TEST = """coverage ==7.13.5; python_version >= "3.10"
numpy >1.21.0, <1.27.0; python_version < "3.12"
onnx-ir >= 0.1.16
-r ../other.txt
"""


@pytest.fixture
def checkout(tmp_path: Path) -> Path:
    write(tmp_path / ".github/workflows/code-checks.yml", CODE_CHECKS)
    write(tmp_path / ".github/workflows/ci-tests-fabric.yml", TESTS_WORKFLOW)
    write(tmp_path / ".pre-commit-config.yaml", PRE_COMMIT)
    write(tmp_path / "requirements/fabric/base.txt", BASE)
    write(tmp_path / "requirements/fabric/test.txt", TEST)
    return tmp_path


def test_the_jobs_are_read_from_upstreams_own_files(checkout: Path):
    job = mypy_job(checkout)
    assert (job.python, job.extras, job.requirements, job.command) == (
        "3.11",
        "pytorch-all,fabric-all",
        "requirements/typing.txt",
        ["mypy"],
    )
    assert ruff_version(checkout) == "0.15.9"
    oldest = oldest_job(checkout, "fabric")
    assert oldest.python == "3.10"
    assert oldest.requirement_files == ["requirements/fabric/base.txt", "requirements/fabric/test.txt"]


def test_a_workflow_of_another_shape_is_one_error_naming_the_file(checkout: Path):
    (checkout / ".github/workflows/code-checks.yml").write_text("jobs:\n  lint:\n    steps: []\n")
    with pytest.raises(PatchsetError, match=r"code-checks.yml no longer has a `mypy` job"):
        mypy_job(checkout)
    with pytest.raises(PatchsetError, match=r"ci-tests-pytorch.yml is missing"):
        oldest_job(checkout, "pytorch")


def test_the_oldest_pins_are_set_oldests_and_pip_resolves_them(checkout: Path, tmp_path: Path):
    constraints = oldest_constraints(checkout, oldest_job(checkout, "fabric").requirement_files)
    assert constraints.splitlines() == [
        "torch==2.1.0,<2.10.0",
        "fsspec==2022.5.0,<2026.4.0",  # pip constraints cannot carry extras
        "packaging==23.0,<=26.0",
        "onnx-ir==0.1.16",
    ]  # a `>=` only in a marker pins nothing; lines without `>=` are not constrained
    path = write(tmp_path / "constraints.txt", "packaging==23.0,<=26.0\n")
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "install",
            "--dry-run",
            "--no-deps",
            "--ignore-installed",
            "-c",
            str(path),
            "--report",
            "-",
            "-q",
            "packaging",
        ],
        capture_output=True,
        text=True,
    )
    assert proc.returncode == 0, proc.stderr
    assert '"version": "23.0"' in proc.stdout


def test_the_oldest_jobs_warning_filters_apply_in_a_real_pytest_run(tmp_path: Path):
    from patchset.upstream_tests import run_selection

    write(
        tmp_path / "pyproject.toml",
        '[tool.pytest.ini_options]\nfilterwarnings = [\n  "error::FutureWarning",\n'
        '  "ignore:harmless:UserWarning",\n]\n',
    )
    write(
        tmp_path / "tests/test_w.py", "import warnings\n\n\ndef test_w():\n    warnings.warn('soon', FutureWarning)\n"
    )
    filters = oldest_filterwarnings(tmp_path)
    assert filters == ["ignore:harmless:UserWarning"]
    newest = run_selection(Path(sys.executable), tmp_path, ["tests"], tmp_path / "newest.xml")
    oldest = run_selection(
        Path(sys.executable),
        tmp_path,
        ["tests"],
        tmp_path / "oldest.xml",
        ["-o", "filterwarnings=" + "\n".join(filters)],
    )
    assert newest["tests/test_w.py::test_w"].outcome == "failed"  # upstream's error::FutureWarning
    assert oldest["tests/test_w.py::test_w"].outcome == "passed"  # pruned, as the oldest job prunes it


def test_a_missing_python_of_the_jobs_version_is_one_error_naming_the_option(tmp_path: Path):
    assert find_python(f"{sys.version_info.major}.{sys.version_info.minor}") == sys.executable
    other = "3.10" if sys.version_info[:2] != (3, 10) else "3.11"
    with pytest.raises(PatchsetError, match=rf"runs Python {other}; .* is Python 3\.\d+: pass --oldest-python"):
        find_python(other, sys.executable)
    with pytest.raises(PatchsetError, match=r"no-such-python is not found"):
        find_python("3.10", str(tmp_path / "no-such-python"))


def test_only_the_files_the_install_reads_are_pinned():
    """Upstream's job rewrites examples.txt too, but installs no examples extra: its pins must not apply here."""
    files = [f"requirements/pytorch/{name}.txt" for name in ("base", "extra", "strategies", "examples", "test")]
    assert oldest_files(files, "pytorch") == [files[0], files[1], files[4]]
    assert oldest_files(["requirements/fabric/base.txt", "requirements/fabric/test.txt"], "fabric") == [
        "requirements/fabric/base.txt",
        "requirements/fabric/test.txt",
    ]
