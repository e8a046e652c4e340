"""A patch's pull request description, in upstream's ``.github/PULL_REQUEST_TEMPLATE.md``, answered from the patch.

The template is read from the upstream checkout (at the PR's base), so the text follows upstream's current template.
What it asks is answered from what the project has, never assumed:

- *What does this PR do?*: the patch's description; ``Fixes #N`` from its ``Bug:`` fields, ``Part of #N`` from its
  ``Part-Of:`` fields (an issue it fixes only part of);
- its breaking changes: the patch's ``Changelog:`` entries under ``Removed`` and ``Changed`` (Keep a Changelog's
  sections for what stops working as before);
- each *Before submitting* item: the agreement (``Agreed:``, where a maintainer agreed to the change; an issue
  alone is no agreement), one change (one patch; ``Depends-On:`` names the PR it stacks
  on), the docs and tests among the patch's files and new files, the CHANGELOG entries, and whether upstream's tests,
  oldest-requirements tests, mypy and ruff passed, from the patch's sections of ``docs/upstream-tests.md`` recorded at
  the patch's current blob (a missing or stale record is said to be so, unchecked). Reading the contributor guide is
  left for whoever opens the PR to confirm;
- the benchmark line: the ``benchmark`` links of the patch's row in the maintainers' table of patches
  (``docs/maintaining.md``, where the patch's docs and benchmark pages are linked already), as addresses in the fork's
  repository.

An item the rules do not know (upstream changed its template) is marked **not answered** and named by
:func:`unanswered`, which ``upstream-pr`` reports.
"""

from __future__ import annotations

import posixpath
import re
from dataclasses import dataclass
from pathlib import Path

from patchset import PatchsetError
from patchset.feature_request import request_url
from patchset.fork_metadata import fork_url
from patchset.gitops import git
from patchset.overlay import overlay_files
from patchset.sections import split_patch
from patchset.series import Patch, find_patch, issue_lines, issue_refs
from patchset.upstream_record import PAGE, RUNS, TITLES, blob_hash, caused_count, sections

TEMPLATE = ".github/PULL_REQUEST_TEMPLATE.md"
PATCH_TABLE = "docs/maintaining.md"  # its table of patches: a row each, with the patch's docs and benchmark links
NOT_ANSWERED = "**not answered**"
BREAKING_SECTIONS = ("Removed", "Changed")
_ITEM = re.compile(r"^- (\[[ x]\] )?(.+)$")


@dataclass
class Answer:
    """An answer to one item: whether its box is ticked, and what backs it."""

    yes: bool
    text: str


def read_template(onto: Path, base: str) -> str:
    """Upstream's PR template as it is at ``base`` in the checkout."""
    proc = git(onto, "show", f"{base}:{TEMPLATE}", check=False, isolated=False)
    if proc.returncode != 0:
        raise PatchsetError(f"{onto} has no {TEMPLATE} at {base}: is it a checkout of upstream Lightning?")
    return proc.stdout.decode("utf-8")


def patch_files(project: Path, patch: Patch) -> list[str]:
    """The upstream files the patch changes and the new files it owns."""
    changed = [section.path for section in split_patch(patch.path.read_bytes())[1]]
    return sorted({*changed, *(f for f in overlay_files(project) if patch.owns(f))})


def issues(patch: Patch, field: str = "Bug") -> list[str]:
    """``#N`` for each upstream issue of the patch's ``Bug:`` fields (or of another field that names issues)."""
    return issue_refs(patch.trailers.get(field, []))


def fixes_line(project: Path, patch: Patch) -> str:
    """The template's ``Fixes #N`` line: the issues the patch fixes, then those it fixes only part of."""
    lines = issue_lines(patch.trailers)
    request = request_url(project, patch)
    if not lines and request:
        return f"Implements the feature request to be filed first, from {request}: put its number here."
    return "\n".join(lines) or "Fixes no upstream issue (none was filed)."


