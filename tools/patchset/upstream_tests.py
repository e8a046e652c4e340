"""Run upstream's CI jobs on a patch's PR branch and on its base, and record the outcome in the docs.

The PR branch is made with ``upstream-pr`` in an upstream checkout. Each job of :data:`RUNS` runs in a venv made as
upstream's CI makes it (:mod:`patchset.upstream_envs`, from the checkout's own workflows:
:mod:`patchset.upstream_ci`): the patch's tests with the newest torch upstream's requirements allow and under the
oldest requirements, mypy and ruff (:mod:`patchset.upstream_checks`). Each runs on the branch, then on the base
without the patch; a failure or finding on the branch that the base does not share is caused by the patch. Tests
that upstream marks standalone run one per process, as upstream's CI runs them, with gloo on the CPU. Each job's
record goes into the page as soon as it is done (:mod:`patchset.upstream_record`), so an interrupted run keeps what
it finished.
"""

from __future__ import annotations

import functools
import hashlib
import os
import signal
import subprocess
import tempfile
import time
import xml.etree.ElementTree as ET
from collections.abc import Callable
from pathlib import Path

from patchset import PatchsetError
from patchset.gitops import check_checkout, current_branch, git, out
from patchset.pin import cache_dir
from patchset.series import Patch, find_patch
from patchset.upstream_checks import Finding, python_files, run_mypy, run_ruff
from patchset.upstream_ci import mypy_job, oldest_filterwarnings, oldest_job, ruff_version
from patchset.upstream_envs import (
    EXTRAS,
    installed_version,
    mypy_environment,
    newest_environment,
    oldest_environment,
    oldest_files,
    python_version,
    ruff_environment,
)
from patchset.upstream_pr import default_base, upstream_pr
from patchset.upstream_record import (
    RUNS,
    CheckRecord,
    Context,
    Outcome,
    Record,
    blob_hash,
    portable,
    write_record,
)

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
_TIMEOUT = 300  # per test, as pytest-timeout (upstream's CI uses 60 s on faster machines)


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


def package_of(patch: Patch) -> str:
    """``fabric`` or ``pytorch``: the subject's prefix, else the package of the patch's CHANGELOG entries.

    A fabric change that the Trainer shares has entries in both changelogs; its subject says whose jobs it runs.
    """
    prefix = patch.subject.split(":", 1)[0].strip()
    if prefix in SELECTIONS:
        return prefix
    packages = {entry.package for entry in patch.changelog}
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


def _default_signals() -> None:
    """Tests of signal handling expect the defaults, which ``nohup`` or a CI runner may have changed."""
    for name in ("SIGHUP", "SIGINT", "SIGTERM", "SIGUSR1"):
        signal.signal(getattr(signal, name), signal.SIG_DFL)


