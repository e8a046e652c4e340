"""The series' formats, one parser each: the order file, a patch's mail headers and fields, its per-file sections.

A patch may carry sections for upstream files the pinned sdist does not ship (existing tests, docs, CI files): those
*upstream-only* sections are skipped when the fork is built and applied by ``upstream-pr``.
"""

from __future__ import annotations

import email.parser
import email.policy
import fnmatch
import functools
import itertools
import re
from dataclasses import dataclass, field
from pathlib import Path

from patchset import PatchsetError
from patchset.gitops import git

SERIES_FILE = Path("patches") / "series"
CHANGELOG_SECTIONS = ("Added", "Changed", "Deprecated", "Removed", "Fixed")
# Fields of the fork only (the patch's life here, not the upstream change): dropped from the upstream commit.
# `Bug:` an issue the patch fixes, `Part-Of:` one it fixes part of, `Agreed:` where a maintainer agreed,
# `Feature-Request:` the project's file with the request to file first, `Docs:` docs the patch changes outside `docs/`,
# `Benchmark:` the project's pages that measure it.
FORK_TRAILERS: tuple[str, ...] = ("Forwarded", "Applied-Upstream", "Changelog", "New-Files", "Bug", "Part-Of")
FORK_TRAILERS += ("Agreed", "Feature-Request", "Mirrors", "Depends-On", "Docs", "Benchmark")
ISSUE_FIELDS = (("Bug", "Fixes"), ("Part-Of", "Part of"))  # fields naming upstream issues, and how a PR says it
_CHANGELOG = re.compile(r"^(fabric|pytorch) (" + "|".join(CHANGELOG_SECTIONS) + r"): (.+)$")
_SECTION = re.compile(rb"(?m)^diff --git ")
_GLOB_SPECIAL = re.compile(r"[*?\[\\]")


def series_entries(text: str) -> list[tuple[int, str]]:
    """The patch file names a series file lists, with their line numbers (one a line; ``#`` starts a comment)."""
    return [(n, name) for n, raw in enumerate(text.splitlines(), 1) if (name := raw.split("#", 1)[0].strip())]


def parse_trailers(message: str) -> list[tuple[str, str]]:
    """The fields of a message's last paragraph, as ``git interpret-trailers --parse`` reads them (folds unfolded)."""
    said = git(Path("/"), "interpret-trailers", "--parse", input=f"subject\n\n{message}\n".encode()).stdout.decode()
    return [(key, value.strip()) for key, _, value in (line.partition(": ") for line in said.splitlines())]


@dataclass(frozen=True)
class ChangelogEntry:
    """One CHANGELOG line: the package whose CHANGELOG gets it, the Keep a Changelog section, the text."""

    package: str
    section: str
    text: str


@dataclass(frozen=True)
class Section:
    """One ``diff --git`` section of a patch: the file it changes and its bytes, up to the next section."""

    path: str
    text: bytes

    @property
    def creates_file(self) -> bool:
        """Whether the section adds a file (new files belong to the overlay, not to a patch)."""
        return b"\nnew file mode " in self.text.split(b"\n@@", 1)[0]


@dataclass
class Patch:
    """A patch file of the series: its bytes, subject, author, description and fields."""

    path: Path
    data: bytes
    subject: str
    author: str
    description: str
    message: str
    trailers: dict[str, list[str]] = field(default_factory=dict)

    @property
    def name(self) -> str:
        """The patch's file name."""
        return self.path.name

    def field(self, key: str) -> str:
        """The first value of a message field, or ``""``."""
        return (self.trailers.get(key) or [""])[0]

    @property
    def forwarded(self) -> str:
        """DEP-3 ``Forwarded``: ``no``, ``not-needed`` or where it was sent."""
        return self.field("Forwarded") or "no"

    @property
    def upstreamable(self) -> bool:
        """Patches marked ``Forwarded: not-needed`` are fork packaging, never sent upstream."""
        return self.forwarded != "not-needed"

    @property
    def new_files(self) -> list[str]:
        """Globs of the project's new files that belong to this patch's upstream PR."""
        return [glob for value in self.trailers.get("New-Files", []) for glob in value.split()]

    def owns(self, relpath: str) -> bool:
        """Whether one of the project's new files belongs to this patch's upstream PR."""
        return any(fnmatch.fnmatchcase(relpath, glob) for glob in self.new_files)

    @property
    def changelog(self) -> list[ChangelogEntry]:
        """The CHANGELOG entries the patch carries for upstream; a malformed field is an error."""
        entries = []
        for value in self.trailers.get("Changelog", []):
            match = _CHANGELOG.match(value)
            if not match:
                raise PatchsetError(
                    f"{self.name}: bad Changelog field {value!r}; expected `<fabric|pytorch> <Section>: <text>`"
                    f" with Section one of {', '.join(CHANGELOG_SECTIONS)}"
                )
            entries.append(ChangelogEntry(*match.groups()))
        return entries

    @functools.cached_property
    def sections(self) -> list[Section]:
        """The patch's per-file sections."""
        try:
            return split_patch(self.data)[1]
        except PatchsetError as err:
            raise PatchsetError(f"{self.name}: {err}") from None


