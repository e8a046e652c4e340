"""Check the series: its own rules, every patch applying to the pinned base exactly, and to an upstream checkout."""

from __future__ import annotations

import re
import tempfile
from dataclasses import dataclass
from pathlib import Path

from patchset import PatchsetError
from patchset.gitops import am, default_branch, git, out
from patchset.lint import lint
from patchset.materialize import base_repo, diagnose
from patchset.overlay import check_overlay, overlay_files
from patchset.pin import read_pin
from patchset.sections import exclude_args, join_patch, shipped_files, split_patch, upstream_only
from patchset.series import find_patch, read_series
from patchset.workspace import format_commit


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
                findings.append(Finding(patch.name, False, diagnose(repo, patch, skip)))
                continue
            if am(repo, "-q", "--keep-cr", *skip, str(patch.path)).returncode != 0:
                git(repo, "am", "--abort", check=False)
                findings.append(Finding(patch.name, False, diagnose(repo, patch, skip)))
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
    """Apply every upstream-bound patch, whole, to ``base`` of an upstream git checkout, as ``upstream-pr`` would.

    Each patch is applied on a scratch index of its own, at ``base`` (default: upstream's default branch) with the
    patches it ``Depends-On`` applied first, so the checkout's branch, index and files are untouched. A patch must
    apply without fuzz (offsets are fine: upstream moved on) and its new files must not exist there yet.
    """
    if not (checkout / ".git").exists():
        raise PatchsetError(f"{checkout}: not a git checkout of upstream Lightning")
    base = base or default_branch(checkout)
    proc = git(checkout, "rev-parse", "--verify", "--quiet", f"{base}^{{commit}}", check=False)
    if proc.returncode != 0:
        raise PatchsetError(f"{checkout}: no branch or commit {base!r}")
    commit = proc.stdout.decode().strip()
    files = overlay_files(project)
    findings = []
    for patch in read_series(project):
        if not patch.upstreamable:
            continue
        chain = [patch]
        while chain[0].field("Depends-On") and len(chain) < 20:
            chain.insert(0, find_patch(project, chain[0].field("Depends-On")))
        with tempfile.TemporaryDirectory() as tmp:
            env = {"GIT_INDEX_FILE": str(Path(tmp) / "index")}
            git(checkout, "read-tree", commit, env=env)
            for needed in chain:
                proc = git(checkout, "apply", "--cached", "-v", str(needed.path), check=False, env=env)
                if proc.returncode != 0:
                    break
        text = proc.stderr.decode(errors="replace")
        on = base + "".join(f" + {p.name[:4]}" for p in chain[:-1])
        if proc.returncode != 0:
            errors = [line for line in text.splitlines() if line.startswith("error:")]
            reason = next((e for e in errors if "while searching" not in e), "git gave no reason")
            failed = "" if needed is patch else f" (its dependency {needed.name} fails)"
            findings.append(Finding(patch.name, False, f"{patch.name} does not apply to {on}{failed}: {reason}"))
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
            findings.append(Finding(patch.name, True, f"{patch.name} applies to {on} ({commit[:10]}) {how}"))
    return findings
