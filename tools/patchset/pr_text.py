"""A patch's PR text: upstream's ``.github/PULL_REQUEST_TEMPLATE.md``, every item answered.

The template is read from the upstream checkout at the PR's base, so the text follows upstream's current one. Each
*Before submitting* item is answered from what the project has, never assumed: the agreement from
``Agreed:`` (an issue alone is no agreement), one thing from the series (``Depends-On:`` names the PR it stacks on),
docs and tests from the patch's files, the CHANGELOG from its entries, breaking changes from its ``Removed`` and
``Changed`` entries, the benchmark from ``Benchmark:``, and the tests from the last ``nox -s upstream`` run of this
version of the patch, if this checkout has one (:data:`UPSTREAM_RUNS`, never committed). Reading the contributor guide
is left to whoever opens the PR; an item no rule knows is marked :data:`NOT_ANSWERED`.

A feature without an upstream issue names the project's request with ``Feature-Request: <file>``, ready to file: one
``## <label>`` section per field of upstream's feature request form, pasted into the form's fields as they are.
"""

from __future__ import annotations

import hashlib
import re
from dataclasses import dataclass
from pathlib import Path

from patchset import PatchsetError
from patchset.flavours import fork_url
from patchset.gitops import git
from patchset.overlay import overlay_files
from patchset.series import Patch, issue_lines, issue_refs

TEMPLATE = ".github/PULL_REQUEST_TEMPLATE.md"
NOT_ANSWERED = "**not answered**"
# what `nox -s upstream -- NNNN` found last, per patch (NNNN.txt): the patch file's sha256, the session's result line
# (its command, the commits and the counts), and the number of failures the patch caused
UPSTREAM_RUNS = Path(".work") / "upstream"
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


def benchmark_links(project: Path, patch: Patch) -> list[str]:
    """The pages its ``Benchmark:`` fields name, as addresses in the fork's repository; a missing page is an error."""
    pages = [page for value in patch.trailers.get("Benchmark", []) for page in value.split()]
    if missing := [page for page in pages if not (project / page).is_file()]:
        raise PatchsetError(f"{patch.name}: Benchmark: {missing[0]} is not a file of the project")
    return [f"[{Path(page).stem}]({_in_fork(project, page)})" for page in pages]


def tests_answer(project: Path, patch: Patch) -> Answer:
    """The last ``nox -s upstream`` result of this version of the patch (its sha256), as that session printed it."""
    command = f"`nox -s upstream -- {patch.name[:4]}`"
    saved = project / UPSTREAM_RUNS / f"{patch.name[:4]}.txt"
    lines = saved.read_text(encoding="utf-8").splitlines() if saved.is_file() else []
    if len(lines) < 3 or lines[0] != hashlib.sha256(patch.data).hexdigest():
        return Answer(False, f"Not yet: {command} (upstream's tests on this branch and on its base) has not run on it.")
    return Answer(lines[2].strip() == "0", lines[1].strip())


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
    tests = [f"`{f}`" for f in files if f.startswith("tests/") and not f.endswith("/conftest.py")]
    tooling = [f"`{f}`" for f in files if f.startswith("tests/") and f.endswith("/conftest.py")]
    entries = [f"`{e.package}` {e.section}: {e.text}" for e in patch.changelog]
    no_tests = "No test changes in this PR."
    if tooling:
        no_tests = f"No new tests: the change is to the test tooling ({', '.join(tooling)}), checked as described."
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
            Answer(bool(tests), f"Yes: {', '.join(tests)}." if tests else no_tests),
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
