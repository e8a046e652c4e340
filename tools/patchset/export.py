"""``export``: write the workspace's commits back to ``patches/``, or (``--check``) show what that would change."""

from __future__ import annotations

import difflib
import tempfile
from pathlib import Path

from patchset import PatchsetError
from patchset.gitops import git, refuse_busy
from patchset.pin import fetch_sdist, read_pin, sdist_files
from patchset.series import parse_patch, series_files
from patchset.workspace import (
    NOTES_REF,
    SERIES,
    WORKSPACE,
    changed_names,
    make_workspace,
    planned_export,
    record_snapshot,
    snapshot_dir,
)


def preview(project: Path) -> tuple[dict[str, bytes], dict[str, bytes]]:
    """The series files as they are, and as exporting would write them: from the workspace, else a fresh one."""
    current = series_files(project / "patches")
    if (project / WORKSPACE).exists():
        return current, planned_export(project, project / WORKSPACE)
    with tempfile.TemporaryDirectory() as tmp:
        make_workspace(project, Path(tmp) / "tree")
        return current, planned_export(project, Path(tmp) / "tree")


def diff_text(old: dict[str, bytes], new: dict[str, bytes]) -> str:
    """A unified diff of the changed patch files (``a/`` as committed, ``b/`` as a re-export would write them)."""
    lines: list[str] = []
    for name in changed_names(old, new):
        before, after = (files.get(name, b"").decode(errors="replace").splitlines(True) for files in (old, new))
        lines += difflib.unified_diff(before, after, f"a/patches/{name}", f"b/patches/{name}")
    return "".join(line if line.endswith("\n") else line + "\n" for line in lines)


def _lost_sections(before: dict[str, bytes], after: dict[str, bytes], shipped: frozenset[str]) -> list[str]:
    """Upstream-only sections that a patch, matched by subject, had and would lose (a commit recreated without note)."""

    def by_subject(files: dict[str, bytes]) -> dict[str, set[str]]:
        patches = [parse_patch(Path(name), data) for name, data in files.items() if name != SERIES]
        return {p.subject: {s.path for s in p.sections if s.path not in shipped} for p in patches}

    old, new = by_subject(before), by_subject(after)
    lost = [
        (subject, paths - new[subject]) for subject, paths in old.items() if subject in new and paths - new[subject]
    ]
    return [f"{subject}: {', '.join(sorted(paths))}" for subject, paths in lost]


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
    lost = _lost_sections(snapshot, planned, sdist_files(fetch_sdist(read_pin(project))))
    if lost and not force:
        raise PatchsetError(
            f"exporting would drop upstream-only sections ({'; '.join(lost)}): a commit was recreated without its"
            f" note (cherry-pick, reset?); copy it back with `git notes --ref={NOTES_REF} copy <old> <new>` in"
            f" {WORKSPACE}, or `export --force` to drop them"
        )
    changed = changed_names(current, planned)
    for name in changed:
        if name in planned:
            (project / "patches" / name).write_bytes(planned[name])
        else:
            (project / "patches" / name).unlink()
    record_snapshot(project, workspace)
    return changed
