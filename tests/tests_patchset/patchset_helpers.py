"""Helpers for the patch set tooling's tests (importable; the fixtures live in conftest.py)."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import sysconfig
import tempfile
from pathlib import Path

import pytest

from patchset import backend
from patchset.pin import read_pin

REPO = Path(__file__).resolve().parents[2]
TOOLS = REPO / "tools"
PROJECT_EMAIL = "maintainers@users.noreply.a-seed-28b837d4.example"  # the project's identity in its patches
FORK = read_pin(REPO).fork_version  # what a copy of this checkout without git history builds, e.g. 2.6.6+patchset.1
DEMO = "src/lightning/fabric/utilities/_patchset_demo.py"  # a new file the tool tests add to a copy of the project
# distribution (as in wheel names) -> the folder that builds it (a git URL's `#subdirectory=`), and where our
# src/lightning files land
DISTRIBUTIONS = {
    "lightning": ("", {"src/lightning/": "lightning/"}),
    "pytorch_lightning": (
        "distributions/pytorch-lightning",
        {"src/lightning/pytorch/": "pytorch_lightning/", "src/lightning/fabric/": "lightning_fabric/"},
    ),
    "lightning_fabric": ("distributions/lightning-fabric", {"src/lightning/fabric/": "lightning_fabric/"}),
}
BUILT_FILES = ("patches", "tools", "src", "distributions", "pyproject.toml")  # what a build of the fork reads


def project_files(root: Path) -> list[str]:
    """The files of this checkout that a fresh clone would have, plus new files not yet committed."""
    listed = subprocess.run(
        ["git", "-C", str(root), "ls-files", "--cached", "--others", "--exclude-standard", "-z"],
        capture_output=True,
        check=True,
    ).stdout.decode()
    return sorted({f for f in listed.split("\0") if f and (root / f).is_file()})


# 0001 owns src/lightning/_patchset.py: the first patch alone needs its one new file
_PROJECT_FILES = (
    "patches", "tools", "pyproject.toml", "README.md", "docs/maintaining.md", "src/lightning/_patchset.py",
)  # fmt: skip


def copy_project(dest: Path, include: tuple[str, ...] = _PROJECT_FILES) -> Path:
    """A copy of this project's pin, series, tool and build config (no new files unless asked) at ``dest``."""
    for rel in project_files(REPO):
        if rel.split("/")[0] in include or rel in include:
            target = dest / rel
            target.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(REPO / rel, target)
    return dest


def first_patch_only(project: Path) -> Path:
    """Cut the copy's series to its first patch: the tool's tests work on a fixed, small series."""
    patches = project / "patches"
    lines = (patches / "series").read_text().splitlines()
    names = [line for line in lines if line and not line.startswith("#")]
    for name in names[1:]:
        (patches / name).unlink()
    (patches / "series").write_text("\n".join([*(line for line in lines if line.startswith("#")), names[0]]) + "\n")
    return project


def commit_as_project(monkeypatch: pytest.MonkeyPatch) -> str:
    """Commit as the project, as the series' upstream-bound patches do (upstream-pr refuses a placeholder author)."""
    for role in ("AUTHOR", "COMMITTER"):
        monkeypatch.setenv(f"GIT_{role}_NAME", "Lightning patch set")
        monkeypatch.setenv(f"GIT_{role}_EMAIL", PROJECT_EMAIL)
    return f"Lightning patch set <{PROJECT_EMAIL}>"


def write(path: Path, text: str) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text, encoding="utf-8")
    return path


def git(repo: Path, *args: str) -> str:
    return subprocess.run(["git", "-C", str(repo), *args], capture_output=True, text=True, check=True).stdout.strip()


def own_new_files(project: Path, *globs: str) -> None:
    """Make the copy's first patch (0001, fork packaging) own ``globs`` as `New-Files:` (the build refuses strays)."""
    patch = next((project / "patches").glob("0001-*.patch"))
    text = patch.read_text(encoding="utf-8")
    fields = re.search(r"\nForwarded: [^\n]*\n", text)
    assert fields, patch
    patch.write_text(text[: fields.end()] + f"New-Files: {' '.join(globs)}\n" + text[fields.end() :], encoding="utf-8")