def agreed_answer(project: Path, patch: Patch) -> Answer:
    """Whether the change was agreed: only an ``Agreed:`` field (where a maintainer agreed) says yes."""
    agreed = [a.strip() for a in patch.trailers.get("Agreed", [])]
    if agreed:
        return Answer(True, f"Yes: {', '.join(agreed)}.")
    request = request_url(project, patch)
    if request:
        return Answer(False, f"Not yet: the feature request ({request}) is to be filed and agreed first.")
    reported = issues(patch) + issues(patch, "Part-Of")
    if reported:
        return Answer(
            False, f"Not yet: reported in {', '.join(reported)}, with no maintainer's agreement to this change."
        )
    return Answer(False, "No: no upstream issue was filed for it.")


def breaking_changes(patch: Patch) -> list[str]:
    """The CHANGELOG entries that change or remove behaviour."""
    return [entry.text for entry in patch.changelog if entry.section in BREAKING_SECTIONS]


def benchmark_links(project: Path, patch: Patch) -> list[str]:
    """The benchmark pages of the patch's row in the maintainers' table, as addresses in the fork's repository."""
    table = project / PATCH_TABLE
    if not table.is_file():
        raise PatchsetError(f"{table}: missing; it holds the table of patches that the PR texts take links from")
    number = patch.name[:4]
    row = next(
        (line for line in table.read_text(encoding="utf-8").splitlines() if line.startswith(f"| {number} |")), ""
    )
    links = re.findall(r"\[([^\]]*benchmark[^\]]*)\]\(([^)\s]+)\)", row, flags=re.I)
    base, folder = fork_url(project), posixpath.dirname(PATCH_TABLE)

    def address(target: str) -> str:
        return target if "://" in target else f"{base}/blob/main/{posixpath.normpath(posixpath.join(folder, target))}"

    return [f"[{text}]({address(target)})" for text, target in links]


def recorded_runs(project: Path, patch: Patch) -> dict[str, str | None]:
    """Each job of ``docs/upstream-tests.md`` for the patch: its section if recorded at the current blob, else None."""
    blob = blob_hash(patch.path)
    found = sections(project)
    result: dict[str, str | None] = {}
    for run in RUNS:
        text = found.get((patch.name, run))
        result[run] = text if text is not None and f"| patch blob | `{blob}` |" in text else None
    return result


def _row(section: str, label: str) -> str:
    match = re.search(rf"^\| {re.escape(label)}[^|]* \| (.+?) \|$", section, flags=re.M)
    return match.group(1) if match else "?"


def tests_answer(project: Path, patch: Patch) -> Answer:
    """Whether upstream's jobs passed on the PR branch, from the recorded runs."""
    runs = recorded_runs(project, patch)
    parts, ok = [], True
    for run, section in runs.items():
        if section is None:
            ok = False
            parts.append(f"{TITLES[run]}: not recorded for this version of the patch")
            continue
        caused = caused_count(section)
        ok = ok and caused == 0
        counts = _row(section, "on the PR branch")
        parts.append(f"{TITLES[run]}: {counts}, {caused} caused by this PR")
    record = f"[the record]({fork_url(project)}/blob/main/{PAGE.as_posix()})"
    lead = f"Yes, every other failure or finding is on the base too ({record})" if ok else f"Not yet ({record})"
    return Answer(ok, f"{lead}: " + "; ".join(parts) + ".")


