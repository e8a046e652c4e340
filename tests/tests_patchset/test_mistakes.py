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
