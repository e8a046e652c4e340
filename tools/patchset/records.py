"""Records of test runs: read from JUnit XML, kept as JSON in ``docs/records/``, shown as tables in ``docs/``.

Two kinds of run write records, one per key: upstream's CI jobs on a patch's PR branch and its base (``upstream-tests``,
the ``upstream_*`` sessions of ``noxfile.py``) and the fork's suite against one torch release (``torch-matrix``, the
``tests``/``oldest`` sessions). The page ``docs/<kind>.md`` is prose written by hand, with the tables rendered from
the JSON between its two markers.
"""

from __future__ import annotations

import hashlib
import json
import re
import tempfile
import xml.etree.ElementTree as ET
from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from patchset import PatchsetError
from patchset.gitops import git, out
from patchset.overlay import OVERLAY_ROOTS, overlay_files
from patchset.series import Patch, parse_patch

RECORDS = Path("docs") / "records"
BEGIN = "<!-- tables from docs/records/{}.json: do not edit by hand between these markers -->"
END = "<!-- end of the tables -->"
JOBS = ("newest", "oldest", "mypy", "ruff")  # upstream's jobs on a pull request, in the order the page lists them
TITLES = {
    "newest": "upstream's tests, newest torch allowed",
    "oldest": "upstream's tests, oldest requirements",
    "mypy": "mypy, as code-checks.yml runs it",
    "ruff": "ruff check and ruff format, as the pre-commit hooks run them",
}
# failures that come from where the tests ran, not from the code: (what the failure says, its cause)
ENVIRONMENT = (
    (re.compile(r"No checkpoints found in folder .*tests/legacy/checkpoints"), "the legacy checkpoints not downloaded"),
    (re.compile(r"only supported on CUDA GPUs"), "needs a CUDA GPU"),
)
# what a torch-matrix record's commit must share with the checkout to describe it
SOURCES = ("patches", "src", "tests", "tools", "pyproject.toml")


@dataclass(frozen=True)
class Case:
    """One JUnit test case: its id, ``passed``, ``failed`` (errors too) or ``skipped``, and a one-line reason."""

    id: str
    outcome: str
    reason: str = ""


def read_junit(path: Path, root: Path | None = None, places: dict[str, str] | None = None) -> dict[str, Case]:
    """The cases of a JUnit XML report by id; paths under ``root`` relative, each of ``places`` replaced by its name.

    A test's id is its pytest node id (``file::Class::name``); an error in its teardown keeps its failure. A check's
    finding (a case with no file: ruff's, mypy's) is ``classname::name: message``, a line the message names as
    ``line N`` (lines move with a patch), and each further one of that id is counted (``#2``).
    """
    places = {**(places or {}), **({str(root): "<checkout>"} if root else {})}
    cases: dict[str, Case] = {}
    for element in ET.parse(path).iter("testcase") if path.is_file() else ():
        outcome, reason = "passed", ""
        for child in element:
            if child.tag in ("failure", "error", "skipped"):
                outcome = "skipped" if child.tag == "skipped" else "failed"
                text = (child.get("message") or child.text or child.tag).strip()
                reason = text.splitlines()[0][:200] if text else child.tag
                break
        for place, name in sorted(places.items(), key=lambda item: -len(item[0])):
            reason = reason.replace(place, name)
        case_id = _case_id(element).removeprefix(f"{root}/" if root else "\0")
        if element.get("file") is None and outcome == "failed":
            case_id += ": " + re.sub(r"\b(lines?) \d+", r"\1 N", reason)
            seen = sum(key == case_id or key.startswith(case_id + " #") for key in cases)
            case_id += f" #{seen + 1}" if seen else ""
        if cases.get(case_id, Case(case_id, "")).outcome != "failed":
            cases[case_id] = Case(case_id, outcome, reason)
    return cases


def _case_id(case: ET.Element) -> str:
    classname, name, file = case.get("classname", ""), case.get("name", ""), case.get("file")
    if file is None:
        return f"{classname}::{name}"
    module = file.removesuffix(".py").replace("/", ".")
    classes = classname[len(module) + 1 :].split(".") if classname.startswith(module + ".") else []
    return "::".join([file, *classes, name])


def write_junit(path: Path, suite: str, findings: Iterable[tuple[str, str, str]]) -> None:
    """A JUnit XML report of a check's ``(file, code, message)`` findings, a failed test case each."""
    root = ET.Element("testsuite", name=suite)
    for file, code, message in findings:
        ET.SubElement(ET.SubElement(root, "testcase", classname=file, name=code), "failure", message=message)
    ET.ElementTree(root).write(path, encoding="utf-8", xml_declaration=True)


