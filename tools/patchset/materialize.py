"""Turn the pinned sdist plus the patch series plus our new files into a source tree of the fork."""

from __future__ import annotations

import hashlib
import os
import re
import shutil
import tempfile
from pathlib import Path

from patchset import PatchsetError
from patchset.build_label import build_pin
from patchset.gitops import am, git, init_repo
from patchset.overlay import check_overlay, lay_overlay, overlay_files, refuse_stray_sources
from patchset.pin import Pin, cache_dir, extract_sdist, fetch_sdist, read_pin
from patchset.sections import NOTES_REF, exclude_args, shipped_files, upstream_only, write_note
from patchset.series import Patch, read_series, series_digest_material

BASE_TAG = "upstream"
# Bump when the layout of cached trees changes, so old caches are not reused.
_CACHE_FORMAT = b"patchset-tree-1"


def diagnose(repo: Path, patch: Patch, skip: list[str] | None = None) -> str:
    """Why ``patch`` does not apply to ``repo``: already upstream, or which file and hunk fail.

    ``skip`` holds ``--exclude`` options for sections the repository does not have (upstream-only sections).
    """
    skip = skip or []
    if git(repo, "apply", "--check", "--reverse", *skip, str(patch.path), check=False).returncode == 0:
        return f"{patch.name} is already upstream (it applies in reverse): drop it from patches/series"
    proc = git(repo, "apply", "--check", *skip, str(patch.path), check=False)
    stderr = proc.stderr.decode(errors="replace")
    failed = re.search(r"patch failed: (.+):(\d+)", stderr)
    if failed:
        path, line = failed.group(1), int(failed.group(2))
        return f"{patch.name} does not apply: {path}, {_hunk_header(patch, path, line)}"
    missing = re.search(r"error: (.+?): (does not exist in index|No such file or directory)", stderr)
    if missing:
        return f"{patch.name} does not apply: {missing.group(1)} does not exist in the base"
    exists = re.search(r"error: (.+?): already exists in working directory", stderr)
    if exists:
        return f"{patch.name} does not apply: it creates {exists.group(1)}, which already exists"
    detail = stderr.strip().splitlines()[-1] if stderr.strip() else "git apply gave no reason"
    return f"{patch.name} does not apply: {detail}"


def _hunk_header(patch: Patch, path: str, line: int) -> str:
    current = None
    for text in patch.path.read_text(encoding="utf-8").splitlines():
        if text.startswith("+++ "):
            current = text[4:].removeprefix("b/")
        elif text.startswith("@@") and current == path:
            match = re.match(r"@@ -(\d+)", text)
            if match and int(match.group(1)) == line:
                return f"hunk `{text}`"
    return f"hunk at line {line}"


def base_repo(pin: Pin, dest: Path) -> None:
    """Create ``dest`` as a git repository holding the pinned sdist's contents as one commit tagged ``upstream``."""
    sdist = fetch_sdist(pin)
    extract_sdist(sdist, dest)
    init_repo(dest)
    git(dest, "add", "-A", "-f")
    git(dest, "commit", "-q", "-m", f"{pin.name} {pin.version} (upstream sdist {pin.sdist}, sha256 {pin.sha256})")
    git(dest, "tag", BASE_TAG)


def apply_series(repo: Path, patches: list[Patch], three_way: bool = True, notes: bool = False) -> None:
    """Apply each patch as one commit with ``git am``; on failure, leave no half-applied state and say why.

    Sections for files the sdist does not ship are skipped; with ``notes`` (a workspace), each commit keeps them as
    a git note so that ``export`` writes them back unchanged.
    """
    shipped = shipped_files(repo, BASE_TAG)
    if notes:
        git(repo, "config", "notes.rewriteRef", NOTES_REF)
    for patch in patches:
        extra = upstream_only(patch.path, shipped)
        skip = exclude_args(extra)
        args = ["-q", "--keep-cr", *(["-3"] if three_way else []), *skip, str(patch.path)]
        if am(repo, *args).returncode != 0:
            git(repo, "am", "--abort", check=False)
            raise PatchsetError(diagnose(repo, patch, skip))
        if notes and extra:
            write_note(repo, "HEAD", extra)


def write_version(tree: Path, pin: Pin) -> list[Path]:
    """Write the fork's version into every ``version.info`` of the tree's ``src``, where ``__version__`` reads it."""
    written = []
    for path in sorted((tree / "src").rglob("version.info")):
        path.write_text(pin.fork_version + "\n", encoding="utf-8")
        written.append(path)
    if not written:
        raise PatchsetError(f"no version.info under {tree / 'src'}: cannot label the fork's version")
    return written


def tree_key(project: Path, pin: Pin) -> str:
    """Identify a patched tree by the sdist's hash and the series' content."""
    digest = hashlib.sha256(_CACHE_FORMAT + b"\0" + pin.sha256.encode() + b"\0" + series_digest_material(project))
    return digest.hexdigest()[:24]


def patched_tree(project: Path) -> Path:
    """The upstream sdist with the series applied (no overlay, no .git), made once per (sdist, series) and cached."""
    pin = read_pin(project)
    patches = read_series(project)
    final = cache_dir() / "trees" / tree_key(project, pin)
    fetch_sdist(pin)  # verifies the sdist (and a $LIGHTNING_PATCHSET_SDIST override) even when the tree is cached
    if (final / ".complete").is_file():
        return final
    final.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=final.parent, prefix=".build-") as tmp:
        repo = Path(tmp) / "repo"
        base_repo(pin, repo)
        apply_series(repo, patches)
        staging = Path(tmp) / "tree"
        shutil.copytree(repo, staging, ignore=shutil.ignore_patterns(".git"), symlinks=True)
        (staging / ".complete").write_text(tree_key(project, pin) + "\n")
        try:
            os.rename(staging, final)
        except OSError:
            if not (final / ".complete").is_file():  # a concurrent build finished first otherwise
                raise
    return final


def build_tree(project: Path, dest: Path, link: bool = False) -> Path:
    """A complete fork source tree at ``dest``: patched upstream, our new files and the version label."""
    pin = read_pin(project)
    refuse_stray_sources(project, overlay_files(project))
    source = patched_tree(project)
    if dest.exists():
        shutil.rmtree(dest)
    shutil.copytree(source, dest, symlinks=True, ignore=shutil.ignore_patterns(".complete"))
    files = check_overlay(project, dest)
    lay_overlay(project, dest, files, link=link)
    write_version(dest, build_pin(project, pin))
    return dest


def make_workspace(project: Path, repo: Path) -> None:
    """Build a workspace repository at ``repo`` (see :func:`materialize_workspace`)."""
    pin = read_pin(project)
    base_repo(pin, repo)
    apply_series(repo, read_series(project), notes=True)
    files = check_overlay(project, repo)
    lay_overlay(project, repo, files, link=True)
    exclude = repo / ".git" / "info" / "exclude"
    exclude.parent.mkdir(parents=True, exist_ok=True)
    exclude.write_text(
        "# our new files, linked in from the patch set checkout; and what running code leaves behind\n"
        + "".join(f"/{f}\n" for f in files)
        + "__pycache__/\n*.pyc\n"
    )
    versions = write_version(repo, pin)
    git(repo, "update-index", "--skip-worktree", *(str(p.relative_to(repo)) for p in versions))
