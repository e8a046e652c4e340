"""Write the workspace's patch commits back to ``patches/`` as byte-stable ``git format-patch`` files."""

from __future__ import annotations

import difflib
import re
import shutil
import tempfile
from pathlib import Path

from patchset import PatchsetError
from patchset.gitops import git, out
from patchset.materialize import BASE_TAG, WORKSPACE, make_workspace
from patchset.sections import join_patch, read_note, split_patch
from patchset.series import SERIES_FILE

_FORMAT_ARGS = (
    "format-patch",
    "--stdout",
    "--no-stat",
    "--no-signature",
    "--zero-commit",
    "--full-index",
    "--no-numbered",
    "--subject-prefix=PATCH",
    "--no-renames",
    "--encode-email-headers",
    "--always",  # a patch whose every section is upstream-only is an empty commit in the workspace
)
SERIES = SERIES_FILE.name
# git states in which HEAD is not the workspace's real series
_IN_PROGRESS = {
    "rebase-merge": "a rebase",
    "rebase-apply": "a rebase or `git am`",
    "CHERRY_PICK_HEAD": "a cherry-pick",
    "MERGE_HEAD": "a merge",
    "REVERT_HEAD": "a revert",
}


def format_commit(repo: Path, commit: str) -> bytes:
    """One commit as a patch file: no date, no commit id, no diffstat, no version signature.

    The upstream-only sections kept in the commit's note are merged back in, in git's order.
    """
    text = git(repo, *_FORMAT_ARGS, "-1", commit).stdout
    head, sep, body = text.partition(b"\n\n")
    head = b"\n".join(line for line in head.split(b"\n") if not line.startswith(b"Date: "))
    message, sections = split_patch(head + sep + body)
    return join_patch(message, sections + read_note(repo, commit))


def patch_name(position: int, subject: str) -> str:
    """``NNNN-subject-slug.patch``, numbered by position in the series, as ``git format-patch`` names files."""
    slug = re.sub(r"[^a-z0-9]+", "-", subject.lower()).strip("-")[:52].rstrip("-") or "patch"
    return f"{position:04d}-{slug}.patch"


def series_files(patches_dir: Path) -> dict[str, bytes]:
    """The series file and every patch it names, by name (missing patches are left out)."""
    series = patches_dir / SERIES
    if not series.is_file():
        return {}
    files = {SERIES: series.read_bytes()}
    for raw in series.read_text(encoding="utf-8").splitlines():
        name = raw.split("#", 1)[0].strip()
        if name and (patches_dir / name).is_file():
            files[name] = (patches_dir / name).read_bytes()
    return files


def _series_text(header_from: bytes | None, names: list[str]) -> bytes:
    header = []
    for line in (header_from or b"").decode("utf-8").splitlines():
        if not line.startswith("#"):
            break
        header.append(line)
    return ("\n".join([*header, *names]) + "\n").encode("utf-8")


def in_progress(workspace: Path) -> str | None:
    """The git operation under way in ``workspace`` (a paused rebase, say), if any."""
    return next((what for marker, what in _IN_PROGRESS.items() if (workspace / ".git" / marker).exists()), None)


def planned_export(project: Path, workspace: Path) -> dict[str, bytes]:
    """The series file and patches that exporting ``workspace`` would write, by name."""
    if not (workspace / ".git").is_dir():
        raise PatchsetError(f"{workspace}: no workspace; run `materialize` first")
    operation = in_progress(workspace)
    if operation:
        raise PatchsetError(f"{workspace} is in the middle of {operation}: finish or abort it first")
    commits = out(workspace, "rev-list", "--reverse", f"{BASE_TAG}..HEAD").split()
    files = {}
    for position, commit in enumerate(commits, 1):
        files[patch_name(position, out(workspace, "log", "-1", "--format=%s", commit))] = format_commit(
            workspace, commit
        )
    current_series = project / "patches" / SERIES
    header = current_series.read_bytes() if current_series.is_file() else None
    return {SERIES: _series_text(header, list(files)), **files}


def _changed(old: dict[str, bytes], new: dict[str, bytes]) -> list[str]:
    return sorted(name for name in old.keys() | new.keys() if old.get(name) != new.get(name))


def snapshot_dir(workspace: Path) -> Path:
    """Where the workspace keeps the patches it was materialized from."""
    return workspace / ".git" / "patchset-snapshot"


def record_snapshot(project: Path, workspace: Path) -> None:
    """Remember ``patches/`` as the workspace now reflects it."""
    target = snapshot_dir(workspace)
    if target.exists():
        shutil.rmtree(target)
    target.mkdir(parents=True)
    for name, data in series_files(project / "patches").items():
        (target / name).write_bytes(data)


def unexported_work(project: Path, workspace: Path) -> list[str]:
    """What the workspace holds that ``patches/`` (as it was when materialized) does not: edits not yet exported."""
    changes = _changed(series_files(snapshot_dir(workspace)), planned_export(project, workspace))
    if git(workspace, "status", "--porcelain").stdout.strip():
        changes.append("uncommitted changes")
    return changes


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
    for name in _changed(old, new):
        before = old.get(name, b"").decode("utf-8", errors="replace").splitlines(keepends=True)
        after = new.get(name, b"").decode("utf-8", errors="replace").splitlines(keepends=True)
        lines += difflib.unified_diff(before, after, f"a/patches/{name}", f"b/patches/{name}")
    return "".join(line if line.endswith("\n") else line + "\n" for line in lines)


def export(project: Path, check: bool = False, force: bool = False) -> list[str]:
    """Write the workspace's commits back as patches (with ``check``, only report). Returns the changed names.

    Refuses when ``patches/`` changed since the workspace was materialized (a pull, say), since writing would revert
    those changes, unless ``force``; and refuses uncommitted edits in the workspace, which would not be exported.
    """
    if check:
        return _changed(*preview(project))
    workspace = project / WORKSPACE
    if not (workspace / ".git").is_dir():
        raise PatchsetError(f"{workspace}: no workspace; run `materialize` first")
    operation = in_progress(workspace)
    if operation:
        raise PatchsetError(f"{workspace} is in the middle of {operation}: finish or abort it first")
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
            f"patches/ changed since {WORKSPACE} was materialized ({', '.join(_changed(snapshot, current))}): run"
            " `materialize` to pick the changes up, or `export --force` to overwrite them with the workspace"
        )
    changed = _changed(current, planned)
    patches_dir = project / "patches"
    for name in changed:
        if name in planned:
            (patches_dir / name).write_bytes(planned[name])
        else:
            (patches_dir / name).unlink()
    record_snapshot(project, workspace)
    return changed
