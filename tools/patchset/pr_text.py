"""A patch's PR text, upstream's ``.github/PULL_REQUEST_TEMPLATE.md`` answered, and the feature request it needs.

The template and the issue forms are read from the upstream checkout at the PR's base, so the texts follow upstream's
current ones. Each *Before submitting* item is answered from what the project has, never assumed: the agreement from
``Agreed:`` (an issue alone is no agreement), one thing from the series (``Depends-On:`` names the PR it stacks on),
docs and tests from the patch's files, the CHANGELOG from its entries, breaking changes from its ``Removed`` and
``Changed`` entries, and the tests from the records of upstream's jobs at the patch's current blob. Reading the
contributor guide is left to whoever opens the PR; an item no rule knows is marked :data:`NOT_ANSWERED`.

A feature without an upstream issue names the project's request text with ``Feature-Request: <file>``: one
``## <field>`` section per field of upstream's feature request form (the issue form labelled ``feature``).
"""

from __future__ import annotations

import posixpath
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from patchset import PatchsetError
from patchset.distribution import fork_url
from patchset.gitops import git
from patchset.overlay import overlay_files
from patchset.records import JOBS, TITLES, blob_hash, load, pre_existing
from patchset.series import Patch, issue_lines, issue_refs

TEMPLATE = ".github/PULL_REQUEST_TEMPLATE.md"
FORMS = ".github/ISSUE_TEMPLATE"
PATCH_TABLE = "docs/maintaining.md"  # its table of patches: a row each, with the patch's docs and benchmark links
NOT_ANSWERED = "**not answered**"
CHECKS = ("mypy", "ruff")  # jobs whose failed cases are findings, with nothing that passes
_ITEM = re.compile(r"^- (\[[ x]\] )?(.+)$")


@dataclass
class Answer:
    """An answer to one item: whether its box is ticked, and what backs it."""

    yes: bool
    text: str


def _show(onto: Path, base: str, rel: str) -> str:
    proc = git(onto, "show", f"{base}:{rel}", check=False, isolated=False)
    if proc.returncode != 0:
        raise PatchsetError(f"{onto} has no {rel} at {base}: is it a checkout of upstream Lightning?")
    return proc.stdout.decode("utf-8")


def request_path(project: Path, patch: Patch) -> Path | None:
    """The project's file that the patch's ``Feature-Request:`` field names, or ``None`` without the field."""
    value = patch.field("Feature-Request").strip()
    if value and not (project / value).is_file():
        raise PatchsetError(f"{patch.name}: Feature-Request: {value} is not a file of the project")
    return project / value if value else None


def _in_fork(project: Path, rel: str) -> str:
    return f"{fork_url(project)}/blob/main/{rel}"


def form_fields(form: str) -> list[tuple[str, bool]]:
    """The text fields (``textarea``, ``input``) of a GitHub issue form: their labels and whether they are required."""
    body = yaml.safe_load(form).get("body", [])
    return [(f["attributes"]["label"], bool(f.get("validations", {}).get("required"))) for f in body
            if f.get("type") in ("textarea", "input")]  # fmt: skip


def fill_form(fields: list[tuple[str, bool]], text: str, where: str) -> str:
    """The issue's body: each field of the form with its ``## <label>`` section of ``text``."""
    parts = re.split(r"^## (.+?)\s*$", text, flags=re.M)
    sections = {label.strip(): body.strip() for label, body in zip(parts[1::2], parts[2::2], strict=True)}
    labels = [label for label, _ in fields]
    if unknown := [label for label in sections if label not in labels]:
        raise PatchsetError(f"{where}: no field {unknown[0]!r} in upstream's form (it has {', '.join(sorted(labels))})")
    if missing := [label for label, required in fields if required and not sections.get(label)]:
        raise PatchsetError(f"{where}: upstream's form requires {missing[0]!r}; add a `## {missing[0]}` section")
    return "\n\n".join(f"### {label}\n\n{sections.get(label) or '_No response_'}" for label in labels) + "\n"


