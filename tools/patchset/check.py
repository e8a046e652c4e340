"""``check``: the series' rules, every patch applying exactly to the pinned base, and (``--upstream``) to upstream."""

from __future__ import annotations

import re
import tempfile
from dataclasses import dataclass
from pathlib import Path

from patchset import PatchsetError
from patchset.gitops import default_branch, git, verify
from patchset.lint import lint
from patchset.overlay import lay_overlay, overlay_files
from patchset.pin import read_pin
from patchset.series import find_patch, read_series, upstream_only
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
            if problem is not None:
                findings.append(Finding(patch.name, False, problem))
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


def check_upstream(project: Path, checkout: Path, base: str | None = None) -> list[Finding]:
    """Apply every upstream-bound patch, whole, to ``base`` of an upstream checkout, after those it ``Depends-On``.

    Each applies on a scratch index of its own, so the checkout is untouched; it must apply without fuzz (offsets are
    fine: upstream moved on), and its new files must not exist there yet.
    """
    if not (checkout / ".git").exists():
        raise PatchsetError(f"{checkout}: not a git checkout of upstream Lightning")
    base = base or default_branch(checkout)
    commit = verify(checkout, base)
    if commit is None:
        raise PatchsetError(f"{checkout}: no branch or commit {base!r}")
    files, findings = overlay_files(project), []
    for patch in (p for p in read_series(project) if p.upstreamable):
        chain = [patch]
        while chain[0].field("Depends-On") and len(chain) < 20:
            chain.insert(0, find_patch(project, chain[0].field("Depends-On")))
        on = base + "".join(f" + {p.name[:4]}" for p in chain[:-1])
        with tempfile.TemporaryDirectory() as tmp:
            env = {"GIT_INDEX_FILE": str(Path(tmp) / "index")}
            git(checkout, "read-tree", commit, env=env)
            for needed in chain:
                proc = git(checkout, "apply", "--cached", "-v", "-", input=needed.data, check=False, env=env)
                if proc.returncode != 0:
                    errors = [
                        line for line in proc.stderr.decode(errors="replace").splitlines() if line.startswith("error:")
                    ]
                    reason = next((e for e in errors if "while searching" not in e), "git gave no reason")
                    failed = "" if needed is patch else f" (its dependency {needed.name} fails)"
                    findings.append(
                        Finding(patch.name, False, f"{patch.name} does not apply to {on}{failed}: {reason}")
                    )
                    break
            else:
                offsets = len(re.findall(r"\(offset -?\d+ lines?\)", proc.stderr.decode(errors="replace")))
                exists = [
                    f
                    for f in files
                    if patch.owns(f) and git(checkout, "cat-file", "-e", f"{commit}:{f}", check=False).returncode == 0
                ]
                if exists:
                    findings.append(
                        Finding(patch.name, False, f"{patch.name}: its new file {exists[0]} exists in {base}")
                    )
                else:
                    how = f"with {offsets} hunks at an offset" if offsets else "exactly"
                    findings.append(Finding(patch.name, True, f"{patch.name} applies to {on} ({commit[:10]}) {how}"))
    return findings
