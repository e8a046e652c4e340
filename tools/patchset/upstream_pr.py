"""Turn one patch of the series into a clean upstream pull request on a Lightning git checkout."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

from patchset import PatchsetError
from patchset.gitops import am, check_checkout, current_branch, default_branch, git, git_path, is_clean, out
from patchset.lint import placeholder_author
from patchset.overlay import overlay_files
from patchset.series import FORK_TRAILERS, ChangelogEntry, Patch, field_lines, find_patch, issue_lines

# where upstream-pr records the commit each PR branch started from
START_REFS = "refs/patchset-start/"
CHANGELOG_PATHS = {"fabric": "src/lightning/fabric/CHANGELOG.md", "pytorch": "src/lightning/pytorch/CHANGELOG.md"}


def insert_changelog(text: str, entry: ChangelogEntry) -> str:
    """Add ``entry`` under the first (unreleased) release's ``### <section>``, creating the section if needed."""
    lines = text.splitlines()
    release = next((i for i, line in enumerate(lines) if line.startswith("## ")), None)
    if release is None or not lines[release].lower().startswith("## [unreleased]"):
        raise PatchsetError("the CHANGELOG's first `## ` heading is not `## [unreleased]`, where the entry goes")
    end = next((i for i in range(release + 1, len(lines)) if lines[i].startswith("## ")), len(lines))
    item = f"- {entry.text}"
    section = next((i for i in range(release + 1, end) if lines[i].strip() == f"### {entry.section}"), None)
    if section is None:
        lines[release + 1 : release + 1] = ["", f"### {entry.section}", "", item]
        return "\n".join(lines) + "\n"
    # the section's items run to the next heading; a lone "-" is upstream's empty placeholder
    stop = next((i for i in range(section + 1, end) if lines[i].startswith(("#", "--"))), end)
    body = [i for i in range(section + 1, stop) if lines[i].strip()]
    placeholder = [i for i in body if lines[i].strip() == "-"]
    if placeholder:
        lines[placeholder[0]] = item
    else:
        at = (body[-1] + 1) if body else section + 1
        lines[at:at] = ["", item]
    return "\n".join(lines) + "\n"


def _clean_message(message: str) -> str:
    """The commit message upstream sees: fork-only fields removed, the issue it fixes referenced."""
    paragraphs = message.strip().split("\n\n")
    kept: list[str] = []
    fields: dict[str, list[str]] = {}
    for line in field_lines(paragraphs[-1]):
        if line.key in FORK_TRAILERS:
            fields.setdefault(line.key, []).append(line.value)
        else:
            kept += line.lines
    kept += issue_lines(fields)
    paragraphs = paragraphs[:-1] + (["\n".join(kept)] if kept else [])
    return "\n\n".join(paragraphs) + "\n"


def _checked_out_elsewhere(onto: Path, branch: str) -> str | None:
    """The other worktree that has ``branch`` checked out, if any."""
    here = Path(out(onto, "rev-parse", "--show-toplevel", isolated=False)).resolve()
    worktree = None
    for line in out(onto, "worktree", "list", "--porcelain", isolated=False).splitlines():
        if line.startswith("worktree "):
            worktree = Path(line.removeprefix("worktree ")).resolve()
        elif line == f"branch refs/heads/{branch}" and worktree != here:
            return str(worktree)
    return None


def default_base(project: Path, patch: Patch, onto: Path) -> str:
    """Where a patch's PR branch starts: the PR branch of the patch it ``Depends-On``, else upstream's default."""
    depends = patch.field("Depends-On")
    return branch_name(find_patch(project, depends)) if depends else default_branch(onto)


def branch_name(patch: Patch) -> str:
    """The default PR branch of a patch: ``patchset/<subject slug>``."""
    return "patchset/" + patch.name.removesuffix(".patch").split("-", 1)[-1]


def _restore(onto: Path, original: str, branch: str, previous: str | None) -> str | None:
    """Undo a failed attempt: the branch back at ``previous``, or gone.

    Returns what could not be undone, or ``None`` once the checkout is verified clean.
    """
    if git_path(onto, "rebase-apply", isolated=False).exists():
        git(onto, "am", "--abort", check=False, isolated=False)
    git(onto, "reset", "-q", "--hard", check=False, isolated=False)
    git(onto, "clean", "-q", "-fd", check=False, isolated=False)
    git(onto, "checkout", "-q", "--detach", check=False, isolated=False)
    args = ("-f", branch, previous) if previous else ("-D", branch)
    left = []
    if git(onto, "branch", "-q", *args, check=False, isolated=False).returncode:
        left.append(f"branch {branch} could not be {'reset to ' + previous if previous else 'deleted'}")
    git(onto, "checkout", "-q", original, check=False, isolated=False)
    if git_path(onto, "rebase-apply", isolated=False).exists():
        left.append("a `git am` session is still open")
    if current_branch(onto) != original:
        left.append(f"HEAD is {current_branch(onto)}, not {original}")
    if not is_clean(onto, isolated=False):
        left.append("the work tree has changes")
    return "; ".join(left) or None


