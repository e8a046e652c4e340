"""The project's new files at upstream paths (the overlay): which they are, who owns them, laying them over a tree."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

from patchset import PatchsetError
from patchset.series import Patch

# Folders whose files are new files at upstream paths; the fork's own pages (docs/*.md) sit beside them, not laid over.
OVERLAY_ROOTS = ("src", "tests/tests_fabric", "tests/tests_pytorch", "docs/source-fabric", "docs/source-pytorch")
SKIPPED = {"__pycache__", ".pytest_cache", ".mypy_cache", ".ruff_cache"}


def overlay_files(project: Path) -> list[str]:
    """The project's new files at upstream paths, as sorted POSIX paths relative to the project."""
    found = []
    for root in (project / r for r in OVERLAY_ROOTS if (project / r).is_dir()):
        for dirpath, dirnames, filenames in os.walk(root):
            dirnames[:] = [d for d in dirnames if d not in SKIPPED and not d.endswith(".egg-info")]
            rel = Path(dirpath).relative_to(project)
            found += [(rel / name).as_posix() for name in filenames if not name.endswith((".pyc", ".pyo"))]
    return sorted(found)


def unowned(files: list[str], patches: list[Patch]) -> list[str]:
    """The new files that no patch's ``New-Files:`` owns: they would ship in no pull request."""
    return [rel for rel in files if not any(patch.owns(rel) for patch in patches)]


def lay_overlay(project: Path, tree: Path, link: bool) -> list[str]:
    """Place the new files into ``tree`` (symlinks, so edits take effect at once, or copies); refuse a shadow."""
    files = overlay_files(project)
    shadows = [rel for rel in files if (tree / rel).exists() or (tree / rel).is_symlink()]
    if shadows:
        more = f" (and {len(shadows) - 1} more)" if len(shadows) > 1 else ""
        raise PatchsetError(
            f"{shadows[0]} would shadow an upstream file{more}: change upstream files through a patch, not by"
            " overlaying them"
        )
    for rel in files:
        (tree / rel).parent.mkdir(parents=True, exist_ok=True)
        if link:
            (tree / rel).symlink_to((project / rel).resolve())
        else:
            shutil.copy2(project / rel, tree / rel)
    return files
