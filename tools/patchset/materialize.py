"""Turn the pinned sdist plus the patch series plus our new files into a source tree of the fork."""

from __future__ import annotations

import hashlib
import os
import re
import shutil
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import datetime, timezone
from pathlib import Path

from patchset import PatchsetError
from patchset.build_label import build_pin
from patchset.gitops import am, git, init_repo
from patchset.pin import Pin, cache_dir, extract_sdist, fetch_sdist, read_pin
from patchset.sections import NOTES_REF, exclude_args, shipped_files, upstream_only, write_note
from patchset.series import Patch, read_series, series_digest_material

# Folders of this repo whose files are new files at upstream paths, laid over the upstream tree.
# Pages of the fork itself (docs/torch-matrix.md, say) sit beside these in docs/ and are not laid over.
OVERLAY_ROOTS = ("src", "tests/tests_fabric", "tests/tests_pytorch", "docs/source-fabric", "docs/source-pytorch")
_SKIP_PARTS = {"__pycache__", ".pytest_cache", ".mypy_cache", ".ruff_cache"}
WORKSPACE = Path(".work") / "tree"
BASE_TAG = "upstream"
# Bump when the layout of cached trees changes, so old caches are not reused.
_CACHE_FORMAT = b"patchset-tree-1"


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


def _diagnose(repo: Path, patch: Patch, skip: list[str] | None = None) -> str:
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
            raise PatchsetError(_diagnose(repo, patch, skip))
        if notes and extra:
            write_note(repo, "HEAD", extra)


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


def materialize_workspace(project: Path, force: bool = False) -> Path:
    """Make ``.work/tree``: a git repo with the upstream base, one commit per patch, our files linked in.

    Refuses to replace a workspace holding work not exported yet, unless ``force``; the replaced workspace is kept
    as ``.work/previous-tree`` either way.
    """
    from patchset.export import record_snapshot, unexported_work
    from patchset.gitops import in_progress

    workspace = project / WORKSPACE
    previous = workspace.with_name("previous-tree")
    workspace.parent.mkdir(parents=True, exist_ok=True)
    with _locked(workspace.parent / ".lock"):
        if workspace.exists() and not force:
            if not (workspace / ".git").is_dir():
                raise PatchsetError(
                    f"{workspace} exists but was not made by `materialize`: move it away or use --force"
                )
            operation = in_progress(workspace)
            if operation:
                raise PatchsetError(f"{workspace} is in the middle of {operation}: finish or abort it first")
            pending = unexported_work(project, workspace)
            if pending:
                raise PatchsetError(
                    f"{workspace} has work not exported to patches/ ({', '.join(pending)}): run `export` first,"
                    " or materialize with --force to set it aside"
                )
        with tempfile.TemporaryDirectory(dir=workspace.parent, prefix=".tree-") as tmp:
            repo = Path(tmp) / "tree"
            make_workspace(project, repo)
            record_snapshot(project, repo)
            if workspace.exists():
                keep_previous_tree(project)
                os.rename(workspace, previous)
            os.rename(repo, workspace)
    return workspace


def keep_previous_tree(project: Path) -> Path | None:
    """Move an earlier ``.work/previous-tree`` aside as ``previous-tree-<UTC time>``, so no backup is overwritten.

    ``materialize_workspace`` keeps the workspace it replaces as ``.work/previous-tree`` and calls this first.
    Returns where the earlier backup went, if there was one.
    """
    previous = (project / WORKSPACE).with_name("previous-tree")
    if not previous.exists() or not (project / WORKSPACE).exists():
        return None  # materialize will not replace it
    stamp = datetime.now(timezone.utc).strftime("%Y%m%dT%H%M%SZ")
    target = previous.with_name(f"previous-tree-{stamp}")
    n = 1
    while target.exists():
        n += 1
        target = previous.with_name(f"previous-tree-{stamp}-{n}")
    os.rename(previous, target)
    return target


@contextmanager
def _locked(path: Path) -> Iterator[None]:
    """One materialize at a time per checkout (POSIX ``flock``; elsewhere, no lock)."""
    try:
        import fcntl
    except ImportError:  # pragma: no cover - Windows
        yield
        return
    with open(path, "w") as fh:
        fcntl.flock(fh, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(fh, fcntl.LOCK_UN)


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
