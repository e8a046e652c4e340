"""The version a build of the fork carries, so that ``pip list`` tells a release from a build of a later commit.

At a release commit (its CHANGELOG has a heading for the version the pin names) a build carries that release's
version, ``2.6.6+patchset.1``. After it, ``release`` moves the pin to the next label and writes the release commit's
hash under its heading; a build of a later commit then carries the last release's label, the number of commits since
that release and the commit itself, as ``git describe`` names them: ``2.6.6+patchset.1.3.g4a1e8ba`` (a valid PEP 440
local label, which sorts after the release). Where that cannot be known (no git checkout: a build from the sdist,
which keeps the label it was made with; no release yet), the pin's version is the build's.
"""

from __future__ import annotations

import re
from dataclasses import replace
from pathlib import Path

from patchset.gitops import git
from patchset.pin import Pin

CHANGELOG = Path("CHANGELOG.md")
# a release's heading followed by the line that names its commit (`release.commit_line`)
_RELEASED = re.compile(r"^## \[(?P<version>[^\]\s]+)\][^\n]*\n\s*Commit: `(?P<commit>[0-9a-f]{40})`", re.MULTILINE)


def build_pin(project: Path, pin: Pin) -> Pin:
    """``pin`` with the local label that a build of ``project``'s checked-out commit carries."""
    changelog = project / CHANGELOG
    if not (project / ".git").exists() or not changelog.is_file():
        return pin
    text = changelog.read_text(encoding="utf-8")
    if f"## [{pin.fork_version}]" in text:
        return pin  # the release commit: the pin still names the release it makes
    released = _RELEASED.search(text)
    if released is None or not released["version"].startswith(f"{pin.version}+"):
        return pin  # no release of this upstream version yet
    head = git(project, "rev-parse", "--short=7", "HEAD", check=False, isolated=False)
    if head.returncode != 0:
        return pin
    since = git(project, "rev-list", "--count", f"{released['commit']}..HEAD", check=False, isolated=False)
    commit = "g" + head.stdout.decode().strip()
    # a shallow clone does not have the release commit to count from: the commit alone still names the build
    label = f"{since.stdout.decode().strip()}.{commit}" if since.returncode == 0 else commit
    return replace(pin, local_version=f"{released['version'].split('+', 1)[1]}.{label}")
