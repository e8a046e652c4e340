"""The workspace, ``.work/tree``: a git repository of the upstream base and one commit per patch, with the new files.

It owns its path, the snapshot of ``patches/`` it was made from, the guards that keep unexported work from
loss, its commits formatted as patch files, and the upstream-only sections of each commit, kept as a git note (under
:data:`NOTES_REF`, which follows amend and rebase there) since the files they change are not in the sdist.
"""

from __future__ import annotations

import itertools
import os
import re
import shutil
import tempfile
from collections.abc import Iterator
from datetime import datetime, timezone
from pathlib import Path

from patchset import PatchsetError
from patchset.gitops import am, git, out, refuse_busy
from patchset.materialize import diagnose, write_version
from patchset.overlay import lay_overlay
from patchset.pin import Pin, extract_sdist, fetch_sdist, read_pin, sdist_files
from patchset.series import (
    SERIES_FILE,
    Patch,
    Section,
    exclude_args,
    join_patch,
    read_series,
    series_files,
    split_patch,
    upstream_only,
)

WORKSPACE = Path(".work") / "tree"
BASE_TAG = "upstream"
NOTES_REF = "refs/notes/patchset-upstream-only"
SERIES = SERIES_FILE.name
# byte-stable patch files: no date (dropped below), zero commit ids, no diffstat, no signature, full blob ids
_FORMAT: tuple[str, ...] = (
    "format-patch",
    "--stdout",
    "--no-stat",
    "--no-signature",
    "--zero-commit",
    "--full-index",
    "--no-numbered",
)
_FORMAT += ("--subject-prefix=PATCH", "--no-renames", "--encode-email-headers", "--always")


def base_repo(pin: Pin, dest: Path) -> frozenset[str]:
    """``dest`` as a git repository of the pinned sdist's files, one commit tagged ``upstream``; the files."""
    sdist = fetch_sdist(pin)
    extract_sdist(sdist, dest)
    git(dest, "init", "-q")
    git(dest, "symbolic-ref", "HEAD", "refs/heads/main")
    git(dest, "add", "-A", "-f")
    git(dest, "commit", "-q", "-m", f"{pin.name} {pin.version} (upstream sdist {pin.sdist}, sha256 {pin.sha256})")
    git(dest, "tag", BASE_TAG)
    git(dest, "config", "notes.rewriteRef", NOTES_REF)
    return sdist_files(sdist)


def apply_series(repo: Path, patches: list[Patch], shipped: frozenset[str], three_way: bool) -> Iterator[str | None]:
    """Apply each patch as one commit (its upstream-only sections as the commit's note): ``None``, or why not."""
    for patch in patches:
        extra = upstream_only(patch, shipped)
        args = ["-q", "--keep-cr", "--keep-non-patch", *(["-3"] if three_way else []), *exclude_args(extra)]
        if am(repo, *args, str(patch.path)) is not None:
            yield diagnose(repo, patch, exclude_args(extra))
            continue
        if extra:
            blob = git(repo, "hash-object", "-w", "--stdin", input=b"".join(s.text for s in extra)).stdout
            git(repo, "notes", f"--ref={NOTES_REF}", "add", "-f", "-C", blob.decode().strip(), "HEAD")
        yield None


def make_workspace(project: Path, repo: Path) -> None:
    """A workspace repository at ``repo``: the base, a commit per patch, the new files linked in and ignored."""
    patches = read_series(project)
    for problem in apply_series(repo, patches, base_repo(read_pin(project), repo), three_way=True):
        if problem:
            raise PatchsetError(problem)
    files = lay_overlay(project, repo, link=True)
    ignored = "".join(f"/{f}\n" for f in files) + "__pycache__/\n*.pyc\n"
    (repo / ".git" / "info").mkdir(exist_ok=True)
    (repo / ".git" / "info" / "exclude").write_text("# the new files, linked in; what running code leaves\n" + ignored)
    versions = write_version(repo, read_pin(project).fork_version)
    git(repo, "update-index", "--skip-worktree", *(str(p.relative_to(repo)) for p in versions))


def format_commit(repo: Path, commit: str) -> bytes:
    """One commit as a byte-stable patch file, with the upstream-only sections of its note merged in."""
    head, sep, body = git(repo, *_FORMAT, "-1", commit).stdout.partition(b"\n\n")
    head = b"\n".join(line for line in head.split(b"\n") if not line.startswith(b"Date: "))
    message, sections = split_patch(head + sep + body)
    listed = git(repo, "notes", f"--ref={NOTES_REF}", "list", commit, check=False)
    if listed.returncode == 0:  # squashing two commits joins their notes with a blank line, which no diff line can be
        note = split_patch(git(repo, "cat-file", "blob", listed.stdout.decode().strip()).stdout)[1]
        sections += [Section(s.path, s.text.rstrip(b"\n") + b"\n") for s in note]
    paths = [s.path for s in sections]
    twice = sorted({p for p in paths if paths.count(p) > 1})
    if twice:
        raise PatchsetError(
            f"{out(repo, 'log', '-1', '--format=%s', commit)!r} holds two upstream-only sections for"
            f" {', '.join(twice)} (two patches squashed?): combine them on the PR branch and bring them back with"
            " import-pr"
        )
    return join_patch(message, sections)


