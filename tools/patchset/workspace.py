"""The workspace, ``.work/tree``: its path, lock, snapshot of ``patches/``, and the guards that keep work from loss.

It is made from the snapshot's patches, one commit each; its commits, formatted as ``git format-patch`` files, are
what ``export`` writes back to ``patches/``.
"""

from __future__ import annotations

import os
import re
import shutil
import sys
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import datetime, timezone
from pathlib import Path

from patchset import PatchsetError
from patchset.gitops import git, in_progress, out
from patchset.materialize import BASE_TAG, make_workspace
from patchset.sections import join_patch, read_note, split_patch
from patchset.series import SERIES_FILE, series_files

if sys.platform != "win32":
    import fcntl

WORKSPACE = Path(".work") / "tree"
SERIES = SERIES_FILE.name
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


def refuse_busy(workspace: Path, exists: bool = True) -> None:
    """Refuse a workspace that is missing (with ``exists``) or in the middle of a rebase, ``git am`` or cherry-pick."""
    if exists and not (workspace / ".git").is_dir():
        raise PatchsetError(f"{workspace}: no workspace; run `materialize` first")
    operation = in_progress(workspace)
    if operation:
        raise PatchsetError(f"{workspace} is in the middle of {operation}: finish or abort it first")


def format_commit(repo: Path, commit: str) -> bytes:
    """One commit as a patch file: no date, no commit id, no diffstat, no version signature.

    The upstream-only sections kept in the commit's note are merged back in, in git's order.
    """
    text = git(repo, *_FORMAT_ARGS, "-1", commit).stdout
    head, sep, body = text.partition(b"\n\n")
    head = b"\n".join(line for line in head.split(b"\n") if not line.startswith(b"Date: "))
    message, sections = split_patch(head + sep + body)
    extra = read_note(repo, commit)
    paths = [s.path for s in sections + extra]
    twice = sorted({p for p in paths if paths.count(p) > 1})
    if twice:
        subject = out(repo, "log", "-1", "--format=%s", commit)
        raise PatchsetError(
            f"{subject!r} holds two upstream-only sections for {', '.join(twice)} (two patches squashed?): combine"
            " them on the PR branch (upstream-pr, edit, git commit --amend) and bring them back with import-pr"
        )
    return join_patch(message, sections + extra)


def patch_name(position: int, subject: str) -> str:
    """``NNNN-subject-slug.patch``, numbered by position in the series, as ``git format-patch`` names files."""
    slug = re.sub(r"[^a-z0-9]+", "-", subject.lower()).strip("-")[:52].rstrip("-") or "patch"
    return f"{position:04d}-{slug}.patch"


def _series_text(header_from: bytes | None, names: list[str]) -> bytes:
    header = []
    for line in (header_from or b"").decode("utf-8").splitlines():
        if not line.startswith("#"):
            break
        header.append(line)
    return ("\n".join([*header, *names]) + "\n").encode("utf-8")


def planned_export(project: Path, workspace: Path) -> dict[str, bytes]:
    """The series file and patches that exporting ``workspace`` would write, by name."""
    refuse_busy(workspace)
    commits = out(workspace, "rev-list", "--reverse", f"{BASE_TAG}..HEAD").split()
    files = {}
    for position, commit in enumerate(commits, 1):
        files[patch_name(position, out(workspace, "log", "-1", "--format=%s", commit))] = format_commit(
            workspace, commit
        )
    current_series = project / "patches" / SERIES
    header = current_series.read_bytes() if current_series.is_file() else None
    return {SERIES: _series_text(header, list(files)), **files}


def changed_names(old: dict[str, bytes], new: dict[str, bytes]) -> list[str]:
    """The names whose bytes differ between two sets of series files (added and removed ones too)."""
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
    changes = changed_names(series_files(snapshot_dir(workspace)), planned_export(project, workspace))
    if git(workspace, "status", "--porcelain").stdout.strip():
        changes.append("uncommitted changes")
    return changes


def materialize_workspace(project: Path, force: bool = False) -> Path:
    """Make ``.work/tree``: a git repo with the upstream base, one commit per patch, our files linked in.

    Refuses to replace a workspace holding work not exported yet, unless ``force``; the replaced workspace is kept
    as ``.work/previous-tree`` either way.
    """
    workspace = project / WORKSPACE
    previous = workspace.with_name("previous-tree")
    workspace.parent.mkdir(parents=True, exist_ok=True)
    with _locked(workspace.parent / ".lock"):
        if workspace.exists() and not force:
            if not (workspace / ".git").is_dir():
                raise PatchsetError(
                    f"{workspace} exists but was not made by `materialize`: move it away or use --force"
                )
            refuse_busy(workspace, exists=False)
            pending = unexported_work(project, workspace)
            if pending:
                raise PatchsetError(
                    f"{workspace} has work not exported to patches/ ({', '.join(pending)}): run `export` first,"
                    " or materialize with --force to set it aside"
                )
        with tempfile.TemporaryDirectory(dir=workspace.parent, prefix=".tree-") as tmp:
            repo = Path(tmp) / "tree"
            make_workspace(project, repo)
            record_snapshot(project, repo)
            if workspace.exists():
                keep_previous_tree(project)
                os.rename(workspace, previous)
            os.rename(repo, workspace)
    return workspace


def keep_previous_tree(project: Path) -> Path | None:
    """Move an earlier ``.work/previous-tree`` aside as ``previous-tree-<UTC time>``, so no backup is overwritten.

    ``materialize_workspace`` keeps the workspace it replaces as ``.work/previous-tree`` and calls this first.
    Returns where the earlier backup went, if there was one.
    """
    previous = (project / WORKSPACE).with_name("previous-tree")
    if not previous.exists() or not (project / WORKSPACE).exists():
        return None  # materialize will not replace it
    stamp = datetime.now(timezone.utc).strftime("%Y%m%dT%H%M%SZ")
    target = previous.with_name(f"previous-tree-{stamp}")
    n = 1
    while target.exists():
        n += 1
        target = previous.with_name(f"previous-tree-{stamp}-{n}")
    os.rename(previous, target)
    return target


@contextmanager
def _locked(path: Path) -> Iterator[None]:
    """One materialize at a time per checkout (POSIX ``flock``; on Windows, no lock)."""
    if sys.platform == "win32":  # pragma: no cover - Windows
        yield
        return
    with open(path, "w") as fh:
        fcntl.flock(fh, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(fh, fcntl.LOCK_UN)