def counts(cases: Iterable[Case]) -> dict[str, int]:
    """Passed, failed and skipped."""
    found = Counter(case.outcome for case in cases)
    return {kind: found[kind] for kind in ("passed", "failed", "skipped")}


def attribute(branch: Iterable[Case], base: Iterable[Case]) -> list[dict[str, Any]]:
    """Each failure on the branch, caused by the patch unless the base has as many failures with its id."""
    left = Counter(case.id for case in base if case.outcome == "failed")
    failures = []
    for case in sorted((c for c in branch if c.outcome == "failed"), key=lambda c: c.id):
        failures.append({"id": case.id, "reason": case.reason, "caused": left[case.id] <= 0})
        left[case.id] -= 1
    return failures


def blob_hash(path: Path) -> str:
    """The file's git blob id (what ``git hash-object`` prints)."""
    data = path.read_bytes()
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()


def load(project: Path, kind: str) -> dict[str, dict[str, Any]]:
    """The records of one kind, by key."""
    path = project / RECORDS / f"{kind}.json"
    return dict(json.loads(path.read_text(encoding="utf-8"))) if path.is_file() else {}


def store(project: Path, kind: str, found: dict[str, dict[str, Any]]) -> None:
    """Write the records of one kind and the tables between the markers of ``docs/<kind>.md``."""
    path = project / RECORDS / f"{kind}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(found, indent=1, sort_keys=True) + "\n", encoding="utf-8")
    page, begin = project / "docs" / f"{kind}.md", BEGIN.format(kind)
    text = page.read_text(encoding="utf-8") if page.is_file() else f"# {kind}\n\n{begin}\n{END}\n"
    head, _, rest = text.partition(begin)
    tables = upstream_tables(found) if kind == "upstream-tests" else matrix_table(found)
    page.write_text(f"{head}{begin}\n\n{tables}\n{END}{rest.partition(END)[2]}", encoding="utf-8")


def add(project: Path, kind: str, record: dict[str, Any]) -> None:
    """Store one record, replacing the one with its key."""
    store(project, kind, {**load(project, kind), record["key"]: record})


def stale_upstream(project: Path, patches: dict[str, Path]) -> list[str]:
    """Each job of each patch (name: path) not recorded at the patch's blob, or recorded with a failure it caused.

    A record carried to the blob (``ran_on``) is checked again against the commit its job ran at.
    """
    found, problems = load(project, "upstream-tests"), []
    for name, path in patches.items():
        for job in JOBS:
            record = found.get(f"{name} {job}")
            if record is None or record["blob"] != blob_hash(path):
                problems.append(f"{name[:4]} {job}: not recorded at blob {blob_hash(path)[:12]}")
            elif "ran_on" in record and (why := _unlike_run(project, parse_patch(path), record["ran_on"]["commit"])):
                problems.append(f"{name[:4]} {job}: carried from blob {record['ran_on']['blob'][:12]}, but {why}")
            elif record["caused"]:
                problems.append(f"{name[:4]} {job}: {record['caused']} caused by the patch")
    return problems


def _applied(data: bytes) -> bytes:
    """The part of a format-patch file that ``git am`` applies: what ``git mailinfo`` splits off as the patch."""
    with tempfile.TemporaryDirectory() as tmp:
        git(Path(tmp), "mailinfo", "msg", "patch", input=data)
        return (Path(tmp) / "patch").read_bytes()


def _owned(project: Path, patch: Patch, commit: str | None) -> dict[str, str]:
    """The new files ``patch`` owns, as ``upstream-pr`` takes them, by path: their blobs at ``commit`` or on disk."""
    if commit is None:
        return {f: blob_hash(project / f) for f in overlay_files(project) if patch.owns(f)}
    listing = git(project, "ls-tree", "-r", "-z", commit, "--", *OVERLAY_ROOTS).stdout.decode().split("\0")
    entries = (line.partition("\t") for line in listing if line)  # "mode type blob", a tab, the path
    return {path: info.split()[2] for info, _, path in entries if info.split()[1] == "blob" and patch.owns(path)}