def answers(project: Path, patch: Patch) -> list[tuple[re.Pattern[str], Answer]]:
    """Each *Before submitting* item's answer, by a pattern of the item's text."""
    files = patch_files(project, patch)
    docs = [f for f in files if f.startswith("docs/") or f.endswith(".rst")]
    tests = [f for f in files if f.startswith("tests/")]
    docstrings = patch.field("Docs")
    docs_changed = ([", ".join(f"`{p}`" for p in docs)] if docs else []) + ([docstrings] if docstrings else [])
    depends = patch.field("Depends-On")
    breaking = breaking_changes(patch)
    entries = [f"`{e.package}` {e.section}: {e.text}" for e in patch.changelog]
    one = f"Yes: one patch of the series ({patch.subject})"
    if depends:
        one += f"; it stacks on the PR of {depends.removesuffix('.patch')}, which goes first"

    def listed(paths: list[str]) -> str:
        return ", ".join(f"`{p}`" for p in paths)

    return [
        (re.compile(r"discussed/agreed", re.I), agreed_answer(project, patch)),
        (
            re.compile(r"contributor guideline", re.I),
            Answer(False, "For whoever opens this PR to confirm."),
        ),
        (re.compile(r"only one thing", re.I), Answer(True, one + ".")),
        (
            re.compile(r"update the documentation", re.I),
            Answer(bool(docs_changed), f"Yes: {'; '.join(docs_changed)}." if docs_changed else "No docs change."),
        ),
        (
            re.compile(r"new necessary tests", re.I),
            Answer(bool(tests), f"Yes: {listed(tests)}." if tests else "No test changes in this PR."),
        ),
        (re.compile(r"existing tests pass", re.I), tests_answer(project, patch)),
        (
            re.compile(r"breaking changes", re.I),
            Answer(True, "Yes, above." if breaking else "There are none (no Removed or Changed entries)."),
        ),
        (
            re.compile(r"update the CHANGELOG", re.I),
            Answer(bool(entries), ("Yes: " + "; ".join(entries)) if entries else "No CHANGELOG entry."),
        ),
    ]


def pr_description(project: Path, ref: str, onto: Path, base: str) -> str:
    """The PR description of patch ``ref``: upstream's template at ``base`` in ``onto``, every item answered."""
    patch = find_patch(project, ref)
    return fill_template(read_template(onto, base), project, patch)


def fill_template(template: str, project: Path, patch: Patch) -> str:
    """``template`` with the patch's description, issue, breaking changes, item answers and benchmark line."""
    rules = answers(project, patch)
    breaking = breaking_changes(patch)
    out: list[str] = []
    lines = template.splitlines()
    i, described, in_checklist = 0, False, False
    while i < len(lines):
        line = lines[i]
        if line.startswith("<!--") and not described and any(o.startswith("## What does this PR do") for o in out):
            end = next(j for j in range(i, len(lines)) if "-->" in lines[j])
            out.append(patch.description)
            benchmarks = benchmark_links(project, patch)
            if benchmarks:
                out += ["", "Benchmark: " + ", ".join(benchmarks)]
            described, i = True, end + 1
            continue
        if line.startswith("Fixes #"):
            out.append(fixes_line(project, patch))
        elif line.startswith("<!--") and "breaking changes" in line.lower() and line.rstrip().endswith("-->"):
            if breaking:
                out += ["**Breaking changes:**", "", *(f"- {text}" for text in breaking)]
            else:
                out.append("No breaking changes.")
        elif "<summary>" in line and "Before submitting" in line:
            in_checklist = True
            out.append(line)
        elif in_checklist and line.startswith("</details>"):
            in_checklist = False
            out.append(line)
        elif in_checklist and (item := _ITEM.match(line)):
            box, text = item.group(1), item.group(2)
            answer = next((a for pattern, a in rules if pattern.search(text)), None)
            if answer is None:
                out.append(f"{line} {NOT_ANSWERED}")
            else:
                tick = ("[x] " if answer.yes else "[ ] ") if box else ""
                out.append(f"- {tick}{text} {answer.text}")
        else:
            out.append(line)
        i += 1
    return "\n".join(out) + "\n"


def checklist_items(template: str) -> list[str]:
    """The *Before submitting* items of a template (their text, without the box)."""
    block = template.split("Before submitting", 1)[-1].split("</details>", 1)[0]
    return [m.group(2) for line in block.splitlines() if (m := _ITEM.match(line))]


def unanswered(text: str) -> list[str]:
    """The items of a filled template that no rule answered."""
    return [line for line in text.splitlines() if line.endswith(NOT_ANSWERED)]


def default_path(project: Path, patch: Patch) -> Path:
    """Where ``upstream-pr`` writes the description unless told: the fork's ``.work/pr/<patch>.md``."""
    return project / ".work" / "pr" / (patch.name.removesuffix(".patch") + ".md")