def run_selection(
    python: Path, onto: Path, selection: list[str], report: Path, options: list[str] | None = None
) -> dict[str, Outcome]:
    """Run the selection, then its standalone tests one per process; outcomes by node id.

    ``options`` go to every pytest run (the oldest job's ``-o filterwarnings=...``).
    """
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PL_", "PYTEST_", "COV_"))}
    env.update({"PL_RUN_CUDA_TESTS": "0", "CUDA_VISIBLE_DEVICES": "", "PYTHONHASHSEED": "0"})
    # the venv's own commands first, as in upstream's CI, where the environment is activated (tests run `fabric`)
    env["PATH"] = os.pathsep.join([str(python.parent), *filter(None, [env.get("PATH")])])
    common = ["-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "no:randomly", f"--timeout={_TIMEOUT}"]
    common += ["-o", "junit_family=xunit1", "-W", "ignore::DeprecationWarning", *(options or [])]
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


def _extras(package: str) -> str:
    return f"`lightning[{','.join(EXTRAS[package])}]`"


def run_upstream_tests(
    project: Path,
    ref: str,
    onto: Path,
    runs: tuple[str, ...] | list[str] = RUNS,
    base: str | None = None,
    torch: str | None = None,
    python: str | None = None,
    select: list[str] | None = None,
    base_runs: str = "all",
    author: str | None = None,
    oldest_python: str | None = None,
    interpreters: dict[str, Path] | None = None,
) -> list[Record | CheckRecord]:
    """Make the PR branch, run each job of ``runs`` on it and on its base, record each in :data:`PAGE`; the records.

    ``python`` is a ready interpreter for the ``newest`` tests instead of a venv made here; ``interpreters`` gives one
    per job (the tool's tests use it). ``oldest_python`` is the Python that the ``oldest`` venv is made from.
    """
    unknown = [run for run in runs if run not in RUNS]
    if unknown:
        raise PatchsetError(f"{', '.join(unknown)}: no such job; the jobs are {', '.join(RUNS)}")
    patch = find_patch(project, ref)
    package = package_of(patch)
    selection = select or SELECTIONS[package]
    check_checkout(onto)
    ready = dict(interpreters or {})
    if python:
        ready["newest"] = Path(python)
    original = current_branch(onto)
    branch = upstream_pr(project, ref, onto, base=base, force=True, author=author)
    start_commit = out(onto, "rev-parse", f"{branch}~1", isolated=False)
    base = base or default_base(project, patch, onto)
    upstream_commit, local_commits = upstream_ancestor(onto, start_commit, base)
    context = Context(
        patch=patch.name,
        blob=blob_hash(patch.path),
        upstream=upstream_commit,
        upstream_subject=out(onto, "log", "-1", "--format=%s", upstream_commit, isolated=False),
        local_commits=local_commits,
    )

    def on_base() -> None:
        git(onto, "checkout", "-q", "--detach", start_commit, isolated=False)

    def on_branch() -> None:
        git(onto, "checkout", "-q", "--force", branch, isolated=False)

    records: list[Record | CheckRecord] = []
    try:
        for run in [r for r in RUNS if r in runs]:
            started = time.monotonic()
            on_branch()
            if run in ("newest", "oldest"):
                if run == "newest":
                    interpreter = ready.get(run) or newest_environment(onto, package, torch)
                else:
                    interpreter = ready.get(run) or oldest_environment(onto, package, oldest_python)
                record: Record | CheckRecord = _test_job(
                    run, context, package, interpreter, onto, selection, base_runs, on_base
                )
            else:
                record, interpreter = _check_job(run, context, onto, ready.get(run), on_base)
            _make_portable(record, onto, interpreter)
            record.seconds = time.monotonic() - started
            write_record(project, record)
            records.append(record)
    finally:
        git(onto, "checkout", "-q", "--force", original, isolated=False)
    return records


def _test_job(
    run: str,
    context: Context,
    package: str,
    interpreter: Path,
    onto: Path,
    selection: list[str],
    base_runs: str,
    on_base: Callable[[], object],
) -> Record:
    """A tests job (``newest`` or ``oldest``) on the branch, then on the base."""
    torch = installed_version(interpreter, "torch")  # what ran, whatever was asked for
    installed = f"{_extras(package)} with torch {torch}, Python {python_version(interpreter)}"
    options: list[str] = []
    if run == "oldest":
        job = oldest_job(onto, package)
        files = ", ".join(f"`{Path(f).name}`" for f in oldest_files(job.requirement_files, package))
        installed += (
            f"; every `>=` of `requirements/{package}/` {files} pinned as `==` (`set-oldest`), pytest's"
            " `filterwarnings` without `error::FutureWarning` (`prune_pytest_as_errors`)"
        )
        options = ["-o", "filterwarnings=" + "\n".join(oldest_filterwarnings(onto))]
    record = Record(context, run, installed, selection, base_runs=base_runs)
    with tempfile.TemporaryDirectory() as tmp:
        record.branch = run_selection(interpreter, onto, selection, Path(tmp) / "branch.xml", options)
        on_base()
        again = selection
        if base_runs == "failures":
            again = sorted(o.nodeid for o in record.branch.values() if o.outcome == "failed")
            # a test the patch adds is not on the base: caused by the patch, with nothing to run there
            again = [nodeid for nodeid in again if (onto / nodeid.split("::")[0]).is_file()]
        if again:
            record.on_base = run_selection(interpreter, onto, again, Path(tmp) / "base.xml", options)
    return record


def _check_job(
    run: str, context: Context, onto: Path, ready: Path | None, on_base: Callable[[], object]
) -> tuple[CheckRecord, Path]:
    """A static check (``mypy`` or ``ruff``) on the branch, then on the base; the record and the interpreter."""
    check: Callable[[Path], tuple[list[Finding], str]]
    if run == "mypy":
        job = mypy_job(onto)
        interpreter = ready or mypy_environment(onto, job)
        # mypy's incremental cache, out of the checkout (the base reuses what the branch run left)
        cache = cache_dir() / "mypy-cache" / hashlib.sha256(str(interpreter).encode()).hexdigest()[:16]
        versions = [
            f"{dist} {installed_version(interpreter, dist)}" for dist in ("mypy", "torch") if _has(interpreter, dist)
        ]
        versions.append(f"Python {python_version(interpreter)}")
        installed = f"`lightning[{job.extras}]` and `{job.requirements}`: {', '.join(versions)}"
        command = f"`{' '.join(job.command)}` in the checkout (upstream's `[tool.mypy]` of `pyproject.toml`)"
        check = functools.partial(run_mypy, interpreter, command=job.command, cache=cache)
    else:
        version = ruff_version(onto)
        interpreter = ready or ruff_environment(version)
        installed = f"ruff {installed_version(interpreter, 'ruff')} (`.pre-commit-config.yaml` pins {version})"
        command = (
            f"`ruff check --force-exclude` and `ruff format --force-exclude --check` on the {len(python_files(onto))}"
            " tracked Python files (`pre-commit run --all-files`)"
        )
        check = functools.partial(run_ruff, interpreter)
    record = CheckRecord(context, run, installed, command)
    record.branch, record.branch_summary = check(onto)
    on_base()
    record.on_base, record.base_summary = check(onto)
    return record, interpreter


def _has(python: Path, dist: str) -> bool:
    try:
        installed_version(python, dist)
    except PatchsetError:
        return False
    return True


def _make_portable(record: Record | CheckRecord, onto: Path, interpreter: Path | None) -> None:
    places = {onto: "<checkout>", cache_dir(): "<cache>", Path.home(): "~"}
    if interpreter is not None and (interpreter.parent.parent / "pyvenv.cfg").is_file():
        places[interpreter.parent.parent] = "<venv>"
    if isinstance(record, Record):
        for results in (record.branch, record.on_base):
            for outcome in results.values():
                outcome.reason = portable(outcome.reason, places)
    else:
        for finding in (*record.branch, *record.on_base):
            finding.message = portable(finding.message, places)
        record.branch_summary = portable(record.branch_summary, places)
        record.base_summary = portable(record.base_summary, places)
