"""Fixtures for the patch set tooling's tests: real git, the real pinned sdist, throwaway copies of this project."""

from __future__ import annotations

import contextlib
import ensurepip
import io
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from filelock import FileLock
from patchset_helpers import (
    BUILT_FILES,
    DEMO,
    DISTRIBUTIONS,
    REPO,
    commit_as_project,
    copy_project,
    first_patch_only,
    make_venv,
    own_new_files,
    pip,
    pip_wheel,
    run_python,
    write,
)

from patchset.pin import CACHE_ENV, cache_dir, fetch_sdist, file_sha256, read_pin


@pytest.fixture(autouse=True)
def git_identity(monkeypatch):
    """Commits the tests make (and upstream-pr makes in a user's checkout) need an identity; CI machines have none."""
    for role in ("AUTHOR", "COMMITTER"):
        monkeypatch.setenv(f"GIT_{role}_NAME", "Patch Set Tests")
        monkeypatch.setenv(f"GIT_{role}_EMAIL", "tests@patchset.invalid")


@pytest.fixture
def project_identity(monkeypatch) -> str:
    """Commit as the project, as the series' upstream-bound patches do (upstream-pr refuses a placeholder author)."""
    return commit_as_project(monkeypatch)


@pytest.fixture(scope="session", autouse=True)
def patchset_cache(tmp_path_factory: pytest.TempPathFactory):
    """A cache of the tests' own: they write fake sdists and trees there, never into the user's cache.

    It starts with the pinned sdist, copied (not linked: a test must never be able to change the user's file) from the
    user's cache when that holds a verified copy, otherwise downloaded once for the whole session.
    """
    pin = read_pin(REPO)
    users = cache_dir() / "sdist" / pin.sha256 / pin.sdist
    ours = tmp_path_factory.mktemp("patchset-cache")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv(CACHE_ENV, str(ours))
        if users.is_file() and file_sha256(users) == pin.sha256:
            seeded = ours / "sdist" / pin.sha256 / pin.sdist
            seeded.parent.mkdir(parents=True)
            shutil.copyfile(users, seeded)
        yield ours


@pytest.fixture(scope="session")
def upstream_sdist(patchset_cache: Path) -> Path:
    """The real pinned sdist, in the tests' own cache (downloaded at most once per session)."""
    return fetch_sdist(read_pin(REPO))


@pytest.fixture
def project(tmp_path: Path, upstream_sdist: Path) -> Path:
    """A throwaway copy of this project: pin, the tool, and a series of just its first patch; no new files.

    The tool's tests work on a fixed, small series so that they do not change meaning as patches are added.
    """
    return first_patch_only(copy_project(tmp_path / "project"))


@pytest.fixture
def run_cli(monkeypatch):
    """Run the CLI as ``python -m patchset --project P ...`` would, in-process (so coverage sees it).

    Returns an object with ``returncode``, ``stdout`` and ``stderr``.
    """
    from patchset.cli import main

    def run(project: Path, *args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
        for key, value in (env or {}).items():
            monkeypatch.setenv(key, value)
        out, err = io.StringIO(), io.StringIO()
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            code = main(["--project", str(project), *args])
        return subprocess.CompletedProcess(args, code, out.getvalue(), err.getvalue())

    return run


@pytest.fixture
def demo_project(project: Path) -> Path:
    """The throwaway project with one new file under src/, owned by its patch 0001."""
    write(project / DEMO, 'GREETING = "hello"\n')
    own_new_files(project, DEMO)
    return project


@pytest.fixture(scope="session")
def newest_pip(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The newest pip wheel the index has (downloaded once per session)."""
    dest = tmp_path_factory.mktemp("newest-pip")
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary", ":all:", "-d", str(dest), "pip"]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    wheels = list(dest.glob("pip-*.whl"))
    if proc.returncode != 0 or len(wheels) != 1:
        pytest.skip(f"no pip wheel from the index: {proc.stderr.strip()[-300:]}")
    return wheels[0]


@pytest.fixture
def bundled_pip_venv(tmp_path: Path) -> Path:
    """A fresh venv with the pip that `python -m venv` bundles (23.2 with Python 3.11), as a user's; its python."""
    python = make_venv(tmp_path / "venv", with_pip=True)
    assert run_python(python, "import pip; print(pip.__version__)") == ensurepip.version()
    return python


@pytest.fixture(params=["bundled", "newest"])
def pip_in_venv(request: pytest.FixtureRequest, tmp_path: Path) -> Path:
    """A fresh venv with a pip of its own: the one `python -m venv` bundles, or the newest.

    Returns the venv's interpreter; :func:`patchset_helpers.pip` runs that venv's own pip.
    """
    if request.param == "bundled":
        return request.getfixturevalue("bundled_pip_venv")
    wheel = request.getfixturevalue("newest_pip")
    python = make_venv(tmp_path / "venv")
    proc = pip(python, "install", "--no-deps", str(wheel))
    assert proc.returncode == 0, proc.stderr
    assert run_python(python, "import pip; print(pip.__version__)") == wheel.name.split("-")[1]
    return python


@pytest.fixture(scope="session")
def fork_wheels(tmp_path_factory: pytest.TempPathFactory, patchset_cache: Path) -> dict[str, Path]:
    """The fork's three distributions, built once per run as users build them (``pip wheel`` through the backend).

    Each from its folder (the project, or one of ``distributions/``), from a copy of this checkout's files (no git: the
    version is the pin's, :data:`patchset_helpers.FORK`), and shared by pytest-xdist's workers: the first to get the
    lock builds, the others wait and read.
    """
    root = tmp_path_factory.getbasetemp()
    root = root.parent if os.environ.get("PYTEST_XDIST_WORKER") else root  # the run's folder, every worker's is in it
    dest = root / "fork-wheels"
    with FileLock(str(root / "fork-wheels.lock")):
        if not (dest / "built").is_file():
            source = copy_project(root / "fork-source", include=BUILT_FILES)
            for folder, _ in DISTRIBUTIONS.values():
                pip_wheel(source / folder, dest)
            (dest / "built").write_text("")
    return {name: next(dest.glob(f"{name}-*.whl")) for name in DISTRIBUTIONS}
