"""Run upstream's own tests on a patch's PR branch and on its base, and record the outcome in the docs.

The PR branch is made with ``upstream-pr`` in an upstream checkout. The checkout is installed as upstream's CI
installs it (the package with the extras CI uses, which read ``requirements/<pkg>/*.txt`` as pinned there, torch
included, unless ``--torch`` pins another release that those requirements allow; not ``strategies``, whose DeepSpeed
and bitsandbytes need CUDA), editable, so that the same environment tests the branch and the base. The patch's
tests run on the branch, then on the base without the patch; a failure on the branch that the base does not share is
caused by the patch. Tests that upstream marks standalone run one per process, as upstream's CI runs them, with gloo
on the CPU.

The record goes into :data:`PAGE`, one section per patch, naming the patch's blob hash, so that CI (which cannot reach
upstream) can tell whether the page describes the patches as they are, and what a maintainer elsewhere needs to run
it again: the newest commit of the branch that exists upstream (on a remote of the checkout), the local commits on
top of it with what each changes, and no path of this machine. Failures that come from the environment rather than
the code (:data:`ENVIRONMENT`, when the base fails them too) take one row each, with their cause.
"""

from __future__ import annotations

import hashlib
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ET
from dataclasses import dataclass, field
from pathlib import Path

from patchset import PatchsetError
from patchset.gitops import git, out
from patchset.pin import cache_dir
from patchset.series import Patch, read_series
from patchset.upstream_pr import _head, check_checkout, default_base, find_patch, upstream_pr

PAGE = Path("docs") / "upstream-tests.md"
# What each kind of patch runs: the whole CPU suite of fabric; the parts of pytorch that checkpointing touches.
SELECTIONS = {
    "fabric": ["tests/tests_fabric"],
    "pytorch": [
        "tests/tests_pytorch/checkpointing",
        "tests/tests_pytorch/callbacks",
        "tests/tests_pytorch/trainer/connectors",
        "tests/tests_pytorch/core",
        "tests/tests_pytorch/loops",
        "tests/tests_pytorch/trainer/optimization",
    ],
}
# The extras upstream's CI installs, less `strategies` (DeepSpeed and bitsandbytes: CUDA only, their tests skip here).
EXTRAS = {"fabric": ["fabric-test"], "pytorch": ["pytorch-extra", "pytorch-test"]}
_TIMEOUT = 300  # per test, as pytest-timeout (upstream's CI uses 60 s on faster machines)
# Failures that come from where the tests ran, not from the code: (what the failure says, its cause).
ENVIRONMENT = (
    (
        re.compile(r"No checkpoints found in folder .*tests/legacy/checkpoints"),
        "upstream's CI downloads the legacy checkpoints first (`.actions/pull_legacy_checkpoints.sh`)",
    ),
    (re.compile(r"only supported on CUDA GPUs"), "needs a CUDA GPU"),
    (re.compile(r"fabric: not found"), "the venv's `fabric` command was not on `PATH`"),
)
_BEGIN = "<!-- upstream-tests: {} -->"
_END = "<!-- /upstream-tests -->"


@dataclass
class Outcome:
    """One test's result: ``passed``, ``failed`` (errors included) or ``skipped``, and a one-line reason."""

    nodeid: str
    outcome: str
    reason: str = ""


