"""Releases: `release` tags a commit and moves the label; users pin a tag or a commit, as the README shows."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from patchset_helpers import FORK, git, pip, run_python, write

from patchset.pin import read_pin

CHANGELOG = """# Changelog

## [Unreleased]

### Fixed

- Something users asked for.
"""
NEXT = f"{FORK.rsplit('.', 1)[0]}.{int(FORK.rsplit('.', 1)[1]) + 1}"  # 2.6.6+patchset.1 -> 2.6.6+patchset.2


@pytest.fixture
def checkout(demo_project: Path) -> Path:
    """The throwaway project as a git checkout with a CHANGELOG, one commit on main."""
    write(demo_project / "CHANGELOG.md", CHANGELOG)
    git(demo_project, "init", "-q", "-b", "main")
    git(demo_project, "add", "-A")
    git(demo_project, "commit", "-qm", "fork")
    return demo_project


def test_release_tags_the_commit_then_moves_the_label(checkout: Path, run_cli):
    proc = run_cli(checkout, "release", "--date", "2026-12-01")
    assert proc.returncode == 0, proc.stderr
    tag = f"v{FORK}"
    released = git(checkout, "rev-parse", f"{tag}^{{commit}}")
    head = git(checkout, "rev-parse", "HEAD")  # the commit that starts the next label, one after the release
    assert proc.stdout.splitlines() == [
        f"released {FORK}: tag {tag} at {released[:12]}; this checkout now builds {FORK}.1.g{head[:7]}",
        f"nothing was pushed; to publish: git push origin HEAD {tag} (the release workflow attaches the wheels)",
    ]
    # the tagged commit is the release: its CHANGELOG names it, its pin builds it
    assert (
        git(checkout, "show", f"{tag}:CHANGELOG.md")
        == CHANGELOG.replace("## [Unreleased]", f"## [{FORK}] - 2026-12-01").strip()
    )
    assert f"local-version = {FORK.split('+')[1]}" in git(checkout, "show", f"{tag}:patches/upstream.pin")
    assert git(checkout, "tag", "-l", "--format=%(contents)", tag).splitlines() == [
        f"Lightning patch set {FORK}",
        "",
        "### Fixed",
        "",
        "- Something users asked for.",
    ]
    # the commit after it builds the next label, with an empty [Unreleased] section
    assert git(checkout, "rev-parse", "HEAD~1") == released
    assert read_pin(checkout).fork_version == NEXT
    # under the release's heading, its full commit hash, which users pin: a clone of main has it, and no tags
    assert (
        (checkout / "CHANGELOG.md")
        .read_text()
        .startswith(
            f"# Changelog\n\n## [Unreleased]\n\n## [{FORK}] - 2026-12-01\n\nCommit: `{released}`\n\n### Fixed\n"
        )
    )
    assert git(checkout, "status", "--porcelain") == ""
    again = run_cli(checkout, "release")
    assert again.returncode == 1
    assert again.stderr == (
        f"patchset: error: CHANGELOG.md: nothing under `## [Unreleased]`: say what {NEXT} changes first\n"
    )


def test_release_refuses_uncommitted_work_an_existing_tag_and_a_bad_date(checkout: Path, run_cli):
    (checkout / "README.md").write_text("edited\n")
    proc = run_cli(checkout, "release")
    assert (proc.returncode, proc.stderr) == (
        1,
        f"patchset: error: {checkout} has uncommitted changes: a release is a commit; commit or stash them first\n",
    )
    git(checkout, "checkout", "README.md")
    git(checkout, "tag", f"v{FORK}")
    proc = run_cli(checkout, "release")
    assert proc.returncode == 1
    assert proc.stderr.startswith(f"patchset: error: v{FORK} exists already (at ")
    assert proc.stderr.endswith("bump local-version in patches/upstream.pin\n")
    assert run_cli(checkout, "release", "--date", "1 Dec").stderr == (
        "patchset: error: --date '1 Dec': expected YYYY-MM-DD\n"
    )


@pytest.mark.slow
def test_a_tag_and_a_commit_pin_install_from_a_fresh_venv(checkout: Path, run_cli, bundled_pip_venv: Path):
    """The README's pins, with a local clone's URL: the release commit that the CHANGELOG names, in requirements.txt,
    and a later commit in pyproject.toml; the clone has no tags, as a clone of the published repository has none."""
    assert run_cli(checkout, "release", "--date", "2026-12-01").returncode == 0
    clone = checkout.parent / "clone"
    git(checkout.parent, "clone", "-q", "--no-tags", str(checkout), str(clone))
    assert git(clone, "tag", "-l") == ""
    released = re.search(r"^Commit: `([0-9a-f]{40})`$", (clone / "CHANGELOG.md").read_text(), re.MULTILINE).group(1)
    url = f"git+file://localhost{clone.as_posix()}"  # pip before 24.1 refuses git+file:///<path>
    requirements = write(checkout.parent / "requirements.txt", f"lightning @ {url}@{released}\n")
    proc = pip(bundled_pip_venv, "install", "--no-deps", "--no-build-isolation", "-r", str(requirements))
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert run_python(bundled_pip_venv, "import lightning; print(lightning.__version__)") == FORK

    commit = git(clone, "rev-parse", "HEAD")  # after the release: its label, one commit since, and the commit
    consumer = checkout.parent / "consumer"
    write(
        consumer / "pyproject.toml",
        f'[project]\nname = "consumer"\nversion = "1"\ndependencies = ["lightning @ {url}@{commit}"]\n'
        "[tool.setuptools]\npy-modules = []\n",
    )
    proc = pip(bundled_pip_venv, "install", "--no-build-isolation", str(consumer))
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert run_python(bundled_pip_venv, "import lightning; print(lightning.__version__)") == f"{FORK}.1.g{commit[:7]}"
