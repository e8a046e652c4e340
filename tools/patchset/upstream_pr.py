"""A patch as an upstream pull request: its branch in an upstream checkout, and its edits there brought back.

``upstream-pr`` makes one commit with the whole patch (upstream-only sections too), its new files and its CHANGELOG
entries, under a message without the fork's fields. Upstream-only sections (existing tests, conftests, docs, CI files)
are edited on that branch; ``import-pr`` writes them and the patch's new files back, and lists the changes to files
the sdist ships, which belong in ``.work/tree``.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

from patchset import PatchsetError
from patchset.gitops import am, check_checkout, current_branch, default_branch, git, git_path, is_clean, out, verify
from patchset.lint import placeholder_author
from patchset.overlay import OVERLAY_ROOTS, overlay_files
from patchset.pin import fetch_sdist, read_pin, sdist_files
from patchset.series import (
    FORK_TRAILERS,
    ChangelogEntry,
    Patch,
    find_patch,
    issue_lines,
    join_patch,
    parse_trailers,
    split_patch,
)
from patchset.workspace import WORKSPACE, materialize_workspace, unexported_work

START_REFS = "refs/patchset-start/"  # where upstream-pr records the commit each PR branch started from
CHANGELOG_PATHS = {"fabric": "src/lightning/fabric/CHANGELOG.md", "pytorch": "src/lightning/pytorch/CHANGELOG.md"}


def insert_changelog(text: str, entry: ChangelogEntry) -> str:
    """Add ``entry`` under the first (unreleased) release's ``### <section>``, creating the section if needed."""
    lines = text.splitlines()
    release = next((i for i, line in enumerate(lines) if line.startswith("## ")), None)
    if release is None or not lines[release].lower().startswith("## [unreleased]"):
        raise PatchsetError("the CHANGELOG's first `## ` heading is not `## [unreleased]`, where the entry goes")
    end = next((i for i in range(release + 1, len(lines)) if lines[i].startswith("## ")), len(lines))
    section = next((i for i in range(release + 1, end) if lines[i].strip() == f"### {entry.section}"), None)
    if section is None:
        lines[release + 1 : release + 1] = ["", f"### {entry.section}", "", f"- {entry.text}"]
        return "\n".join(lines) + "\n"
    stop = next((i for i in range(section + 1, end) if lines[i].startswith(("#", "--"))), end)
    body = [i for i in range(section + 1, stop) if lines[i].strip()]
    placeholder = [i for i in body if lines[i].strip() == "-"]  # upstream's empty section holds a lone "-"
    if placeholder:
        lines[placeholder[0]] = f"- {entry.text}"
    else:
        at = (body[-1] + 1) if body else section + 1
        lines[at:at] = ["", f"- {entry.text}"]
    return "\n".join(lines) + "\n"


def clean_message(message: str) -> str:
    """The commit message upstream sees: the fork's fields removed, the issues it fixes referenced."""
    paragraphs, fields = message.strip().split("\n\n"), parse_trailers(message)
    kept = [f"{key}: {value}" for key, value in fields if key not in FORK_TRAILERS]
    kept += issue_lines({key: [v for k, v in fields if k == key] for key, _ in fields})
    return "\n\n".join((paragraphs[:-1] if fields else paragraphs) + (["\n".join(kept)] if kept else [])) + "\n"


def branch_name(patch: Patch) -> str:
    """The default PR branch of a patch: ``patchset/<subject slug>``."""
    return "patchset/" + patch.name.removesuffix(".patch").split("-", 1)[-1]


def default_base(project: Path, patch: Patch, onto: Path) -> str:
    """Where a patch's PR branch starts: the PR branch of the patch it ``Depends-On``, else upstream's default."""
    depends = patch.field("Depends-On")
    return branch_name(find_patch(project, depends)) if depends else default_branch(onto)


def upstream_pr(project: Path, ref: str, onto: Path, branch: str | None = None, base: str | None = None,
                force: bool = False, author: str | None = None) -> str:  # fmt: skip
    """Make the branch of patch ``ref`` in the upstream checkout ``onto``, starting at ``base``; its name.

    ``force`` recreates an existing branch. The author is the patch's, or ``author``. On failure the checkout is put
    back as it was and verified clean.
    """
    patch = find_patch(project, ref)
    if not patch.upstreamable:
        raise PatchsetError(f"{patch.name} is fork packaging (Forwarded: not-needed); it has no upstream PR")
    check_checkout(onto)
    who = author or patch.author
    if why := placeholder_author(who):
        raise PatchsetError(f"{patch.name}: {why}; fix the patch's From: or pass --author 'Name <address>'")
    base = base or default_base(project, patch, onto)
    start = verify(onto, base)
    if start is None:
        hint = " (make it first with upstream-pr)" if base.startswith("patchset/") else ""
        raise PatchsetError(f"{onto}: no branch or commit {base!r} to start from{hint}")
    new_files = [f for f in overlay_files(project) if patch.owns(f)]
    clashes = [rel for rel in new_files if git(onto, "cat-file", "-e", f"{start}:{rel}", check=False).returncode == 0]
    if clashes:
        raise PatchsetError(f"{clashes[0]} already exists in {onto}; a new file of the patch set cannot replace it")
    branch = branch or branch_name(patch)
    previous = verify(onto, f"refs/heads/{branch}")
    if previous and not force:
        raise PatchsetError(f"{onto}: branch {branch} exists; pass --force to recreate it from {base}")
    worktrees = out(onto, "worktree", "list", "--porcelain", isolated=False).split("\n\n")
    here = Path(out(onto, "rev-parse", "--show-toplevel", isolated=False)).resolve()
    for tree in (t for t in worktrees if f"branch refs/heads/{branch}" in t.splitlines()):
        if (elsewhere := Path(tree.splitlines()[0].removeprefix("worktree ")).resolve()) != here:
            raise PatchsetError(
                f"{branch} is checked out in the worktree {elsewhere}; switch it to another branch first"
            )
    original = current_branch(onto)
    git(onto, "checkout", "-q", "-B" if force else "-b", branch, start, isolated=False)
    try:
        _commit(project, patch, onto, new_files, who)
    except PatchsetError as err:
        left = _restore(onto, original, branch, previous)
        raise PatchsetError(f"{err}\nand {onto} could not be put back: {left}" if left else str(err)) from err
    git(onto, "update-ref", f"{START_REFS}{branch}", start, isolated=False)  # import-pr diffs against it
    return branch


