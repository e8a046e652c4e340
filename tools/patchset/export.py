"""Write the workspace's patch commits back to ``patches/`` as byte-stable ``git format-patch`` files."""

from __future__ import annotations

import re
import tempfile
from pathlib import Path

from patchset import PatchsetError
from patchset.gitops import git, out
from patchset.materialize import BASE_TAG, WORKSPACE, make_workspace
from patchset.series import SERIES_FILE, read_series, write_series

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
)


def format_commit(repo: Path, commit: str) -> bytes:
    """One commit as a patch file: no date, no commit id, no diffstat, no version signature."""
    text = git(repo, *_FORMAT_ARGS, "-1", commit).stdout
    head, sep, body = text.partition(b"\n\n")
    head = b"\n".join(line for line in head.split(b"\n") if not line.startswith(b"Date: "))
    return head + sep + body


def _slug(subject: str) -> str:
    return re.sub(r"[^a-z0-9]+", "-", subject.lower()).strip("-")[:52].rstrip("-") or "patch"


def planned_export(project: Path, workspace: Path) -> tuple[list[str], dict[str, bytes]]:
    """The series order and patch contents that exporting ``workspace`` would write.

    Commits are matched to existing patches by subject first, then by position; the rest get new names.
    """
    if not (workspace / ".git").exists():
        raise PatchsetError(f"{workspace}: no workspace; run `materialize` first")
    commits = out(workspace, "rev-list", "--reverse", f"{BASE_TAG}..HEAD").split()
    existing = read_series(project)
    by_subject = {p.subject: p.name for p in existing}
    taken: set[str] = set()
    names: list[str | None] = []
    for commit in commits:
        name = by_subject.get(out(workspace, "log", "-1", "--format=%s", commit))
        names.append(name if name not in taken else None)
        if name:
            taken.add(name)
    for i, name in enumerate(names):
        if name is None and i < len(existing) and existing[i].name not in taken:
            names[i] = existing[i].name
            taken.add(existing[i].name)
    order, contents = [], {}
    for i, (commit, name) in enumerate(zip(commits, names, strict=True), 1):
        if name is None:
            name = f"{i:04d}-{_slug(out(workspace, 'log', '-1', '--format=%s', commit))}.patch"
        order.append(name)
        contents[name] = format_commit(workspace, commit)
    return order, contents


def pending_changes(project: Path, workspace: Path) -> list[str]:
    """Files under ``patches/`` that exporting ``workspace`` would create, change or delete."""
    order, contents = planned_export(project, workspace)
    patches_dir = project / "patches"
    changed = [name for name, data in contents.items() if _read(patches_dir / name) != data]
    changed += [p.name for p in read_series(project) if p.name not in contents]
    if [p.name for p in read_series(project)] != order:
        changed.append(SERIES_FILE.name)
    return sorted(set(changed))


def _read(path: Path) -> bytes | None:
    return path.read_bytes() if path.is_file() else None


def export(project: Path, check: bool = False) -> list[str]:
    """Write the patches back (or with ``check``, only report what would change). Returns the changed names."""
    workspace = project / WORKSPACE
    if check:
        if workspace.exists():
            return pending_changes(project, workspace)
        # No workspace (CI, a fresh clone): re-export what the patches materialize to, which must be byte-identical.
        with tempfile.TemporaryDirectory() as tmp:
            make_workspace(project, Path(tmp) / "tree")
            return pending_changes(project, Path(tmp) / "tree")
    order, contents = planned_export(project, workspace)
    changed = pending_changes(project, workspace)
    patches_dir = project / "patches"
    for patch in read_series(project):
        if patch.name not in contents:
            patch.path.unlink()
    for name, data in contents.items():
        if _read(patches_dir / name) != data:
            (patches_dir / name).write_bytes(data)
    write_series(project, order)
    return changed
