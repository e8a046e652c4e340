"""Write the workspace's patch commits back to ``patches/`` as byte-stable ``git format-patch`` files."""

from __future__ import annotations

import difflib
import tempfile
from pathlib import Path

from patchset import PatchsetError
from patchset.gitops import git
from patchset.materialize import BASE_TAG, make_workspace
from patchset.sections import NOTES_REF, shipped_files, split_patch
from patchset.series import series_files
from patchset.workspace import (
    SERIES,
    WORKSPACE,
    changed_names,
    planned_export,
    record_snapshot,
    refuse_busy,
    snapshot_dir,
)


def preview(project: Path) -> tuple[dict[str, bytes], dict[str, bytes]]:
    """The series file and patches as they are, and as exporting would write them.

    From the workspace if there is one, else from a fresh materialization, as on CI or in a fresh clone.
    """
    workspace = project / WORKSPACE
    current = series_files(project / "patches")
    if workspace.exists():
        return current, planned_export(project, workspace)
    with tempfile.TemporaryDirectory() as tmp:
        make_workspace(project, Path(tmp) / "tree")
        return current, planned_export(project, Path(tmp) / "tree")


def diff_text(old: dict[str, bytes], new: dict[str, bytes]) -> str:
    """A unified diff of the changed patch files (``a/`` as committed, ``b/`` as a re-export would write them)."""
    lines: list[str] = []
    for name in changed_names(old, new):
        before = old.get(name, b"").decode("utf-8", errors="replace").splitlines(keepends=True)
        after = new.get(name, b"").decode("utf-8", errors="replace").splitlines(keepends=True)
        lines += difflib.unified_diff(before, after, f"a/patches/{name}", f"b/patches/{name}")
    return "".join(line if line.endswith("\n") else line + "\n" for line in lines)


def _lost_sections(before: dict[str, bytes], after: dict[str, bytes], shipped: frozenset[str]) -> list[str]:
    """Upstream-only sections (files not in ``shipped``) that a patch, matched by subject, had and would lose."""

    def by_subject(files: dict[str, bytes]) -> dict[bytes, set[str]]:
        found = {}
        for name, data in files.items():
            if name != SERIES:
                head, sections = split_patch(data)
                subject = next((line for line in head.split(b"\n") if line.startswith(b"Subject:")), b"")
                found[subject] = {s.path for s in sections if s.path not in shipped}
        return found

    old, new = by_subject(before), by_subject(after)
    lost = []
    for subject, paths in old.items():
        if subject in new and paths - new[subject]:
            what = subject.decode(errors="replace").removeprefix("Subject: [PATCH] ")
            lost.append(f"{what}: {', '.join(sorted(paths - new[subject]))}")
    return lost


def export(project: Path, check: bool = False, force: bool = False) -> list[str]:
    """Write the workspace's commits back as patches (with ``check``, only report). Returns the changed names.

    Refuses when ``patches/`` changed since the workspace was materialized (a pull, say), since writing would revert
    those changes, unless ``force``; and refuses uncommitted edits in the workspace, which would not be exported.
    """
    if check:
        return changed_names(*preview(project))
    workspace = project / WORKSPACE
    refuse_busy(workspace)
    current = series_files(project / "patches")
    dirty = git(workspace, "status", "--porcelain").stdout.decode().splitlines()
    if dirty:
        raise PatchsetError(
            f"{WORKSPACE} has uncommitted edits ({', '.join(line[3:] for line in dirty)}): commit them to the patch"
            " they belong to (git commit --fixup, then git rebase -i --autosquash), or discard them, then export"
        )
    planned = planned_export(project, workspace)
    snapshot = series_files(snapshot_dir(workspace))
    if not force and current != snapshot:
        raise PatchsetError(
            f"patches/ changed since {WORKSPACE} was materialized ({', '.join(changed_names(snapshot, current))}): run"
            " `materialize` to pick the changes up, or `export --force` to overwrite them with the workspace"
        )
    lost = _lost_sections(snapshot, planned, shipped_files(workspace, BASE_TAG))
    if lost and not force:
        raise PatchsetError(
            f"exporting would drop upstream-only sections ({'; '.join(lost)}): a commit was recreated without its"
            f" note (cherry-pick, reset?); copy it back with `git notes --ref={NOTES_REF} copy <old> <new>` in"
            f" {WORKSPACE}, or `export --force` to drop them"
        )
    changed = changed_names(current, planned)
    patches_dir = project / "patches"
    for name in changed:
        if name in planned:
            (patches_dir / name).write_bytes(planned[name])
        else:
            (patches_dir / name).unlink()
    record_snapshot(project, workspace)
    return changed
