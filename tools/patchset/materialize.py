"""The fork's source tree, as a build makes it: the pinned sdist, the series applied, the new files, the version."""

from __future__ import annotations

import re
import shutil
from pathlib import Path

from patchset import PatchsetError
from patchset.build_label import build_pin
from patchset.gitops import git
from patchset.overlay import lay_overlay, overlay_files, unowned
from patchset.pin import extract_sdist, fetch_sdist, read_pin, sdist_files
from patchset.series import Patch, exclude_args, read_series, upstream_only


def diagnose(repo: Path, patch: Patch, skip: list[str]) -> str:
    """Why ``patch`` does not apply in ``repo`` (``skip``: options that leave out its upstream-only sections)."""
    if git(repo, "apply", "--check", "--reverse", *skip, "-", input=patch.data, check=False).returncode == 0:
        return f"{patch.name} is already upstream (it applies in reverse): drop it from patches/series"
    stderr = git(repo, "apply", "--check", *skip, "-", input=patch.data, check=False).stderr.decode(errors="replace")
    if failed := re.search(r"patch failed: (.+):(\d+)", stderr):
        section = b"".join(s.text for s in patch.sections if s.path == failed.group(1))
        hunks = re.findall(rb"(?m)^@@ -" + failed.group(2).encode() + rb"\b.*$", section)
        where = f"hunk `{hunks[0].decode()}`" if hunks else f"hunk at line {failed.group(2)}"
        return f"{patch.name} does not apply: {failed.group(1)}, {where}"
    if missing := re.search(r"error: (.+?): (does not exist in index|No such file or directory)", stderr):
        return f"{patch.name} does not apply: {missing.group(1)} does not exist in the base"
    if exists := re.search(r"error: (.+?): already exists in working directory", stderr):
        return f"{patch.name} does not apply: it creates {exists.group(1)}, which already exists"
    return f"{patch.name} does not apply: {(stderr.strip().splitlines() or ['git apply gave no reason'])[-1]}"


def write_version(tree: Path, version: str) -> list[Path]:
    """Write the fork's version into every ``version.info`` of the tree's ``src``, where ``__version__`` reads it."""
    written = sorted((tree / "src").rglob("version.info"))
    if not written:
        raise PatchsetError(f"no version.info under {tree / 'src'}: cannot label the fork's version")
    for path in written:
        path.write_text(version + "\n", encoding="utf-8")
    return written


def build_tree(project: Path, dest: Path, link: bool = False) -> Path:
    """The fork's tree at ``dest``: upstream's sdist patched, the new files (linked or copied), the version label."""
    pin, patches = read_pin(project), read_series(project)
    stray = [rel for rel in unowned(overlay_files(project), patches) if rel.startswith("src/")]
    if stray:
        more = f" (and {len(stray) - 1} more)" if len(stray) > 1 else ""
        raise PatchsetError(
            f"{stray[0]} belongs to no patch{more}: add it to the `New-Files:` of the patch whose pull request it is"
            " part of (a fork-only file to a `Forwarded: not-needed` patch), or remove it; nothing was built"
        )
    sdist = fetch_sdist(pin)
    if dest.exists():
        shutil.rmtree(dest)
    dest.parent.mkdir(parents=True, exist_ok=True)
    extract_sdist(sdist, dest)
    git(dest, "init", "-q")  # its own repository, so that `git apply` takes paths from here, wherever this is
    shipped = sdist_files(sdist)
    for patch in patches:
        skip = exclude_args(upstream_only(patch, shipped))
        if git(dest, "apply", *skip, "-", input=patch.data, check=False).returncode:
            raise PatchsetError(diagnose(dest, patch, skip))
    shutil.rmtree(dest / ".git")
    lay_overlay(project, dest, link)
    write_version(dest, build_pin(project, pin).fork_version)
    return dest