def _unlike_run(project: Path, patch: Patch, commit: str) -> str:
    """What differs between the PR branch as the series makes it now and at ``commit``; ``""`` when nothing.

    The jobs read the patch's applied diff, its new files and those of the patches it stacks on (``Depends-On:``);
    the message and the fields (the CHANGELOG entries among them) none of them reads.
    """
    rel = patch.path.relative_to(project).as_posix()
    then = git(project, "show", f"{commit}:{rel}", check=False)
    if then.returncode != 0:
        return f"{rel} is not in commit {commit[:10]}"
    before = parse_patch(patch.path, then.stdout)
    if _applied(then.stdout) != _applied(patch.data) or before.new_files != patch.new_files:
        return f"{patch.name[:4]}'s diff or New-Files differ from commit {commit[:10]}'s"
    if _owned(project, before, commit) != _owned(project, patch, None):
        return f"{patch.name[:4]}'s new files differ from commit {commit[:10]}'s"
    if depends := patch.field("Depends-On"):
        return _unlike_run(project, parse_patch(patch.path.parent / depends), commit)
    return ""


def _first_commit_with(project: Path, rel: str, blob: str) -> str | None:
    """The oldest commit whose ``rel`` is ``blob``: the earliest a job on that blob can have run."""
    for commit in out(project, "log", "--reverse", "--format=%H", "--", rel).split():
        found = git(project, "rev-parse", "--verify", "--quiet", f"{commit}:{rel}", check=False)
        if found.stdout.decode().strip() == blob:
            return commit
    return None


def carry(project: Path, patch: Patch) -> list[str]:
    """Move the patch's records to its current blob where only its message and fields changed; the keys moved.

    A record moves when the PR branch would hold what its job ran (:func:`_unlike_run`) as of the commit it ran at:
    the one ``ran_on`` or the session's ``fork_commit`` names, else the oldest commit whose patch had the record's blob
    (a job cannot have run before it; a file changed after it refuses the move, even where the job ran later). The
    record keeps that blob and commit as ``ran_on``.
    """
    found, blob, moved = load(project, "upstream-tests"), blob_hash(patch.path), []
    rel = patch.path.relative_to(project).as_posix()
    for key, record in sorted(found.items()):
        if record["patch"] != patch.name or record["blob"] == blob:
            continue
        ran_on = record.get("ran_on") or {"blob": record["blob"], "commit": record.get("fork_commit", "")}
        if ran_on["commit"].endswith("+dirty"):  # the session ran with uncommitted changes: the oldest commit it can be
            ran_on["commit"] = ""
        commit = ran_on["commit"] or _first_commit_with(project, rel, record["blob"])
        if commit is None:
            raise PatchsetError(f"{key}: no commit of this branch has blob {record['blob'][:12]} at {rel}")
        if why := _unlike_run(project, patch, commit):
            raise PatchsetError(f"{key}: {why}, where the job ran: run it again")
        found[key] = {**record, "blob": blob, "ran_on": {"blob": ran_on["blob"], "commit": commit[:10]}}
        moved.append(key)
    if moved:
        store(project, "upstream-tests", found)
    return moved


def checkout_commit(project: Path) -> str:
    """The checkout's commit as a record names it, ``+dirty`` when tracked files (``docs/`` aside) differ."""
    changed = out(project, "status", "--porcelain", "--untracked-files=no", "--", ".", ":(exclude)docs")
    return out(project, "rev-parse", "--short=10", "HEAD") + ("+dirty" if changed else "")


def stale_matrix(project: Path) -> list[str]:
    """Why the torch matrix does not describe the checkout: a failed cell, or cells not from one commit like it."""
    found = load(project, "torch-matrix")
    problems = [f"{key}: exit {c['exit_code']}" for key, c in sorted(found.items()) if c["exit_code"] != 0]
    commits = sorted({c["commit"] for c in found.values()})
    if len(commits) != 1:
        return [*problems, f"the cells name {len(commits)} commits: {', '.join(commits) or 'none'}"]
    diff = git(project, "diff", "--stat", commits[0].removesuffix("+dirty"), "HEAD", "--", *SOURCES, check=False)
    if commits[0].endswith("+dirty") or diff.returncode or diff.stdout.strip():
        problems.append(f"{commits[0]} is not this checkout's {', '.join(SOURCES)}")
    return problems


def _cell(text: str, limit: int = 160) -> str:
    return text.replace("|", "\\|").replace("\n", " ")[:limit]


def _code(text: str) -> str:
    """``text`` as a code span in a table cell: its pipes escaped, fenced by two backticks where it has one."""
    return f"`` {_cell(text)} ``" if "`" in text else f"`{_cell(text)}`"


def _counted(n: dict[str, int]) -> str:
    return f"{n['passed']} passed, {n['failed']} failed, {n['skipped']} skipped"


def _ran_on(record: dict[str, Any]) -> str:
    if "ran_on" not in record:
        return ""
    ran = record["ran_on"]
    same = "the same diff and new files, another message"
    return f" (the job ran on blob `{ran['blob'][:12]}`, made at `{ran['commit']}`: {same})"