def make_venv(path: Path, with_pip: bool = False) -> Path:
    """A fresh venv with its own site-packages that also sees, after its own, this environment's (torch, setuptools).

    ``with_pip``: the venv gets the pip that ``python -m venv`` bundles, as a user's fresh venv does.
    """
    subprocess.run([sys.executable, "-m", "venv", *([] if with_pip else ["--without-pip"]), str(path)], check=True)
    python = path / ("Scripts/python.exe" if os.name == "nt" else "bin/python")
    (site_packages(python) / "_parent_environment.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    return python


def site_packages(python: Path) -> Path:
    code = "import sysconfig; print(sysconfig.get_paths()['purelib'])"
    return Path(subprocess.run([python, "-c", code], capture_output=True, text=True, check=True).stdout.strip())


def pip(
    python: Path, *args: str, env: dict[str, str] | None = None, unset: tuple[str, ...] = (), cwd: Path | None = None
) -> subprocess.CompletedProcess[str]:
    """The venv's own pip if it has one, else this environment's pip acting on the venv of ``python``.

    ``env`` adds to this process's environment, ``unset`` removes from it.
    """
    if (site_packages(python) / "pip").is_dir():
        cmd = [str(python), "-m", "pip", "--disable-pip-version-check", *args]
    else:
        cmd = [sys.executable, "-m", "pip", "--python", str(python), "--disable-pip-version-check", *args]
    environ = {k: v for k, v in os.environ.items() if k not in unset}
    return subprocess.run(cmd, capture_output=True, text=True, env={**environ, **(env or {})}, cwd=cwd)


def pip_wheel(project: Path, dest: Path, flavour: str | None = None) -> Path:
    """Build the fork's wheel into ``dest`` as the docs and the release workflow do (``pip wheel --no-deps``)."""
    env = {k: v for k, v in os.environ.items() if k != "PACKAGE_NAME"}
    if flavour:
        env["PACKAGE_NAME"] = flavour
    with tempfile.TemporaryDirectory() as tmp:
        cmd = [sys.executable, "-m", "pip", "wheel", "--no-deps", "-q", "-w", tmp, str(project)]
        proc = subprocess.run(cmd, capture_output=True, text=True, env=env)
        assert proc.returncode == 0, proc.stderr[-3000:]
        (built,) = Path(tmp).glob("*.whl")
        dest.mkdir(parents=True, exist_ok=True)
        return built.replace(dest / built.name)


def build_in_process(
    project: Path, dest: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> str:
    """Run the backend's ``build_wheel`` hook in this process, in the project as pip would; what it printed."""
    monkeypatch.chdir(project)
    dest.mkdir(parents=True, exist_ok=True)
    with pytest.raises(SystemExit):
        backend.build_wheel(str(dest))
    assert not list(dest.iterdir())
    return capsys.readouterr().err


def run_python(python: Path, code: str) -> str:
    """Run ``code`` with ``python`` outside any checkout (so imports come from its environment); its output."""
    proc = subprocess.run([python, "-c", code], capture_output=True, text=True, cwd="/")
    assert proc.returncode == 0, proc.stderr
    return proc.stdout.strip()


# A pull request template shaped as upstream's `.github/PULL_REQUEST_TEMPLATE.md` (its sections, comments and both
# kinds of checklist item), in words of our own: the tests fill it as `upstream-pr` fills upstream's.
PR_TEMPLATE = """## What does this PR do?

<!--
Say what changes and why; link the issue.
-->

Fixes #\\<issue_number>

<!-- Any breaking changes? List them here. -->

<details>
  <summary><b>Before submitting</b></summary>

- Was this **discussed/agreed** via a GitHub issue? (not for typos and docs)
- [ ] Did you read the [contributor guideline](https://example.invalid/CONTRIBUTING.md), **Pull Request** section?
- [ ] Did you make sure your **PR does only one thing**, instead of bundling different changes together?
- Did you make sure to **update the documentation** with your changes? (if necessary)
- Did you write any **new necessary tests**? (not for typos and docs)
- [ ] Did you verify new and **existing tests pass** locally with your changes?
- Did you list all the **breaking changes** introduced by this pull request?
- Did you **update the CHANGELOG**? (not for typos, docs, test updates, or minor internal changes/refactors)

<!-- a note on CHANGELOG entries -->

</details>

## PR review

<details>
  <summary>Reviewer checklist</summary>

- [ ] Is this pull request ready for review?

</details>
"""


def uv_binary() -> str:
    """The uv that tests/requirements.txt installs: on PATH, or beside this interpreter (a venv not activated)."""
    uv = shutil.which("uv") or str(Path(sys.executable).with_name("uv"))
    if not Path(uv).is_file():
        pytest.skip("uv is not installed (tests/requirements.txt installs it)")
    return uv


def newest_release() -> tuple[str, str]:
    """The newest release in the CHANGELOG and its commit, which the README's install lines pin; on the release commit
    itself, whose heading names no commit yet (``release`` adds it in the next), this commit: the README describes
    that release before its lines can pin it."""
    changelog = (REPO / "CHANGELOG.md").read_text(encoding="utf-8")
    version, commit = re.findall(r"^## \[([^\]]+)\] - [0-9-]+\n(?:\nCommit: `([0-9a-f]{40})`$)?", changelog, re.M)[0]
    return version, commit or git(REPO, "rev-parse", "HEAD")
