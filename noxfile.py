# /// script
# dependencies = ["nox>=2025.2", "pyyaml>=6"]  # PyYAML: the upstream_* sessions read upstream's workflows
# ///
"""The torch matrix: the fork's test suite against each supported torch release, one nox session per release.

Each ``tests(torch='X')`` session makes a fresh venv (with the Python that runs nox), installs ``torch==X`` (plus
``numpy<2`` where that torch was built against NumPy 1.x), builds and installs the fork from this checkout with pip
(through the in-tree PEP 517 backend), removes any unpatched ``pytorch-lightning`` / ``lightning-fabric``
distribution, and runs the project's test command from the repository root; tests import ``lightning`` from the
venv's site-packages. The result of a full run is recorded in docs/torch-matrix.md (see .ci/torch_matrix.py).

    nox                                  # the default: tests(torch='2.13.0')
    nox -s "tests(torch='2.1.2')"        # one cell; `nox -l` lists them
    nox -s "tests(torch='2.1.2')" -- tests/tests_fabric -x   # a subset (not recorded in the table)

torch comes from your pip configuration: on a plain Linux machine that is a CUDA build of several GB (it runs on the
CPU too). Sessions share a wheelhouse in pip's cache directory (``TORCH_MATRIX_WHEELHOUSE`` overrides it): ``pip
download`` fills it, skipping files it already holds, and the session installs torch from it, so each build is
downloaded once. Set ``TORCH_INDEX_URL`` to an extra index (CI points it at PyTorch's CPU wheel index) to take torch
from there instead.
"""

from __future__ import annotations

import argparse
import ast
import datetime as dt
import json
import os
import platform
import re
import shlex
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

import nox
import yaml

if sys.version_info >= (3, 11):
    import tomllib
else:  # nox itself requires tomli on Python 3.10
    import tomli as tomllib

sys.path.insert(0, str(Path(__file__).resolve().parent / "tools"))  # the patch set's tool, from this checkout
from patchset import PatchsetError, records
from patchset.build_label import build_pin
from patchset.gitops import check_checkout, current_branch, git, out
from patchset.pin import read_pin
from patchset.series import Patch, find_patch
from patchset.upstream_pr import default_base, upstream_pr

nox.options.default_venv_backend = "venv"
nox.options.sessions = ["tests(torch='2.13.0')"]
nox.options.error_on_missing_interpreters = True

ROOT = Path(__file__).resolve().parent
# The latest patch of every minor release from the oldest Lightning 2.6 supports (torch>=2.1) to the newest on the
# index; 2.13.0 is the default session's. ci-tests-fork.yml runs the same releases (a tool test checks it).
TORCH = [
    "2.1.2", "2.2.2", "2.3.1", "2.4.1", "2.5.1", "2.6.0", "2.7.1", "2.8.0", "2.9.1", "2.10.0", "2.11.0", "2.12.1",
    "2.13.0", "2.14.1", "2.15.0",
]  # fmt: skip
OLDEST = TORCH[0]
# The project's test command (README, .ci/run), run from the repository root against the installed fork.
TEST_COMMAND = ["python", "-m", "pytest", "-n", "2", "--cov", "--cov-report=term"]
UNPATCHED = ["pytorch-lightning", "lightning-fabric"]

CHECK_INSTALL = """
import importlib.metadata as md, importlib.util, pathlib, sys
import torch, lightning
want, fork = sys.argv[1:3]
assert torch.__version__.split("+")[0] == want, f"torch {torch.__version__} installed, the session wants {want}"
root = pathlib.Path(lightning.__file__).resolve().parent
assert "site-packages" in root.parts, f"lightning imported from {root}, not from the installed fork"
assert lightning.__version__ == fork, f"lightning {lightning.__version__} is not the fork's {fork}"
for dist in ("pytorch-lightning", "lightning-fabric"):
    try:
        md.distribution(dist)
    except md.PackageNotFoundError:
        continue
    raise AssertionError(f"the unpatched {dist} distribution is installed")
for name in ("pytorch_lightning", "lightning_fabric"):
    assert importlib.util.find_spec(name) is None, f"{name} is importable: an unpatched copy is installed"
print(f"torch {torch.__version__}, lightning {lightning.__version__} from {root}")
"""


def _fork_version() -> str:
    """What this checkout builds (``2.6.6+patchset.N``), from its pin (read by the tool's own parser)."""
    return build_pin(ROOT, read_pin(ROOT)).fork_version


