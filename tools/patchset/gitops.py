"""git, run with a fixed identity and no user configuration in the tool's own repositories; checkout helpers."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

from patchset import PatchsetError

# the identity of the tool's own commits (the upstream base); patch commits keep their patch's author
IDENTITY = {"NAME": "Lightning patch set", "EMAIL": "patchset@lightning.invalid", "DATE": "2000-01-01T00:00:00+0000"}
_ISOLATED = ("-c", "core.autocrlf=false", "-c", "commit.gpgsign=false", "-c", "core.hooksPath=" + os.devnull)
# git states in which HEAD is not what it seems: someone's operation is paused there
_IN_PROGRESS = {
    "rebase-merge": "a rebase",
    "rebase-apply": "a rebase or `git am`",
    "CHERRY_PICK_HEAD": "a cherry-pick",
    "MERGE_HEAD": "a merge",
    "REVERT_HEAD": "a revert",
    "BISECT_LOG": "a bisect",
}


def git(
    repo: Path,
    *args: str,
    check: bool = True,
    input: bytes | None = None,
    env: dict[str, str] | None = None,
    isolated: bool = True,
) -> subprocess.CompletedProcess[bytes]:
    """Run ``git -C repo args``; a failure (with ``check``) is one :class:`PatchsetError` with git's words.

    ``isolated`` (the tool's own repositories) ignores the user's configuration, hooks and identity; a user's checkout
    (``upstream-pr --onto``) runs with ``isolated=False``, as the user's own git would, ``env`` added to theirs.
    """
    run_env = dict(os.environ)
    if isolated:
        run_env = {k: v for k, v in os.environ.items() if not k.startswith("GIT_")}
        run_env.update({"GIT_CONFIG_NOSYSTEM": "1", "GIT_CONFIG_GLOBAL": os.devnull, "LC_ALL": "C"})
        for role in ("AUTHOR", "COMMITTER"):
            run_env.update({f"GIT_{role}_{key}": value for key, value in IDENTITY.items()})
    cmd = ["git", *(_ISOLATED if isolated else ()), "-C", str(repo), *args]
    try:
        proc = subprocess.run(cmd, input=input, capture_output=True, env={**run_env, **(env or {})})
    except FileNotFoundError as err:
        raise PatchsetError("git is required but was not found on PATH") from err
    if check and proc.returncode != 0:
        said = "; ".join(line.strip() for line in proc.stderr.decode(errors="replace").splitlines() if line.strip())
        raise PatchsetError(f"`git {' '.join(args)}` failed in {repo}: {said}")
    return proc


def out(repo: Path, *args: str, isolated: bool = True) -> str:
    """Git's stripped standard output."""
    return git(repo, *args, isolated=isolated).stdout.decode().strip()


def am(repo: Path, *args: str, isolated: bool = True, env: dict[str, str] | None = None) -> str | None:
    """``git am``: ``None`` once applied, else git's account (the session aborted). No diff is an empty commit."""
    proc = git(repo, "am", *args, check=False, isolated=isolated, env=env)
    if proc.returncode != 0 and b"Patch is empty" in proc.stdout + proc.stderr:
        proc = git(repo, "am", "--allow-empty", check=False, isolated=isolated, env=env)
    if proc.returncode == 0:
        return None
    git(repo, "am", "--abort", check=False, isolated=isolated)
    return (proc.stdout + proc.stderr).decode(errors="replace")


def is_clean(repo: Path, isolated: bool = True) -> bool:
    """Whether the work tree and index match HEAD (ignored files aside)."""
    return not git(repo, "status", "--porcelain", isolated=isolated).stdout.strip()


def git_path(repo: Path, name: str, isolated: bool = True) -> Path:
    """Where ``name`` lives in the repository's git dir (linked worktrees have their own)."""
    path = Path(out(repo, "rev-parse", "--git-path", name, isolated=isolated))
    return path if path.is_absolute() else repo / path


def refuse_busy(repo: Path, isolated: bool = True) -> None:
    """Refuse a repository in the middle of a rebase, ``git am``, cherry-pick, merge, revert or bisect."""
    for name, what in _IN_PROGRESS.items():
        if git_path(repo, name, isolated).exists():
            raise PatchsetError(f"{repo} is in the middle of {what}: finish or abort it first")


def check_checkout(onto: Path) -> None:
    """Refuse a checkout that is not a git checkout, is busy, or has uncommitted changes."""
    if not (onto / ".git").exists():
        raise PatchsetError(f"{onto}: not a git checkout of upstream Lightning")
    refuse_busy(onto, isolated=False)
    if not is_clean(onto, isolated=False):
        raise PatchsetError(f"{onto}: the checkout has uncommitted changes; commit or stash them first")


def verify(repo: Path, rev: str) -> str | None:
    """The commit ``rev`` names in ``repo``, or ``None``."""
    proc = git(repo, "rev-parse", "--verify", "--quiet", f"{rev}^{{commit}}", check=False, isolated=False)
    return proc.stdout.decode().strip() if proc.returncode == 0 else None


def default_branch(checkout: Path) -> str:
    """Upstream's default branch in ``checkout``: what ``origin/HEAD`` names, else a local ``master`` or ``main``."""
    proc = git(checkout, "symbolic-ref", "--quiet", "--short", "refs/remotes/origin/HEAD", check=False, isolated=False)
    if proc.returncode == 0 and proc.stdout.strip():
        return proc.stdout.decode().strip()
    for name in ("master", "main"):
        if verify(checkout, f"refs/heads/{name}"):
            return name
    raise PatchsetError(f"{checkout}: no origin/HEAD, master or main; name the base branch with --base")


def current_branch(onto: Path) -> str:
    """The checked-out branch, or the commit when HEAD is detached."""
    proc = git(onto, "symbolic-ref", "--quiet", "--short", "HEAD", check=False, isolated=False)
    return proc.stdout.decode().strip() if proc.returncode == 0 else out(onto, "rev-parse", "HEAD", isolated=False)
