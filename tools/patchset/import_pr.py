"""Bring edits made on a patch's upstream PR branch back into the series.

Upstream-only sections (existing tests, conftests, docs toctrees, CI configuration) cannot be edited in
``.work/tree``, which is made from the sdist. They are edited where they live: on the PR branch that ``upstream-pr``
made in an upstream checkout. ``import-pr`` then takes the branch's change against its base and writes back
- its upstream-only sections, replacing the patch's (byte for byte, as git wrote them);
- the patch's new files (those its ``New-Files:`` globs own), into this project;
and reports, without taking them, changes to files the sdist ships: those are edited in ``.work/tree``, where the
fork's build can test them. The CHANGELOG hunks come from the patch's ``Changelog:`` fields and are skipped.
"""

from __future__ import annotations

import tarfile
from dataclasses import dataclass, field
from pathlib import Path

from patchset import PatchsetError
from patchset.gitops import git
from patchset.overlay import OVERLAY_ROOTS
from patchset.pin import fetch_sdist, read_pin
from patchset.sections import join_patch, split_patch
from patchset.series import find_patch
from patchset.upstream_pr import CHANGELOG_PATHS, START_REFS, branch_name, default_base
from patchset.workspace import WORKSPACE, materialize_workspace, unexported_work


@dataclass
class ImportResult:
    """What ``import-pr`` wrote, and what it left for the workspace."""

    patch: str
    upstream_only: list[str] = field(default_factory=list)
    new_files: list[str] = field(default_factory=list)
    not_taken: list[str] = field(default_factory=list)


def sdist_paths(project: Path) -> frozenset[str]:
    """The files the pinned sdist ships, relative to its top folder."""
    with tarfile.open(fetch_sdist(read_pin(project))) as tar:
        return frozenset(m.name.split("/", 1)[1] for m in tar.getmembers() if m.isfile() and "/" in m.name)


def _start(onto: Path, branch: str, base: str) -> str:
    """The commit the PR branch started from: as upstream-pr recorded it, else where it forks from ``base``."""
    recorded = git(onto, "rev-parse", "--verify", "--quiet", f"{START_REFS}{branch}", check=False)
    if recorded.returncode == 0:
        start = recorded.stdout.decode().strip()
        if git(onto, "merge-base", "--is-ancestor", start, branch, check=False).returncode != 0:
            raise PatchsetError(
                f"{branch} no longer contains the commit it started from ({start[:10]}): it was rebased; make it"
                " again with upstream-pr --force and redo the edit there"
            )
        return start
    return git(onto, "merge-base", base, branch).stdout.decode().strip()


def import_pr(project: Path, ref: str, onto: Path, branch: str | None = None, base: str | None = None) -> ImportResult:
    """Write the upstream-only sections and new files of ``branch`` (in checkout ``onto``) back into the patch."""
    patch = find_patch(project, ref)
    branch = branch or branch_name(patch)
    base = base or default_base(project, patch, onto)
    for rev in (branch, base):
        if git(onto, "rev-parse", "--verify", "--quiet", f"{rev}^{{commit}}", check=False).returncode:
            raise PatchsetError(f"{onto}: no branch or commit {rev!r}")
    workspace = project / WORKSPACE
    if (workspace / ".git").is_dir():
        pending = unexported_work(project, workspace)
        if pending:
            raise PatchsetError(f"{workspace} has work not exported ({', '.join(pending)}): export it first")
    fork = _start(onto, branch, base)
    diff_args = ("--full-index", "--binary", "--no-renames", "--no-color", "--src-prefix=a/", "--dst-prefix=b/")
    diff = git(onto, "diff", *diff_args, fork, branch).stdout
    head, old_sections = split_patch(patch.path.read_bytes())
    shipped = sdist_paths(project)
    old_by_path = {s.path: s for s in old_sections}
    result = ImportResult(patch.name)
    taken = [s for s in old_sections if s.path in shipped]
    for section in split_patch(diff)[1]:
        if section.path in CHANGELOG_PATHS.values():
            continue
        if section.path in shipped:
            if old_by_path.get(section.path) != section:
                result.not_taken.append(section.path)
        elif section.creates_file or patch.owns(section.path):
            if not patch.owns(section.path):
                result.not_taken.append(section.path)
                continue
            if not section.path.startswith(tuple(root + "/" for root in OVERLAY_ROOTS)):
                raise PatchsetError(f"{section.path}: a new file outside {', '.join(OVERLAY_ROOTS)}")
            target = project / section.path
            target.parent.mkdir(parents=True, exist_ok=True)
            target.write_bytes(git(onto, "show", f"{branch}:{section.path}").stdout)
            result.new_files.append(section.path)
        else:
            taken.append(section)
            result.upstream_only.append(section.path)
    patch.path.write_bytes(join_patch(head if taken else head.rstrip(b"\n") + b"\n", taken))
    if (workspace / ".git").is_dir():
        materialize_workspace(project)
    return result
