"""Build and install the fork's wheel, always through the in-tree PEP 517 backend, so there is one build path."""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
from pathlib import Path

from patchset import PatchsetError
from patchset.build_label import build_pin
from patchset.flavours import PACKAGE_NAME_ENV
from patchset.pin import read_pin


def build(project: Path, dist: Path, flavour: str | None = None) -> Path:
    """Build the fork's wheel into ``dist`` with ``pip wheel`` and return its path.

    ``flavour`` (``pytorch`` or ``fabric``) builds the ``pytorch-lightning`` or ``lightning-fabric`` distribution.
    """
    pin = build_pin(project, read_pin(project))
    dist.mkdir(parents=True, exist_ok=True)
    env = {k: v for k, v in os.environ.items() if k != PACKAGE_NAME_ENV}
    if flavour:
        env[PACKAGE_NAME_ENV] = flavour
    with tempfile.TemporaryDirectory() as tmp:
        cmd = [sys.executable, "-m", "pip", "wheel", "--no-deps", "--wheel-dir", tmp, str(project)]
        proc = subprocess.run(cmd, capture_output=True, text=True, env=env)
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


def install(project: Path, dist: Path, python: str | None, extra_args: list[str], flavour: str | None = None) -> Path:
    """Build the wheel first, then install it (into the environment of ``python``): a failed build installs nothing.

    The fork itself is always reinstalled; its dependencies are installed where missing (pin torch first, or pip
    picks a CUDA build).
    """
    wheel = build(project, dist, flavour)
    pip = [sys.executable, "-m", "pip", *(["--python", python] if python else []), "install"]
    for step in (["--force-reinstall", "--no-deps", str(wheel)], [str(wheel)]):
        if subprocess.run([*pip, *step, *extra_args]).returncode != 0:
            raise PatchsetError(f"pip could not install {wheel.name}")
    return wheel
