"""The version a build of the fork carries, so that ``pip list`` tells a release from a build of a later commit.

A release commit (its CHANGELOG has a heading for the version the pin names) builds that version,
``2.6.6+patchset.1``. A later commit builds the last release's label, the commits since its commit (named under its
heading) and its own, as ``git describe`` would: ``2.6.6+patchset.1.3.g4a1e8ba``, or ``2.6.6+patchset.1.g4a1e8ba``
in a shallow clone. Without git (a build from the sdist) or a release, the pin's version is the build's.
"""

from __future__ import annotations

import re
from dataclasses import replace
from pathlib import Path

from patchset.gitops import git
from patchset.pin import Pin

CHANGELOG = Path("CHANGELOG.md")
_RELEASED = re.compile(r"^## \[(?P<version>[^\]\s]+)\][^\n]*\n\s*Commit: `(?P<commit>[0-9a-f]{40})`", re.MULTILINE)


def build_pin(project: Path, pin: Pin) -> Pin:
    """``pin`` with the local label that a build of ``project``'s checked-out commit carries."""
    changelog = project / CHANGELOG
    if not (project / ".git").exists() or not changelog.is_file():
        return pin
    text = changelog.read_text(encoding="utf-8")
    released = _RELEASED.search(text)
    if f"## [{pin.fork_version}]" in text or released is None or not released["version"].startswith(f"{pin.version}+"):
        return pin  # the release commit, or no release of this upstream version yet
    head = git(project, "rev-parse", "--short=7", "HEAD", check=False, isolated=False)
    if head.returncode != 0:
        return pin
    since = git(project, "rev-list", "--count", f"{released['commit']}..HEAD", check=False, isolated=False)
    commit = "g" + head.stdout.decode().strip()
    label = f"{since.stdout.decode().strip()}.{commit}" if since.returncode == 0 else commit
    return replace(pin, local_version=f"{released['version'].split('+', 1)[1]}.{label}")
