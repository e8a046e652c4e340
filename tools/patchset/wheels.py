"""Build and install the fork's wheel, always through the in-tree PEP 517 backend, so there is one build path."""

from __future__ import annotations

import subprocess
import sys
import tempfile
from pathlib import Path

from patchset import PatchsetError
from patchset.pin import read_pin


def build(project: Path, dist: Path) -> Path:
    """Build the fork's wheel into ``dist`` with ``pip wheel`` and return its path."""
    pin = read_pin(project)
    dist.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        cmd = [sys.executable, "-m", "pip", "wheel", "--no-deps", "--wheel-dir", tmp, str(project)]
        proc = subprocess.run(cmd, capture_output=True, text=True)
        wheels = list(Path(tmp).glob("*.whl"))
        if proc.returncode != 0 or len(wheels) != 1:
            # the backend's own one-line reason, if it gave one; otherwise pip's whole report
            ours = [
                line.split("patchset: error: ", 1)[1]
                for line in proc.stderr.splitlines()
                if "patchset: error: " in line
            ]
            raise PatchsetError(ours[0] if ours else f"pip wheel failed:\n{proc.stderr}")
        wheel = dist / wheels[0].name
        wheels[0].replace(wheel)
    if f"-{pin.fork_version}-" not in wheel.name:
        raise PatchsetError(f"{wheel.name}: expected version {pin.fork_version} in the wheel's name")
    return wheel


def install(project: Path, dist: Path, python: str | None, extra_args: list[str]) -> Path:
    """Build the wheel first, then install it (into the environment of ``python``): a failed build installs nothing.

    Only the fork is (re)installed; its dependencies are installed if missing.
    """
    wheel = build(project, dist)
    target = ["--python", python] if python else []
    cmd = [sys.executable, "-m", "pip", *target, "install", "--force-reinstall", "--no-deps", str(wheel), *extra_args]
    if subprocess.run(cmd).returncode != 0:
        raise PatchsetError(f"pip could not install {wheel.name}")
    return wheel
