"""The patch series: the order file, and the DEP-3 style fields each patch carries in its message."""

from __future__ import annotations

import email.parser
import email.policy
import fnmatch
import re
from dataclasses import dataclass, field
from pathlib import Path

from patchset import PatchsetError

SERIES_FILE = Path("patches") / "series"
CHANGELOG_SECTIONS = ("Added", "Changed", "Deprecated", "Removed", "Fixed")
# Trailers kept in the fork only: they describe the patch's life here, not the upstream change.
# `Bug:` an upstream issue the patch fixes, `Part-Of:` one it fixes only part of, `Agreed:` where a maintainer agreed,
# `Feature-Request:` the project's file with the request a feature needs upstream before its PR,
# `Docs:` documentation the patch changes outside `docs/` (a docstring that the API reference shows)
FORK_TRAILERS = (
    "Forwarded",
    "Applied-Upstream",
    "Changelog",
    "New-Files",
    "Bug",
    "Part-Of",
    "Agreed",
    "Feature-Request",
    "Mirrors",
    "Depends-On",
    "Docs",
)
# the fields that name upstream issues, and how a commit message or a PR text refers to them
ISSUE_FIELDS = (("Bug", "Fixes"), ("Part-Of", "Part of"))


def issue_refs(values: list[str]) -> list[str]:
    """``#N`` for each upstream issue address among ``values``."""
    return [f"#{m.group(1)}" for v in values if (m := re.search(r"/issues/(\d+)", v))]


def issue_lines(fields: dict[str, list[str]]) -> list[str]:
    """The ``Fixes #N`` and ``Part of #N`` lines of the issues that the fields name."""
    return [f"{verb} {', '.join(refs)}" for key, verb in ISSUE_FIELDS if (refs := issue_refs(fields.get(key, [])))]


_CHANGELOG = re.compile(r"^(fabric|pytorch) (" + "|".join(CHANGELOG_SECTIONS) + r"): (.+)$")


@dataclass
class FieldLine:
    """A line of a message's last paragraph and its folded continuation lines; ``key`` is ``None`` for a non-field."""

    key: str | None
    value: str
    lines: list[str]


_FIELD_KEY = re.compile(r"[A-Za-z][A-Za-z-]*")


def field_lines(paragraph: str) -> list[FieldLine]:
    """The lines of a paragraph as fields: ``Key: value``, continued by lines that start with a space or a tab."""
    found: list[FieldLine] = []
    for line in paragraph.splitlines():
        if line[:1] in (" ", "\t") and found and found[-1].key is not None:
            found[-1].value += " " + line.strip()
            found[-1].lines.append(line)
            continue
        key, sep, value = line.partition(": ")
        if sep and _FIELD_KEY.fullmatch(key):
            found.append(FieldLine(key, value.strip(), [line]))
        else:
            found.append(FieldLine(None, line, [line]))
    return found


@dataclass(frozen=True)
class ChangelogEntry:
    """One CHANGELOG line: the package whose CHANGELOG gets it, the Keep a Changelog section, the text."""

    package: str
    section: str
    text: str


@dataclass
class Patch:
    """A patch file of the series, with the fields parsed from its message."""

    path: Path
    subject: str
    trailers: dict[str, list[str]] = field(default_factory=dict)
    author: str = ""
    description: str = ""
    message: str = ""

    @property
    def name(self) -> str:
        """The patch's file name."""
        return self.path.name

    def field(self, key: str) -> str:
        """The first value of a message field, or ``""``."""
        values = self.trailers.get(key, [])
        return values[0] if values else ""

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
        """Globs of the patch set's new files (tests, docs, modules) that belong to this patch's upstream PR."""
        return [glob for value in self.trailers.get("New-Files", []) for glob in value.split()]

    def owns(self, relpath: str) -> bool:
        """Whether one of our new files belongs to this patch's upstream PR."""
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


def parse_patch(path: Path) -> Patch:
    """Read a ``git format-patch`` mbox: its subject and the ``Key: value`` trailers of its message."""
    text = path.read_text(encoding="utf-8")
    head, sep, rest = text.partition("\n\n")
    if not sep:
        raise PatchsetError(f"{path.name}: not a git format-patch file (no header block)")
    headers = email.parser.HeaderParser(policy=email.policy.default).parsestr(head)
    if headers["Subject"] is None:
        raise PatchsetError(f"{path.name}: no Subject header")
    message = re.split(r"\n---\n|\ndiff --git ", "\n" + rest, maxsplit=1)[0]
    trailers: dict[str, list[str]] = {}
    # Trailers are the last paragraph of the message; the paragraphs before it describe the patch.
    paragraphs = message.strip().split("\n\n")
    for line in field_lines(paragraphs[-1]):
        if line.key is not None:
            trailers.setdefault(line.key, []).append(line.value)
    description = "\n\n".join(paragraphs[:-1] if trailers else paragraphs).strip()
    subject = re.sub(r"^\[PATCH[^\]]*\]\s*", "", str(headers["Subject"]))
    return Patch(path, subject, trailers, str(headers["From"] or ""), description, message.strip())


def series_entries(text: str) -> list[tuple[int, str]]:
    """The patch file names a series file lists, with their line numbers (one a line; ``#`` starts a comment)."""
    entries = []
    for lineno, raw in enumerate(text.splitlines(), 1):
        name = raw.split("#", 1)[0].strip()
        if name:
            entries.append((lineno, name))
    return entries


def series_files(patches_dir: Path) -> dict[str, bytes]:
    """The series file and every patch it names, by name (missing patches are left out)."""
    series = patches_dir / SERIES_FILE.name
    if not series.is_file():
        return {}
    files = {SERIES_FILE.name: series.read_bytes()}
    for _, name in series_entries(series.read_text(encoding="utf-8")):
        if (patches_dir / name).is_file():
            files[name] = (patches_dir / name).read_bytes()
    return files


def find_patch(project: Path, ref: str) -> Patch:
    """A patch of the series by file name, by path, or by its leading number (``2`` or ``0002``)."""
    patches = read_series(project)
    for patch in patches:
        if ref in (patch.name, str(patch.path)) or Path(ref).name == patch.name:
            return patch
        if ref.isdigit() and patch.name.startswith(f"{int(ref):04d}-"):
            return patch
    raise PatchsetError(f"{ref}: no such patch in patches/series ({', '.join(p.name for p in patches)})")


def read_series(project: Path) -> list[Patch]:
    """The patches named in ``patches/series``, in order (one file name a line, ``#`` comments)."""
    series = project / SERIES_FILE
    if not series.is_file():
        raise PatchsetError(f"{series}: the series (order) file is missing")
    patches = []
    for lineno, name in series_entries(series.read_text(encoding="utf-8")):
        path = series.parent / name
        if not path.is_file():
            raise PatchsetError(f"{series}:{lineno}: names {name}, which is not in patches/")
        patches.append(parse_patch(path))
    return patches


def series_digest_material(project: Path) -> bytes:
    """The bytes that identify the series: order and every patch's content."""
    chunks = []
    for patch in read_series(project):
        chunks.append(patch.name.encode() + b"\0" + patch.path.read_bytes())
    return b"\0\0".join(chunks)