def _version(v: str) -> tuple[int, ...]:
    return tuple(int(p) for p in re.findall(r"\d+", v)[:3])


def _needs_numpy_1(torch: str) -> bool:
    """Whether this torch needs ``numpy<2``: releases before 2.4 were built against NumPy 1.x."""
    return _version(torch) < (2, 4)


def _wheelhouse(session: nox.Session) -> Path:
    """``$TORCH_MATRIX_WHEELHOUSE``, else ``torch-matrix-wheels`` in pip's cache directory."""
    if os.environ.get("TORCH_MATRIX_WHEELHOUSE"):
        return Path(os.environ["TORCH_MATRIX_WHEELHOUSE"])
    out = session.run("python", "-m", "pip", "cache", "dir", silent=True, success_codes=[0, 1])
    cache = Path(out.strip()) if isinstance(out, str) and out.strip() else Path.home() / ".cache" / "pip"
    return cache / "torch-matrix-wheels"


def _wheel_bytes(wheelhouse: Path) -> int:
    return sum(p.stat().st_size for p in wheelhouse.glob("*.whl")) if wheelhouse.is_dir() else 0


def _install_fork(session: nox.Session, torch: str) -> Path:
    """Torch, the test requirements, the fork (``pip install .``), no unpatched copy; returns the constraints file."""
    # the record names the session's wall time (install included), what it downloaded, and the commit it built (the
    # checkout may move on while the suite runs)
    session.env["TORCH_MATRIX_SESSION_START"] = repr(time.time())
    session.env["TORCH_MATRIX_COMMIT"] = records.checkout_commit(ROOT)
    session.run("python", "-m", "pip", "install", "--quiet", "--upgrade", "pip", silent=True)
    constraints = Path(session.create_tmp()) / "constraints.txt"
    pins = [f"torch=={torch}"] + (["numpy<2"] if _needs_numpy_1(torch) else [])
    constraints.write_text("\n".join(pins) + "\n", encoding="utf-8")
    index = os.environ.get("TORCH_INDEX_URL")
    # torch and its dependencies go through a wheelhouse shared by every session (and kept with pip's cache): a
    # file already there is not downloaded again, even where the index's responses are not cacheable by pip.
    wheelhouse = _wheelhouse(session)
    held = _wheel_bytes(wheelhouse)
    session.run(
        "python", "-m", "pip", "download", "--dest", str(wheelhouse), *pins, "-c", str(constraints),
        *(["--extra-index-url", index] if index else []),
    )  # fmt: skip
    session.env["TORCH_MATRIX_DOWNLOADED"] = str(_wheel_bytes(wheelhouse) - held)
    session.install("--no-index", "--find-links", str(wheelhouse), *pins, "-c", str(constraints))
    # every later install is held to the same torch (and numpy), so nothing upgrades them behind the session's back
    session.install("-r", "tests/requirements.txt", "-c", str(constraints))
    session.install(".", "-c", str(constraints))
    session.run("python", "-m", "pip", "uninstall", "--yes", *UNPATCHED)
    return constraints


PROBE = "import sys, torch; print(torch.__version__, sys.version.split()[0])"


def _check_and_test(session: nox.Session, torch: str, kind: str) -> None:
    """The test command with a JUnit XML report; a whole run is recorded in docs/records/torch-matrix.json."""
    session.run("python", "-c", CHECK_INSTALL, torch, _fork_version())
    session.run("python", "-m", "pip", "list", "--format=freeze", silent=False)
    tmp = Path(session.create_tmp())
    report = tmp / "junit.xml"
    command = [*TEST_COMMAND, *session.posargs]
    started = time.monotonic()
    # the session's own coverage data file: the repository root stays clean and cells can run side by side
    try:
        junit = [f"--junitxml={report}", "-o", "junit_family=xunit1"]  # xunit1: a case's file, hence its node id
        session.run(*command, *junit, env={"COVERAGE_FILE": str(tmp / ".coverage")})
        code = 0
    except nox.command.CommandFailed:
        code = 1
    cases = list(records.read_junit(report, ROOT, {str(Path.home()): "~"}).values())
    torch_version, python = str(session.run("python", "-c", PROBE, silent=True)).split()
    if session.posargs:  # a subset of the suite: run, but kept out of the table
        session.log("a subset of the suite: not recorded")
    else:
        records.add(ROOT, "torch-matrix", {
            "key": f"{kind}:{torch}:py{'.'.join(python.split('.')[:2])}:{platform.system()}",
            "kind": kind, "session": session.name, "torch_requested": torch, "torch": torch_version, "python": python,
            "platform": f"{platform.system()} {platform.machine()}", "commit": session.env["TORCH_MATRIX_COMMIT"],
            "date": dt.datetime.now(dt.timezone.utc).strftime("%Y-%m-%d %H:%M"),
            "duration_s": round(time.monotonic() - started, 1),
            "wall_s": round(time.time() - float(session.env["TORCH_MATRIX_SESSION_START"]), 1),
            "downloaded_bytes": int(session.env["TORCH_MATRIX_DOWNLOADED"]), "exit_code": code,
            "counts": records.counts(cases), "failures": records.attribute(cases, []), "command": " ".join(command),
        })  # fmt: skip
    if code:
        session.error(f"the test command failed: {records.counts(cases)}")


