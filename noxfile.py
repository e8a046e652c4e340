"""The fork's tests against each torch release, the lint checks, and a patch's upstream tests (``nox -l``).

Environment: TORCH_INDEX_URL (an extra index for torch), TORCH_MATRIX_WHEELHOUSE (a folder torch is downloaded into
once), TORCH_MATRIX_RESULTS (a folder a full tests/oldest run writes its result into), UPSTREAM_CHECKOUT (--onto).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import platform
import re
import sys
import time
import xml.etree.ElementTree as ET
from collections import Counter
from pathlib import Path

import nox

ROOT = Path(__file__).resolve().parent
sys.path.insert(0, str(ROOT / "tools"))  # the patch set's tool, from this checkout
from patchset import PatchsetError, build_label, pin  # noqa: E402
from patchset.gitops import check_checkout, current_branch, git, out  # noqa: E402
from patchset.pr_text import UPSTREAM_RUNS  # noqa: E402
from patchset.series import find_patch  # noqa: E402
from patchset.upstream_pr import upstream_pr  # noqa: E402

nox.options.default_venv_backend = "venv"
nox.options.sessions = ["tests(torch='2.13.0')"]

TORCH = [  # every minor release from the oldest Lightning 2.6 supports, its newest patch; as ci-tests-fork.yml
    "2.1.2", "2.2.2", "2.3.1", "2.4.1", "2.5.1", "2.6.0", "2.7.1", "2.8.0", "2.9.1", "2.10.0", "2.11.0", "2.12.1",
    "2.13.0", "2.14.1", "2.15.0",
]  # fmt: skip
TEST_COMMAND = ["python", "-m", "pytest", "-n", "2", "--cov", "--cov-report=term"]  # README, .ci/run
UNPATCHED = ["pytorch-lightning", "lightning-fabric"]
INDEX = ["--extra-index-url", os.environ["TORCH_INDEX_URL"]] if os.environ.get("TORCH_INDEX_URL") else []

CHECK_INSTALL = """
import importlib.metadata as md, importlib.util, pathlib, sys, torch, lightning
want, fork = sys.argv[1:3]
assert torch.__version__.split("+")[0] == want, f"torch {torch.__version__} installed, the session wants {want}"
root = pathlib.Path(lightning.__file__).resolve().parent
assert "site-packages" in root.parts, f"lightning imported from {root}, not from the installed fork"
assert lightning.__version__ == fork, f"lightning {lightning.__version__} is not the fork's {fork}"
unpatched = {d.metadata["Name"].lower() for d in md.distributions()} & {"pytorch-lightning", "lightning-fabric"}
assert not unpatched, f"the unpatched {unpatched} distribution is installed"
assert not [n for n in ("pytorch_lightning", "lightning_fabric") if importlib.util.find_spec(n)], "unpatched copy"
print(f"torch {torch.__version__}, lightning {lightning.__version__} from {root}")
"""
PROBE = "import sys, torch; print(torch.__version__, sys.version.split()[0])"


def junit(report: Path) -> dict[str, str]:
    """Each test of a JUnit XML report (xunit1: a case names its file) by node id: passed, failed or skipped."""
    cases: dict[str, str] = {}
    for case in ET.parse(report).iter("testcase") if report.is_file() else ():
        tags = {child.tag for child in case}
        outcome = "failed" if tags & {"failure", "error"} else "skipped" if "skipped" in tags else "passed"
        file, classname = case.get("file") or "", case.get("classname", "")
        module = file.removesuffix(".py").replace("/", ".")
        classes = classname[len(module) + 1 :].split(".") if file and classname.startswith(module + ".") else []
        node = "::".join([file or classname, *classes, case.get("name", "")])
        cases[node] = outcome if cases.get(node) != "failed" else "failed"  # a teardown error keeps its failure
    return cases


def _install_fork(session: nox.Session, torch: str) -> str:
    """Torch, the test requirements and the fork (``pip install .``), no unpatched copy; the commit it was built at."""
    dirty = out(ROOT, "status", "--porcelain", "--untracked-files=no", "--", ".", ":(exclude)docs")  # docs aside
    commit = out(ROOT, "rev-parse", "HEAD") + ("+dirty" if dirty else "")  # what the session tests
    pins = [f"torch=={torch}"] + (["numpy<2"] if [int(n) for n in torch.split(".")[:2]] < [2, 4] else [])
    (Path(session.create_tmp()) / "constraints.txt").write_text("\n".join(pins) + "\n", encoding="utf-8")
    if wheelhouse := os.environ.get("TORCH_MATRIX_WHEELHOUSE"):  # pip download skips what it holds: torch comes once
        session.run("python", "-m", "pip", "download", "--dest", wheelhouse, *pins, *INDEX)
        session.install("--no-index", "--find-links", wheelhouse, *pins)
    else:
        session.install(*pins, *INDEX)
    session.install("-r", "tests/requirements.txt", ".", "-c", str(Path(session.create_tmp()) / "constraints.txt"))
    session.run("python", "-m", "pip", "uninstall", "--yes", *UNPATCHED)
    return commit


def _test(session: nox.Session, torch: str, commit: str) -> None:
    """The test command; one summary line, and the result in ``$TORCH_MATRIX_RESULTS`` after a full run."""
    session.run("python", "-c", CHECK_INSTALL, torch, build_label.build_pin(ROOT, pin.read_pin(ROOT)).fork_version)
    tmp, started, ok = Path(session.create_tmp()).resolve(), time.monotonic(), True
    (report := tmp / "junit.xml").unlink(missing_ok=True)
    try:  # the session's own coverage file: the repository root stays clean and cells can run side by side
        env = {"COVERAGE_FILE": str(tmp / ".coverage")}
        session.run(*TEST_COMMAND, f"--junitxml={report}", "-o", "junit_family=xunit1", *session.posargs, env=env)
    except nox.command.CommandFailed:
        ok = False
    counts = Counter(junit(report).values())
    torch_version, python = str(session.run("python", "-c", PROBE, silent=True)).split()
    result = {
        "session": session.name, "torch": torch_version, "python": python, "commit": commit,
        "platform": f"{platform.system()} {platform.machine()}", "passed": counts["passed"], "failed": counts["failed"],
        "skipped": counts["skipped"], "seconds": round(time.monotonic() - started),
    }  # fmt: skip
    session.log(" ".join(f"{k}={v}" for k, v in result.items()))
    if (folder := os.environ.get("TORCH_MATRIX_RESULTS")) and not session.posargs:  # a full run: a cell of the matrix
        os.makedirs(folder, exist_ok=True)
        slug = re.sub(r"[^\w.]+", "-", session.name).strip("-")
        Path(folder, f"{slug}.json").write_text(json.dumps(result, indent=1) + "\n", encoding="utf-8")
    if not ok or not counts["passed"]:
        session.error(f"the test command failed: {dict(counts)}")


@nox.session
@nox.parametrize("torch", TORCH)
def tests(session: nox.Session, torch: str) -> None:
    """The test suite against the fork installed with this torch release."""
    _test(session, torch, _install_fork(session, torch))


OLDEST_REQUIREMENTS = """
import importlib.metadata, re
for req in importlib.metadata.requires("lightning") or []:
    low = re.match(r"([A-Za-z0-9_.-]+)(\\[[^]]*\\])?[^;]*?>=\\s*([\\w.]+)[^;]*$", req)  # with a marker: an extra's
    if low and low.group(1).lower() != "torch":  # the session pins torch itself
        print(f"{low.group(1)}=={low.group(3)}")
