"""``release``: tag the checkout's commit as the release the pin names, then move the pin to the next label.

The label (``local-version``, ``patchset.N``) is bumped here rather than derived from the series (a count or a digest
would change with every commit that touches the patches, name no decision, and a digest does not sort). The release
commit's full hash goes under its CHANGELOG heading: users pin that hash, which names the release for good, tag or no.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, replace
from datetime import datetime, timezone
from pathlib import Path

from patchset import PatchsetError
from patchset.build_label import CHANGELOG, build_pin
from patchset.check import check
from patchset.gitops import git, is_clean, out, verify
from patchset.pin import PIN_FILE, read_pin, write_pin

_UNRELEASED = re.compile(r"^## \[Unreleased\][^\n]*\n", re.MULTILINE)


@dataclass(frozen=True)
class Release:
    """What :func:`release` did: the version it tagged, the tag, its commit, and the version a build carries now."""

    version: str
    tag: str
    commit: str
    next_version: str


def unreleased_notes(text: str) -> tuple[re.Match[str], str]:
    """The CHANGELOG's ``## [Unreleased]`` heading and the text of its section."""
    heading = _UNRELEASED.search(text)
    if heading is None:
        raise PatchsetError(f"{CHANGELOG}: no `## [Unreleased]` section to release")
    following = re.compile(r"^## \[", re.MULTILINE).search(text, heading.end())
    return heading, text[heading.end() : following.start() if following else len(text)].strip()


def release(project: Path, date: str | None = None) -> Release:
    """Tag the release the pin names on the checkout's commit (``v<version>``), then move the pin to the next label.

    Refuses a bad date, uncommitted changes, an existing tag, a series ``check`` rejects and an empty
    ``[Unreleased]``. Commits and tags as your git identity; pushes nothing.
    """
    if date is not None and not re.fullmatch(r"\d{4}-\d{2}-\d{2}", date):
        raise PatchsetError(f"--date {date!r}: expected YYYY-MM-DD")
    if not (project / ".git").exists():
        raise PatchsetError(f"{project} is not a git checkout: releases are tags of its commits")
    if not is_clean(project, isolated=False):
        raise PatchsetError(f"{project} has uncommitted changes: a release is a commit; commit or stash them first")
    pin = read_pin(project)
    label = re.fullmatch(r"patchset\.([1-9][0-9]*)", pin.local_version)
    if label is None:
        raise PatchsetError(f"{PIN_FILE}: local-version {pin.local_version!r} is not `patchset.N`")
    version, tag = pin.fork_version, f"v{pin.fork_version}"
    if existing := verify(project, f"refs/tags/{tag}"):
        raise PatchsetError(f"{tag} exists already (at {existing[:12]}): bump local-version in {PIN_FILE}")
    failed = [finding.message for finding in check(project) if not finding.ok]
    if failed:
        raise PatchsetError(f"`check` fails ({failed[0]}); nothing was tagged")
    changelog = project / CHANGELOG
    text = changelog.read_text(encoding="utf-8")
    heading, notes = unreleased_notes(text)
    if not notes:
        raise PatchsetError(f"{CHANGELOG}: nothing under `## [Unreleased]`: say what {version} changes first")
    released = f"## [{version}] - {date or datetime.now(timezone.utc).date().isoformat()}\n"
    changelog.write_text(text[: heading.start()] + released + text[heading.end() :], encoding="utf-8")
    git(project, "commit", "-q", "-m", f"Release {version}", "--", str(CHANGELOG), isolated=False)
    message = f"Lightning patch set {version}\n\n{notes}\n"  # `whitespace` cleanup keeps the notes' `###` headings
    git(project, "tag", "-a", "--cleanup=whitespace", "-m", message, tag, isolated=False)
    commit = out(project, "rev-parse", "HEAD", isolated=False)
    following = replace(pin, local_version=f"patchset.{int(label.group(1)) + 1}")
    write_pin(project, following)
    text = changelog.read_text(encoding="utf-8").replace(
        released, f"## [Unreleased]\n\n{released}\nCommit: `{commit}`\n", 1
    )
    changelog.write_text(text, encoding="utf-8")
    message = f"Start {following.fork_version}: builds after the {tag} release carry the next label"
    git(project, "commit", "-q", "-m", message, "--", str(CHANGELOG), str(PIN_FILE), isolated=False)
    return Release(version, tag, commit, build_pin(project, following).fork_version)
