"""What upstream's CI runs on a pull request, read from the upstream checkout's own configuration.

``upstream-tests`` reproduces three of upstream's jobs besides its test run with the newest torch, and takes each
command and pin from the files that define them, so that a change upstream changes what is run here:

- the ``mypy`` job of ``.github/workflows/code-checks.yml``: its Python, the extras it installs with
  ``requirements/typing.txt`` (which pins mypy and torch), and its command;
- the ruff hooks of ``.pre-commit-config.yaml``: the version of ``ruff-pre-commit`` (its ``rev`` is ruff's version);
- the ``requires: "oldest"`` job of ``ci-tests-<package>.yml``: its Python and the requirement files in which
  ``lightning_utilities.cli requirements set-oldest`` turns every ``>=`` into ``==``.

The files are YAML, read here with regular expressions for the few values needed (the tool keeps to the standard
library); a workflow that no longer has the expected shape is one clear error naming the file and what was looked for.
"""

from __future__ import annotations

import ast
import re
import sys
from dataclasses import dataclass
from pathlib import Path

from patchset import PatchsetError

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - Python 3.10
    import tomli as tomllib

CODE_CHECKS = Path(".github/workflows/code-checks.yml")
PRE_COMMIT = Path(".pre-commit-config.yaml")
_RUFF_HOOKS = "https://github.com/astral-sh/ruff-pre-commit"


def _read(onto: Path, rel: Path) -> str:
    path = onto / rel
    if not path.is_file():
        raise PatchsetError(f"{rel} is missing in {onto}: is it a checkout of upstream Lightning?")
    return path.read_text(encoding="utf-8")


def _find(pattern: str, text: str, rel: Path, what: str) -> re.Match[str]:
    match = re.search(pattern, text, flags=re.S | re.M)
    if match is None:
        raise PatchsetError(f"{rel} no longer has {what} where upstream-tests looks for it; update upstream_ci.py")
    return match


@dataclass(frozen=True)
class MypyJob:
    """The ``mypy`` job of ``code-checks.yml``."""

    python: str  # "3.11"
    extras: str  # "pytorch-all,fabric-all"
    requirements: str  # "requirements/typing.txt"
    command: list[str]  # ["mypy"]


def mypy_job(onto: Path) -> MypyJob:
    """How upstream's ``code-checks.yml`` installs and runs mypy."""
    text = _read(onto, CODE_CHECKS)
    job = _find(r"^  mypy:\n(.*?)(?=^  \S|\Z)", text, CODE_CHECKS, "a `mypy` job").group(1)
    python = _find(r'python-version:\s*"?([\d.]+)"?', job, CODE_CHECKS, "the mypy job's python-version").group(1)
    install = _find(
        r"pip install '\.\[([\w,-]+)\]' -r (\S+)", job, CODE_CHECKS, "the mypy job's `pip install '.[...]' -r ...`"
    )
    run = _find(r"name: Check typing\n\s+run: ([^\n]+)$", job, CODE_CHECKS, "the `Check typing` step").group(1)
    return MypyJob(python, install.group(1), install.group(2), run.split())


def ruff_version(onto: Path) -> str:
    """The ruff release upstream's pre-commit hooks run (``ruff-pre-commit``'s ``rev``, without its ``v``)."""
    text = _read(onto, PRE_COMMIT)
    rev = _find(rf"repo: {re.escape(_RUFF_HOOKS)}\s*\n\s*rev: v?([\w.]+)", text, PRE_COMMIT, "the ruff hooks' rev")
    return rev.group(1)


@dataclass(frozen=True)
class OldestJob:
    """The ``requires: "oldest"`` job of ``ci-tests-<package>.yml``."""

    python: str  # "3.10"
    requirement_files: list[str]  # the files set-oldest rewrites


def oldest_job(onto: Path, package: str) -> OldestJob:
    """How upstream's oldest-requirements job for ``package`` (``fabric`` or ``pytorch``) sets its pins."""
    rel = Path(f".github/workflows/ci-tests-{package}.yml")
    text = _read(onto, rel)
    _find(r'requires:\s*"oldest"', text, rel, 'a `requires: "oldest"` entry in the matrix')
    # the oldest entry names no python-version: it takes the default of the setup step
    python = _find(r"python-version: \$\{\{ matrix\.config\.python-version \|\| '([\d.]+)' \}\}", text, rel, "it")
    files = _find(r"requirements set-oldest\s*\\\s*--req_files \"(\[[^\]]*\])\"", text, rel, "set-oldest --req_files")
    return OldestJob(python.group(1), list(ast.literal_eval(files.group(1))))


def oldest_constraints(onto: Path, files: list[str]) -> str:
    """Pip constraints equivalent to ``set-oldest`` on ``files``: every requirement with a ``>=`` becomes ``==``.

    Upstream's job rewrites the files in its checkout (``str.replace(">=", "==")`` on the whole text, markers
    included, which is why it runs on Python 3.10: ``python_version >= "3.10"`` becomes ``== "3.10"``). A constraint
    holds the same pin without touching the checkout, which stays clean for the branch and the base; extras are
    dropped, as pip constraints cannot name them.
    """
    lines = []
    for rel in files:
        for raw in _read(onto, Path(rel)).splitlines():
            requirement = raw.split(" #", 1)[0].strip()
            spec, _, marker = requirement.partition(";")
            if ">=" not in spec or requirement.startswith(("#", "-")):
                continue  # a `>=` in the marker alone pins nothing (and stays true on the job's own Python)
            spec, marker = spec.replace(">=", "=="), marker.replace(">=", "==")
            spec = re.sub(r"\[[^\]]*\]", "", spec).replace(" ", "")
            lines.append(spec + (f"; {marker.strip()}" if marker else ""))
    return "\n".join(lines) + "\n"


def oldest_filterwarnings(onto: Path) -> list[str]:
    """The pytest ``filterwarnings`` after ``.actions/assistant.py prune_pytest_as_errors``, as the oldest job has.

    It drops every ``error::FutureWarning`` and ``error::DeprecationWarning`` from ``pyproject.toml``'s list; the run
    here passes the result with ``-o filterwarnings=...`` instead of editing the checkout.
    """
    config = tomllib.loads(_read(onto, Path("pyproject.toml")))
    filters = config.get("tool", {}).get("pytest", {}).get("ini_options", {}).get("filterwarnings", [])
    return [f for f in filters if not any(f"error::{kind}" in f for kind in ("FutureWarning", "DeprecationWarning"))]
