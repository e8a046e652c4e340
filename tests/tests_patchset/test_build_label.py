"""The version a build carries: a release commit's is the release; a later commit's names the release and the commit."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest
from packaging.version import Version
from patchset_helpers import FORK, git, write

from patchset.build_label import build_pin
from patchset.pin import read_pin, write_pin

RELEASED_CHANGELOG = "# Changelog\n\n## [Unreleased]\n\n## [{version}] - 2026-12-01\n\nCommit: `{commit}`\n"


@pytest.fixture
def released(project: Path) -> tuple[Path, str]:
    """The throwaway project as a checkout at a release commit, then the commit that starts the next label."""
    write(project / "CHANGELOG.md", f"# Changelog\n\n## [{FORK}] - 2026-12-01\n\n### Fixed\n\n- A fix.\n")
    git(project, "init", "-q", "-b", "main")
    git(project, "add", "-A")
    git(project, "commit", "-qm", "Release")
    release = git(project, "rev-parse", "HEAD")
    assert build_pin(project, read_pin(project)).fork_version == FORK  # the release commit builds the release

    pin = read_pin(project)
    label = int(pin.local_version.removeprefix("patchset."))
    write_pin(project, replace(pin, local_version=f"patchset.{label + 1}"))
    write(project / "CHANGELOG.md", RELEASED_CHANGELOG.format(version=FORK, commit=release))
    git(project, "commit", "-qam", "Start the next label")
    return project, release


def test_a_commit_after_the_release_names_the_release_the_commits_since_and_itself(released: tuple[Path, str]):
    project, _ = released
    write(project / "README.md", "a change\n")
    git(project, "commit", "-qam", "a change")
    head = git(project, "rev-parse", "HEAD")
    version = build_pin(project, read_pin(project)).fork_version
    assert version == f"{FORK}.2.g{head[:7]}"
    assert Version(version) > Version(FORK)  # valid PEP 440, after the release
    assert Version(version).public == Version(FORK).public  # so `lightning==2.6.6` still matches it


def test_a_shallow_clone_without_the_release_commit_names_the_commit(released: tuple[Path, str], tmp_path: Path):
    project, _ = released
    clone = tmp_path / "shallow"
    git(tmp_path, "clone", "-q", "--depth=1", f"file://{project}", str(clone))
    head = git(clone, "rev-parse", "HEAD")
    assert build_pin(clone, read_pin(clone)).fork_version == f"{FORK}.g{head[:7]}"


def test_without_git_or_a_release_the_pin_names_the_build(released: tuple[Path, str], tmp_path: Path):
    project, _ = released
    no_git = tmp_path / "extracted"
    no_git.mkdir()
    for rel in ("patches/upstream.pin", "CHANGELOG.md"):
        write(no_git / rel, (project / rel).read_text())
    assert build_pin(no_git, read_pin(no_git)) == read_pin(no_git)  # a build from the sdist: its pin has the label

    write(project / "CHANGELOG.md", "# Changelog\n\n## [Unreleased]\n\n- Not released yet.\n")
    git(project, "commit", "-qam", "before any release")
    assert build_pin(project, read_pin(project)) == read_pin(project)