OLDEST_REQUIREMENTS = """
import importlib.metadata, re
for req in importlib.metadata.requires("lightning") or []:
    low = re.match(r"([A-Za-z0-9_.-]+)(\\[[^]]*\\])?[^;]*?>=\\s*([\\w.]+)[^;]*$", req)  # with a marker: an extra's
    if low and low.group(1).lower() != "torch":  # the session pins torch itself
        print(f"{low.group(1)}{low.group(2) or ''}=={low.group(3)}")
"""


@nox.session
@nox.parametrize("torch", TORCH)
def tests(session: nox.Session, torch: str) -> None:
    """The test suite against the fork installed with this torch release."""
    _install_fork(session, torch)
    _check_and_test(session, torch, "tests")


@nox.session
def oldest(session: nox.Session) -> None:
    """The oldest torch with the lowest versions of lightning's requirements that the fork declares."""
    constraints = _install_fork(session, OLDEST)
    lowest = str(session.run("python", "-c", OLDEST_REQUIREMENTS, silent=True)).split()
    session.log("lowest requirements: " + " ".join(lowest))
    # the lowest versions join the constraints and the test requirements are resolved again against them: installed
    # over the newest, they left pytest 9 with packaging 23.0, below what it requires, and pkg_resources (which
    # lightning-utilities 0.10 asks) then denied that pytest-rerunfailures was installed at all
    with constraints.open("a", encoding="utf-8") as f:
        f.write("".join(re.sub(r"\[[^\]]*\]", "", req) + "\n" for req in lowest))  # no extras in constraints
    # the fork too, so that its other requirements (torchmetrics needs a newer lightning-utilities) are resolved again
    session.install("-r", "tests/requirements.txt", ".", *lowest, "-c", str(constraints))
    session.run("python", "-m", "pip", "uninstall", "--yes", *UNPATCHED)
    session.run("python", "-m", "pip", "check")  # every installed distribution's requirements hold
    _check_and_test(session, OLDEST, "oldest")


# What the lint session installs: the linters, pinned (each new release of either has new rules, which broke this
# session while they were taken newest), PyYAML (the tool's commands read upstream's issue forms) with its stubs,
# pytest (which the rerun plugin imports: mypy reads its types), and, for type-checking our src/lightning modules
# against the fork's own code, the default session's torch.
LINTERS = ["ruff==0.17.6", "mypy==2.4.1", "pyyaml==6.0.4", "types-PyYAML==6.0.12.20261122", "pytest==9.2.0"]
LINT_TORCH = "2.13.0"

MYPY_OUR_MODULES = """
import os, pathlib, subprocess, sys
from patchset.materialize import build_tree
tree = build_tree(pathlib.Path("."), pathlib.Path(sys.argv[1]))
files = subprocess.run(["git", "ls-files", "src/lightning/*.py"], capture_output=True, text=True, check=True).stdout
modules = [f.removeprefix("src/").removesuffix(".py").replace("/", ".") for f in files.split()]
if not modules:
    print("no src/lightning files")
    sys.exit(0)
args = ["mypy", "--install-types", "--non-interactive", "--follow-imports=silent"]
args += [arg for module in modules for arg in ("-m", module)]
# upstream's mypy settings (its pyproject.toml) apply: mypy runs in the patched tree, where lightning.* is the fork's
sys.exit(subprocess.run(args, cwd=tree, env={**os.environ, "MYPYPATH": "src"}).returncode)
"""


