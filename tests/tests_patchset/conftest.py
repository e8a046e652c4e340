"""Fixtures for the patch set tooling's tests: real git, the real pinned sdist, throwaway copies of this project."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from patchset_helpers import REPO, TOOLS, copy_project

from patchset.pin import fetch_sdist, read_pin


@pytest.fixture(scope="session")
def upstream_sdist() -> Path:
    """The real pinned sdist (downloaded once into the cache)."""
    return fetch_sdist(read_pin(REPO))


@pytest.fixture
def project(tmp_path: Path, upstream_sdist: Path) -> Path:
    """A throwaway copy of this project: pin, series and patches, the tool; no new files."""
    return copy_project(tmp_path / "project")


@pytest.fixture
def run_cli():
    """Run ``python -m patchset`` as a user would, in a subprocess; returns the completed process."""

    def run(project: Path, *args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
        full_env = {**os.environ, "PYTHONPATH": str(TOOLS), **(env or {})}
        cmd = [sys.executable, "-m", "patchset", "--project", str(project), *args]
        return subprocess.run(cmd, capture_output=True, text=True, env=full_env)

    return run
