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

import os
import re
import sys
import time
from pathlib import Path

import nox

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
    sys.path.insert(0, str(ROOT / "tools"))
    try:
        from patchset.build_label import build_pin
        from patchset.pin import read_pin
    finally:
        sys.path.remove(str(ROOT / "tools"))
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
    # the recorder reports the session's wall time (install included) and what this session downloaded
    session.env["TORCH_MATRIX_SESSION_START"] = repr(time.time())
    # the commit the fork is built from, recorded with the result (the checkout may move on while the suite runs)
    commit = session.run("python", ".ci/torch_matrix.py", "commit", silent=True)
    session.env["TORCH_MATRIX_COMMIT"] = commit.strip() if isinstance(commit, str) else ""
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


def _check_and_test(session: nox.Session, torch: str, kind: str) -> None:
    session.run("python", "-c", CHECK_INSTALL, torch, _fork_version())
    session.run("python", "-m", "pip", "list", "--format=freeze", silent=False)
    logs = ROOT / ".nox" / "torch-matrix-logs"
    logs.mkdir(parents=True, exist_ok=True)
    record = ["python", ".ci/torch_matrix.py", "record", "--kind", kind, "--session", session.name, "--torch", torch]
    record += ["--log", str(logs / f"{kind}-{torch}.log"), "--commit", session.env.get("TORCH_MATRIX_COMMIT") or ""]
    if session.posargs:  # a subset of the suite: run it, but keep it out of the table
        record.append("--no-record")
    # the session's own coverage data file: the repository root stays clean and cells can run side by side
    coverage_file = Path(session.create_tmp()) / ".coverage"
    session.run(*record, "--", *TEST_COMMAND, *session.posargs, env={"COVERAGE_FILE": str(coverage_file)})


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
    lowest = session.run("python", ".ci/torch_matrix.py", "oldest-requirements", silent=True)
    assert isinstance(lowest, str)
    session.log("lowest requirements: " + " ".join(lowest.split()))
    # the lowest versions join the constraints and the test requirements are resolved again against them: installed
    # over the newest, they left pytest 9 with packaging 23.0, below what it requires, and pkg_resources (which
    # lightning-utilities 0.10 asks) then denied that pytest-rerunfailures was installed at all
    with constraints.open("a", encoding="utf-8") as f:
        f.write("".join(re.sub(r"\[[^\]]*\]", "", req) + "\n" for req in lowest.split()))  # no extras in constraints
    # the fork too, so that its other requirements (torchmetrics needs a newer lightning-utilities) are resolved again
    session.install("-r", "tests/requirements.txt", ".", *lowest.split(), "-c", str(constraints))
    session.run("python", "-m", "pip", "uninstall", "--yes", *UNPATCHED)
    session.run("python", "-m", "pip", "check")  # every installed distribution's requirements hold
    _check_and_test(session, OLDEST, "oldest")


@nox.session(venv_backend="none")
def matrix_table(session: nox.Session) -> None:
    """Rewrite docs/torch-matrix.md from the results it holds (no test run)."""
    session.run("python", ".ci/torch_matrix.py", "render")


# What the lint session installs: the linters (newest, as ci-checks.yml always took them) and, for type-checking our
# src/lightning modules against the fork's own code, the default session's torch.
LINTERS = ["ruff", "mypy"]
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
