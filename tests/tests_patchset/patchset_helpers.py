"""Helpers for the patch set tooling's tests (importable; the fixtures live in conftest.py)."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
TOOLS = REPO / "tools"
PROJECT_EMAIL = "maintainers@users.noreply.a-seed-28b837d4.example"  # the project's identity in its patches


def project_files(root: Path) -> list[str]:
    """The files of this checkout that a fresh clone would have, plus new files not yet committed."""
    listed = subprocess.run(
        ["git", "-C", str(root), "ls-files", "--cached", "--others", "--exclude-standard", "-z"],
        capture_output=True,
        check=True,
    ).stdout.decode()
    return sorted({f for f in listed.split("\0") if f and (root / f).is_file()})


def copy_project(dest: Path, include: tuple[str, ...] = ("patches", "tools", "pyproject.toml", "README.md")) -> Path:
    """A copy of this project's pin, series, tool and build config (no new files unless asked) at ``dest``."""
    for rel in project_files(REPO):
        if rel.split("/")[0] in include or rel in include:
            target = dest / rel
            target.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(REPO / rel, target)
    return dest


def write(path: Path, text: str) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text, encoding="utf-8")
    return path


def git(repo: Path, *args: str) -> str:
    return subprocess.run(["git", "-C", str(repo), *args], capture_output=True, text=True, check=True).stdout.strip()