@nox.session
def lint(session: nox.Session) -> None:
    """Everything ci-checks.yml runs (it runs this session): the series, ruff, mypy on the tool and on our modules."""
    tools = {"PYTHONPATH": str(ROOT / "tools")}
    session.install(*LINTERS)
    # on failure the output is the diff: `git apply` it (CI uploads it as an artifact)
    session.run("python", "-m", "patchset", "export", "--check", env=tools)
    session.run("python", "-m", "patchset", "check", env=tools)
    session.run("ruff", "check", ".")
    session.run("ruff", "format", "--check", "--diff", ".")
    session.run("mypy", "--strict", "-p", "patchset", env={"MYPYPATH": str(ROOT / "tools")})
    index = os.environ.get("TORCH_INDEX_URL")
    session.install(f"torch=={LINT_TORCH}", *(["--extra-index-url", index] if index else []))
    session.install(".")
    session.run("python", "-m", "pip", "uninstall", "--yes", *UNPATCHED)
    session.run("python", "-c", MYPY_OUR_MODULES, str(Path(session.create_tmp()) / "tree"), env=tools)


# Upstream's CI jobs on a patch's pull request, a session each: `nox -s upstream_newest -- 0002 --onto <checkout>`.
# Each makes the PR branch with the tool's upstream-pr, installs as upstream's CI does (read from the checkout's own
# workflows), runs the job on the branch, then on its base without the patch, and records both from JUnit XML in
# docs/records/upstream-tests.json. A failure on the branch that the base does not share is caused by the patch.
SELECTIONS = {  # what each kind of patch runs: the CPU suite of fabric; the parts of pytorch checkpointing touches
    "fabric": ["tests/tests_fabric"],
    "pytorch": [f"tests/tests_pytorch/{d}" for d in ("checkpointing", "callbacks", "trainer/connectors", "core")]
    + ["tests/tests_pytorch/loops", "tests/tests_pytorch/trainer/optimization"],
}
EXTRAS = {"fabric": ["fabric-test"], "pytorch": ["pytorch-extra", "pytorch-test"]}  # upstream's, less CUDA-only ones
CI_ENV = {"PACKAGE_NAME": "lightning", "FREEZE_REQUIREMENTS": "1"}  # as upstream's CI installs on a pull request
# A pytest plugin (-p default_signals) that restores the default signal handlers, which a CI runner or a background
# shell may have changed (upstream's tests of signal handling expect them). A plugin, not a wrapper script: Lightning's
# launchers start the other ranks with the command line of the first, `python -m pytest ...`.
DEFAULT_SIGNALS = """import signal
for name in ("SIGHUP", "SIGINT", "SIGTERM", "SIGUSR1"):
    signal.signal(getattr(signal, name), signal.SIG_DFL)
"""
PYTEST = ["python", "-m", "pytest", "-p", "default_signals", "-q", "-p", "no:cacheprovider", "-p", "no:randomly"]
PYTEST += ["--timeout=300", "-o", "junit_family=xunit1", "-W", "ignore::DeprecationWarning"]
PYTHON = (".py", ".pyi", ".ipynb")  # the files the ruff hooks' `types_or: [python, pyi, jupyter]` select
Cases = dict[str, records.Case]
T = TypeVar("T")


def upstream_context(onto: Path, start: str, base: str) -> dict[str, Any]:
    """Where the PR branch starts: the newest commit a remote of ``onto`` has, and each local commit on it, described.

    A checkout without remote-tracking branches cannot tell: ``start`` itself, said to be unchecked.
    """
    if not out(onto, "for-each-ref", "--count=1", "refs/remotes", isolated=False):
        local, described = [], ["not checked: the checkout has no remote to compare with"]
    else:
        local, described = out(onto, "rev-list", "--reverse", start, "--not", "--remotes", isolated=False).split(), []
    for sha in local:
        changes = out(onto, "diff-tree", "--no-commit-id", "--name-status", "-r", sha, isolated=False).splitlines()
        deleted = [line.split("\t", 1)[1] for line in changes if line.startswith("D\t")]
        if base.startswith("patchset/") and sha == start:
            described.append(f"`{sha[:12]}` the PR branch `{base}`")
        elif changes and len(deleted) == len(changes):
            described.append(f"`{sha[:12]}` deletes {', '.join(f'`{path}`' for path in deleted)}, nothing else")
        else:
            subject = out(onto, "log", "-1", "--format=%s", sha, isolated=False)
            described.append(f"`{sha[:12]}` {subject} ({len(changes)} file{'' if len(changes) == 1 else 's'} changed)")
    upstream = out(onto, "rev-parse", f"{local[0]}^", isolated=False) if local else start
    subject = out(onto, "log", "-1", "--format=%s", upstream, isolated=False)
    return {"upstream": upstream, "upstream_subject": subject, "local_commits": described}


