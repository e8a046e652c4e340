"""Upstream's static checks on a checkout: mypy as ``code-checks.yml`` runs it, ruff as the pre-commit hooks run it.

Each check gives a list of :class:`Finding`. A finding on the PR branch is caused by the patch unless the base has the
same one (same file, code and message: line numbers move with the patch), counted with multiplicity.

Ruff runs on every tracked Python file of the tree (``git ls-files``: ``.py``, ``.pyi``, ``.ipynb``, what the hooks'
``types_or`` selects), with ``--force-exclude``, as ``pre-commit run --all-files`` (what pre-commit.ci runs on a pull
request) passes them: the whole tree rather than only the patch's files, so that the base gives the pre-existing
findings to compare with, and a finding the patch causes in a file it does not touch (an import sorted differently
because a new module appeared) is not missed. It takes under a minute. ``ruff check`` reports findings without
fixing them (the hooks' ``--fix`` would rewrite the checkout; a fixable finding is still one the PR must fix), and
``ruff format --check`` names each file that would be reformatted.
"""

from __future__ import annotations

import json
import re
import subprocess
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

from patchset import PatchsetError
from patchset.gitops import out

_MYPY_LINE = re.compile(
    r"^(?P<path>[^:\n]+):(?P<line>\d+)(?::\d+)?: error: (?P<message>.*?)(?:  \[(?P<code>[\w-]+)\])?$"
)
_PYTHON_FILES = (".py", ".pyi", ".ipynb")


@dataclass
class Finding:
    """One finding of a static check: where, its code (``F401``, ``arg-type``) and its message."""

    path: str
    line: int
    code: str
    message: str

    @property
    def key(self) -> tuple[str, str, str]:
        """What identifies it on the branch and on the base, whatever line it moved to."""
        return self.path, self.code, self.message


def attribute(branch: list[Finding], base: list[Finding]) -> list[tuple[Finding, bool]]:
    """Each finding on the branch, with whether the patch caused it (the base lacks it, counted per occurrence)."""
    left = Counter(f.key for f in base)
    attributed = []
    for finding in sorted(branch, key=lambda f: (f.path, f.line, f.code)):
        attributed.append((finding, left[finding.key] == 0))
        left[finding.key] -= 1
    return attributed


def parse_mypy(output: str) -> list[Finding]:
    """The errors of mypy's normal output (``path:line: error: message  [code]``); notes are not findings."""
    findings = []
    for line in output.splitlines():
        match = _MYPY_LINE.match(line.strip())
        if match:
            findings.append(Finding(match["path"], int(match["line"]), match["code"] or "", match["message"]))
    return findings


def run_mypy(python: Path, onto: Path, command: list[str], cache: Path) -> tuple[list[Finding], str]:
    """Run upstream's mypy command in the checkout (its ``pyproject.toml`` configures it); findings and summary."""
    if command[:1] != ["mypy"]:
        raise PatchsetError(f"upstream's mypy step runs {' '.join(command)!r}, not `mypy ...`; update upstream_ci.py")
    proc = subprocess.run(
        [str(python), "-m", "mypy", f"--cache-dir={cache}", *command[1:]],
        cwd=onto,
        capture_output=True,
        text=True,
    )
    # the errors come on either stream (with upstream's settings, mypy 1.20 writes them to stderr)
    summary = (proc.stdout.strip().splitlines() or [""])[-1]
    findings = parse_mypy(proc.stdout + "\n" + proc.stderr)
    if proc.returncode not in (0, 1) or (proc.returncode == 1 and not findings):
        raise PatchsetError(f"mypy could not check {onto} (exit code {proc.returncode}):\n{proc.stderr[-2000:]}")
    return findings, summary


def python_files(onto: Path) -> list[str]:
    """The tracked files that the ruff hooks select (their ``types_or: [python, pyi, jupyter]``)."""
    return [f for f in out(onto, "ls-files", "-z", isolated=False).split("\0") if f.endswith(_PYTHON_FILES)]


def parse_ruff_check(output: str, onto: Path) -> list[Finding]:
    """``ruff check --output-format=json``'s findings, paths relative to the checkout."""
    findings = []
    for item in json.loads(output or "[]"):
        path = Path(item["filename"])
        rel = path.relative_to(onto).as_posix() if path.is_absolute() and path.is_relative_to(onto) else str(path)
        fixable = " (fixable)" if item.get("fix") else ""
        code = item.get("code") or "syntax"
        findings.append(Finding(rel, int(item["location"]["row"]), code, item["message"] + fixable))
    return findings


def parse_ruff_format(output: str) -> list[Finding]:
    """``ruff format --check``'s ``Would reformat: <path>`` lines, one finding per file."""
    prefix = "Would reformat: "
    lines = [line.strip() for line in output.splitlines()]
    return [
        Finding(line[len(prefix) :], 0, "format", "would be reformatted") for line in lines if line.startswith(prefix)
    ]


def run_ruff(python: Path, onto: Path) -> tuple[list[Finding], str]:
    """``ruff check`` and ``ruff format --check`` on the tree's Python files; findings and a summary."""
    files = python_files(onto)
    ruff = [str(python), "-m", "ruff"]
    check = subprocess.run(
        [*ruff, "check", "--force-exclude", "--no-cache", "--no-fix", "--output-format=json", *files],
        cwd=onto,
        capture_output=True,
        text=True,
    )
    if check.returncode not in (0, 1):
        raise PatchsetError(f"ruff check failed in {onto} (exit code {check.returncode}):\n{check.stderr[-2000:]}")
    fmt = subprocess.run(
        [*ruff, "format", "--force-exclude", "--no-cache", "--check", *files], cwd=onto, capture_output=True, text=True
    )
    if fmt.returncode not in (0, 1):
        raise PatchsetError(f"ruff format failed in {onto} (exit code {fmt.returncode}):\n{fmt.stderr[-2000:]}")
    checked, formatted = parse_ruff_check(check.stdout, onto), parse_ruff_format(fmt.stdout)
    summary = f"{len(checked)} from `ruff check`, {len(formatted)} files `ruff format --check` would reformat"
    return checked + formatted, summary