def upstream_pr(
    project: Path,
    ref: str,
    onto: Path,
    branch: str | None = None,
    out_dir: Path | None = None,
    base: str | None = None,
    force: bool = False,
    author: str | None = None,
) -> str:
    """Create a branch in the upstream checkout ``onto`` holding the patch, its new files and CHANGELOG entries.

    The branch starts at ``base``: by default upstream's default branch or, for a patch with ``Depends-On:``, the PR
    branch of the patch it depends on. ``force`` recreates an existing branch. The commit's author is the patch's, or
    ``author``. On failure the checkout is put back as it was and verified clean. Returns the branch name; with
    ``out_dir``, also writes the commit as a ``git format-patch`` file there.
    """
    patch = find_patch(project, ref)
    if not patch.upstreamable:
        raise PatchsetError(f"{patch.name} is fork packaging (Forwarded: not-needed); it has no upstream PR")
    check_checkout(onto)
    who = author or patch.author
    why = placeholder_author(who)
    if why:
        raise PatchsetError(f"{patch.name}: {why}; fix the patch's From: or pass --author 'Name <address>'")
    base = base or default_base(project, patch, onto)
    if git(onto, "rev-parse", "--verify", "--quiet", f"{base}^{{commit}}", check=False, isolated=False).returncode:
        hint = " (make it first with upstream-pr)" if base.startswith("patchset/") else ""
        raise PatchsetError(f"{onto}: no branch or commit {base!r} to start from{hint}")
    new_files = [f for f in overlay_files(project) if patch.owns(f)]
    clashes = [rel for rel in new_files if git(onto, "cat-file", "-e", f"{base}:{rel}", check=False).returncode == 0]
    if clashes:
        raise PatchsetError(f"{clashes[0]} already exists in {onto}; a new file of the patch set cannot replace it")
    branch = branch or branch_name(patch)
    exists = git(onto, "rev-parse", "--verify", "--quiet", f"refs/heads/{branch}", check=False).returncode == 0
    if exists and not force:
        raise PatchsetError(f"{onto}: branch {branch} exists; pass --force to recreate it from {base}")
    elsewhere = _checked_out_elsewhere(onto, branch)
    if elsewhere:
        raise PatchsetError(f"{branch} is checked out in the worktree {elsewhere}; switch it to another branch first")
    original = current_branch(onto)
    previous = out(onto, "rev-parse", branch, isolated=False) if exists else None
    start = out(onto, "rev-parse", f"{base}^{{commit}}", isolated=False)
    git(onto, "checkout", "-q", "-B" if force else "-b", branch, start, isolated=False)
    # import-pr diffs the branch against where it started, even after the base branch moves or is recreated
    git(onto, "update-ref", f"{START_REFS}{branch}", start, isolated=False)
    try:
        _commit(project, patch, onto, new_files, who)
    except PatchsetError as err:
        left = _restore(onto, original, branch, previous)
        if left:
            raise PatchsetError(f"{err}\nand {onto} could not be put back: {left}") from err
        raise
    if out_dir is not None:
        out_dir.mkdir(parents=True, exist_ok=True)
        git(onto, "format-patch", "-q", "-1", "-o", str(out_dir.resolve()), "HEAD", isolated=False)
    return branch


def _commit(project: Path, patch: Patch, onto: Path, new_files: list[str], author: str) -> None:
    """Apply the whole patch (upstream-only sections too), add its new files and CHANGELOG entries, in one commit."""
    identity = git(onto, "config", "user.email", check=False, isolated=False).returncode == 0 or any(
        os.environ.get(k) for k in ("GIT_COMMITTER_EMAIL", "EMAIL")
    )
    name, _, address = author.partition(" <")
    # a maintainer's own identity commits; a checkout with none (CI) commits as the author
    env = None if identity else {"GIT_COMMITTER_NAME": name, "GIT_COMMITTER_EMAIL": address.rstrip(">")}
    proc = am(onto, "-3", "--keep-cr", str(patch.path), isolated=False, env=env)
    if proc.returncode != 0:
        # git's own account (which file conflicts, and how), without its advice on an am session we abort
        lines = (proc.stdout + proc.stderr).decode(errors="replace").splitlines()
        detail = "\n".join(line for line in lines if "git am " not in line and "resolved this problem" not in line)
        raise PatchsetError(f"{patch.name} does not apply to {onto}; git said:\n{detail}")
    for rel in new_files:
        (onto / rel).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(project / rel, onto / rel)
    for entry in patch.changelog:
        changelog = onto / CHANGELOG_PATHS[entry.package]
        if not changelog.is_file():
            raise PatchsetError(f"{CHANGELOG_PATHS[entry.package]} is missing in {onto}")
        changelog.write_text(insert_changelog(changelog.read_text(encoding="utf-8"), entry), encoding="utf-8")
    git(onto, "add", "-A", isolated=False)
    message = _clean_message(out(onto, "log", "-1", "--format=%B", isolated=False))
    cmd = ["commit", "-q", "--amend", "--no-verify", f"--author={author}", "-F", "-"]
    proc = git(onto, *cmd, check=False, input=message.encode(), isolated=False, env=env)
    if proc.returncode != 0:
        raise PatchsetError(f"git commit failed in {onto}: {proc.stderr.decode(errors='replace').strip()}")
