"""The venvs ``upstream-tests`` runs upstream's jobs in, made as upstream's CI makes them and cached.

One mechanism, :func:`cached_venv`, makes each of them: a venv from a given Python, a list of pip steps, kept under
the patch set's cache in a directory named after everything that went into it (the checkout, the requirement files'
contents, the pins), so a change upstream makes a new one and a second run reuses it.

- ``newest``: the checkout editable with the test extras, pinned as ``requirements/<pkg>/*.txt`` pin them (pip takes
  the newest torch they allow), or with ``--torch`` held by a constraint.
- ``oldest``: the same, from the Python of upstream's oldest job, with every ``>=`` of that job's requirement files
  pinned as ``==`` (a constraints file: :func:`patchset.upstream_ci.oldest_constraints`).
- ``mypy``: ``code-checks.yml``'s install, not editable: the extras it names and ``requirements/typing.txt``.
- ``ruff``: the ruff release of upstream's pre-commit hooks.

``FREEZE_REQUIREMENTS=1`` keeps the requirement files' upper bounds, as upstream's CI does on a pull request.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import sys
from pathlib import Path

from patchset import PatchsetError
from patchset.pin import cache_dir
from patchset.upstream_ci import MypyJob, oldest_constraints, oldest_job

# The extras upstream's CI installs, less `strategies` (DeepSpeed and bitsandbytes: CUDA only, their tests skip here).
EXTRAS = {"fabric": ["fabric-test"], "pytorch": ["pytorch-extra", "pytorch-test"]}


def find_python(version: str, given: str | None = None, hint: str = "pass --oldest-python") -> str:
    """An interpreter of Python ``version`` (``3.10``): ``given``, this one if it is that version, else on ``PATH``."""
    if given is None and f"{sys.version_info.major}.{sys.version_info.minor}" == version:
        return sys.executable
    candidate = given or f"python{version}"
    found = "not found"
    if shutil.which(candidate):
        code = "import sys; print('%d.%d' % sys.version_info[:2])"
        proc = subprocess.run([candidate, "-c", code], capture_output=True, text=True, check=False)
        found = f"Python {proc.stdout.strip()}" if proc.returncode == 0 else "not a working interpreter"
        if proc.returncode == 0 and proc.stdout.strip() == version:
            return candidate
    raise PatchsetError(f"upstream's job runs Python {version}; {candidate} is {found}: {hint}")


def _python_of(venv: Path) -> Path:
    return venv / ("Scripts/python.exe" if os.name == "nt" else "bin/python")


def cached_venv(
    name: str,
    key: list[bytes],
    base_python: str,
    steps: list[list[str]],
    env: dict[str, str] | None = None,
    files: dict[str, str] | None = None,
) -> Path:
    """A venv under the cache, made once per ``key``: ``files`` written into it, then each pip ``step`` run.

    ``{venv}`` in a step or a file's text is the venv's directory. A failed step is one error with pip's last words,
    and the venv is not marked complete, so the next run makes it again.
    """
    digest = hashlib.sha256(b"\0".join([name.encode(), base_python.encode(), *key, repr(steps).encode()]))
    venv = cache_dir() / "upstream-venvs" / f"{name}-{digest.hexdigest()[:16]}"
    python = _python_of(venv)
    if (venv / ".complete").is_file():
        return python
    subprocess.run([base_python, "-m", "venv", "--clear", str(venv)], check=True)
    for rel, text in (files or {}).items():
        (venv / rel).write_text(text.replace("{venv}", str(venv)), encoding="utf-8")
    environ = {**os.environ, **(env or {})}
    for step in [["install", "-q", "--upgrade", "pip"], *steps]:
        args = [arg.replace("{venv}", str(venv)) for arg in step]
        proc = subprocess.run([str(python), "-m", "pip", *args], env=environ, capture_output=True, text=True)
        if proc.returncode != 0:
            said = [line for line in proc.stderr.splitlines() if not line.startswith("WARNING: ")]
            raise PatchsetError(f"pip {' '.join(args)} failed:\n" + "\n".join(said)[-2000:])
    (venv / ".complete").write_text("")
    return python


def _requirements(onto: Path) -> list[bytes]:
    return [str(onto).encode(), *(p.read_bytes() for p in sorted((onto / "requirements").rglob("*.txt")))]


_CI_ENV = {"PACKAGE_NAME": "lightning", "FREEZE_REQUIREMENTS": "1"}


def newest_environment(onto: Path, package: str, torch: str | None = None) -> Path:
    """The checkout editable with its test extras; torch the newest its requirements allow, or ``torch``."""
    extras = ",".join(EXTRAS[package])
    files, pin = {}, []
    if torch:  # held through the whole install: upstream's requirements may not replace it
        files["torch-constraint.txt"] = f"torch=={torch}\n"
        pin = ["-c", "{venv}/torch-constraint.txt"]
    try:
        return cached_venv(
            package,
            [*_requirements(onto), (torch or "").encode()],
            sys.executable,
            [["install", "-q", "-e", f"{onto}[{extras}]", *pin]],
            _CI_ENV,
            files,
        )
    except PatchsetError as err:
        hint = f" (does {onto / 'requirements'} allow torch {torch}?)" if torch else ""
        raise PatchsetError(f"{err}{hint}") from err


def oldest_environment(onto: Path, package: str, python: str | None = None) -> Path:
    """The checkout editable with its test extras at the lowest versions, as upstream's oldest job installs them."""
    job = oldest_job(onto, package)
    base = find_python(job.python, python)
    extras = ",".join(EXTRAS[package])
    constraints = oldest_constraints(onto, oldest_files(job.requirement_files, package))
    return cached_venv(
        f"{package}-oldest",
        [*_requirements(onto), constraints.encode()],
        base,
        [["install", "-q", "-e", f"{onto}[{extras}]", "-c", "{venv}/oldest-constraints.txt"]],
        _CI_ENV,
        {"oldest-constraints.txt": constraints},
    )


