"""``export``: write the workspace's commits back to ``patches/``, or (``--check``) show what that would change.

A patch whose subject was reworded, or that a patch inserted before it renumbered, gets a new file name; the
``Depends-On:`` fields that named the old one follow it.
"""

from __future__ import annotations

import difflib
import tempfile
from pathlib import Path

from patchset import PatchsetError
from patchset.gitops import git, refuse_busy
from patchset.pin import fetch_sdist, read_pin, sdist_files
from patchset.series import Patch, parse_patch, patch_id, series_files
from patchset.workspace import (
    NOTES_REF,
    SERIES,
    WORKSPACE,
    changed_names,
    make_workspace,
    materialize_workspace,
    planned_export,
    record_snapshot,
    snapshot_dir,
)


def preview(project: Path) -> tuple[dict[str, bytes], dict[str, bytes]]:
    """The series files as they are, and as a fresh workspace re-exports them (never a workspace that may be stale)."""
    with tempfile.TemporaryDirectory() as tmp:
        make_workspace(project, Path(tmp) / "tree")
        return series_files(project / "patches"), planned_export(project, Path(tmp) / "tree")


def diff_text(old: dict[str, bytes], new: dict[str, bytes]) -> str:
    """A unified diff of the changed patch files (``a/`` as committed, ``b/`` as a re-export would write them)."""
    lines: list[str] = []
    for name in changed_names(old, new):
        before, after = (files.get(name, b"").decode(errors="replace").splitlines(True) for files in (old, new))
        lines += difflib.unified_diff(before, after, f"a/patches/{name}", f"b/patches/{name}")
    return "".join(line if line.endswith("\n") else line + "\n" for line in lines)


def matched(before: dict[str, bytes], after: dict[str, bytes], shipped: frozenset[str]) -> list[tuple[Patch, Patch]]:
    """The patches of two exports that are one patch, each matched once.

    By git's patch-id, which a reworded message or a new number leaves alone: of the diff to the files the sdist ships
    (the same when upstream-only sections were lost), then of the whole diff; else by the subject.
    """
    old, new = ([parse_patch(Path(n), d) for n, d in files.items() if n != SERIES] for files in (before, after))

    def keys(patch: Patch) -> tuple[str, str, str]:
        return patch_id([s for s in patch.sections if s.path in shipped]), patch_id(patch.sections), patch.subject

    old_keys, new_keys = [keys(p) for p in old], [keys(p) for p in new]
    pairs: list[tuple[Patch, Patch]] = []
    for i in range(3):
        column = [k[i] for k in new_keys]
        for patch, own in ((p, k[i]) for p, k in zip(old, old_keys, strict=True)):
            if (
                own
                and column.count(own) == 1
                and all(patch is not o and new[column.index(own)] is not n for o, n in pairs)
            ):
                pairs.append((patch, new[column.index(own)]))
    return pairs


def export(project: Path, force: bool = False) -> list[str]:
    """Write the workspace's commits back as patches; the changed names.

    Refuses uncommitted edits, and a ``patches/`` that changed since the workspace was made (writing would revert
    those changes) or a patch that would lose upstream-only sections, unless ``force``.
    """
    workspace = project / WORKSPACE
    if not (workspace / ".git").is_dir():
        raise PatchsetError(f"{workspace}: no workspace; run `materialize` first")
    refuse_busy(workspace)
    dirty = git(workspace, "status", "--porcelain").stdout.decode().splitlines()
    if dirty:
        raise PatchsetError(
            f"{WORKSPACE} has uncommitted edits ({', '.join(line[3:] for line in dirty)}): commit them to the patch"
            " they belong to (git commit --fixup, then git rebase -i --autosquash), or discard them, then export"
        )
    current, planned = series_files(project / "patches"), planned_export(project, workspace)
    snapshot = series_files(snapshot_dir(workspace))
    if not force and current != snapshot:
        raise PatchsetError(
            f"patches/ changed since {WORKSPACE} was materialized ({', '.join(changed_names(snapshot, current))}): run"
            " `materialize` to pick the changes up, or `export --force` to overwrite them with the workspace"
        )
    shipped = sdist_files(fetch_sdist(read_pin(project)))
    pairs = matched(snapshot, planned, shipped)
    lost = []  # upstream-only sections a patch had and would lose (a commit recreated without its note)
    for old, new in pairs:
        if gone := {s.path for s in old.sections if s.path not in shipped} - {s.path for s in new.sections}:
            lost.append(f"{new.subject}: {', '.join(sorted(gone))}")
    if lost and not force:
        raise PatchsetError(
            f"exporting would drop upstream-only sections ({'; '.join(lost)}): a commit was recreated without its"
            f" note (cherry-pick, reset?); copy it back with `git notes --ref={NOTES_REF} copy <old> <new>` in"
            f" {WORKSPACE}, or `export --force` to drop them"
        )
    renamed = {old.name: new.name for old, new in pairs if old.name != new.name}
    for name, data in planned.items():  # a `Depends-On:` follows its patch to its new name
        for before, after in renamed.items():
            data = data.replace(f"\nDepends-On: {before}\n".encode(), f"\nDepends-On: {after}\n".encode())
        planned[name] = data
    changed = changed_names(current, planned)
    for name in changed:
        if name in planned:
            (project / "patches" / name).write_bytes(planned[name])
        else:
            (project / "patches" / name).unlink()
    record_snapshot(project, workspace)
    if renamed:  # the workspace's commits say what the files now say
        materialize_workspace(project, force=True)
    return changed