def feature_request(project: Path, patch: Patch, onto: Path, base: str) -> str | None:
    """The patch's feature request, upstream's feature form filled in, with its title; ``None`` without one."""
    path = request_path(project, patch)
    if path is None:
        return None
    listing = git(onto, "ls-tree", "--name-only", f"{base}:{FORMS}", check=False, isolated=False).stdout.decode()
    forms = [
        _show(onto, base, f"{FORMS}/{name}") for name in sorted(listing.split()) if name.endswith((".yaml", ".yml"))
    ]
    form = next((f for f in forms if "feature" in (yaml.safe_load(f) or {}).get("labels", [])), None)
    if form is None:
        raise PatchsetError(f"{onto} has no issue form labelled `feature` in {FORMS} at {base}")
    text, rel = path.read_text(encoding="utf-8"), path.relative_to(project).as_posix()
    title = re.search(r"^# (.+?)\s*$", text, flags=re.M)
    if title is None:
        raise PatchsetError(f"{rel}: the request's title, a `# ` line, is missing")
    return f"# {title.group(1)}\n\n" + fill_form(form_fields(form), text[title.end() :], rel)


def benchmark_links(project: Path, patch: Patch) -> list[str]:
    """The benchmark pages of the patch's row in the maintainers' table, as addresses in the fork's repository."""
    table = project / PATCH_TABLE
    if not table.is_file():
        raise PatchsetError(f"{table}: missing; it holds the table of patches that the PR texts take links from")
    rows = [line for line in table.read_text(encoding="utf-8").splitlines() if line.startswith(f"| {patch.name[:4]} |")]
    links = re.findall(r"\[([^\]]*benchmark[^\]]*)\]\(([^)\s]+)\)", "".join(rows[:1]), flags=re.I)
    folder = posixpath.dirname(PATCH_TABLE)
    return [
        f"[{t}]({a if '://' in a else _in_fork(project, posixpath.normpath(posixpath.join(folder, a)))})"
        for t, a in links
    ]


def _job_result(job: str, record: dict[str, Any]) -> str:
    """A job's counts on the PR branch; the failures the base has too, by their cause or their first id."""
    groups = pre_existing(record["failures"])
    said = []
    for cause, count, first in groups:
        name = first["id"].split(": ")[0]  # a finding's id is its file and code, then its message
        name = f"`{name if job in CHECKS else name.rsplit('/', 1)[-1]}`"  # a test: its file's name and its own
        if cause:
            what = f"{name}: {cause}" if count == 1 else cause
        else:
            what = name + (f" and {count - 1} more" if count > 1 else "")
        said.append(f"{count} {what}" if len(groups) > 1 else what)
    why = f" ({'; '.join(said)}, as on the base)" if said else ""
    n = record["branch"]
    if job in CHECKS:
        return f"{n['failed']} finding{'s' * (n['failed'] != 1)}{why}" if n["failed"] else "no findings"
    return f"{n['passed']} passed, {n['failed']} failed{why}, {n['skipped']} skipped"


def tests_answer(project: Path, patch: Patch) -> Answer:
    """Whether upstream's jobs passed on the PR branch, from their records at the patch's current blob."""
    found, blob, parts, ok = load(project, "upstream-tests"), blob_hash(patch.path), [], True
    for job in JOBS:
        record = found.get(f"{patch.name} {job}")
        if record is None or record["blob"] != blob:
            ok = False
            parts.append(f"{TITLES[job]}: not recorded for this version of the patch")
            continue
        ok = ok and record["caused"] == 0
        parts.append(f"{TITLES[job]}: {_job_result(job, record)}, {record['caused']} caused by this PR")
    link = f"[the record]({_in_fork(project, 'docs/upstream-tests.md')})"
    lead = f"Yes, every other failure or finding is on the base too ({link})" if ok else f"Not yet ({link})"
    return Answer(ok, f"{lead}: " + "; ".join(parts) + ".")


def agreed_answer(project: Path, patch: Patch) -> Answer:
    """Whether the change was agreed: only an ``Agreed:`` field (where a maintainer agreed) says yes."""
    if agreed := [a.strip() for a in patch.trailers.get("Agreed", [])]:
        return Answer(True, f"Yes: {', '.join(agreed)}.")
    if request := request_path(project, patch):
        where = _in_fork(project, request.relative_to(project).as_posix())
        return Answer(False, f"Not yet: the feature request ({where}) is to be filed and agreed first.")
    if reported := issue_refs(patch.trailers.get("Bug", []) + patch.trailers.get("Part-Of", [])):
        return Answer(
            False, f"Not yet: reported in {', '.join(reported)}, with no maintainer's agreement to this change."
        )
    return Answer(False, "No: no upstream issue was filed for it.")


