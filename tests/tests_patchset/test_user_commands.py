"""The README's commands to check for the fork, replace a leftover unpatched copy and go back to stock, as written."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest
from patchset_helpers import FORK, REPO, pip

pytestmark = pytest.mark.slow

CHECK = 'python -m pip list | grep -iE "^(lightning|pytorch-lightning|lightning-fabric) "'
REPLACE = "python -m pip uninstall -y pytorch-lightning lightning-fabric"
GO_BACK = 'python -m pip install "lightning===2.6.6"'


def _run(python: Path, command: str) -> str:
    """``command`` in a shell whose ``python`` is the venv's, as a user with the venv activated runs it."""
    path = f"{python.parent}{os.pathsep}{os.environ['PATH']}"
    env = {**os.environ, "PATH": path, "PIP_DISABLE_PIP_VERSION_CHECK": "1"}
    proc = subprocess.run(["bash", "-c", command], capture_output=True, text=True, env=env, cwd="/")
    assert proc.returncode == 0, proc.stderr[-2000:]
    return proc.stdout


def _versions(listing: str) -> dict[str, str]:
    return dict(line.split()[:2] for line in listing.splitlines())


def test_check_replace_and_go_back(fork_wheels: dict[str, Path], bundled_pip_venv: Path):
    readme = (REPO / "README.md").read_text(encoding="utf-8")
    assert all(command in readme for command in (CHECK, REPLACE, GO_BACK))
    python = bundled_pip_venv
    stock = ("lightning==2.6.6", "pytorch-lightning==2.6.6", "lightning-fabric==2.6.6")
    if pip(python, "install", "--no-deps", *stock).returncode != 0:
        pytest.skip("the index has no lightning 2.6.6")
    proc = pip(python, "install", "--no-deps", str(fork_wheels["lightning"]))  # the fork over stock
    assert proc.returncode == 0, proc.stderr[-2000:]

    # the check shows the leftover unpatched copies: no `+patchset` label
    assert _versions(_run(python, CHECK)) == {
        "lightning": FORK,
        "lightning-fabric": "2.6.6",
        "pytorch-lightning": "2.6.6",
    }
    _run(python, REPLACE)
    assert _versions(_run(python, CHECK)) == {"lightning": FORK}
    _run(python, GO_BACK)  # `==2.6.6` would be "already satisfied" by 2.6.6+patchset.N; `===` is not
    back = _versions(_run(python, CHECK))  # stock's own dependencies come back with it
    assert back["lightning"] == "2.6.6"
    assert set(back.values()) == {"2.6.6"}, back
