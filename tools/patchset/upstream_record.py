"""The records of ``upstream-tests`` in :data:`PAGE`: one section per patch and job, each naming the patch's blob.

A section is one job that upstream's CI runs on a pull request (:data:`RUNS`), run on the PR branch and on its base.
It names the patch's blob hash, so that CI (which cannot reach upstream) can tell whether the page describes the
patches as they are, and what a maintainer elsewhere needs to run it again: the newest commit of the branch that
exists upstream, the local commits on top of it, and no path of this machine. Every failure or finding on the branch
gets a row, caused by the patch or pre-existing; pre-existing ones that share a cause take one row.
"""

from __future__ import annotations

import hashlib
import re
from dataclasses import dataclass, field
from pathlib import Path

from patchset.series import read_series
from patchset.upstream_checks import Finding, attribute

PAGE = Path("docs") / "upstream-tests.md"
# upstream's jobs on a pull request, in the order the page lists them
RUNS = ("newest", "oldest", "mypy", "ruff")
TITLES = {
    "newest": "upstream's tests, newest torch allowed",
    "oldest": "upstream's tests, oldest requirements",
    "mypy": "mypy, as code-checks.yml runs it",
    "ruff": "ruff check and ruff format, as the pre-commit hooks run them",
}
# Failures that come from where the tests ran, not from the code: (what the failure says, its cause).
ENVIRONMENT = (
    (
        re.compile(r"No checkpoints found in folder .*tests/legacy/checkpoints"),
        "upstream's CI downloads the legacy checkpoints first (`.actions/pull_legacy_checkpoints.sh`)",
    ),
    (re.compile(r"only supported on CUDA GPUs"), "needs a CUDA GPU"),
    (re.compile(r"fabric: not found"), "the venv's `fabric` command was not on `PATH`"),
)
_BEGIN = "<!-- upstream-tests: {} {} -->"
_END = "<!-- /upstream-tests -->"
# a section: its patch and job (sections written before jobs were recorded separately name no job: `newest`)
_SECTION = re.compile(r"<!-- upstream-tests: (\S+?)(?: (\w+))? -->.*?" + re.escape(_END), flags=re.S)


@dataclass
class Outcome:
    """One test's result: ``passed``, ``failed`` (errors included) or ``skipped``, and a one-line reason."""

    nodeid: str
    outcome: str
    reason: str = ""


@dataclass
class Context:
    """What every section of one run names: the patch as it is and where its PR branch starts."""

    patch: str
    blob: str
    upstream: str
    upstream_subject: str = ""
    local_commits: list[str] = field(default_factory=list)

    def rows(self, run: str) -> list[str]:
        """The opening of a job's section: its marker, heading and the rows that say what was run."""
        return [
            _BEGIN.format(self.patch, run),
            f"## {self.patch}: {TITLES[run]}",
            "",
            "| | |",
            "|---|---|",
            f"| patch blob | `{self.blob}` |",
            f"| upstream commit | `{self.upstream}` ({self.upstream_subject}) |",
            f"| local commits on it | {'; '.join(self.local_commits) or 'none'} |",
        ]


