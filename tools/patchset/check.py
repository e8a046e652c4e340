"""``check``: the series' rules, and every patch applying exactly to the pinned base."""

from __future__ import annotations

import re
import tempfile
from dataclasses import dataclass
from pathlib import Path

from patchset import PatchsetError
from patchset.lint import lint
from patchset.overlay import lay_overlay, overlay_files
from patchset.pin import read_pin
from patchset.series import read_series, upstream_only
from patchset.workspace import apply_series, base_repo, format_commit


@dataclass
class Finding:
    """The result for one patch (or for the overlay): ``ok`` is False for anything that needs action."""

    name: str
    ok: bool
    message: str


def check(project: Path) -> list[Finding]:
    """Lint the series, then apply it to a fresh base without merging and compare each commit with its patch file.

    A patch that git writes back otherwise applies only with offsets or is not in exported form: ``export`` it.
    """
    pin, patches = read_pin(project), read_series(project)
    findings = [Finding("series", False, problem) for problem in lint(project, overlay_files(project))]
    with tempfile.TemporaryDirectory() as tmp:
        repo = Path(tmp) / "tree"
        shipped = base_repo(pin, repo)
        for patch, problem in zip(patches, apply_series(repo, patches, shipped, three_way=False), strict=True):
            exported = format_commit(repo, "HEAD") if problem is None else patch.data
            hunks = [re.findall(rb"(?m)^@@ .*$", data) for data in (exported, patch.data)]
            extra = upstream_only(patch, shipped)
            failed = [f.name for f in findings if not f.ok and f.name != "series"]
            if problem is not None:
                after = f" (after {failed[0]} failed)" if failed else ""
                findings.append(Finding(patch.name, False, problem + after))
            elif exported != patch.data:
                what = "only with offsets" if hunks[0] != hunks[1] else "not in exported form"
                findings.append(Finding(patch.name, False, f"{patch.name} applies, but {what}: re-run `export`"))
            else:
                note = f" ({len(extra)} upstream-only sections kept for upstream-pr)" if extra else ""
                findings.append(
                    Finding(patch.name, True, f"{patch.name} applies to {pin.name} {pin.version} exactly{note}")
                )
        try:
            files = lay_overlay(project, repo, link=True)
            findings.append(Finding("overlay", True, f"{len(files)} new files, none shadows an upstream file"))
        except PatchsetError as err:
            findings.append(Finding("overlay", False, str(err)))
    return findings