class Upstream:
    """One upstream job's run: the patch, the checkout, its PR branch and where the branch starts.

    A context manager: the checkout is put back on the branch it was on, whatever happens in the session.
    """

    def __init__(self, session: nox.Session, job: str) -> None:
        parser = argparse.ArgumentParser(prog=f"nox -s {session.name} --")
        parser.add_argument("patch", help="patch file name or number, e.g. 0002")
        parser.add_argument("--onto", type=Path, required=True, help="an upstream Lightning git checkout")
        parser.add_argument("--base", help="as upstream-pr --base")
        parser.add_argument("--author", help="as upstream-pr --author")
        parser.add_argument("--torch", help="newest: this torch release instead of the newest allowed")
        parser.add_argument("--select", nargs="+", help="test paths or node ids instead of the patch's selection")
        what = "tests: on the base, the whole selection or what failed on the branch (default)"
        parser.add_argument("--base-runs", choices=["all", "failures"], default="failures", help=what)
        self.args, self.session, self.job = parser.parse_args(session.posargs), session, job
        self.onto: Path = self.args.onto.resolve()
        self.reports = Path(session.create_tmp()).resolve()  # relative to the directory nox started in
        self.started = time.monotonic()
        try:  # the commit carry-records compares a later version of the patch with
            self.fork_commit = records.checkout_commit(ROOT)
        except PatchsetError:  # not a git checkout: carry-records takes the oldest commit of the patch's blob
            self.fork_commit = ""
        try:
            self.patch: Patch = find_patch(ROOT, self.args.patch)
            if not self.patch.upstreamable:
                raise PatchsetError(
                    f"{self.patch.name} is fork packaging (Forwarded: not-needed): it has no PR to test"
                )
            prefix = self.patch.subject.split(":", 1)[0].strip()  # a fabric change the Trainer shares runs fabric's
            packages = {prefix} & set(SELECTIONS) or {entry.package for entry in self.patch.changelog}
            if len(packages) != 1:
                raise PatchsetError(
                    f"{self.patch.name}: its subject names no package (`fabric:` or `pytorch:`) and its Changelog"
                    " fields name none or both: name it in the subject"
                )
            self.package = packages.pop()
            check_checkout(self.onto)
            self.original = current_branch(self.onto)
        except PatchsetError as err:
            session.error(str(err))
        self.selection = self.args.select or SELECTIONS[self.package]
        # the sessions' own places, never written into a record: the checkout, the venv and the home folder
        self.places = {str(self.onto): "<checkout>", str(session.virtualenv.location): "<venv>", str(Path.home()): "~"}

    def __enter__(self) -> Upstream:
        try:
            self.base = self.args.base or default_base(ROOT, self.patch, self.onto)
            self.branch = upstream_pr(
                ROOT, self.args.patch, self.onto, base=self.base, force=True, author=self.args.author
            )
        except PatchsetError as err:
            self.session.error(str(err))
        self.start = out(self.onto, "rev-parse", f"{self.branch}~1", isolated=False)
        self.session.chdir(self.onto)
        git(self.onto, "checkout", "-q", "--force", self.branch, isolated=False)  # the install reads the branch
        return self

    def __exit__(self, *exc: object) -> None:
        git(self.onto, "checkout", "-q", "--force", self.original, isolated=False)

    def read(self, rel: str, what: str, find: Callable[[Any], T]) -> T:
        """``find`` applied to a YAML file of the checkout; one error naming the file and ``what`` if it fails."""
        try:
            return find(yaml.safe_load((self.onto / rel).read_text(encoding="utf-8")))
        except (OSError, yaml.YAMLError, LookupError, StopIteration, AttributeError, TypeError, ValueError,
                SyntaxError) as err:  # fmt: skip
            self.session.error(
                f"{rel} no longer has {what} ({type(err).__name__}: {err}): update the {self.session.name} session"
            )

    def junit(self, report: Path) -> Cases:
        """The cases of a JUnit XML report, without this machine's paths."""
        return records.read_junit(report, self.onto, self.places)

    def both(self, run: Callable[[str], Cases]) -> tuple[Cases, Cases]:
        """``run("branch")`` on the PR branch, then ``run("base")`` on its base."""
        git(self.onto, "checkout", "-q", "--force", self.branch, isolated=False)
        branch = run("branch")
        git(self.onto, "checkout", "-q", "--detach", self.start, isolated=False)
        return branch, run("base")

    def tests(self, options: list[str]) -> tuple[Cases, Cases]:
        """The selection, then its standalone tests one per process, as upstream's CI runs them; branch, then base."""
        unset: dict[str, str | None] = {k: None for k in os.environ if k.startswith(("PL_", "PYTEST_", "COV_"))}
        env = {**unset, "PL_RUN_CUDA_TESTS": "0", "CUDA_VISIBLE_DEVICES": "", "PYTHONHASHSEED": "0"}
        (self.reports / "default_signals.py").write_text(DEFAULT_SIGNALS, encoding="utf-8")
        env["PYTHONPATH"] = os.pathsep.join([str(self.reports), *filter(None, [os.environ.get("PYTHONPATH")])])
        failed_on_branch: list[str] = []

        def collect(tests: list[str], env: dict[str, str | None]) -> list[str]:
            listed = self.session.run("python", "-m", "pytest", "-q", "--collect-only", "-p", "no:cacheprovider",
                                      *tests, env=env, silent=True, success_codes=[0, 1, 5])  # fmt: skip
            return [line.strip() for line in str(listed).splitlines() if "::" in line]

        def run(where: str) -> Cases:
            tests = self.selection
            if where == "base" and self.args.base_runs == "failures":  # a test the patch adds is not on the base
                files = sorted({t.split("::")[0] for t in failed_on_branch if (self.onto / t.split("::")[0]).is_file()})
                on_base = set(collect(files, env)) if files else set()  # one collection of the files, not one a test
                tests = [t for t in failed_on_branch if t in on_base]
                if not tests:
                    return {}
            pytest = [*PYTEST, *options]
            report = self.reports / f"{where}.xml"
            report.unlink(
                missing_ok=True
            )  # a report left by an earlier run of a reused venv (`nox -r`) is not this one
            self.session.run(*pytest, f"--junitxml={report}", *tests, env=env, success_codes=[0, 1])
            cases = self.junit(report)
            if not cases:  # it died before it could report (or collected nothing): nothing to attribute
                self.session.error(f"pytest reported no test of {' '.join(tests)} on the {where}")
            standalone = {**env, "PL_RUN_STANDALONE_TESTS": "1"}
            for i, nodeid in enumerate(collect(tests, standalone)):
                single = self.reports / f"{where}-standalone-{i}.xml"
                single.unlink(missing_ok=True)
                self.session.run(*pytest, f"--junitxml={single}", nodeid, env=standalone, success_codes=range(-64, 256))
                found = self.junit(single)
                cases.update(found or {nodeid: records.Case(nodeid, "failed", "crashed: pytest wrote no report")})
            failed_on_branch[:] = [c.id for c in cases.values() if c.outcome == "failed"]
            return cases

        return self.both(run)

    def record(self, installed: str, command: str, base_runs: str, branch: Cases, base: Cases) -> None:
        """Add the job's record; the session fails if the patch caused a failure."""
        failures = records.attribute(branch.values(), base.values())
        caused = sum(f["caused"] for f in failures)
        self.session.log(f"{self.patch.name} {self.job}: {records.counts(branch.values())}, {caused} caused")
        if self.args.select:  # a part of the job: run, but its record would claim the whole job
            self.session.log("a selection of tests: not recorded")
        else:
            self.add_record(installed, command, base_runs, branch, base, failures)
        if caused:
            self.session.error(f"{caused} failures caused by the patch: see docs/upstream-tests.md")

    def add_record(self, installed: str, command: str, base_runs: str, branch: Cases, base: Cases,
                   failures: list[dict[str, Any]]) -> None:  # fmt: skip
        """The job's record in docs/records/upstream-tests.json, and the page's tables."""
        caused = sum(f["caused"] for f in failures)
        records.add(ROOT, "upstream-tests", {
            "key": f"{self.patch.name} {self.job}", "patch": self.patch.name, "job": self.job,
            "blob": records.blob_hash(self.patch.path), **upstream_context(self.onto, self.start, self.base),
            "installed": installed, "command": command, "base_runs": base_runs,
            "branch": records.counts(branch.values()), "base": records.counts(base.values()),
            "failures": failures, "caused": caused, "seconds": round(time.monotonic() - self.started),
            "fork_commit": self.fork_commit,
        })  # fmt: skip

    def record_tests(self, installed: str, options: list[str]) -> None:
        """Run the tests on both and record them."""
        command = "pytest " + " ".join(self.selection) + ", their standalone tests one per process"
        base_runs = "the same selection" if self.args.base_runs == "all" else "the tests that failed on the branch"
        self.record(installed, command, base_runs, *self.tests(options))


