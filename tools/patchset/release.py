"""Releases of the fork: a git tag for each, and a version label that moves with each.

The label (``local-version`` in ``patches/upstream.pin``, ``patchset.N``) is bumped by :func:`release`, not derived
from the series: a label computed from the patches (a count, a digest) would change with every commit that touches
them, name no decision, and a digest does not sort. :func:`release` tags the checkout's commit as the release its pin
names (``v2.6.6+patchset.N``, after the CHANGELOG's ``[Unreleased]`` section becomes that release's), then moves the
pin to ``patchset.N+1`` at once, and writes the release commit's full hash under the release's heading
(:func:`commit_line`): a build of a later commit then carries the release's label, the commits since and the commit
(``build_label``), never a released version. That hash is what users pin: a clone
of the repository has every commit of main but no tags, so a pin on the tag resolves only where the tag was pushed.
``rebase`` starts a new upstream version at ``patchset.1``. Nothing is pushed.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, replace
from datetime import datetime, timezone
from pathlib import Path

from patchset import PatchsetError
from patchset.build_label import build_pin
from patchset.check import check
from patchset.gitops import git, is_clean, out
from patchset.pin import PIN_FILE, read_pin, write_pin

CHANGELOG = Path("CHANGELOG.md")
_LABEL = re.compile(r"patchset\.([1-9][0-9]*)")
_UNRELEASED = re.compile(r"^## \[Unreleased\][^\n]*\n", re.MULTILINE)
_NEXT_SECTION = re.compile(r"^## \[", re.MULTILINE)


@dataclass(frozen=True)
class Release:
    """What :func:`release` did: the version it tagged, the tag, its commit, and the version a build carries now."""

    version: str
    tag: str
    commit: str
    next_version: str


def tag_name(version: str) -> str:
    """The git tag of a release: ``v`` and the version, e.g. ``v2.6.6+patchset.1``."""
    return f"v{version}"


def commit_line(commit: str) -> str:
    """The line under a release's CHANGELOG heading that names its commit, which users pin."""
    return f"Commit: `{commit}`"


def unreleased_notes(text: str) -> tuple[re.Match[str], str]:
    """The CHANGELOG's ``## [Unreleased]`` heading and the text of its section (empty when there is none)."""
    heading = _UNRELEASED.search(text)
    if heading is None:
        raise PatchsetError(f"{CHANGELOG}: no `## [Unreleased]` section to release")
    following = _NEXT_SECTION.search(text, heading.end())
    return heading, text[heading.end() : following.start() if following else len(text)].strip()


def release(project: Path, date: str | None = None) -> Release:
    """Tag the release the pin names on the checkout's commit, then move the pin to the next label.

    Refuses a checkout with uncommitted changes, a tag that exists already, a series that ``check`` rejects, and a
    CHANGELOG with nothing under ``[Unreleased]``. Commits and tags as your git identity.
    """
    if date is not None and not re.fullmatch(r"\d{4}-\d{2}-\d{2}", date):
        raise PatchsetError(f"--date {date!r}: expected YYYY-MM-DD")
    if not (project / ".git").exists():
        raise PatchsetError(f"{project} is not a git checkout: releases are tags of its commits")
    if not is_clean(project, isolated=False):
        raise PatchsetError(f"{project} has uncommitted changes: a release is a commit; commit or stash them first")
    pin = read_pin(project)
    label = _LABEL.fullmatch(pin.local_version)
    if label is None:
        raise PatchsetError(f"{PIN_FILE}: local-version {pin.local_version!r} is not `patchset.N`")
    version, tag = pin.fork_version, tag_name(pin.fork_version)
    existing = git(project, "rev-parse", "-q", "--verify", f"refs/tags/{tag}", check=False, isolated=False)
    if existing.returncode == 0:
        raise PatchsetError(
            f"{tag} exists already (at {existing.stdout.decode().strip()[:12]}): bump local-version in {PIN_FILE}"
        )
    failed = [finding.message for finding in check(project) if not finding.ok]
    if failed:
        raise PatchsetError(f"`check` fails ({failed[0]}); nothing was tagged")
    changelog = project / CHANGELOG
    text = changelog.read_text(encoding="utf-8")
    heading, notes = unreleased_notes(text)
    if not notes:
        raise PatchsetError(f"{CHANGELOG}: nothing under `## [Unreleased]`: say what {version} changes first")
    day = date or datetime.now(timezone.utc).date().isoformat()
    released = f"## [{version}] - {day}\n"
    changelog.write_text(text[: heading.start()] + released + text[heading.end() :], encoding="utf-8")
    git(project, "commit", "-q", "-m", f"Release {version}", "--", str(CHANGELOG), isolated=False)
    message = f"Lightning patch set {version}\n\n{notes}\n"  # `whitespace`: keep the notes' `###` headings
    git(project, "tag", "-a", "--cleanup=whitespace", "-m", message, tag, isolated=False)
    commit = out(project, "rev-parse", "HEAD", isolated=False)

    following = replace(pin, local_version=f"patchset.{int(label.group(1)) + 1}")
    write_pin(project, following)
    text = changelog.read_text(encoding="utf-8")
    released_with_commit = f"{released}\n{commit_line(commit)}\n"
    changelog.write_text(text.replace(released, "## [Unreleased]\n\n" + released_with_commit, 1), encoding="utf-8")
    message = f"Start {following.fork_version}: builds after the {tag} release carry the next label"
    git(project, "commit", "-q", "-m", message, "--", str(CHANGELOG), str(PIN_FILE), isolated=False)
    return Release(version, tag, commit, build_pin(project, following).fork_version)
