"""The series' own rules, read from the text of the files (nothing is applied): ``check`` reports each broken one."""

from __future__ import annotations

import fnmatch
import re
from pathlib import Path

from patchset import PatchsetError
from patchset.pin import PIN_FILE
from patchset.series import FORK_TRAILERS, SERIES_FILE, Patch, read_series, series_entries

# DEP-3: `Forwarded` is `no`, `not-needed` or where the patch was sent; `Applied-Upstream` appears only once upstream
# has the patch, and names the version, URL or commit that has it.
_URL = re.compile(r"https?://\S+")
_APPLIED = re.compile(r"(\d+(\.\d+)+\S*|https?://\S+|(commit:)?[0-9a-f]{7,40})")
_PLACEHOLDER_HOST = re.compile(r"(^|\.)(localhost|localdomain|invalid|local|test|example\.(com|org|net))$")
_AUTHOR = re.compile(r"^(?P<name>[^<>]*\S)\s*<(?P<email>[^<>@\s]+@(?P<host>[^<>@\s]+\.[^<>@\s]+))>$")
_GIT_TRAILERS = ("Signed-off-by", "Co-authored-by", "Reviewed-by", "Acked-by", "Tested-by", "Reported-by")
KNOWN_FIELDS = (*FORK_TRAILERS, *_GIT_TRAILERS, "Suggested-by", "Helped-by")
_FIELD_LIKE = re.compile(r"^\s*([A-Za-z][A-Za-z -]*?)\s*:")


def placeholder_author(author: str) -> str | None:
    """Why ``author`` is not a real identity (no name, no full address, a host that reaches nobody), or ``None``."""
    match = _AUTHOR.match(author.strip())
    if match is None:
        return f"author {author!r} is not `Name <address>` with a full address"
    return f"author {author!r} is a placeholder address" if _PLACEHOLDER_HOST.search(match["host"].lower()) else None


def lint(project: Path, new_files: list[str]) -> list[str]:
    """Every rule the series breaks, a sentence each; ``new_files`` must belong to exactly one patch each."""
    series = project / SERIES_FILE
    listed = [name for _, name in series_entries(series.read_text(encoding="utf-8"))] if series.is_file() else []
    problems = [
        f"{SERIES_FILE}: {name} is listed more than once" for name in sorted(set(listed)) if listed.count(name) > 1
    ]
    for path in sorted(series.parent.iterdir()) if series.is_file() else []:
        if path.is_file() and path.name not in {SERIES_FILE.name, PIN_FILE.name, *listed}:
            problems.append(f"patches/{path.name} is not listed in {SERIES_FILE}: add it there, or remove it")
    try:
        patches = read_series(project)
    except PatchsetError as err:
        return [*problems, str(err)]
    owners: dict[str, set[str]] = {rel: set() for rel in new_files}
    for i, patch in enumerate(patches):
        problems += [f"{patch.name}: {p}" for p in patch_problems(patch)]
        depends, earlier = patch.field("Depends-On"), {p.name: p for p in patches[:i]}
        if depends and (depends not in earlier or not earlier[depends].upstreamable):
            problems.append(
                f"{patch.name}: Depends-On: {depends} is not an earlier, upstream-bound patch of the series"
            )
        for glob in patch.new_files:
            matched = [rel for rel in new_files if fnmatch.fnmatchcase(rel, glob)]
            problems += [] if matched else [f"{patch.name}: New-Files glob {glob!r} matches no new file"]
            for rel in matched:
                owners[rel].add(patch.name)
    for rel, names in owners.items():
        if not names:
            problems.append(
                f"{rel} belongs to no patch: add it to the `New-Files:` of the patch whose pull request it is part of"
                " (a fork-only file to a `Forwarded: not-needed` patch)"
            )
        elif len(names) > 1:
            problems.append(f"{rel} belongs to more than one patch ({', '.join(sorted(names))})")
    return problems


def patch_problems(patch: Patch) -> list[str]:
    """The rules one patch breaks: its fields (a typo must not change where it goes), description, author, diff."""
    problems = []
    paragraphs = patch.message.split("\n\n")
    known = {key.lower() for key in FORK_TRAILERS}
    for line in "\n".join(paragraphs[:-1]).splitlines():
        if (field := _FIELD_LIKE.match(line)) and field.group(1).strip().lower() in known:
            problems.append(f"the field line {line.strip()!r} is not in the last paragraph, where fields go")
    if any(_FIELD_LIKE.match(line) for line in paragraphs[-1].splitlines()):  # git reads the fields: each line one
        for line in (line for line in paragraphs[-1].splitlines() if line[:1] not in (" ", "\t")):
            key, _, value = line.partition(":")
            if key not in patch.trailers or key not in KNOWN_FIELDS or not value.strip():
                what = f"a `Key: value` field with a known key ({', '.join(KNOWN_FIELDS)})"
                problems.append(f"{line.strip()!r} is not {what}")
    if len(patch.trailers.get("Forwarded", [])) != 1:
        problems.append("needs exactly one `Forwarded:` field (`no`, `not-needed` or the PR's URL)")
    if len(patch.trailers.get("Applied-Upstream", [])) > 1:
        problems.append("has more than one `Applied-Upstream:` field")
    if not patch.description:
        problems.append("no description: say why the patch exists, above its fields")
    if patch.forwarded not in ("no", "not-needed") and not _URL.fullmatch(patch.forwarded):
        problems.append(f"Forwarded: {patch.forwarded!r} must be `no`, `not-needed` or the URL of the pull request")
    for value in patch.trailers.get("Applied-Upstream", []):
        if not _APPLIED.fullmatch(value):
            problems.append(
                f"Applied-Upstream: {value!r} must name the upstream version, URL or commit that has the change;"
                " leave the field out until then"
            )
    if patch.upstreamable and (why := placeholder_author(patch.author)):
        problems.append(f"{why}; an upstream pull request needs a real identity")
    try:
        patch.changelog  # noqa: B018 - parsing validates the field
    except PatchsetError as err:
        problems.append(str(err).removeprefix(f"{patch.name}: "))
    for section in patch.sections:
        if section.creates_file:
            problems.append(f"creates {section.path}: new files live in the project's overlay, owned by New-Files")
        added = [
            line.rstrip(b"\r") for line in section.text.split(b"\n") if line.startswith(b"+") and line[:4] != b"+++ "
        ]
        blank = next((line for line in added if line.rstrip(b" \t") != line), None)  # a CRLF file keeps its ends
        if blank is not None:
            problems.append(
                f"{section.path}: an added line ends in whitespace: {blank[:60].decode(errors='replace')!r}"
            )
    return problems