def breaking_changes(patch: Patch) -> list[str]:
    """The CHANGELOG entries that change or remove behaviour."""
    return [entry.text for entry in patch.changelog if entry.section in ("Removed", "Changed")]


def answers(project: Path, patch: Patch) -> list[tuple[str, Answer]]:
    """Each *Before submitting* item's answer, by a word of the item's text."""
    files = sorted({*(s.path for s in patch.sections), *(f for f in overlay_files(project) if patch.owns(f))})
    docs = [f"`{f}`" for f in files if f.startswith("docs/") or f.endswith(".rst")] + patch.trailers.get("Docs", [])
    tests = [f"`{f}`" for f in files if f.startswith("tests/")]
    entries = [f"`{e.package}` {e.section}: {e.text}" for e in patch.changelog]
    one = f"Yes: one patch of the series ({patch.subject})"
    if depends := patch.field("Depends-On"):
        one += f"; it stacks on the PR of {depends.removesuffix('.patch')}, which goes first"
    breaking = "Yes, above." if breaking_changes(patch) else "There are none (no Removed or Changed entries)."
    return [
        ("discussed/agreed", agreed_answer(project, patch)),
        ("contributor guideline", Answer(False, "For whoever opens this PR to confirm.")),
        ("only one thing", Answer(True, one + ".")),
        ("update the documentation", Answer(bool(docs), f"Yes: {'; '.join(docs)}." if docs else "No docs change.")),
        (
            "new necessary tests",
            Answer(bool(tests), f"Yes: {', '.join(tests)}." if tests else "No test changes in this PR."),
        ),
        ("existing tests pass", tests_answer(project, patch)),
        ("breaking changes", Answer(True, breaking)),
        (
            "update the CHANGELOG",
            Answer(bool(entries), "Yes: " + "; ".join(entries) if entries else "No CHANGELOG entry."),
        ),
    ]


def pr_description(project: Path, patch: Patch, onto: Path, base: str) -> str:
    """The PR text of ``patch``: upstream's template at ``base`` in ``onto``, every item answered."""
    return fill_template(_show(onto, base, TEMPLATE), project, patch)


def fill_template(template: str, project: Path, patch: Patch) -> str:
    """``template`` with the patch's description, issues, breaking changes, item answers and benchmark line."""
    rules, lines, out = answers(project, patch), template.splitlines(), list[str]()
    i, described, checklist = 0, False, False
    while i < len(lines):
        line = lines[i]
        if line.startswith("<!--") and not described and any(o.startswith("## What does this PR do") for o in out):
            out.append(patch.description)  # the prompt's comment, replaced
            if benchmarks := benchmark_links(project, patch):
                out += ["", "Benchmark: " + ", ".join(benchmarks)]
            described, i = True, next(j for j in range(i, len(lines)) if "-->" in lines[j]) + 1
            continue
        if line.startswith("Fixes #"):
            request = request_path(project, patch)
            where = request and _in_fork(project, request.relative_to(project).as_posix())
            fixes = issue_lines(patch.trailers) or ([f"Implements the feature request to be filed first, from {where}:"
                                                     " put its number here."] if where else [])  # fmt: skip
            out.append("\n".join(fixes) or "Fixes no upstream issue (none was filed).")
        elif line.startswith("<!--") and "breaking changes" in line.lower() and line.rstrip().endswith("-->"):
            breaking = breaking_changes(patch)
            out += (
                ["**Breaking changes:**", "", *(f"- {t}" for t in breaking)] if breaking else ["No breaking changes."]
            )
        elif ("<summary>" in line and "Before submitting" in line) or (checklist and line.startswith("</details>")):
            checklist = not checklist
            out.append(line)
        elif checklist and (item := _ITEM.match(line)):
            answer = next((a for word, a in rules if word.lower() in item.group(2).lower()), None)
            tick = ("[x] " if answer.yes else "[ ] ") if answer and item.group(1) else ""
            out.append(f"- {tick}{item.group(2)} {answer.text}" if answer else f"{line} {NOT_ANSWERED}")
        else:
            out.append(line)
        i += 1
    return "\n".join(out) + "\n"


def unanswered(text: str) -> list[str]:
    """The items of a filled template that no rule answered."""
    return [line for line in text.splitlines() if line.endswith(NOT_ANSWERED)]
