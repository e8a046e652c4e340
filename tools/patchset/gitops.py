"""Thin wrappers around the git command line, with a fixed identity and no user configuration leaking in."""

from __future__ import annotations

import os
import subprocess
from collections.abc import Sequence
from pathlib import Path

from patchset import PatchsetError

# The identity recorded for the upstream base commit and for commits made by the tool itself. Patch commits keep
# the author from their patch file.
TOOL_NAME = "Lightning patch set"
TOOL_EMAIL = "patchset@lightning.invalid"
FIXED_DATE = "2000-01-01T00:00:00+0000"


def _env(extra: dict[str, str] | None = None) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("GIT_")}
    env.update({
        "GIT_CONFIG_NOSYSTEM": "1",
        "GIT_CONFIG_GLOBAL": os.devnull,
        "GIT_AUTHOR_NAME": TOOL_NAME,
        "GIT_AUTHOR_EMAIL": TOOL_EMAIL,
        "GIT_COMMITTER_NAME": TOOL_NAME,
        "GIT_COMMITTER_EMAIL": TOOL_EMAIL,
        "GIT_AUTHOR_DATE": FIXED_DATE,
        "GIT_COMMITTER_DATE": FIXED_DATE,
        "LC_ALL": "C",
    })
    if extra:
        env.update(extra)
    return env


def git(
    repo: Path,
    *args: str,
    check: bool = True,
    input: bytes | None = None,
    env: dict[str, str] | None = None,
    isolated: bool = True,
) -> subprocess.CompletedProcess[bytes]:
    """Run ``git -C repo args`` and return the completed process.

    ``isolated`` (for the tool's own repositories) ignores the user's git configuration, hooks and identity; work in
    a user's checkout (``upstream-pr --onto``) runs with ``isolated=False``, as the user's own git would (``env`` is
    then added to the user's environment).
    """
    options = ("-c", "core.autocrlf=false", "-c", "commit.gpgsign=false", "-c", "core.hooksPath=" + os.devnull)
    cmd: Sequence[str] = ("git", *(options if isolated else ()), "-C", str(repo), *args)
    try:
        run_env = _env(env) if isolated else ({**os.environ, **env} if env else None)
        proc = subprocess.run(cmd, input=input, capture_output=True, env=run_env)
    except FileNotFoundError as err:
        raise PatchsetError("git is required but was not found on PATH") from err
    if check and proc.returncode != 0:
        stderr = proc.stderr.decode(errors="replace").strip()
        raise PatchsetError(f"`git {' '.join(args)}` failed in {repo}: {stderr}")
    return proc


def out(repo: Path, *args: str, isolated: bool = True) -> str:
    """Run git and return its stripped standard output as text."""
    return git(repo, *args, isolated=isolated).stdout.decode().strip()


def init_repo(path: Path) -> None:
    """Create an empty repository at ``path`` on branch ``main``."""
    path.mkdir(parents=True, exist_ok=True)
    git(path, "init", "-q")
    git(path, "symbolic-ref", "HEAD", "refs/heads/main")


def is_clean(repo: Path, isolated: bool = True) -> bool:
    """Whether the work tree and index match HEAD (ignored files aside)."""
    return not git(repo, "status", "--porcelain", isolated=isolated).stdout.strip()


def am(
    repo: Path, *args: str, isolated: bool = True, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess[bytes]:
    """``git am``; a patch with no diff (all its sections upstream-only, say) becomes an empty commit."""
    proc = git(repo, "am", *args, check=False, isolated=isolated, env=env)
    if proc.returncode != 0 and b"Patch is empty" in proc.stdout + proc.stderr:
        proc = git(repo, "am", "--allow-empty", check=False, isolated=isolated, env=env)
    return proc


# git states in which HEAD is not what it seems: someone's operation is paused there
_IN_PROGRESS = {
    "rebase-merge": "a rebase",
    "rebase-apply": "a rebase or `git am`",
    "CHERRY_PICK_HEAD": "a cherry-pick",
    "MERGE_HEAD": "a merge",
    "REVERT_HEAD": "a revert",
    "BISECT_LOG": "a bisect",
}


def git_path(repo: Path, name: str, isolated: bool = True) -> Path:
    """Where ``name`` lives in the repository's git dir (linked worktrees have their own)."""
    path = Path(out(repo, "rev-parse", "--git-path", name, isolated=isolated))
    return path if path.is_absolute() else repo / path


def in_progress(repo: Path, isolated: bool = True) -> str | None:
    """The git operation paused in ``repo`` (a rebase, say), if any."""
    return next((what for name, what in _IN_PROGRESS.items() if git_path(repo, name, isolated).exists()), None)


def check_checkout(onto: Path) -> None:
    """Refuse a checkout that is not a git checkout, has uncommitted changes, or has someone's operation paused."""
    if not (onto / ".git").exists():
        raise PatchsetError(f"{onto}: not a git checkout of upstream Lightning")
    operation = in_progress(onto, isolated=False)
    if operation:
        raise PatchsetError(f"{onto} is in the middle of {operation}: finish or abort it first")
    if not is_clean(onto, isolated=False):
        raise PatchsetError(f"{onto}: the checkout has uncommitted changes; commit or stash them first")


def default_branch(checkout: Path) -> str:
    """Upstream's default branch in ``checkout``: what ``origin/HEAD`` names, else a local ``master`` or ``main``."""
    proc = git(checkout, "symbolic-ref", "--quiet", "--short", "refs/remotes/origin/HEAD", check=False, isolated=False)
    if proc.returncode == 0 and proc.stdout.strip():
        return proc.stdout.decode().strip()
    for name in ("master", "main"):
        if git(checkout, "rev-parse", "--verify", "--quiet", f"refs/heads/{name}", check=False).returncode == 0:
            return name
    raise PatchsetError(f"{checkout}: no origin/HEAD, master or main; name the base branch with --base")


def current_branch(onto: Path) -> str:
    """The checked-out branch, or the commit when HEAD is detached."""
    proc = git(onto, "symbolic-ref", "--quiet", "--short", "HEAD", check=False, isolated=False)
    return proc.stdout.decode().strip() if proc.returncode == 0 else out(onto, "rev-parse", "HEAD", isolated=False)