def oldest_files(files: list[str], package: str) -> list[str]:
    """Those of the oldest job's requirement files that the install reads: ``base.txt`` and the installed extras'.

    Upstream's job rewrites more (``examples.txt``), but installs only some extras; a file it does not install pins
    nothing there, and must not pin here (``torchmetrics`` is in ``base.txt`` with a lower bound of its own).
    """
    read = {"base", *(extra.split("-", 1)[1] for extra in EXTRAS[package])}
    return [f for f in files if Path(f).stem in read]


def mypy_environment(onto: Path, job: MypyJob) -> Path:
    """``code-checks.yml``'s install: the package (not editable) with its extras, and ``requirements/typing.txt``."""
    base = find_python(job.python, hint=f"put a python{job.python} on PATH")
    step = ["install", "-q", f"{onto}[{job.extras}]", "-r", str(onto / job.requirements)]
    return cached_venv("mypy", _requirements(onto), base, [step], _CI_ENV)


def ruff_environment(version: str) -> Path:
    """The ruff release that upstream's pre-commit hooks pin."""
    return cached_venv("ruff", [version.encode()], sys.executable, [["install", "-q", f"ruff=={version}"]])


def installed_version(python: Path, dist: str) -> str:
    """The version of ``dist`` in ``python``'s environment; torch's as it reports itself, with its build (``+cu128``).

    The index's torch wheels carry no local label in their metadata, but ``torch.__version__`` names the build.
    """
    if dist == "torch":
        code = "import torch; print(torch.__version__)"
    else:
        code = f"import importlib.metadata as m; print(m.version({dist!r}))"
    proc = subprocess.run([str(python), "-c", code], capture_output=True, text=True)
    if proc.returncode != 0:
        raise PatchsetError(f"{python} has no {dist}:\n{proc.stderr[-2000:]}")
    return proc.stdout.strip()


def python_version(python: Path) -> str:
    """``3.11`` for a Python 3.11 interpreter."""
    code = "import sys; print('%d.%d' % sys.version_info[:2])"
    return subprocess.run([str(python), "-c", code], capture_output=True, text=True, check=True).stdout.strip()
