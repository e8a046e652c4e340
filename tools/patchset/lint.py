"""The series' own rules, checked without applying anything: the order file, DEP-3 fields, authors, new files."""

from __future__ import annotations

import fnmatch
import re
from pathlib import Path

from patchset import PatchsetError
from patchset.pin import PIN_FILE
from patchset.sections import split_patch
from patchset.series import FORK_TRAILERS, SERIES_FILE, Patch, field_lines, read_series, series_entries

# DEP-3: `Forwarded` is `no`, `not-needed` or where the patch was sent; `Applied-Upstream` appears only once the patch
# is applied upstream, and names the version, the URL or the commit that has it.
_URL = re.compile(r"https?://\S+")
_APPLIED = re.compile(r"(\d+(\.\d+)+\S*|https?://\S+|(commit:)?[0-9a-f]{7,40})")
# Addresses that reach nobody: a placeholder author on an upstream pull request.
_PLACEHOLDER_HOST = re.compile(r"(^|\.)(localhost|localdomain|invalid|local|test|example\.(com|org|net))$")
# Fields a patch may carry: the fork's DEP-3 style ones, and git's usual trailers.
KNOWN_FIELDS = (
    *FORK_TRAILERS,
    "Signed-off-by",
    "Co-authored-by",
    "Reviewed-by",
    "Acked-by",
    "Tested-by",
    "Reported-by",
    "Suggested-by",
    "Helped-by",
)
_KNOWN_LOWER = {key.lower() for key in FORK_TRAILERS}
_FIELD_LIKE = re.compile(r"^\s*([A-Za-z][A-Za-z -]*?)\s*:")
_AUTHOR = re.compile(r"^(?P<name>[^<>]*\S)\s*<(?P<email>[^<>@\s]+@(?P<host>[^<>@\s]+\.[^<>@\s]+))>$")


def placeholder_author(author: str) -> str | None:
    """Why ``author`` is not a real identity (no name, no address, a host that reaches nobody), or ``None``."""
    match = _AUTHOR.match(author.strip())
    if match is None:
        return f"author {author!r} is not `Name <address>` with a full address"
    if _PLACEHOLDER_HOST.search(match.group("host").lower()):
        return f"author {author!r} is a placeholder address"
    return None


def lint(project: Path, new_files: list[str]) -> list[str]:
    """Every rule the series breaks, as one sentence each (empty when all hold).

    ``new_files`` are the project's new files at upstream paths: each must belong to exactly one patch.
    """
    problems = _series_file(project)
    try:
        patches = read_series(project)
    except PatchsetError as err:
        return [*problems, str(err)]
    owners: dict[str, list[str]] = {rel: [] for rel in new_files}
    for i, patch in enumerate(patches):
        problems += [f"{patch.name}: {p}" for p in _patch(patch)]
        depends = patch.field("Depends-On")
        earlier = {p.name: p for p in patches[:i]}
        if depends and (depends not in earlier or not earlier[depends].upstreamable):
            problems.append(
                f"{patch.name}: Depends-On: {depends} is not an earlier, upstream-bound patch of the series"
            )
        for glob in patch.new_files:
            matched = [rel for rel in new_files if fnmatch.fnmatchcase(rel, glob)]
            if not matched:
                problems.append(f"{patch.name}: New-Files glob {glob!r} matches no new file")
            for rel in matched:
                owners[rel].append(patch.name)
    for rel, names in owners.items():
        if not names:
            problems.append(
                f"{rel} belongs to no patch: add it to the `New-Files:` of the patch whose pull request it is part of"
                " (a fork-only file to a `Forwarded: not-needed` patch)"
            )
        elif len(set(names)) > 1:
            problems.append(f"{rel} belongs to more than one patch ({', '.join(sorted(set(names)))})")
    return problems


def _series_file(project: Path) -> list[str]:
    series = project / SERIES_FILE
    if not series.is_file():
        return []  # read_series names the missing file
    listed = [name for _, name in series_entries(series.read_text(encoding="utf-8"))]
    problems = [
        f"{SERIES_FILE}: {name} is listed more than once" for name in sorted(set(listed)) if listed.count(name) > 1
    ]
    known = {SERIES_FILE.name, PIN_FILE.name, *listed}
    for path in sorted(series.parent.iterdir()):
        if path.is_file() and path.name not in known:
            problems.append(f"patches/{path.name} is not listed in {SERIES_FILE}: add it there, or remove it")
    return problems


def _fields(patch: Patch) -> list[str]:
    """Field lines are exactly `Key: value` with a known key, in the last paragraph.

    A typo must not change what happens to the patch: a misspelt `Forwarded:` would send a fork-only patch upstream.
    """
    problems = []
    paragraphs = patch.message.split("\n\n")
    for line in "\n".join(paragraphs[:-1] if len(paragraphs) > 1 else []).splitlines():
        key = _FIELD_LIKE.match(line)
        if key and key.group(1).strip().lower() in _KNOWN_LOWER:
            problems.append(f"the field line {line.strip()!r} is not in the last paragraph, where fields go")
    last = paragraphs[-1]
    for entry in field_lines(last) if any(_FIELD_LIKE.match(line) for line in last.splitlines()) else []:
        if entry.key not in KNOWN_FIELDS or not entry.value:
            problems.append(
                f"{entry.lines[0].strip()!r} is not a `Key: value` field with a known key ({', '.join(KNOWN_FIELDS)})"
            )
    if len(patch.trailers.get("Forwarded", [])) != 1:
        problems.append("needs exactly one `Forwarded:` field (`no`, `not-needed` or the PR's URL)")
    if len(patch.trailers.get("Applied-Upstream", [])) > 1:
        problems.append("has more than one `Applied-Upstream:` field")
    return problems


def _patch(patch: Patch) -> list[str]:
    problems = _fields(patch)
    if not patch.description:
        problems.append("no description: say why the patch exists, above its fields")
    forwarded = patch.forwarded
    if forwarded not in ("no", "not-needed") and not _URL.fullmatch(forwarded):
        problems.append(f"Forwarded: {forwarded!r} must be `no`, `not-needed` or the URL of the pull request")
    for value in patch.trailers.get("Applied-Upstream", []):
        if not _APPLIED.fullmatch(value):
            problems.append(
                f"Applied-Upstream: {value!r} must name the upstream version, URL or commit that has the change;"
                " leave the field out until then"
            )
    if patch.upstreamable:
        why = placeholder_author(patch.author)
        if why:
            problems.append(f"{why}; an upstream pull request needs a real identity")
    try:
        patch.changelog  # noqa: B018 - parsing validates the field
    except PatchsetError as err:
        problems.append(str(err).removeprefix(f"{patch.name}: "))
    for section in split_patch(patch.path.read_bytes())[1]:
        if section.creates_file:
            problems.append(f"creates {section.path}: new files live in the project's overlay, owned by New-Files")
        for line in section.text.split(b"\n"):
            if line.startswith(b"+") and not line.startswith(b"+++ ") and _ends_in_blank(line):
                problems.append(
                    f"{section.path}: an added line ends in whitespace: {line[:60].decode(errors='replace')!r}"
                )
                break
    return problems


def _ends_in_blank(line: bytes) -> bool:
    body = line.rstrip(b"\r")  # a CRLF file keeps its line ends
    return body.rstrip(b" \t") != body