def patch_name(position: int, subject: str) -> str:
    """``NNNN-subject-slug.patch``, numbered by position in the series, as ``git format-patch`` names files."""
    slug = re.sub(r"[^a-z0-9]+", "-", subject.lower()).strip("-")[:52].rstrip("-") or "patch"
    return f"{position:04d}-{slug}.patch"


def planned_export(project: Path, workspace: Path) -> dict[str, bytes]:
    """The series file and patches that exporting ``workspace`` would write, by name."""
    refuse_busy(workspace)
    if git(workspace, "symbolic-ref", "-q", "HEAD", check=False).stdout.strip() != b"refs/heads/main":
        raise PatchsetError(f"{workspace} is not on its branch main: check out main (with your commits) first")
    files = {}
    for position, commit in enumerate(out(workspace, "rev-list", "--reverse", f"{BASE_TAG}..HEAD").split(), 1):
        files[patch_name(position, out(workspace, "log", "-1", "--format=%s", commit))] = format_commit(
            workspace, commit
        )
    series = project / SERIES_FILE
    lines = series.read_text(encoding="utf-8").splitlines() if series.is_file() else []
    header = list(itertools.takewhile(lambda line: line.startswith("#"), lines))
    return {SERIES: ("\n".join([*header, *files]) + "\n").encode("utf-8"), **files}


def changed_names(old: dict[str, bytes], new: dict[str, bytes]) -> list[str]:
    """The names whose bytes differ between two sets of series files (added and removed ones too)."""
    return sorted(name for name in old.keys() | new.keys() if old.get(name) != new.get(name))


def snapshot_dir(workspace: Path) -> Path:
    """Where the workspace keeps the patches it was made from."""
    return workspace / ".git" / "patchset-snapshot"


def record_snapshot(project: Path, workspace: Path) -> None:
    """Remember ``patches/`` as the workspace now reflects it."""
    shutil.rmtree(snapshot_dir(workspace), ignore_errors=True)
    snapshot_dir(workspace).mkdir(parents=True)
    for name, data in series_files(project / "patches").items():
        (snapshot_dir(workspace) / name).write_bytes(data)


def unexported_work(project: Path, workspace: Path) -> list[str]:
    """What the workspace holds that ``patches/`` (as it was when materialized) does not: edits not yet exported."""
    changes = changed_names(series_files(snapshot_dir(workspace)), planned_export(project, workspace))
    return changes + (["uncommitted changes"] if git(workspace, "status", "--porcelain").stdout.strip() else [])


def materialize_workspace(project: Path, force: bool = False) -> Path:
    """Make ``.work/tree``; refuse to replace unexported work unless ``force``. The old one is kept aside."""
    workspace = project / WORKSPACE
    workspace.parent.mkdir(parents=True, exist_ok=True)
    if workspace.exists() and not force:
        if not (workspace / ".git").is_dir():
            raise PatchsetError(f"{workspace} exists but was not made by `materialize`: move it away or use --force")
        refuse_busy(workspace)
        pending = unexported_work(project, workspace)
        if pending:
            raise PatchsetError(
                f"{workspace} has work not exported to patches/ ({', '.join(pending)}): run `export` first,"
                " or materialize with --force to set it aside"
            )
    with tempfile.TemporaryDirectory(dir=workspace.parent, prefix=".tree-") as tmp:
        make_workspace(project, Path(tmp) / "tree")
        record_snapshot(project, Path(tmp) / "tree")
        if workspace.exists():
            keep_previous_tree(project)
            os.rename(workspace, workspace.with_name("previous-tree"))
        os.rename(Path(tmp) / "tree", workspace)
    return workspace


def keep_previous_tree(project: Path) -> Path | None:
    """Move an earlier ``.work/previous-tree`` aside as ``previous-tree-<UTC time>``; where it went, if anywhere."""
    previous = (project / WORKSPACE).with_name("previous-tree")
    if not previous.exists() or not (project / WORKSPACE).exists():
        return None  # materialize will not replace it
    stamp = datetime.now(timezone.utc).strftime("%Y%m%dT%H%M%SZ")
    target, n = previous.with_name(f"previous-tree-{stamp}"), 1
    while target.exists():
        n += 1
        target = previous.with_name(f"previous-tree-{stamp}-{n}")
    os.rename(previous, target)
    return target