def _version_of(session: nox.Session, dist: str) -> str:
    code = f"import importlib.metadata as m; print(m.version({dist!r}))"
    if dist == "torch":  # as torch reports itself, with its build (``+cu128``), which the wheel's metadata lacks
        code = "import torch; print(torch.__version__)"
    return str(session.run("python", "-c", code, silent=True)).strip()


def _install_upstream(job: Upstream, constraints: list[str]) -> str:
    """The checkout editable with its test extras, as upstream's CI installs it; says what was installed."""
    extras = ",".join(EXTRAS[job.package])
    job.session.install("-e", f".[{extras}]", *constraints, env=CI_ENV)
    return f"`lightning[{extras}]` with torch {_version_of(job.session, 'torch')}, Python {job.session.python}"


@nox.session(python="3.11")
def upstream_newest(session: nox.Session) -> None:
    """Upstream's tests for what the patch touches, with the newest torch its requirements allow (or --torch)."""
    with Upstream(session, "newest") as job:
        pin = []
        if job.args.torch:  # held through the whole install: upstream's requirements may not replace it
            (job.reports / "torch.txt").write_text(f"torch=={job.args.torch}\n", encoding="utf-8")
            pin = ["-c", str(job.reports / "torch.txt")]
        job.record_tests(_install_upstream(job, pin), [])


