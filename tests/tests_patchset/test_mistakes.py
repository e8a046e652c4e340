"""A user's mistakes get one line saying what to do: the tests or the demo run where stock Lightning is installed."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from patchset_helpers import REPO, write


@pytest.fixture
def stock_first(tmp_path: Path) -> dict[str, str]:
    """An environment whose ``lightning`` (module and distribution) is stock's 2.6.6, ahead of the installed fork."""
    write(tmp_path / "lightning" / "__init__.py", '__version__ = "2.6.6"\n')
    metadata = "Metadata-Version: 2.1\nName: lightning\nVersion: 2.6.6\n"
    write(tmp_path / "lightning-2.6.6.dist-info" / "METADATA", metadata)
    return {**os.environ, "PYTHONPATH": str(tmp_path)}


def _one_line(proc: subprocess.CompletedProcess[str]) -> str:
    lines = [line for line in (proc.stdout + proc.stderr).splitlines() if line.strip()]
    assert len(lines) == 1, lines
    return lines[0]


def test_the_tests_without_the_fork_stop_at_once_with_one_line(stock_first: dict[str, str]):
    cmd = [sys.executable, "-m", "pytest", "-n", "2", str(REPO / "tests")]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=stock_first, cwd=REPO, timeout=120)
    assert proc.returncode == 4
    assert "install the fork first: `pip install .` (lightning is 2.6.6)" in _one_line(proc)


def test_the_demo_on_stock_says_so_in_one_line(stock_first: dict[str, str]):
    proc = subprocess.run([sys.executable, str(REPO / "demo" / "fixes.py")], capture_output=True, text=True,
                          env=stock_first, cwd="/", timeout=120)  # fmt: skip
    assert proc.returncode == 1
    assert _one_line(proc).endswith("this lightning is 2.6.6, not the patch set's fork (a `+patchset` version):"
                                    " install the fork first, `pip install .`")  # fmt: skip


def _beside_the_fork(tmp_path: Path, name: str, version: str) -> dict[str, str]:
    """An environment in which ``name`` ``version`` is installed beside the fork (its metadata only)."""
    folder = tmp_path / f"{name.replace('-', '_')}-{version}.dist-info"
    write(folder / "METADATA", f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n")
    environ = {k: v for k, v in os.environ.items() if k != "LIGHTNING_PATCHSET_WARNED_UNPATCHED"}
    return {**environ, "PYTHONPATH": str(tmp_path)}


def test_stock_beside_the_fork_is_one_warning_even_where_warnings_are_errors(tmp_path: Path):
    env = _beside_the_fork(tmp_path, "lightning-fabric", "2.6.6")
    for flags in ([], ["-W", "error"]):  # `-W error`: the import still works, and says it once
        proc = subprocess.run([sys.executable, *flags, "-c", "import lightning"], capture_output=True, text=True,
                              env=env, cwd="/", timeout=120)  # fmt: skip
        assert proc.returncode == 0, proc.stderr[-2000:]
        (line,) = [line for line in proc.stderr.splitlines() if "installed beside" in line]
        assert "lightning-fabric 2.6.6 is installed beside the patch set's lightning " in line
        assert "`import lightning_fabric` runs that code, without this build's fixes" in line
        assert "run `pip uninstall -y lightning-fabric`" in line


def test_the_forks_build_of_another_commit_beside_it_is_not_called_stock(tmp_path: Path):
    env = _beside_the_fork(tmp_path, "pytorch-lightning", "2.6.6+patchset.1.200.gdeadbee")
    proc = subprocess.run([sys.executable, "-c", "import lightning"], capture_output=True, text=True, env=env, cwd="/")
    (line,) = [line for line in proc.stderr.splitlines() if "installed beside" in line]
    assert "install all three of the fork's distributions from one commit" in line
    assert "uninstall" not in line
