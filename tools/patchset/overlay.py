"""Our new files at upstream paths (the overlay): which they are, and laying them over an upstream tree."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

from patchset import PatchsetError
from patchset.series import read_series

# Folders of this repo whose files are new files at upstream paths, laid over the upstream tree.
# Pages of the fork itself (docs/torch-matrix.md, say) sit beside these in docs/ and are not laid over.
OVERLAY_ROOTS = ("src", "tests/tests_fabric", "tests/tests_pytorch", "docs/source-fabric", "docs/source-pytorch")
_SKIP_PARTS = {"__pycache__", ".pytest_cache", ".mypy_cache", ".ruff_cache"}


def overlay_files(project: Path) -> list[str]:
    """Our new files at upstream paths, as sorted POSIX paths relative to the project."""
    found = []
    for root in OVERLAY_ROOTS:
        base = project / root
        if not base.is_dir():
            continue
        for dirpath, dirnames, filenames in os.walk(base):
            dirnames[:] = sorted(d for d in dirnames if d not in _SKIP_PARTS and not d.endswith(".egg-info"))
            for name in filenames:
                if name.endswith((".pyc", ".pyo")):
                    continue
                found.append((Path(dirpath) / name).relative_to(project).as_posix())
    return sorted(found)


def check_overlay(project: Path, tree: Path) -> list[str]:
    """Our new files; refuse any that would shadow a file of the (patched) upstream tree."""
    files = overlay_files(project)
    shadows = []
    for rel in files:
        target = tree / rel
        if target.is_symlink() and Path(os.readlink(target)) == (project / rel).resolve():
            continue
        if target.exists() or target.is_symlink():
            shadows.append(rel)
    if shadows:
        raise PatchsetError(
            f"{shadows[0]} would shadow an upstream file"
            + (f" (and {len(shadows) - 1} more)" if len(shadows) > 1 else "")
            + ": change upstream files through a patch, not by overlaying them"
        )
    return files


def lay_overlay(project: Path, tree: Path, files: list[str], link: bool) -> None:
    """Place our new files into ``tree``: symlinks (edits take effect at once) or copies."""
    for rel in files:
        target = tree / rel
        target.parent.mkdir(parents=True, exist_ok=True)
        if target.is_symlink():
            target.unlink()
        if link:
            target.symlink_to((project / rel).resolve())
        else:
            shutil.copy2(project / rel, target)


def refuse_stray_sources(project: Path, files: list[str]) -> None:
    """Refuse to build a file under ``src/`` that no patch's ``New-Files:`` owns: it would ship in no pull request.

    ``check`` reports every unowned new file; the build stops only for those it would put into the wheel.
    """
    patches = read_series(project)
    stray = [rel for rel in files if rel.startswith("src/") and not any(patch.owns(rel) for patch in patches)]
    if stray:
        raise PatchsetError(
            f"{stray[0]} belongs to no patch"
            + (f" (and {len(stray) - 1} more)" if len(stray) > 1 else "")
            + ": add it to the `New-Files:` of the patch whose pull request it is part of (a fork-only file to a"
            " `Forwarded: not-needed` patch), or remove it; nothing was built"
        )
