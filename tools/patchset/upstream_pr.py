"""Turn one patch of the series into a clean upstream pull request on a Lightning git checkout."""

from __future__ import annotations

import re
import shutil
from pathlib import Path

from patchset import PatchsetError
from patchset.gitops import git, is_clean, out
from patchset.materialize import overlay_files
from patchset.series import FORK_TRAILERS, ChangelogEntry, Patch, read_series

CHANGELOG_PATHS = {"fabric": "src/lightning/fabric/CHANGELOG.md", "pytorch": "src/lightning/pytorch/CHANGELOG.md"}


def find_patch(project: Path, ref: str) -> Patch:
    """A patch of the series by file name, by path, or by its leading number (``2`` or ``0002``)."""
    patches = read_series(project)
    for patch in patches:
        if ref in (patch.name, str(patch.path)) or Path(ref).name == patch.name:
            return patch
        if ref.isdigit() and patch.name.startswith(f"{int(ref):04d}-"):
            return patch
    raise PatchsetError(f"{ref}: no such patch in patches/series ({', '.join(p.name for p in patches)})")


def insert_changelog(text: str, entry: ChangelogEntry) -> str:
    """Add ``entry`` under the first (unreleased) release's ``### <section>``, creating the section if needed."""
    lines = text.splitlines()
    release = next((i for i, line in enumerate(lines) if line.startswith("## ")), None)
    if release is None:
        raise PatchsetError("the CHANGELOG has no `## ` release heading to add the entry under")
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
    kept, bugs, dropping = [], [], False
    for line in paragraphs[-1].splitlines():
        key, sep, value = line.partition(": ")
        if sep and key in FORK_TRAILERS:
            dropping = True
            if key == "Bug":
                bugs.append(value)
        elif line[:1] in (" ", "\t") and dropping:
            continue  # the folded continuation of a dropped field
        else:
            dropping = False
            kept.append(line)
    refs = [f"#{m.group(1)}" for b in bugs if (m := re.search(r"/issues/(\d+)", b))]
    if refs:
        kept.append("Fixes " + ", ".join(refs))
    paragraphs = paragraphs[:-1] + (["\n".join(kept)] if kept else [])
    return "\n\n".join(paragraphs) + "\n"


def upstream_pr(project: Path, ref: str, onto: Path, branch: str | None = None, out_dir: Path | None = None) -> str:
    """Create a branch in the upstream checkout ``onto`` holding the patch, its new files and CHANGELOG entries.

    Returns the branch name. With ``out_dir``, also writes the commit as a ``git format-patch`` file there.
    """
    patch = find_patch(project, ref)
    if not patch.upstreamable:
        raise PatchsetError(f"{patch.name} is fork packaging (Forwarded: not-needed); it has no upstream PR")
    if not (onto / ".git").exists():
        raise PatchsetError(f"{onto}: not a git checkout of upstream Lightning")
    if not is_clean(onto, isolated=False):
        raise PatchsetError(f"{onto}: the checkout has uncommitted changes; commit or stash them first")
    new_files = [f for f in overlay_files(project) if patch.owns(f)]
    clashes = [rel for rel in new_files if (onto / rel).exists()]
    if clashes:
        raise PatchsetError(f"{clashes[0]} already exists in {onto}; a new file of the patch set cannot replace it")
    branch = branch or "patchset/" + patch.name.removesuffix(".patch").split("-", 1)[-1]
    git(onto, "checkout", "-q", "-b", branch, isolated=False)
    try:
        if git(onto, "am", "-q", "-3", str(patch.path), check=False, isolated=False).returncode != 0:
            git(onto, "am", "--abort", check=False, isolated=False)
            head = out(onto, "rev-parse", "--short", "HEAD", isolated=False)
            raise PatchsetError(f"{patch.name} does not apply to {onto} ({head})")
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
        git(onto, "commit", "-q", "--amend", "--no-verify", "-F", "-", input=message.encode(), isolated=False)
    except PatchsetError:
        git(onto, "add", "-A", check=False, isolated=False)
        git(onto, "reset", "-q", "--hard", check=False, isolated=False)
        git(onto, "checkout", "-q", "-", check=False, isolated=False)
        git(onto, "branch", "-q", "-D", branch, check=False, isolated=False)
        raise
    if out_dir is not None:
        out_dir.mkdir(parents=True, exist_ok=True)
        git(onto, "format-patch", "-q", "-1", "-o", str(out_dir.resolve()), "HEAD", isolated=False)
    return branch
