"""``rebase``: move the series onto a new upstream release by replaying it in the workspace with ``git rebase``."""

from __future__ import annotations

import tempfile
from dataclasses import dataclass, replace
from pathlib import Path

from patchset import PatchsetError
from patchset.gitops import git, out
from patchset.materialize import write_version
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
from patchset.workspace import BASE_TAG, materialize_workspace


@dataclass
class RebaseResult:
    """What happened: the new pin, the patches replayed and dropped, and where git stopped if it did."""

    pin: Pin
    replayed: int
    dropped: list[str]
    stopped_at: str | None


def _subjects(workspace: Path) -> list[str]:
    return out(workspace, "log", "--reverse", "--format=%s", f"{BASE_TAG}..HEAD").splitlines()


def rebase(project: Path, version: str, sdist: Path | None = None, sha256: str | None = None) -> RebaseResult:
    """Replay the series onto ``lightning==version`` in ``.work/tree`` and pin that release (label ``patchset.1``).

    The new sdist (``sdist``, else pip's) is fetched and checked against ``sha256`` first: a release that does not
    exist or a wrong hash changes nothing. Commits whose change upstream has are dropped; on a conflict git stops in
    the workspace, for the user to resolve (``git rebase --continue``), then ``export``.
    """
    old = read_pin(project)
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
        path = cache_sdist(path, actual)
    new = replace(old, version=version, sdist=path.name, sha256=actual, local_version="patchset.1")
    workspace = materialize_workspace(project)  # refuses to replace work that was not exported
    before = _subjects(workspace)
    with tempfile.TemporaryDirectory() as tmp:  # the new release as a commit on the old base
        extract_sdist(path, Path(tmp) / "release")
        env = {"GIT_INDEX_FILE": str(Path(tmp) / "index")}
        git(workspace, f"--work-tree={Path(tmp) / 'release'}", "add", "-A", "-f", ".", env=env)
        tree = git(workspace, "write-tree", env=env).stdout.decode().strip()
    message = f"{new.name} {new.version} (upstream sdist {new.sdist}, sha256 {new.sha256})"
    release = out(workspace, "commit-tree", tree, "-p", BASE_TAG, "-m", message)
    # upstream's own version.info moves with the release: hand it back to git for the replay
    versions = [str(p.relative_to(workspace)) for p in sorted((workspace / "src").rglob("version.info"))]
    git(workspace, "update-index", "--no-skip-worktree", *versions)
    git(workspace, "checkout", "-q", "--", *versions)
    git(workspace, "tag", "-f", "upstream-previous", BASE_TAG)
    git(workspace, "tag", "-f", BASE_TAG, release)
    write_pin(project, new)
    proc = git(workspace, "rebase", "-q", "--onto", BASE_TAG, "upstream-previous", "main", check=False)
    if proc.returncode != 0:  # stopped on a conflict: REBASE_HEAD is the patch commit git could not replay
        stopped = git(workspace, "log", "-1", "--format=%s", "REBASE_HEAD", check=False).stdout.decode().strip()
        return RebaseResult(new, len(_subjects(workspace)), [], stopped or proc.stderr.decode(errors="replace").strip())
    written = write_version(workspace, new.fork_version)
    git(workspace, "update-index", "--skip-worktree", *(str(p.relative_to(workspace)) for p in written))
    after = _subjects(workspace)
    return RebaseResult(new, len(after), [s for s in before if s not in after], None)
