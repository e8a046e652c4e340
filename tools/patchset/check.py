"""Check the series: its own rules, every patch applying to the pinned base exactly, and to an upstream checkout."""

from __future__ import annotations

import re
import tempfile
from dataclasses import dataclass
from pathlib import Path

from patchset import PatchsetError
from patchset.export import format_commit
from patchset.gitops import am, git, out
from patchset.lint import lint
from patchset.materialize import _diagnose, base_repo, check_overlay, overlay_files
from patchset.pin import read_pin
from patchset.sections import exclude_args, join_patch, shipped_files, split_patch, upstream_only
from patchset.series import read_series


@dataclass
class Finding:
    """The result for one patch (or for the overlay): ``ok`` is False for anything that needs action."""

    name: str
    ok: bool
    message: str


def check(project: Path) -> list[Finding]:
    """Lint the series, then apply it to a fresh base without three-way merging (zero fuzz) and report every patch.

    Sections for upstream files the sdist does not ship are skipped here (``check_upstream`` applies them).
    """
    pin = read_pin(project)
    findings = [Finding("series", False, problem) for problem in lint(project, overlay_files(project))]
    patches = read_series(project)
    with tempfile.TemporaryDirectory() as tmp:
        repo = Path(tmp) / "tree"
        base_repo(pin, repo)
        shipped = shipped_files(repo)
        for patch in patches:
            extra = upstream_only(patch.path, shipped)
            skip = exclude_args(extra)
            if git(repo, "apply", "--check", *skip, str(patch.path), check=False).returncode != 0:
                findings.append(Finding(patch.name, False, _diagnose(repo, patch, skip)))
                continue
            if am(repo, "-q", "--keep-cr", *skip, str(patch.path)).returncode != 0:
                git(repo, "am", "--abort", check=False)
                findings.append(Finding(patch.name, False, _diagnose(repo, patch, skip)))
                continue
            head, sections = split_patch(format_commit(repo, out(repo, "rev-parse", "HEAD")))
            exported = join_patch(head, sections + extra)
            if exported != patch.path.read_bytes():
                diff = patch.path.read_bytes().partition(b"\ndiff --git ")[2]
                what = (
                    "only with offsets" if exported.partition(b"\ndiff --git ")[2] != diff else "not in exported form"
                )
                findings.append(Finding(patch.name, False, f"{patch.name} applies, but {what}: re-run `export`"))
            else:
                note = f" ({len(extra)} upstream-only sections kept for upstream-pr)" if extra else ""
                findings.append(
                    Finding(patch.name, True, f"{patch.name} applies to {pin.name} {pin.version} exactly{note}")
                )
        try:
            files = check_overlay(project, repo)
            findings.append(Finding("overlay", True, f"{len(files)} new files, none shadows an upstream file"))
        except PatchsetError as err:
            findings.append(Finding("overlay", False, str(err)))
    return findings


def check_upstream(project: Path, checkout: Path, base: str | None = None) -> list[Finding]:
    """Apply every upstream-bound patch, whole, in series order, to ``base`` of an upstream git checkout.

    Works on a scratch index, so the checkout's branch, index and files are untouched. ``base`` defaults to the
    upstream default branch. A patch must apply without fuzz (offsets are fine: upstream moved on) and its new files
    must not exist there yet.
    """
    from patchset.upstream_pr import default_branch

    if not (checkout / ".git").exists():
        raise PatchsetError(f"{checkout}: not a git checkout of upstream Lightning")
    base = base or default_branch(checkout)
    commit = out(checkout, "rev-parse", "--verify", "--quiet", f"{base}^{{commit}}")
    files = overlay_files(project)
    findings = []
    with tempfile.TemporaryDirectory() as tmp:
        env = {"GIT_INDEX_FILE": str(Path(tmp) / "index")}
        git(checkout, "read-tree", commit, env=env)
        for patch in read_series(project):
            if not patch.upstreamable:
                continue
            proc = git(checkout, "apply", "--cached", "-v", str(patch.path), check=False, env=env)
            text = proc.stderr.decode(errors="replace")
            if proc.returncode != 0:
                errors = [line for line in text.splitlines() if line.startswith("error:")]
                reason = next((e for e in errors if "while searching" not in e), "git gave no reason")
                findings.append(Finding(patch.name, False, f"{patch.name} does not apply to {base}: {reason}"))
                continue
            exists = [
                rel
                for rel in files
                if patch.owns(rel) and git(checkout, "cat-file", "-e", f"{commit}:{rel}", check=False).returncode == 0
            ]
            offsets = len(re.findall(r"\(offset -?\d+ lines?\)", text))
            if exists:
                findings.append(Finding(patch.name, False, f"{patch.name}: its new file {exists[0]} exists in {base}"))
            else:
                how = f"with {offsets} hunks at an offset" if offsets else "exactly"
                findings.append(Finding(patch.name, True, f"{patch.name} applies to {base} ({commit[:10]}) {how}"))
    return findings