def parse_patch(path: Path, data: bytes | None = None) -> Patch:
    """A ``git format-patch`` file (``data``, else read from ``path``): mail headers, message, fields."""
    data = path.read_bytes() if data is None else data
    try:
        head, sep, rest = data.decode("utf-8").partition("\n\n")
    except UnicodeDecodeError as err:
        raise PatchsetError(f"{path.name}: not UTF-8 ({err.reason} at byte {err.start}): export it again") from None
    headers = email.parser.HeaderParser(policy=email.policy.default).parsestr(head)
    if not sep or headers["Subject"] is None:
        raise PatchsetError(f"{path.name}: not a git format-patch file (no header block with a Subject)")
    message = re.split(r"\n---\n|\ndiff --git ", "\n" + rest, maxsplit=1)[0].strip()
    paragraphs = message.split("\n\n")  # the fields are the last paragraph; the ones before describe the patch
    trailers: dict[str, list[str]] = {}
    for key, value in parse_trailers(message):
        trailers.setdefault(key, []).append(value)
    description = "\n\n".join(paragraphs[:-1] if trailers else paragraphs).strip()
    subject = re.sub(r"^\[PATCH[^\]]*\]\s*", "", str(headers["Subject"]))
    return Patch(path, data, subject, str(headers["From"] or ""), description, message, trailers)


def read_series(project: Path) -> list[Patch]:
    """The patches ``patches/series`` names, in order."""
    series = project / SERIES_FILE
    if not series.is_file():
        raise PatchsetError(f"{series}: the series (order) file is missing")
    patches = []
    for lineno, name in series_entries(series.read_text(encoding="utf-8")):
        if not (series.parent / name).is_file():
            raise PatchsetError(f"{series}:{lineno}: names {name}, which is not in patches/")
        patches.append(parse_patch(series.parent / name))
    return patches


def series_files(patches_dir: Path) -> dict[str, bytes]:
    """The series file and every patch it names, by name (missing patches left out)."""
    series = patches_dir / SERIES_FILE.name
    if not series.is_file():
        return {}
    names = [name for _, name in series_entries(series.read_text(encoding="utf-8"))]
    return {
        SERIES_FILE.name: series.read_bytes(),
        **{n: (patches_dir / n).read_bytes() for n in names if (patches_dir / n).is_file()},
    }


def find_patch(project: Path, ref: str) -> Patch:
    """A patch of the series by file name, by path, or by its leading number (``2`` or ``0002``)."""
    patches = read_series(project)
    for patch in patches:
        if Path(ref).name == patch.name or (ref.isdigit() and patch.name.startswith(f"{int(ref):04d}-")):
            return patch
    raise PatchsetError(f"{ref}: no such patch in patches/series ({', '.join(p.name for p in patches)})")


def patch_id(sections: list[Section]) -> str:
    """Their patch-id (``git patch-id``): the same for a patch whose message or number alone changed; "" for none."""
    return git(Path("/"), "patch-id", "--stable", input=b"".join(s.text for s in sections)).stdout.decode()[:40]


def issue_refs(values: list[str]) -> list[str]:
    """``#N`` for each upstream issue address among ``values``."""
    return [f"#{m.group(1)}" for v in values if (m := re.search(r"/issues/(\d+)", v))]


def issue_lines(fields: dict[str, list[str]]) -> list[str]:
    """The ``Fixes #N`` and ``Part of #N`` lines of the issues that the fields name."""
    return [f"{verb} {', '.join(refs)}" for key, verb in ISSUE_FIELDS if (refs := issue_refs(fields.get(key, [])))]


def split_patch(data: bytes) -> tuple[bytes, list[Section]]:
    """The part before the first section (mail header and message), and the sections in file order.

    Each section's path is the one ``git apply --numstat -z`` reads (unquoted).
    """
    match = _SECTION.search(data)
    if match is None:
        return data, []
    head, body = data[: match.start()], data[match.start() :]
    proc = git(Path("/"), "apply", "--numstat", "-z", "-", input=body, check=False)
    if proc.returncode != 0:
        raise PatchsetError(f"git cannot read the patch: {proc.stderr.decode(errors='replace').strip()}")
    paths = [record.split(b"\t", 2)[-1] for record in proc.stdout.split(b"\0")[:-1]]
    if b"" in paths:  # -z gives a rename's two paths as records of their own
        raise PatchsetError("the patch renames a file, which the series does not support")
    starts = [m.start() for m in _SECTION.finditer(body)] + [len(body)]
    if len(paths) != len(starts) - 1:
        raise PatchsetError(f"git reads {len(paths)} files in a patch of {len(starts) - 1} `diff --git` sections")
    pairs = zip(paths, itertools.pairwise(starts), strict=True)
    return head, [Section(p.decode("utf-8", errors="surrogateescape"), body[a:b]) for p, (a, b) in pairs]


def join_patch(head: bytes, sections: list[Section]) -> bytes:
    """A patch from its head and sections, the sections in git's order (by path); no blank line without a diff."""
    if not sections:
        return head
    ordered = sorted(sections, key=lambda s: s.path.encode("utf-8", "surrogateescape"))
    return (head if head.endswith(b"\n\n") else head + b"\n") + b"".join(s.text for s in ordered)


def upstream_only(patch: Patch, shipped: frozenset[str]) -> list[Section]:
    """The sections of ``patch`` that change files the sdist does not ship."""
    return [s for s in patch.sections if s.path not in shipped and not s.creates_file]


def exclude_args(sections: list[Section]) -> list[str]:
    """``git apply``/``git am`` options that skip these sections (paths escaped for git's wildcard matching)."""
    return ["--exclude=" + _GLOB_SPECIAL.sub(r"\\\g<0>", s.path) for s in sections]
