"""A patch's per-file sections, and which of them change upstream files that the pinned sdist does not ship.

A patch is one upstream pull request, so besides hunks for files the sdist ships (``src/``, ``requirements/``) it may
carry hunks for upstream files the sdist leaves out: existing tests and conftests, docs sources, CI configuration.
Those *upstream-only* sections are skipped when the fork is built (``git am --exclude``), kept byte for byte through
``materialize`` and ``export`` (as a git note on the workspace commit) and applied by ``upstream-pr``.
"""

from __future__ import annotations

import itertools
import re
from dataclasses import dataclass
from pathlib import Path

from patchset import PatchsetError
from patchset.gitops import git

# Where the workspace keeps a commit's upstream-only sections. Notes under this ref follow amend and rebase because
# the workspace sets ``notes.rewriteRef`` to it.
NOTES_REF = "refs/notes/patchset-upstream-only"
_SECTION = re.compile(rb"(?m)^diff --git ")
_GLOB_SPECIAL = re.compile(r"[*?\[\\]")


@dataclass(frozen=True)
class Section:
    """One ``diff --git`` section of a patch: the file it changes and its bytes, up to the next section."""

    path: str
    text: bytes

    @property
    def creates_file(self) -> bool:
        """Whether the section adds a file (new files belong in the overlay, not in a patch)."""
        header = self.text.split(b"\n@@", 1)[0]
        return b"\nnew file mode " in header


def split_patch(data: bytes) -> tuple[bytes, list[Section]]:
    """The part before the first section (mail header and message), and the sections in file order."""
    match = _SECTION.search(data)
    if match is None:
        return data, []
    head, body = data[: match.start()], data[match.start() :]
    starts = [m.start() for m in _SECTION.finditer(body)] + [len(body)]
    paths = section_paths(body)
    if len(paths) != len(starts) - 1:
        raise PatchsetError(f"git reads {len(paths)} files in a patch of {len(starts) - 1} `diff --git` sections")
    return head, [Section(path, body[a:b]) for path, (a, b) in zip(paths, itertools.pairwise(starts), strict=True)]


def section_paths(patch: bytes) -> list[str]:
    """The file each section of ``patch`` changes, in order, as ``git apply --numstat -z`` reads them (unquoted)."""
    proc = git(Path("/"), "apply", "--numstat", "-z", "-", input=patch, check=False)
    if proc.returncode != 0:
        raise PatchsetError(f"git cannot read the patch: {proc.stderr.decode(errors='replace').strip()}")
    paths = []
    for record in proc.stdout.split(b"\0")[:-1]:
        path = record.split(b"\t", 2)[-1]
        if not path:  # -z gives a rename's two paths as records of their own
            raise PatchsetError("the patch renames a file, which the series does not support")
        paths.append(path.decode("utf-8", errors="surrogateescape"))
    return paths


def join_patch(head: bytes, sections: list[Section]) -> bytes:
    """A patch from its head and sections, the sections in git's own order (by path).

    A commit with no diff exports without the blank line that separates a message from its first section.
    """
    if not sections:
        return head
    if not head.endswith(b"\n\n"):
        head += b"\n"
    return head + b"".join(s.text for s in sorted(sections, key=lambda s: s.path.encode("utf-8", "surrogateescape")))


def shipped_files(repo: Path, rev: str = "HEAD") -> frozenset[str]:
    """The files of the pinned sdist, as committed at ``rev`` of a repository made from it."""
    listed = git(repo, "ls-tree", "-r", "-z", "--name-only", rev).stdout.decode("utf-8", errors="surrogateescape")
    return frozenset(p for p in listed.split("\0") if p)


def upstream_only(patch: Path, shipped: frozenset[str]) -> list[Section]:
    """The sections of ``patch`` that change files the sdist does not ship."""
    return [s for s in split_patch(patch.read_bytes())[1] if s.path not in shipped and not s.creates_file]


def exclude_args(sections: list[Section]) -> list[str]:
    """``git apply``/``git am`` options that skip these sections (paths escaped for git's wildcard matching)."""
    return ["--exclude=" + _GLOB_SPECIAL.sub(r"\\\g<0>", s.path) for s in sections]


def read_note(repo: Path, commit: str) -> list[Section]:
    """The upstream-only sections stored with a workspace commit (none if it has no note)."""
    listed = git(repo, "notes", f"--ref={NOTES_REF}", "list", commit, check=False)
    if listed.returncode != 0:
        return []
    blob = listed.stdout.decode().strip()
    sections = split_patch(git(repo, "cat-file", "blob", blob).stdout)[1]
    # squashing two commits joins their notes with a blank line, which no diff line can be: drop it
    return [Section(s.path, s.text.rstrip(b"\n") + b"\n") for s in sections]


def write_note(repo: Path, commit: str, sections: list[Section]) -> None:
    """Store the upstream-only sections with a workspace commit, byte for byte (a blob, so no whitespace cleanup)."""
    if not sections:
        git(repo, "notes", f"--ref={NOTES_REF}", "remove", "--ignore-missing", commit)
        return
    blob = git(repo, "hash-object", "-w", "--stdin", input=b"".join(s.text for s in sections)).stdout.decode().strip()
    git(repo, "notes", f"--ref={NOTES_REF}", "add", "-f", "-C", blob, commit)