@dataclass
class Record:
    """What one test job (``newest`` or ``oldest``) found for one patch."""

    context: Context
    run: str
    installed: str  # how the venv was made, for the reader: "`lightning[...]` with torch 2.9.1+cu128, Python 3.11"
    selection: list[str]
    branch: dict[str, Outcome] = field(default_factory=dict)
    on_base: dict[str, Outcome] = field(default_factory=dict)
    base_runs: str = "all"
    seconds: float = 0.0

    def counts(self, results: dict[str, Outcome]) -> dict[str, int]:
        """Passed, failed and skipped."""
        return {kind: sum(o.outcome == kind for o in results.values()) for kind in ("passed", "failed", "skipped")}

    @property
    def failures(self) -> list[tuple[Outcome, bool]]:
        """Each failure on the branch, with whether the patch caused it (the base passed or lacks the test)."""
        failed = [o for o in self.branch.values() if o.outcome == "failed"]
        return [(o, self.on_base.get(o.nodeid, Outcome(o.nodeid, "missing")).outcome != "failed") for o in failed]

    @property
    def caused(self) -> list[Outcome]:
        """The failures the patch caused."""
        return [o for o, caused in self.failures if caused]

    def summary(self) -> str:
        """One line for the terminal."""
        b, a = self.counts(self.branch), self.counts(self.on_base)
        return (
            f"{self.run}: branch {b['passed']} passed, {b['failed']} failed, {b['skipped']} skipped;"
            f" base {a['passed']} passed, {a['failed']} failed, {a['skipped']} skipped;"
            f" caused by the patch: {len(self.caused)}"
        )

    def markdown(self) -> str:
        """The section of :data:`PAGE`."""
        b, a = self.counts(self.branch), self.counts(self.on_base)
        base_what = "the same selection" if self.base_runs == "all" else "the tests that failed on the branch"
        lines = [
            *self.context.rows(self.run),
            f"| installed as | {self.installed} |",
            f"| selection | {', '.join(f'`{s}`' for s in self.selection)}, their standalone tests one per process |",
            f"| on the PR branch | {b['passed']} passed, {b['failed']} failed, {b['skipped']} skipped |",
            f"| on the base ({base_what}) | {a['passed']} passed, {a['failed']} failed, {a['skipped']} skipped |",
            f"| failures caused by the patch | **{len(self.caused)}** |",
            f"| wall time | {_duration(self.seconds)} |",
            "",
        ]
        if self.failures:
            lines += ["| failing test | cause | reason |", "|---|---|---|"]
            for outcome, caused in sorted(self.failures, key=lambda f: f[0].nodeid):
                if caused:
                    lines.append(f"| `{outcome.nodeid}` | **the patch** | {_cell(outcome.reason)} |")
            # pre-existing failures that share a cause (the environment) or a reason take one row
            groups: dict[tuple[str, str], list[Outcome]] = {}
            for outcome, caused in self.failures:
                if not caused:
                    cause = environment_cause(outcome.reason)
                    key = (f"environment: {cause} (fails on the base too)", "") if cause else ("", outcome.reason)
                    groups.setdefault((key[0], _cell(key[1])[:60]), []).append(outcome)
            for (cause, _), outcomes in sorted(groups.items(), key=lambda item: (not item[0][0], item[0])):
                first = min(o.nodeid for o in outcomes)
                what = f"`{first}`" + (f" and {len(outcomes) - 1} more" if len(outcomes) > 1 else "")
                cause = cause or "pre-existing (fails on the base too)"
                lines.append(f"| {what} | {cause} | {_cell(outcomes[0].reason)} |")
            lines.append("")
        lines.append(_END)
        return "\n".join(lines)


@dataclass
class CheckRecord:
    """What one static check (``mypy`` or ``ruff``) found on the PR branch and on its base."""

    context: Context
    run: str
    installed: str
    command: str
    branch: list[Finding] = field(default_factory=list)
    on_base: list[Finding] = field(default_factory=list)
    branch_summary: str = ""
    base_summary: str = ""
    seconds: float = 0.0

    @property
    def caused(self) -> list[Finding]:
        """The findings the patch caused."""
        return [f for f, caused in attribute(self.branch, self.on_base) if caused]

    def summary(self) -> str:
        """One line for the terminal."""
        return (
            f"{self.run}: branch {len(self.branch)} findings, base {len(self.on_base)};"
            f" caused by the patch: {len(self.caused)}"
        )

    def markdown(self) -> str:
        """The section of :data:`PAGE`."""
        lines = [
            *self.context.rows(self.run),
            f"| installed as | {self.installed} |",
            f"| command | {self.command} |",
            f"| on the PR branch | {_findings(len(self.branch))} ({_cell(self.branch_summary)}) |",
            f"| on the base | {_findings(len(self.on_base))} ({_cell(self.base_summary)}) |",
            f"| findings caused by the patch | **{len(self.caused)}** |",
            f"| wall time | {_duration(self.seconds)} |",
            "",
        ]
        attributed = attribute(self.branch, self.on_base)
        if attributed:
            lines += ["| finding | cause | what |", "|---|---|---|"]
            lines += [f"| `{_where(f)}` | **the patch** | {_what(f)} |" for f, caused in attributed if caused]
            groups: dict[str, list[Finding]] = {}
            for finding, caused in attributed:
                if not caused:
                    groups.setdefault(finding.code, []).append(finding)
            for code in sorted(groups):
                found = groups[code]
                what = f"`{_where(found[0])}`" + (f" and {len(found) - 1} more" if len(found) > 1 else "")
                lines.append(f"| {what} | pre-existing (on the base too) | {_what(found[0])} |")
            lines.append("")
        lines.append(_END)
        return "\n".join(lines)


def _findings(count: int) -> str:
    return f"{count} finding" + ("" if count == 1 else "s")


def _duration(seconds: float) -> str:
    return f"{seconds / 60:.0f} min" if seconds >= 60 else f"{seconds:.0f} s"


def _where(finding: Finding) -> str:
    return f"{finding.path}:{finding.line}" if finding.line else finding.path


