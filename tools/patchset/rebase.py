"""Move the patch series onto a new upstream release: replay it in the workspace with ``git rebase``."""

from __future__ import annotations

import tempfile
from dataclasses import dataclass, replace
from pathlib import Path

from patchset import PatchsetError
from patchset.gitops import git, out
from patchset.materialize import BASE_TAG, write_version
from patchset.pin import (
    Pin,
    ReleaseNotFoundError,
    cache_sdist,
    extract_sdist,
    file_sha256,
    pip_download,
    read_pin,
    write_pin,
)
from patchset.workspace import materialize_workspace

PREVIOUS_TAG = "upstream-previous"


@dataclass
class RebaseResult:
    """What happened: the new pin, the patches replayed, and where git stopped if it did."""

    pin: Pin
    replayed: int
    dropped: list[str]
    stopped_at: str | None


def rebase(project: Path, version: str, sdist: Path | None = None, sha256: str | None = None) -> RebaseResult:
    """Replay the series onto ``lightning==version`` in ``.work/tree`` and pin that release.

    The new sdist comes from ``sdist`` or from pip; with ``sha256`` it must match, otherwise its hash is taken as
    downloaded and written to the pin for review. It is fetched and checked first: a release that does not exist or
    a wrong hash changes nothing. Then the workspace is made again (the one it replaces is kept, see
    :func:`keep_previous_tree`). Commits whose change upstream already has are dropped; a conflict stops the rebase in
    the workspace for the user to resolve (``git rebase --continue``), then ``export``.
    """
    old = read_pin(project)
    path, actual = _new_release(old, version, sdist, sha256)
    new = replace(old, version=version, sdist=path.name, sha256=actual, local_version="patchset.1")
    workspace = materialize_workspace(project)  # refuses to replace work that was not exported
    before = out(workspace, "rev-list", "--reverse", f"{BASE_TAG}..HEAD").split()
    subjects = {c: out(workspace, "log", "-1", "--format=%s", c) for c in before}
    with tempfile.TemporaryDirectory() as tmp:
        new_base = _commit_release(workspace, path, new, Path(tmp) / "release")
    # upstream's own version.info moves with the release: hand it back to git for the replay
    versions = [str(p.relative_to(workspace)) for p in sorted((workspace / "src").rglob("version.info"))]
    git(workspace, "update-index", "--no-skip-worktree", *versions)
    git(workspace, "checkout", "-q", "--", *versions)
    git(workspace, "tag", "-f", PREVIOUS_TAG, BASE_TAG)
    git(workspace, "tag", "-f", BASE_TAG, new_base)
    write_pin(project, new)
    proc = git(workspace, "rebase", "-q", "--onto", BASE_TAG, PREVIOUS_TAG, "main", check=False)
    stopped_at = None
    if proc.returncode != 0:
        # git stopped on a conflict: REBASE_HEAD is the patch commit it could not replay
        head = git(workspace, "log", "-1", "--format=%s", "REBASE_HEAD", check=False)
        stopped_at = head.stdout.decode().strip() or proc.stderr.decode(errors="replace").strip()
    else:
        written = write_version(workspace, new)
        git(workspace, "update-index", "--skip-worktree", *(str(p.relative_to(workspace)) for p in written))
    after = {out(workspace, "log", "-1", "--format=%s", c) for c in _commits(workspace)}
    dropped = [s for s in subjects.values() if s not in after] if stopped_at is None else []
    return RebaseResult(new, len(after), dropped, stopped_at)


def _new_release(old: Pin, version: str, sdist: Path | None, sha256: str | None) -> tuple[Path, str]:
    """The new release's sdist in the cache, and its sha256; a short error before anything changed if there is none."""
    if sdist is not None and not sdist.is_file():
        raise PatchsetError(f"--sdist {sdist}: no such file")
    with tempfile.TemporaryDirectory() as tmp:
        try:
            path = sdist if sdist is not None else pip_download(old.name, version, Path(tmp))
        except ReleaseNotFoundError:
            raise PatchsetError(
                f"your index has no sdist of {old.name} {version}: nothing was changed. Check the version; for a"
                f" release your index lacks, download its sdist and pass --sdist {old.name}-{version}.tar.gz"
                " --sha256 <from the release page>"
            ) from None
        actual = file_sha256(path)
        if sha256 and actual != sha256.lower():
            raise PatchsetError(f"{path}: sha256 {actual} does not match the given {sha256}; nothing was changed")
        return cache_sdist(path, actual), actual


def _commits(workspace: Path) -> list[str]:
    return out(workspace, "rev-list", "--reverse", f"{BASE_TAG}..HEAD").split()


def _commit_release(workspace: Path, sdist: Path, pin: Pin, scratch: Path) -> str:
    """Record the new release's files as a commit whose parent is the old base; return its id."""
    extract_sdist(sdist, scratch)
    index = scratch.parent / "index"
    env = {"GIT_INDEX_FILE": str(index)}
    git(workspace, f"--work-tree={scratch}", "add", "-A", "-f", ".", env=env)
    tree = git(workspace, "write-tree", env=env).stdout.decode().strip()
    message = f"{pin.name} {pin.version} (upstream sdist {pin.sdist}, sha256 {pin.sha256})"
    return git(workspace, "commit-tree", tree, "-p", BASE_TAG, "-m", message).stdout.decode().strip()