def _oldest_pins(job: Upstream) -> tuple[list[str], list[str]]:
    """The files upstream's oldest job pins that the install reads, and their ``>=`` as ``==`` (``set-oldest``)."""

    def find(workflow: Any) -> tuple[str, list[str]]:
        steps = next(iter(workflow["jobs"].values()))["steps"]
        python = next(str(s["with"]["python-version"]) for s in steps if "python-version" in s.get("with", {}))
        script = next(step["run"] for step in steps if "set-oldest" in step.get("run", ""))
        return python, list(ast.literal_eval(re.search(r'--req_files "(\[[^\]]*\])"', script).group(1)))  # type: ignore[union-attr]

    what = "a job whose steps set up Python and run `set-oldest --req_files [...]`"
    python, files = job.read(f".github/workflows/ci-tests-{job.package}.yml", what, find)
    if f"|| '{job.session.python}'" not in python:  # the oldest entry names no Python: it takes the default
        job.session.error(f"upstream's oldest job runs Python {python!r}, not {job.session.python}: update the session")
    # only the files the install reads: base.txt and the extras' (a file it does not install pins nothing there, and
    # must not here: torchmetrics has a lower bound of its own in base.txt)
    read = [f for f in files if Path(f).stem in {"base", *(extra.split("-", 1)[1] for extra in EXTRAS[job.package])}]
    pins = []
    for line in (raw for rel in read for raw in (job.onto / rel).read_text(encoding="utf-8").splitlines()):
        spec, _, marker = line.split(" #", 1)[0].strip().partition(";")
        if ">=" in spec and not spec.startswith(("#", "-")):  # set-oldest's str.replace(">=", "=="), markers too
            spec = re.sub(r"\[[^\]]*\]", "", spec.replace(">=", "==")).replace(" ", "")  # constraints name no extras
            pins.append(spec + (f"; {marker.strip().replace('>=', '==')}" if marker else ""))
    return read, pins


@nox.session(python="3.10")
def upstream_oldest(session: nox.Session) -> None:
    """The same tests as upstream's ``requires: "oldest"`` job runs them: every ``>=`` of its files pinned as ``==``."""
    with Upstream(session, "oldest") as job:
        read, pins = _oldest_pins(job)
        (job.reports / "oldest.txt").write_text("\n".join(pins) + "\n", encoding="utf-8")
        installed = _install_upstream(job, ["-c", str(job.reports / "oldest.txt")])
        installed += f"; every `>=` of {', '.join(f'`{f}`' for f in read)} pinned as `==` (`set-oldest`)"
        # prune_pytest_as_errors: the oldest job drops the filters that make future and deprecation warnings errors
        config = tomllib.loads((job.onto / "pyproject.toml").read_text(encoding="utf-8"))
        filters = config["tool"]["pytest"]["ini_options"].get("filterwarnings", [])
        kept = [f for f in filters if "error::FutureWarning" not in f and "error::DeprecationWarning" not in f]
        installed += ", pytest's `filterwarnings` without `error::FutureWarning` (`prune_pytest_as_errors`)"
        job.record_tests(installed, ["-o", "filterwarnings=" + "\n".join(kept)])


