"""Check that every patch applies to the pinned base exactly, and say precisely what is wrong when one does not."""

from __future__ import annotations

import tempfile
from dataclasses import dataclass
from pathlib import Path

from patchset import PatchsetError
from patchset.export import format_commit
from patchset.gitops import git, out
from patchset.materialize import _diagnose, base_repo, check_overlay
from patchset.pin import read_pin
from patchset.series import read_series


@dataclass
class Finding:
    """The result for one patch (or for the overlay): ``ok`` is False for anything that needs action."""

    name: str
    ok: bool
    message: str


def check(project: Path) -> list[Finding]:
    """Apply the series to a fresh base without three-way merging (zero fuzz) and report on every patch."""
    pin = read_pin(project)
    patches = read_series(project)
    findings = []
    with tempfile.TemporaryDirectory() as tmp:
        repo = Path(tmp) / "tree"
        base_repo(pin, repo)
        for patch in patches:
            try:
                patch.changelog  # noqa: B018 - parsing validates the field
            except PatchsetError as err:
                findings.append(Finding(patch.name, False, str(err)))
                continue
            if git(repo, "apply", "--check", str(patch.path), check=False).returncode != 0:
                findings.append(Finding(patch.name, False, _diagnose(repo, patch)))
                continue
            git(repo, "am", "-q", "--keep-cr", str(patch.path))
            exported = format_commit(repo, out(repo, "rev-parse", "HEAD"))
            if exported != patch.path.read_bytes():
                diff = patch.path.read_bytes().partition(b"\ndiff --git ")[2]
                what = (
                    "only with offsets" if exported.partition(b"\ndiff --git ")[2] != diff else "not in exported form"
                )
                findings.append(Finding(patch.name, False, f"{patch.name} applies, but {what}: re-run `export`"))
            else:
                findings.append(Finding(patch.name, True, f"{patch.name} applies to {pin.name} {pin.version} exactly"))
        try:
            files = check_overlay(project, repo)
            findings.append(Finding("overlay", True, f"{len(files)} new files, none shadows an upstream file"))
        except PatchsetError as err:
            findings.append(Finding("overlay", False, str(err)))
    return findings