"""


@nox.session
def oldest(session: nox.Session) -> None:
    """The oldest torch with the lowest versions of lightning's requirements that the fork declares."""
    commit, constraints = _install_fork(session, TORCH[0]), Path(session.create_tmp()) / "constraints.txt"
    lowest = str(session.run("python", "-c", OLDEST_REQUIREMENTS, silent=True)).split()
    constraints.write_text(constraints.read_text(encoding="utf-8") + "\n".join(lowest) + "\n", encoding="utf-8")
    session.install("-r", "tests/requirements.txt", ".", *lowest, "-c", str(constraints))
    session.run("python", "-m", "pip", "uninstall", "--yes", *UNPATCHED)
    session.run("python", "-m", "pip", "check")
    _test(session, TORCH[0], commit)


# pinned (each release of either has new rules); pytest, whose types our testing helpers use; the default session's
# torch, to type-check our src/lightning modules
LINTERS = ["ruff==0.17.6", "mypy==2.4.1", "pytest==9.2.0"]
MYPY_OUR_MODULES = """
import os, pathlib, subprocess, sys
from patchset.materialize import build_tree
tree = build_tree(pathlib.Path("."), pathlib.Path(sys.argv[1]))
files = subprocess.run(["git", "ls-files", "src/lightning/*.py"], capture_output=True, text=True, check=True).stdout
modules = [a for f in files.split() for a in ("-m", f.removeprefix("src/").removesuffix(".py").replace("/", "."))]
args = ["mypy", "--install-types", "--non-interactive", "--follow-imports=silent", *modules]
# upstream's mypy settings (its pyproject.toml) apply: mypy runs in the patched tree, where lightning.* is the fork's
sys.exit(subprocess.run(args, cwd=tree, env={**os.environ, "MYPYPATH": "src"}).returncode if modules else 0)
"""