@nox.session(python="3.11")
def upstream_mypy(session: nox.Session) -> None:
    """``code-checks.yml``'s mypy job: its install and its command; each error one JUnit test case."""
    with Upstream(session, "mypy") as job:

        def find(workflow: Any) -> tuple[str, list[str]]:
            steps = workflow["jobs"]["mypy"]["steps"]
            runs = (line for step in steps for line in step.get("run", "").splitlines())
            install = next(line for line in runs if "pip install" in line)
            return install.strip(), next(step["run"] for step in steps if step.get("name") == "Check typing").split()

        what = "a `mypy` job with a `pip install` step and a `Check typing` step"
        install, command = job.read(".github/workflows/code-checks.yml", what, find)
        if command[:1] != ["mypy"]:
            session.error(f"upstream's mypy step runs {command!r}, not `mypy ...`: update the upstream_mypy session")
        session.install(*shlex.split(install.split("pip install", 1)[1]), env=CI_ENV)
        cache = Path(session.virtualenv.location) / "mypy-cache"  # the base reuses what the branch run left

        def run(where: str) -> Cases:
            said = session.run(
                "mypy", f"--cache-dir={cache}", "-O", "json", *command[1:], silent=True, success_codes=[0, 1]
            )
            errors = [json.loads(line) for line in str(said).splitlines() if line.startswith("{")]
            found = [(e["file"], e["code"] or "error", e["message"]) for e in errors if e["severity"] == "error"]
            plain = [line for line in str(said).splitlines() if not line.startswith("{") and "error" in line.lower()]
            if plain and not found:  # mypy failed without an error of the code (its config, a crash): no pass
                session.error(f"mypy on the {where} reported no error of the code but said: {plain[-1]}")
            records.write_junit(job.reports / f"{where}.xml", "mypy", found)
            return job.junit(job.reports / f"{where}.xml")

        versions = (
            f"mypy {_version_of(session, 'mypy')}, torch {_version_of(session, 'torch')}, Python {session.python}"
        )
        command_text = f"`{' '.join(command)}` in the checkout"
        job.record(f"`{install}`: {versions}", command_text, "the same command", *job.both(run))


@nox.session(python="3.11")
def upstream_ruff(session: nox.Session) -> None:
    """``ruff check`` and ``ruff format --check`` at the pre-commit hooks' version, on every tracked Python file."""
    with Upstream(session, "ruff") as job:

        def find(config: Any) -> str:
            return str(next(r["rev"] for r in config["repos"] if r["repo"].endswith("/ruff-pre-commit"))).lstrip("v")

        rev = job.read(".pre-commit-config.yaml", "a `ruff-pre-commit` repository with its `rev`", find)
        session.install(f"ruff=={rev}")

        def run(where: str) -> Cases:
            checked, formatted = job.reports / f"{where}.xml", job.reports / f"{where}-format.xml"
            checked.unlink(missing_ok=True)  # ruff writes it: one left by a reused venv's run (`nox -r`) is not this
            # `.`: the files ruff finds in the clean checkout are the tracked ones; its configuration excludes the rest
            session.run("ruff", "check", "--no-cache", "--no-fix", "--output-format=junit", f"--output-file={checked}",
                        ".", success_codes=[0, 1])  # fmt: skip
            said = session.run("ruff", "format", "--no-cache", "--check", ".", silent=True, success_codes=[0, 1])
            unformatted = [line.removeprefix("Would reformat: ") for line in str(said).splitlines()]
            findings = [(f, "format", "would be reformatted") for f in unformatted if f.endswith(PYTHON)]
            records.write_junit(formatted, "ruff format", findings)
            cases = {**job.junit(checked), **job.junit(formatted)}
            return {key: case for key, case in cases.items() if case.outcome != "passed"}  # ruff's "No errors found"

        command = (
            "`ruff check .` and `ruff format --check .` in the checkout, as `pre-commit run --all-files` runs them"
        )
        job.record(f"ruff {rev} (`.pre-commit-config.yaml`'s `ruff-pre-commit` rev)", command, "the same command",
                   *job.both(run))  # fmt: skip
