"""The README's commands to check for the fork, replace a leftover unpatched copy and go back to stock, as written;
and the warning the fork's ``lightning`` gives at import while an unpatched copy sits beside it."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest
from patchset_helpers import FORK, REPO, pip

pytestmark = pytest.mark.slow

CHECK = 'python -m pip list | grep -iE "^(lightning|pytorch-lightning|lightning-fabric) "'
REPLACE = "python -m pip uninstall -y pytorch-lightning lightning-fabric"
GO_BACK = (
    "python -m pip uninstall -y lightning pytorch-lightning lightning-fabric"
    ' && python -m pip install "lightning===2.6.6"'
)
STOCK = ("lightning===2.6.6", "pytorch-lightning===2.6.6", "lightning-fabric===2.6.6")


def _run(python: Path, command: str) -> subprocess.CompletedProcess[str]:
    """``command`` in a shell with the venv of ``python`` activated, as a user runs it."""
    path = f"{python.parent}{os.pathsep}{os.environ['PATH']}"
    env = {**os.environ, "PATH": path, "VIRTUAL_ENV": str(python.parents[1]), "PIP_DISABLE_PIP_VERSION_CHECK": "1"}
    proc = subprocess.run(["bash", "-c", command], capture_output=True, text=True, env=env, cwd="/")
    assert proc.returncode == 0, proc.stderr[-2000:]
    return proc


def _versions(python: Path) -> dict[str, str]:
    return dict(line.split()[:2] for line in _run(python, CHECK).stdout.splitlines())


def _import_warnings(python: Path) -> list[str]:
    """The fork's warnings about an unpatched copy that ``import lightning`` writes to stderr."""
    proc = subprocess.run([python, "-c", "import lightning"], capture_output=True, text=True, cwd="/")
    assert proc.returncode == 0, proc.stderr[-2000:]
    return [line for line in proc.stderr.splitlines() if "installed beside the patch set's lightning" in line]


def _install_stock_then_fork(python: Path, fork_wheels: dict[str, Path]) -> None:
    if pip(python, "install", "--no-deps", *STOCK).returncode != 0:
        pytest.skip("the index has no lightning 2.6.6")
    proc = pip(python, "install", "--no-deps", str(fork_wheels["lightning"]))  # the fork over stock
    assert proc.returncode == 0, proc.stderr[-2000:]


def test_check_replace_and_go_back(fork_wheels: dict[str, Path], bundled_pip_venv: Path):
    readme = (REPO / "README.md").read_text(encoding="utf-8")
    assert all(command in readme for command in (CHECK, REPLACE, GO_BACK))
    python = bundled_pip_venv
    _install_stock_then_fork(python, fork_wheels)

    # the check shows the leftover unpatched copies: no `+patchset` label; importing the fork says so, once
    assert _versions(python) == {"lightning": FORK, "lightning-fabric": "2.6.6", "pytorch-lightning": "2.6.6"}
    (warning,) = _import_warnings(python)
    assert "pytorch-lightning 2.6.6 and lightning-fabric 2.6.6 are installed beside" in warning, warning
    assert f"`{REPLACE.removeprefix('python -m ')}`" in warning, warning
    _run(python, REPLACE)
    assert _versions(python) == {"lightning": FORK}
    assert _import_warnings(python) == []

    # the fork's three distributions side by side: one version, no warning
    proc = pip(python, "install", "--no-deps", *(str(wheel) for wheel in fork_wheels.values()))
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert _versions(python) == {"lightning": FORK, "lightning-fabric": FORK, "pytorch-lightning": FORK}
    assert _import_warnings(python) == []

    _run(python, GO_BACK)  # `==2.6.6` would be "already satisfied" by any 2.6.6+patchset.N left; `===` is not
    back = _versions(python)  # stock's own dependency comes back with it
    assert back == {"lightning": "2.6.6", "pytorch-lightning": "2.6.6"}, back