@nox.session
def lint(session: nox.Session) -> None:
    """The series (re-export byte-identical, zero fuzz), ruff, mypy on the tool and on our modules."""
    tools = {"PYTHONPATH": str(ROOT / "tools")}
    session.install(*LINTERS)
    session.run("python", "-m", "patchset", "export", "--check", env=tools)  # on failure: the diff to `git apply`
    session.run("python", "-m", "patchset", "check", env=tools)
    session.run("ruff", "check", ".")
    session.run("ruff", "format", "--check", "--diff", ".")
    session.run("mypy", "--strict", "-p", "patchset", env={"MYPYPATH": str(ROOT / "tools")})
    session.install("torch==2.13.0", ".", *INDEX)
    session.run("python", "-m", "pip", "uninstall", "--yes", *UNPATCHED)
    session.run("python", "-c", MYPY_OUR_MODULES, str(Path(session.create_tmp()) / "tree"), env=tools)


# upstream's ci-tests-<package>.yml CPU tests; pytorch's: what a checkpointing change touches (all: hours on 2 cores)
PYTORCH = ["checkpointing", "callbacks", "trainer/connectors", "core", "loops", "trainer/optimization"]
SELECTIONS = {"fabric": ["tests_fabric"], "pytorch": [f"tests_pytorch/{d}" for d in PYTORCH]}
EXTRAS = {"fabric": "fabric-test,fabric-strategies", "pytorch": "pytorch-extra,pytorch-test,pytorch-strategies"}
# -p default_signals: the default handlers back (a background shell ignores some, which upstream's signal tests need)
SIGNALS = "from signal import *\nfor n in (SIGHUP, SIGINT, SIGTERM, SIGUSR1):\n    signal(n, SIG_DFL)\n"