def pre_existing(failures: list[dict[str, Any]]) -> list[tuple[str, int, dict[str, Any]]]:
    """The failures the patch did not cause, grouped: (their :data:`ENVIRONMENT` cause or ``""``, how many, the first).

    Failures with no known cause are grouped by their reason; a migrated failure counts the ones it stands for.
    """
    groups: dict[tuple[str, str], list[dict[str, Any]]] = {}
    for failure in (f for f in failures if not f["caused"]):
        cause = next((c for pattern, c in ENVIRONMENT if pattern.search(failure["reason"])), "")
        groups.setdefault((cause, "" if cause else _cell(failure["reason"])[:60]), []).append(failure)
    return [(key[0], len(g) + sum(f.get("more", 0) for f in g), g[0]) for key, g in sorted(groups.items())]


def upstream_tables(found: dict[str, dict[str, Any]]) -> str:
    """A table per record, by patch, then in :data:`JOBS` order; a row per failure, pre-existing ones grouped."""
    lines = []
    for r in sorted(found.values(), key=lambda r: (r["patch"], JOBS.index(r["job"]))):
        seconds = r["seconds"]
        lines += [f"## {r['patch']}: {TITLES[r['job']]}", "", "| | |", "|---|---|"]
        lines += [
            f"| patch blob | `{r['blob']}`{_ran_on(r)} |",
            f"| upstream commit | `{r['upstream']}` ({_cell(r['upstream_subject'], 1000)}) |",
            f"| local commits on it | {_cell('; '.join(r['local_commits']), 1000) or 'none'} |",
            f"| installed as | {r['installed']} |",
            f"| command | {r['command']} |",
            f"| on the PR branch | {_counted(r['branch'])} |",
            f"| on the base ({r['base_runs']}) | {_counted(r['base'])} |",
            f"| failed on the branch, caused by the patch | **{r['caused']}** |",
            f"| wall time | {f'{seconds / 60:.0f} min' if seconds >= 60 else f'{seconds:.0f} s'} |",
            "",
        ]
        if r["failures"]:
            lines += ["| failed on the branch | cause | reason |", "|---|---|---|"]
            lines += [
                f"| {_code(f['id'])} | **the patch** | {_cell(f['reason'])} |" for f in r["failures"] if f["caused"]
            ]
            for cause, count, first in pre_existing(r["failures"]):
                what = _code(first["id"]) + (f" and {count - 1} more" if count > 1 else "")
                where = f"environment: {cause} (on the base too)" if cause else "pre-existing (on the base too)"
                lines.append(f"| {what} | {where} | {_cell(first['reason'])} |")
            lines.append("")
    return "\n".join(lines)


def _version(text: str) -> tuple[int, ...]:
    return tuple(int(p) for p in re.findall(r"\d+", text.split("+")[0])[:3])


def matrix_table(found: dict[str, dict[str, Any]]) -> str:
    """A row per cell, by torch release; then each cell's command and its failures."""
    cells = sorted(found.values(), key=lambda c: (_version(c["torch_requested"]), c["kind"], c["python"]))
    lines = [
        "| torch | session | result | passed | failed | skipped | tests | session wall time | downloaded | python | OS"
        " | fork commit | date (UTC) |",
        "|---|---|---|--:|--:|--:|--:|--:|--:|---|---|---|---|",
    ]
    for c in cells:
        size, n = c["downloaded_bytes"], c["counts"]
        got = f"{size / 2**30:.2f} GiB" if size >= 2**28 else f"{size / 2**20:.0f} MiB" if size else "0 (wheelhouse)"
        result = "**pass**" if c["exit_code"] == 0 else f"**FAIL** (exit {c['exit_code']})"
        lines.append(
            f"| {c['torch']} | `{c['session']}` | {result} | {n['passed']} | {n['failed']} | {n['skipped']}"
            f" | {c['duration_s']:.0f} s | {c['wall_s']:.0f} s | {got} | {c['python']} | {c['platform']}"
            f" | `{c['commit']}` | {c['date']} |"
        )
    lines += ["", "Commands:", ""]
    lines += [f'- torch {c["torch"]}: `nox -s "{c["session"]}"` ran `{c["command"]}`' for c in cells]
    for c in (c for c in cells if c["failures"]):
        lines += ["", f"Failed with torch {c['torch']} (`{c['session']}`):", ""]
        lines += [f"- {_code(f['id'])}: {_cell(f['reason'])}" for f in c["failures"]]
    return "\n".join(lines) + "\n"
