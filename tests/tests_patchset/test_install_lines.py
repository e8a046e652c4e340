"""The README's install lines resolve as written, against a clone of this repository: what its users run.

Every pinned line names a release by its commit. A clone of the repository has the commits of main but no tags, so
a ref that is not one of its commits fails for pip, uv and Poetry alike.
"""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import pytest
from patchset_helpers import REPO, pip

from patchset.gitops import git

URL = "https://github.com/lightning-patchset/lightning-patchset"
README = (REPO / "README.md").read_text(encoding="utf-8")
# `git+<URL>@<ref>` in pip, uv and PEP 621 lines; `rev = "<ref>"` in Poetry's table
REFS = re.findall(rf"git\+{re.escape(URL)}(?:\.git)?@([^\s\"']+)", README) + re.findall(r'rev = "([^"]+)"', README)


def _block(marker: str) -> str:
    """The README's fenced block that starts with the comment line ``marker``."""
    (block,) = [b for b in re.findall(r"```\w*\n(.*?)```", README, flags=re.S) if b.startswith(marker)]
    return block


def _release_commit() -> str:
    """The commit of the newest release, under its CHANGELOG heading."""
    changelog = (REPO / "CHANGELOG.md").read_text(encoding="utf-8")
    return re.findall(r"^Commit: `([0-9a-f]{40})`", changelog, flags=re.M)[0]


def test_every_pinned_line_names_the_newest_release_by_its_full_commit():
    assert len(REFS) >= 6  # pip (3 distributions), uv, requirements.txt, PEP 621, Poetry
    assert set(REFS) == {_release_commit()}


def test_the_release_commit_is_a_commit_of_main_in_a_clone(tmp_path: Path):
    clone = tmp_path / "clone"
    subprocess.run(["git", "clone", "-q", "--no-checkout", str(REPO), str(clone)], check=True)
    assert git(clone, "for-each-ref", "--format=%(refname)", "refs/tags").stdout == b""  # a clone has no tags
    commit = _release_commit()
    assert git(clone, "cat-file", "-t", commit).stdout.decode().strip() == "commit"
    assert git(clone, "merge-base", "--is-ancestor", commit, "HEAD", check=False).returncode == 0


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
def test_the_pip_lines_resolve_with_the_pip_a_new_venv_bundles(bundled_pip_venv: Path, clone_url: str, tmp_path: Path):
    fork_lines = re.findall(r"^(?:PACKAGE_NAME=\w+ )?pip install \"(.+?)\"$", _block('pip install "lightning'), re.M)
    assert len(fork_lines) == 3
    requirement = _local(fork_lines[0], clone_url)
    proc = pip(bundled_pip_venv, "download", "--no-deps", "-d", str(tmp_path / "dl"), requirement)
    assert proc.returncode == 0, proc.stderr[-3000:]
    (built,) = (tmp_path / "dl").iterdir()
    assert built.name.startswith("lightning-2.6.6+patchset.1")


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