@nox.session
def upstream(session: nox.Session) -> None:
    """A patch's PR branch through upstream's CI tests; the failures re-run on its base: those the patch caused."""
    parser = argparse.ArgumentParser(prog="nox -s upstream --")
    parser.add_argument("patch", help="its number or file name, e.g. 0006")
    parser.add_argument("--onto", default=os.environ.get("UPSTREAM_CHECKOUT"), help="upstream Lightning's checkout")
    parser.add_argument("--base", help="where the first PR branch starts (default: upstream's default branch)")
    parser.add_argument("--tests", nargs="+", help="paths or node ids under tests/ instead of the package's")
    parser.add_argument("--torch", help="this torch release (upper bounds relaxed, as upstream's CI does for one)")
    args = parser.parse_args(session.posargs)
    tmp, started, on_base, original = Path(session.create_tmp()).resolve(), time.monotonic(), {}, ""
    fork = out(ROOT, "rev-parse", "--short", "HEAD")
    (tmp / "default_signals.py").write_text(SIGNALS, encoding="utf-8")
    (tmp / "torch.txt").write_text(f"torch=={args.torch}\n" if args.torch else "", encoding="utf-8")
    unset = {k: None for k in os.environ if k.startswith(("PL_", "PYTEST_"))}  # a maintainer's settings
    env = {**unset, "PYTHONPATH": str(tmp), "CUDA_VISIBLE_DEVICES": ""}
    pytest = ["python", "-m", "pytest", "-p", "default_signals", "-p", "no:cacheprovider"]
    try:
        if not args.onto:
            raise PatchsetError("no upstream checkout: pass --onto CHECKOUT or set UPSTREAM_CHECKOUT")
        check_checkout(onto := Path(args.onto).resolve())
        patch, original = find_patch(ROOT, args.patch), current_branch(onto)
        if not patch.upstreamable:
            raise PatchsetError(f"{patch.name} is fork packaging (Forwarded: not-needed): it has no upstream PR")
        if (package := patch.subject.split(":", 1)[0].strip()) not in SELECTIONS:
            raise PatchsetError(f"{patch.name}: its subject names no package (`fabric:` or `pytorch:`)")
        chain = [patch]  # the PR branches of the patches it depends on first: each is the next one's base
        while depends := chain[-1].field("Depends-On"):
            chain.append(find_patch(ROOT, depends))
        branches = [upstream_pr(ROOT, p.name, onto, base=None if p.field("Depends-On") else args.base, force=True)
                    for p in reversed(chain)]  # fmt: skip  # the first at --base, or upstream's default branch
        base, start = (out(onto, "rev-parse", "--short", f"{b}~1", isolated=False) for b in (branches[-1], branches[0]))
        # as upstream's CI installs a pull request: frozen requirements, their upper bounds relaxed for another torch
        ci_env = {"PACKAGE_NAME": "lightning", "FREEZE_REQUIREMENTS": "0" if args.torch else "1"}
        session.install("-e", f"{onto}[{EXTRAS[package]}]", "setuptools<80.10.3", "-c", str(tmp / "torch.txt"),
                        *INDEX, env=ci_env)  # fmt: skip  # editable: one venv serves the branch and its base
        if package == "pytorch":  # upstream's CI: "Drop PL for LAI" (the lightning package requires it)
            session.run("python", "-m", "pip", "uninstall", "--yes", "pytorch-lightning")
        torch = str(session.run("python", "-c", "import torch; print(torch.__version__)", silent=True)).strip()
        flags = ["-v", f"--timeout={60 if package == 'fabric' else 90}", "--durations=50", "-o", "junit_family=legacy"]
        with session.chdir(onto / "tests" / f"tests_{package}"):  # where upstream's CI runs them
            tests = [str(onto / "tests" / t) for t in args.tests or SELECTIONS[package]]
            session.run(*pytest, *flags, f"--junitxml={tmp / 'branch.xml'}", *tests, env=env, success_codes=[0, 1])
            on_branch = junit(tmp / "branch.xml")
            failed = [node for node, outcome in on_branch.items() if outcome == "failed"]
            if failed:  # on the base, those of them it has (a test the patch adds is not there), collected once
                git(onto, "checkout", "-q", "--detach", base, isolated=False)
                files = sorted({str(onto / n.split("::")[0]) for n in failed if (onto / n.split("::")[0]).is_file()})
                said = session.run(*pytest, "--collect-only", "-q", *files, env=env, silent=True,
                                   success_codes=[0, 1, 2, 5]) if files else ""  # fmt: skip
                if rerun := [str(onto / n) for n in failed if n in {ln.strip() for ln in str(said).splitlines()}]:
                    session.run(*pytest, *flags, f"--junitxml={tmp / 'base.xml'}", *rerun, env=env,
                                success_codes=[0, 1])  # fmt: skip
                    on_base = junit(tmp / "base.xml")
    except PatchsetError as err:
        session.error(str(err))
    finally:
        if original:
            git(onto, "checkout", "-q", "--force", original, isolated=False)
    number, caused = patch.name[:4], sum(on_base.get(n) != "failed" for n in failed)
    counted = ", ".join(f"{list(on_branch.values()).count(k)} {k}" for k in ("passed", "failed", "skipped"))
    result = f"`nox -s upstream -- {number}` at {fork} on upstream {start} with torch {torch}: {counted}"
    print(f"{patch.name}: {' on '.join(reversed(branches))} (base {base})\n{result}")
    for n in failed:
        print(f"  FAILED {n}: {on_base.get(n, 'absent')} on the base{'' if on_base.get(n) == 'failed' else ', caused'}")
    print(f"caused by {number}: {caused} ({round(time.monotonic() - started)} s)", flush=True)
    if not args.tests:  # the whole selection: the PR text's answer on tests (in .work/, never committed)
        (saved := ROOT / UPSTREAM_RUNS / f"{number}.txt").parent.mkdir(parents=True, exist_ok=True)
        saved.write_text(f"{hashlib.sha256(patch.data).hexdigest()}\n{result}\n{caused}\n", encoding="utf-8")
    if caused or not on_branch:
        session.error(f"{caused} failures caused by {number}" if caused else "pytest reported no test")