def _what(finding: Finding) -> str:
    return _cell(f"`{finding.code}` {finding.message}" if finding.code else finding.message)


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")[:160]


def environment_cause(reason: str) -> str | None:
    """The cause of a failure that comes from the environment (:data:`ENVIRONMENT`), or ``None``."""
    return next((cause for pattern, cause in ENVIRONMENT if pattern.search(reason)), None)


def portable(text: str, places: dict[Path, str]) -> str:
    """``text`` without this machine's paths: each of ``places`` (longest first) becomes its name (``<checkout>``)."""
    for path, name in sorted(places.items(), key=lambda item: -len(str(item[0]))):
        text = text.replace(str(path), name)
    return text


def blob_hash(path: Path) -> str:
    """The patch file's git blob id (what ``git hash-object`` prints)."""
    data = path.read_bytes()
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()


def sections(project: Path) -> dict[tuple[str, str], str]:
    """Each section of :data:`PAGE` by (patch file name, job)."""
    page = project / PAGE
    text = page.read_text(encoding="utf-8") if page.is_file() else ""
    return {(m.group(1), m.group(2) or "newest"): m.group(0) for m in _SECTION.finditer(text)}


def recorded_blobs(project: Path) -> dict[tuple[str, str], str]:
    """The patch blob hash each section of :data:`PAGE` names, by (patch file name, job)."""
    blobs = {}
    for key, text in sections(project).items():
        blob = re.search(r"\| patch blob \| `([0-9a-f]{40})` \|", text)
        if blob:
            blobs[key] = blob.group(1)
    return blobs


def caused_count(section: str) -> int | None:
    """The number of failures or findings a section says the patch caused."""
    match = re.search(r"\| (?:failures|findings) caused by the patch \| \*\*(\d+)\*\* \|", section)
    return int(match.group(1)) if match else None


def write_record(project: Path, record: Record | CheckRecord) -> None:
    """Put the record's section into :data:`PAGE`, replacing its previous one; patches in series order, then jobs.

    What follows :data:`BY_HAND` on the page (runs made by hand) is kept as it is, after the sections.
    """
    found = sections(project)
    found[(record.context.patch, record.run)] = record.markdown()
    order = {patch.name: i for i, patch in enumerate(read_series(project))}
    kept = sorted((key for key in found if key[0] in order), key=lambda k: (order[k[0]], RUNS.index(k[1])))
    page = project / PAGE
    page.parent.mkdir(parents=True, exist_ok=True)
    text = page.read_text(encoding="utf-8") if page.is_file() else ""
    by_hand = text[text.index(BY_HAND) :] if BY_HAND in text else ""
    page.write_text(
        HEADER + "\n".join(found[key] + "\n" for key in kept) + (by_hand and "\n" + by_hand), encoding="utf-8"
    )


#: The line after which :data:`PAGE` holds runs made by hand, which :func:`write_record` keeps.
BY_HAND = "<!-- by hand: upstream-tests keeps what follows -->"


HEADER = """# Upstream's own checks on each pull request

Written by `python -m patchset upstream-tests PATCH --onto <upstream checkout>`, not by hand. For each patch bound
upstream, it makes the pull request's branch with `upstream-pr` and runs there what upstream's CI runs on a pull
request, each job on the branch and on the base without the patch, taking commands, pins and configuration from the
checkout's own files:

- **newest**: upstream's tests for what the patch touches, installed as upstream's CI installs them (the package with
  its test extra, torch included, as pinned in upstream's `requirements/`: the newest torch they allow);
- **oldest**: the same tests under the `requires: "oldest"` job of `ci-tests-<package>.yml`: its Python, and every
  `>=` of the requirement files it names pinned as `==` (torch 2.1), its pytest warning filters;
- **mypy**: `code-checks.yml`'s job, with its install (`requirements/typing.txt` pins mypy and torch) and upstream's
  `[tool.mypy]` configuration;
- **ruff**: `ruff check` and `ruff format --check` at the version of upstream's pre-commit hooks, with upstream's
  configuration, on every tracked Python file, as `pre-commit run --all-files` runs them.

A failure or finding on the branch is **caused by the patch** unless the base has it too (a finding is matched by
file, code and message, not by line); failures that come from the environment (a download upstream's CI makes first,
a GPU) take one row with their cause. Each section names the newest commit of the branch that exists upstream and
every local commit on top of it, and no path of the machine it ran on (`<checkout>`, `<venv>`, `<cache>`), so it can
be run again anywhere. CI checks that every patch has each job recorded at its current blob hash
(`git hash-object patches/<file>`) with nothing caused by the patch, so a patch changed after its run shows up as
stale.

"""