@dataclass
class Record:
    """What one ``upstream-tests`` run found for one patch."""

    patch: str
    blob: str
    package: str
    upstream: str
    base: str
    torch: str
    selection: list[str]
    branch: dict[str, Outcome] = field(default_factory=dict)
    on_base: dict[str, Outcome] = field(default_factory=dict)
    base_runs: str = "all"
    seconds: float = 0.0
    upstream_subject: str = ""
    local_commits: list[str] = field(default_factory=list)

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
        """Two lines for the terminal."""
        b, a = self.counts(self.branch), self.counts(self.on_base)
        return (
            f"{self.patch}: branch {b['passed']} passed, {b['failed']} failed, {b['skipped']} skipped;"
            f" base {a['passed']} passed, {a['failed']} failed, {a['skipped']} skipped\n"
            f"failures caused by the patch: {len(self.caused)}; recorded in {PAGE}"
        )

    def markdown(self) -> str:
        """The patch's section of :data:`PAGE`."""
        b, a = self.counts(self.branch), self.counts(self.on_base)
        base_what = "the same selection" if self.base_runs == "all" else "the tests that failed on the branch"
        lines = [
            _BEGIN.format(self.patch),
            f"## {self.patch}",
            "",
            "| | |",
            "|---|---|",
            f"| patch blob | `{self.blob}` |",
            f"| upstream commit | `{self.upstream}` ({self.upstream_subject}) |",
            f"| local commits on it | {'; '.join(self.local_commits) or 'none'} |",
            f"| installed as | `lightning[{','.join(EXTRAS[self.package])}]` with torch {self.torch}, Python"
            f" {sys.version_info.major}.{sys.version_info.minor} |",
            f"| selection | {', '.join(f'`{s}`' for s in self.selection)}, their standalone tests one per process |",
            f"| on the PR branch | {b['passed']} passed, {b['failed']} failed, {b['skipped']} skipped |",
            f"| on the base ({base_what}) | {a['passed']} passed, {a['failed']} failed, {a['skipped']} skipped |",
            f"| failures caused by the patch | **{len(self.caused)}** |",
            f"| wall time | {self.seconds / 60:.0f} min |",
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


def upstream_ancestor(onto: Path, commit: str, base: str) -> tuple[str, list[str]]:
    """The newest ancestor of ``commit`` that a remote of ``onto`` has, and each local commit on top, described.

    A checkout without remote-tracking branches cannot tell: ``commit`` itself is returned, said to be unchecked.
    """
    if not out(onto, "for-each-ref", "--count=1", "refs/remotes", isolated=False):
        return commit, ["not checked: the checkout has no remote to compare with"]
    local = out(onto, "rev-list", "--reverse", commit, "--not", "--remotes", isolated=False).split()
    if not local:
        return commit, []
    described = []
    for sha in local:
        if base.startswith("patchset/") and sha == commit:
            described.append(f"`{sha[:12]}` the PR branch `{base}`")
            continue
        changes = out(onto, "diff-tree", "--no-commit-id", "--name-status", "-r", sha, isolated=False).splitlines()
        deleted = [line.split("\t", 1)[1] for line in changes if line.startswith("D\t")]
        if changes and len(deleted) == len(changes):
            described.append(f"`{sha[:12]}` deletes {', '.join(f'`{path}`' for path in deleted)}, nothing else")
        else:
            subject = out(onto, "log", "-1", "--format=%s", sha, isolated=False)
            described.append(f"`{sha[:12]}` {subject} ({len(changes)} files changed)")
    return out(onto, "rev-parse", f"{local[0]}^", isolated=False), described


def blob_hash(path: Path) -> str:
    """The patch file's git blob id (what ``git hash-object`` prints)."""
    data = path.read_bytes()
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()


def package_of(patch: Patch) -> str:
    """``fabric`` or ``pytorch``: from the patch's CHANGELOG entries, else its subject's prefix."""
    packages = {entry.package for entry in patch.changelog} or {patch.subject.split(":", 1)[0].strip()}
    if len(packages) != 1 or not packages <= set(SELECTIONS):
        raise PatchsetError(f"{patch.name}: cannot tell whether it is a fabric or a pytorch patch ({packages})")
    return packages.pop()


def parse_junit(path: Path) -> dict[str, Outcome]:
    """Outcomes by node id from a pytest ``--junitxml`` report (xunit1)."""
    results: dict[str, Outcome] = {}
    if not path.is_file():
        return results
    for case in ET.parse(path).iter("testcase"):
        nodeid = _nodeid(case)
        outcome, reason = "passed", ""
        for child in case:
            if child.tag in ("failure", "error"):
                outcome, reason = "failed", _reason(child)
                break
            if child.tag == "skipped":
                outcome, reason = "skipped", child.get("message", "")
        if results.get(nodeid, Outcome(nodeid, "passed")).outcome != "failed":  # an error in teardown stays
            results[nodeid] = Outcome(nodeid, outcome, reason)
    return results


def _nodeid(case: ET.Element) -> str:
    """Pytest's node id from a junit test case.

    The file, the (nested) classes that ``classname`` adds to the module's dotted path, and the name.
    """
    classname = case.get("classname", "")
    file = case.get("file") or classname.replace(".", "/") + ".py"
    module = file.removesuffix(".py").replace("/", ".")
    classes = classname[len(module) + 1 :].split(".") if classname.startswith(module + ".") else []
    return "::".join([file, *classes, case.get("name", "")])


def _reason(element: ET.Element) -> str:
    message = (element.get("message") or element.text or "").strip()
    return message.splitlines()[0] if message else element.tag


def environment(onto: Path, package: str, torch: str | None = None) -> Path:
    """A venv (cached per checkout, torch and requirements) with the checkout installed editable, as CI installs it.

    ``torch`` pins the release (``2.9.1``); by default pip takes the newest one that upstream's requirements allow.

    """
    reqs = sorted((onto / "requirements").rglob("*.txt"))
    extras = ",".join(EXTRAS[package])
    wanted = torch or ""
    key = hashlib.sha256(
        str(onto).encode() + wanted.encode() + extras.encode() + b"".join(p.read_bytes() for p in reqs)
    )
    venv = cache_dir() / "upstream-venvs" / f"{package}-{key.hexdigest()[:16]}"
    python = venv / ("Scripts/python.exe" if os.name == "nt" else "bin/python")
    if (venv / ".complete").is_file():
        return python
    subprocess.run([sys.executable, "-m", "venv", "--clear", str(venv)], check=True)
    env = {**os.environ, "PACKAGE_NAME": "lightning", "FREEZE_REQUIREMENTS": "1"}
    pin = []
    if torch:  # held through the whole install: upstream's requirements may not replace it
        (venv / "torch-constraint.txt").write_text(f"torch=={torch}\n")
        pin = ["-c", str(venv / "torch-constraint.txt")]
    for step in (
        ["install", "-q", "--upgrade", "pip"],
        ["install", "-q", "-e", f"{onto}[{extras}]", *pin],
    ):
        proc = subprocess.run([str(python), "-m", "pip", *step], env=env, capture_output=True, text=True)
        if proc.returncode != 0:
            hint = f" (does {onto / 'requirements'} allow torch {torch}?)" if torch else ""
            raise PatchsetError(f"pip {' '.join(step)} failed{hint}:\n{proc.stderr[-2000:]}")
    (venv / ".complete").write_text(installed_torch(python) + "\n")
    return python


def installed_torch(python: Path) -> str:
    """The torch release in ``python``'s environment, with its local part (``2.9.1+cu128``)."""
    proc = subprocess.run(
        [str(python), "-c", "import torch; print(torch.__version__)"], capture_output=True, text=True, check=False
    )
    if proc.returncode != 0:
        raise PatchsetError(f"{python} cannot import torch:\n{proc.stderr[-2000:]}")
    return proc.stdout.strip()


def _default_signals() -> None:
    """Tests of signal handling expect the defaults, which ``nohup`` or a CI runner may have changed."""
    for name in ("SIGHUP", "SIGINT", "SIGTERM", "SIGUSR1"):
        signal.signal(getattr(signal, name), signal.SIG_DFL)


def run_selection(python: Path, onto: Path, selection: list[str], report: Path) -> dict[str, Outcome]:
    """Run the selection, then its standalone tests one per process; outcomes by node id."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PL_", "PYTEST_", "COV_"))}
    env.update({"PL_RUN_CUDA_TESTS": "0", "CUDA_VISIBLE_DEVICES": "", "PYTHONHASHSEED": "0"})
    # the venv's own commands first, as in upstream's CI, where the environment is activated (tests run `fabric`)
    env["PATH"] = os.pathsep.join([str(python.parent), *filter(None, [env.get("PATH")])])
    common = ["-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "no:randomly", f"--timeout={_TIMEOUT}"]
    common += ["-o", "junit_family=xunit1", "-W", "ignore::DeprecationWarning"]
    proc = subprocess.run(
        [str(python), *common, f"--junitxml={report}", *selection],
        cwd=onto,
        env=env,
        stderr=subprocess.PIPE,
        text=True,
        preexec_fn=_default_signals if os.name == "posix" else None,
    )
    results = parse_junit(report)
    if proc.returncode not in (0, 1) or not results:
        tail = "\n".join(proc.stderr.strip().splitlines()[-5:])
        raise PatchsetError(
            f"pytest could not run {' '.join(selection)} in {onto} (exit code {proc.returncode}); it said:\n{tail}"
        )
    standalone = {**env, "PL_RUN_STANDALONE_TESTS": "1"}
    listed = subprocess.run(
        [str(python), "-m", "pytest", "-q", "--collect-only", "-p", "no:cacheprovider", *selection],
        cwd=onto,
        env=standalone,
        capture_output=True,
        text=True,
    ).stdout
    for i, nodeid in enumerate(line.strip() for line in listed.splitlines() if "::" in line):
        single = report.with_name(f"{report.stem}-standalone-{i}.xml")
        code = subprocess.run(
            [str(python), *common, f"--junitxml={single}", nodeid],
            cwd=onto,
            env=standalone,
            preexec_fn=_default_signals if os.name == "posix" else None,
        ).returncode
        found = parse_junit(single)
        if nodeid not in found and code != 0:  # it died before pytest could report it
            found[nodeid] = Outcome(nodeid, "failed", f"crashed: pytest exited with {code} and no report")
        results.update(found)
    return results


def run_upstream_tests(
    project: Path,
    ref: str,
    onto: Path,
    base: str | None = None,
    torch: str | None = None,
    python: str | None = None,
    select: list[str] | None = None,
    base_runs: str = "all",
    author: str | None = None,
) -> Record:
    """Make the PR branch, test it and its base, record the result in :data:`PAGE` and return it."""
    patch = find_patch(project, ref)
    package = package_of(patch)
    selection = select or SELECTIONS[package]
    check_checkout(onto)
    original = _head(onto)
    branch = upstream_pr(project, ref, onto, base=base, force=True, author=author)
    start_commit = out(onto, "rev-parse", f"{branch}~1", isolated=False)
    base = base or default_base(project, patch, onto)
    upstream_commit, local_commits = upstream_ancestor(onto, start_commit, base)
    record = Record(
        patch=patch.name,
        blob=blob_hash(patch.path),
        package=package,
        upstream=upstream_commit,
        base=base,
        torch=torch or "",
        selection=selection,
        base_runs=base_runs,
        upstream_subject=out(onto, "log", "-1", "--format=%s", upstream_commit, isolated=False),
        local_commits=local_commits,
    )
    started = time.monotonic()
    try:
        interpreter = Path(python) if python else environment(onto, package, torch)
        record.torch = installed_torch(interpreter)  # what ran, whatever was asked for
        with tempfile.TemporaryDirectory() as tmp:
            record.branch = run_selection(interpreter, onto, selection, Path(tmp) / "branch.xml")
            git(onto, "checkout", "-q", "--detach", start_commit, isolated=False)
            again = selection
            if base_runs == "failures":
                again = sorted(o.nodeid for o in record.branch.values() if o.outcome == "failed")
            if again:
                record.on_base = run_selection(interpreter, onto, again, Path(tmp) / "base.xml")
    finally:
        git(onto, "checkout", "-q", "--force", original, isolated=False)
    places = {onto: "<checkout>", cache_dir(): "<cache>", Path.home(): "~"}
    if (interpreter.parent.parent / "pyvenv.cfg").is_file():
        places[interpreter.parent.parent] = "<venv>"
    for results in (record.branch, record.on_base):
        for outcome in results.values():
            outcome.reason = portable(outcome.reason, places)
    record.seconds = time.monotonic() - started
    write_record(project, record)
    return record


def write_record(project: Path, record: Record) -> None:
    """Put the record's section into :data:`PAGE`, replacing the patch's previous one, in series order."""
    page = project / PAGE
    text = page.read_text(encoding="utf-8") if page.is_file() else _HEADER
    series = {patch.name for patch in read_series(project)}
    names = [name for name in re.findall(r"<!-- upstream-tests: (\S+) -->", text) if name in series]
    found = {name: m.group(0) for name in names if (m := re.search(_section_pattern(name), text, flags=re.S))}
    found[record.patch] = record.markdown()
    page.parent.mkdir(parents=True, exist_ok=True)
    page.write_text(_HEADER + "\n".join(found[name] + "\n" for name in sorted(found)), encoding="utf-8")


def _section_pattern(name: str) -> str:
    return re.escape(_BEGIN.format(name)) + r".*?" + re.escape(_END)


def recorded_blobs(project: Path) -> dict[str, str]:
    """The patch blob hash each section of :data:`PAGE` names, by patch file name."""
    page = project / PAGE
    if not page.is_file():
        return {}
    text = page.read_text(encoding="utf-8")
    blobs = {}
    for name in re.findall(r"<!-- upstream-tests: (\S+) -->", text):
        match = re.search(_section_pattern(name), text, flags=re.S)
        blob = re.search(r"\| patch blob \| `([0-9a-f]{40})` \|", match.group(0)) if match else None
        if blob:
            blobs[name] = blob.group(1)
    return blobs


_HEADER = """# Upstream's own tests on each pull request

Written by `python -m patchset upstream-tests PATCH --onto <upstream checkout>`, not by hand. For each patch bound
upstream, it makes the pull request's branch with `upstream-pr`, installs that checkout as upstream's CI does (the
package with its test extra, torch included, as pinned in upstream's `requirements/`; the record names the torch that
ran), runs the upstream tests for what the patch touches on the branch and on the base without the patch, and
records the result here. A failure on the branch is **caused by the patch** unless the base fails the same test;
failures that come from the environment (a download upstream's CI makes first, a GPU) take one row with their cause.
Each record names the newest commit of the branch that exists upstream and every local commit on top of it, and no
path of the machine it ran on (`<checkout>`, `<venv>`, `<cache>`), so it can be run again anywhere. CI checks that
every section names the patch's current blob hash (`git hash-object patches/<file>`), so a patch changed after its
run shows up as stale.

"""