def _commit(project: Path, patch: Patch, onto: Path, new_files: list[str], author: str) -> None:
    """Apply the whole patch, add its new files and CHANGELOG entries, in one commit."""
    identity = git(onto, "config", "user.email", check=False, isolated=False).returncode == 0
    name, _, address = author.partition(" <")
    # a maintainer's own identity commits; a checkout with none (CI) commits as the author
    env = None
    if not identity and not any(os.environ.get(k) for k in ("GIT_COMMITTER_EMAIL", "EMAIL")):
        env = {"GIT_COMMITTER_NAME": name, "GIT_COMMITTER_EMAIL": address.rstrip(">")}
    said = am(onto, "-3", "--keep-cr", "--keep-non-patch", str(patch.path), isolated=False, env=env)
    if said is not None:  # git's account of which file conflicts, without its advice on a session now aborted
        detail = "\n".join(line for line in said.splitlines() if "git am " not in line and "resolved this" not in line)
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
    message = clean_message(out(onto, "log", "-1", "--format=%B", isolated=False)).encode()
    commit = ("commit", "-q", "--amend", "--no-verify", f"--author={author}", "-F", "-")
    proc = git(onto, *commit, check=False, input=message, isolated=False, env=env)
    if proc.returncode != 0:
        raise PatchsetError(f"git commit failed in {onto}: {proc.stderr.decode(errors='replace').strip()}")


def _restore(onto: Path, original: str, branch: str, previous: str | None) -> str | None:
    """Undo a failed attempt (the branch back at ``previous``, or gone); what could not be undone, or ``None``."""
    git(onto, "reset", "-q", "--hard", check=False, isolated=False)
    git(onto, "clean", "-q", "-fd", check=False, isolated=False)
    git(onto, "checkout", "-q", "--detach", check=False, isolated=False)
    left = []
    args = ("-f", branch, previous) if previous else ("-D", branch)
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


def import_pr(
    project: Path, ref: str, onto: Path, branch: str | None = None, base: str | None = None
) -> dict[str, list[str]]:
    """Write a PR branch's upstream-only sections and the patch's new files back; what was taken and what was not."""
    patch = find_patch(project, ref)
    branch, base = branch or branch_name(patch), base or default_base(project, patch, onto)
    for rev in (branch, base):
        if verify(onto, rev) is None:
            raise PatchsetError(f"{onto}: no branch or commit {rev!r}")
    workspace = project / WORKSPACE
    if (workspace / ".git").is_dir() and (pending := unexported_work(project, workspace)):
        raise PatchsetError(f"{workspace} has work not exported ({', '.join(pending)}): export it first")
    start = verify(onto, f"{START_REFS}{branch}") or out(onto, "merge-base", base, branch, isolated=False)
    if git(onto, "merge-base", "--is-ancestor", start, branch, check=False).returncode:
        raise PatchsetError(f"{branch} no longer contains the commit it started from ({start[:10]}): it was rebased;"
                            " make it again with upstream-pr --force and redo the edit there")  # fmt: skip
    diff = git(onto, "diff", "--full-index", "--binary", "--no-renames", "--no-color", "--src-prefix=a/",
               "--dst-prefix=b/", start, branch, isolated=False).stdout  # fmt: skip
    head, old_sections = split_patch(patch.data)
    shipped = sdist_files(fetch_sdist(read_pin(project)))
    taken = [s for s in old_sections if s.path in shipped]
    result: dict[str, list[str]] = {"upstream-only": [], "new files": [], "not taken": []}
    for section in split_patch(diff)[1]:
        if section.path in CHANGELOG_PATHS.values():
            continue  # the entries come from the patch's Changelog fields
        if section.path in shipped:
            if section not in old_sections:
                result["not taken"].append(section.path)
        elif section.creates_file or patch.owns(section.path):
            if not patch.owns(section.path):
                result["not taken"].append(section.path)
                continue
            if not section.path.startswith(tuple(root + "/" for root in OVERLAY_ROOTS)):
                raise PatchsetError(f"{section.path}: a new file outside {', '.join(OVERLAY_ROOTS)}")
            (project / section.path).parent.mkdir(parents=True, exist_ok=True)
            (project / section.path).write_bytes(git(onto, "show", f"{branch}:{section.path}", isolated=False).stdout)
            result["new files"].append(section.path)
        else:
            taken.append(section)
            result["upstream-only"].append(section.path)
    patch.path.write_bytes(join_patch(head if taken else head.rstrip(b"\n") + b"\n", taken))
    if (workspace / ".git").is_dir():
        materialize_workspace(project)
    return result
