"""The README's uv lines resolve as written, against a clone of this repository (which has no tags).

test_docs checks that every pin is the newest release's commit and that a clone has it; test_release installs such
pins with the pip a new venv bundles. Here uv resolves the README's requirements.txt and PEP 621 lines themselves.
"""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import pytest
from patchset_helpers import REPO

URL = "https://github.com/lightning-patchset/lightning-patchset"
README = (REPO / "README.md").read_text(encoding="utf-8")


def _block(marker: str) -> str:
    """The README's fenced block that starts with the comment line ``marker``."""
    (block,) = [b for b in re.findall(r"```\w*\n(.*?)```", README, flags=re.S) if b.startswith(marker)]
    return block


def _release_commit() -> str:
    """The commit of the newest release, under its CHANGELOG heading."""
    changelog = (REPO / "CHANGELOG.md").read_text(encoding="utf-8")
    return re.findall(r"^Commit: `([0-9a-f]{40})`", changelog, flags=re.M)[0]


@pytest.fixture
def clone_url(tmp_path: Path) -> str:
    """A clone of this repository, as the README's URL would give it, as a ``file://`` URL.

    The URL names a host: the pip that a new venv bundles (23.2) rejects a ``git+file:///`` URL without one.
    """
    clone = tmp_path / "lightning-patchset"
    subprocess.run(["git", "clone", "-q", "--bare", str(REPO), str(clone)], check=True)
    return f"file://localhost{clone}"


def _local(line: str, clone_url: str) -> str:
    return line.replace(f"{URL}.git", clone_url).replace(URL, clone_url)


@pytest.mark.slow
def test_the_requirements_and_pep_621_lines_resolve_with_uv(clone_url: str, tmp_path: Path):
    uv = shutil.which("uv")
    if uv is None:
        pytest.skip("uv is not installed (tests/requirements.txt installs it)")
    requirements = _block("# requirements.txt")
    # the CPU index is for the user's torch; here only the fork's line is resolved, without its dependencies
    (line,) = [line for line in requirements.splitlines() if line.startswith("lightning @")]
    (tmp_path / "requirements.txt").write_text(_local(line, clone_url) + "\n")
    pyproject = _block("# pyproject.toml")
    (dependency,) = re.findall(r"dependencies = \[\"(.+?)\"\]", pyproject)
    (tmp_path / "pyproject.toml").write_text(
        f'[project]\nname = "app"\nversion = "0"\ndependencies = ["{_local(dependency, clone_url)}"]\n'
    )
    for source in ("requirements.txt", "pyproject.toml"):
        proc = subprocess.run(
            [uv, "pip", "compile", "--no-deps", "--no-header", "--quiet", source],
            capture_output=True,
            text=True,
            cwd=tmp_path,
        )
        assert proc.returncode == 0, proc.stderr[-3000:]
        assert f"lightning @ git+{clone_url}@{_release_commit()}" in proc.stdout, proc.stdout
