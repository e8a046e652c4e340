"""Every distribution pinnable in a file: ``#subdirectory=distributions/<name>`` on the fork's git URL.

pip, uv and Poetry install ``pytorch-lightning`` and ``lightning-fabric`` from their folders, next to ``lightning`` from
the project, with no ``PACKAGE_NAME``; the errors a user can meet on the way are one line each.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from patchset_helpers import (
    BUILT_FILES,
    DISTRIBUTIONS,
    FORK,
    REPO,
    copy_project,
    git,
    make_venv,
    pip,
    run_python,
    uv_binary,
)

from patchset import backend, flavours
from patchset.flavours import FLAVOURS

if sys.version_info >= (3, 11):
    import tomllib
else:  # Python 3.10: tests/requirements.txt installs tomli
    import tomli as tomllib

FOLDERS = {name: folder for name, (folder, _) in DISTRIBUTIONS.items() if folder}
NAMES = ("lightning", "pytorch-lightning", "lightning-fabric")


@pytest.fixture
def fork_repo(tmp_path: Path) -> Path:
    """A git repository of this checkout's build files, committed once (no CHANGELOG: the version is the pin's)."""
    repo = copy_project(tmp_path / "fork", include=BUILT_FILES)
    git(repo, "init", "-q")
    git(repo, "add", "-A")
    git(repo, "-c", "user.name=t", "-c", "user.email=t@x", "commit", "-qm", "fork")
    return repo


def _url(repo: Path) -> str:
    """The repository's git URL at its commit, with a host: pip 23.2 refuses ``git+file:///<path>``."""
    return f"git+file://localhost{repo.as_posix()}@{git(repo, 'rev-parse', 'HEAD')}"


def _requirements(repo: Path) -> list[str]:
    """The three distributions' lines, as a user's requirements file has them."""
    return [
        f"{name.replace('_', '-')} @ {_url(repo)}" + (f"#subdirectory={folder}" if folder else "")
        for name, (folder, _) in DISTRIBUTIONS.items()
    ]


def _versions(python: Path) -> dict[str, str]:
    """The installed version of each of the three distributions in the environment of ``python``."""
    code = f"from importlib.metadata import version; print(*(version(name) for name in {NAMES}))"
    return dict(zip(NAMES, run_python(python, code).split(), strict=True))


def test_each_folder_declares_its_distribution_and_builds_with_the_projects_backend():
    root = tomllib.loads((REPO / "pyproject.toml").read_text(encoding="utf-8"))
    assert {path.name for path in (REPO / "distributions").iterdir()} == {f.distribution for f in FLAVOURS.values()}
    shims = set()
    for folder in FOLDERS.values():
        settings = tomllib.loads((REPO / folder / "pyproject.toml").read_text(encoding="utf-8"))
        assert settings["build-system"]["requires"] == root["build-system"]["requires"]
        assert settings["build-system"]["backend-path"] == ["."]  # inside the folder, as frontends require
        assert settings["tool"]["patchset"] == {"distribution": Path(folder).name}
        shims.add((REPO / folder / f"{settings['build-system']['build-backend']}.py").read_text(encoding="utf-8"))
        assert not any(path.is_symlink() for path in (REPO / folder).iterdir())  # Windows checkouts
    assert len(shims) == 1


@pytest.mark.parametrize("package_name", ["fabric", "lightning"])
def test_package_name_of_another_distribution_is_one_line(
    package_name: str, tmp_path: Path, monkeypatch, capsys, upstream_sdist
):
    project = copy_project(tmp_path / "project", include=BUILT_FILES)
    monkeypatch.setenv("PACKAGE_NAME", package_name)
    monkeypatch.chdir(project / "distributions" / "pytorch-lightning")
    with pytest.raises(SystemExit):
        backend.build_wheel(str(tmp_path))
    assert capsys.readouterr().err == (
        f"patchset: error: PACKAGE_NAME={package_name}, but distributions/pytorch-lightning builds pytorch-lightning:"
        " unset PACKAGE_NAME (the folder names its distribution) or install from the URL that builds the one you"
        " want\n"
    )


@pytest.mark.parametrize("package_name", ["pytorch", "myapp", ""])
def test_a_folder_builds_its_own_distribution_whatever_else_package_name_says(
    package_name: str, tmp_path: Path, monkeypatch
):
    """Its own flavour's name, or another project's value of the common variable: the folder's distribution."""
    monkeypatch.setenv("PACKAGE_NAME", package_name)
    folder = copy_project(tmp_path / "project", include=BUILT_FILES) / "distributions" / "pytorch-lightning"
    assert flavours.chosen(folder, "distributions/pytorch-lightning") is FLAVOURS["pytorch"]


def test_an_editable_install_of_a_folder_is_one_line(tmp_path: Path, monkeypatch, capsys):
    project = copy_project(tmp_path / "project", include=BUILT_FILES)
    monkeypatch.delenv("PACKAGE_NAME", raising=False)
    monkeypatch.chdir(project / "distributions" / "lightning-fabric")
    with pytest.raises(SystemExit):
        backend.build_editable(str(tmp_path))
    assert capsys.readouterr().err == (
        "patchset: error: distributions/lightning-fabric: editable installs build the lightning distribution only;"
        " install lightning-fabric without -e\n"
    )


@pytest.mark.slow
def test_a_flavours_name_on_the_projects_url_is_one_line(fork_repo: Path, pip_in_venv: Path):
    """pip would build lightning and say "inconsistent name" among ~300 lines; the backend reads what pip asked for
    (its build tracker) and names the fix."""
    line = f"lightning-fabric @ {_url(fork_repo)}"
    proc = pip(pip_in_venv, "install", "--no-deps", "--no-build-isolation", line, unset=("PACKAGE_NAME",))
    assert proc.returncode != 0
    errors = [row.strip() for row in (proc.stdout + proc.stderr).splitlines() if "patchset: error:" in row]
    assert errors == [
        f"patchset: error: {line}: this URL builds lightning; add #subdirectory=distributions/lightning-fabric"
    ]


@pytest.mark.slow
def test_one_requirements_file_installs_the_three_with_pip(fork_repo: Path, bundled_pip_venv: Path, tmp_path: Path):
    """The pip a new venv bundles (23.2 with Python 3.11), with build isolation, as a user runs it."""
    (tmp_path / "requirements.txt").write_text("\n".join(_requirements(fork_repo)) + "\n")
    args = ("install", "--no-deps", "-r", str(tmp_path / "requirements.txt"))
    proc = pip(bundled_pip_venv, *args, unset=("PACKAGE_NAME",))
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert _versions(bundled_pip_venv) == dict.fromkeys(NAMES, FORK)


@pytest.mark.slow
def test_uv_installs_the_three_and_a_teammates_uv_sync_builds_them(fork_repo: Path, tmp_path: Path, monkeypatch):
    """`uv pip install -r`, `uv add` of the three lines into a project, and `uv sync` of that project's pyproject.toml
    and uv.lock elsewhere, with a cache of its own (it builds again) and no PACKAGE_NAME."""
    uv = uv_binary()
    monkeypatch.delenv("PACKAGE_NAME", raising=False)

    def run(*args: str, cwd: Path, cache: Path) -> subprocess.CompletedProcess[str]:
        env = {**os.environ, "UV_CACHE_DIR": str(cache)}
        return subprocess.run([uv, *args], capture_output=True, text=True, cwd=cwd, env=env)

    (tmp_path / "requirements.txt").write_text("\n".join(_requirements(fork_repo)) + "\n")
    venv = make_venv(tmp_path / "venv")
    args = ("pip", "install", "--python", str(venv), "--no-deps", "-r", "requirements.txt")
    proc = run(*args, cwd=tmp_path, cache=tmp_path / "uv-cache")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert _versions(venv) == dict.fromkeys(NAMES, FORK)

    app = tmp_path / "app"
    app.mkdir()
    (app / "pyproject.toml").write_text(
        '[project]\nname = "app"\nversion = "0"\nrequires-python = ">=3.10"\ndependencies = []\n\n[tool.uv]\n'
        "package = false\n# torch's own dependencies are a CUDA build: the test installs the fork, not torch\n"
        "override-dependencies = [\"torch; sys_platform == 'never'\"]\n"
    )
    proc = run("add", "--python", sys.executable, *_requirements(fork_repo), cwd=app, cache=tmp_path / "uv-cache")
    assert proc.returncode == 0, proc.stderr[-3000:]
    teammate = tmp_path / "teammate"
    teammate.mkdir()
    for name in ("pyproject.toml", "uv.lock"):
        shutil.copyfile(app / name, teammate / name)
    assert 'subdirectory = "distributions/lightning-fabric"' in (teammate / "pyproject.toml").read_text()
    proc = run("sync", "--python", sys.executable, cwd=teammate, cache=tmp_path / "teammate-cache")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stderr.count("Built ") == 3, proc.stderr  # the teammate's own builds, not the first cache's wheels
    assert _versions(teammate / ".venv" / "bin" / "python") == dict.fromkeys(NAMES, FORK)


@pytest.mark.slow
def test_poetry_locks_a_folder_dependency(fork_repo: Path, tmp_path: Path, monkeypatch):
    """Poetry 2 with a PEP 621 dependency on a folder; `poetry lock` builds its metadata from the folder."""
    poetry_venv = tmp_path / "poetry-venv"
    subprocess.run([sys.executable, "-m", "venv", str(poetry_venv)], check=True)
    install = [poetry_venv / "bin" / "python", "-m", "pip", "install", "-q", "poetry>=2"]
    proc = subprocess.run(install, capture_output=True, text=True)
    if proc.returncode != 0:
        pytest.skip(f"Poetry could not be installed from the index: {proc.stderr.strip()[-300:]}")
    monkeypatch.delenv("PACKAGE_NAME", raising=False)
    monkeypatch.setenv("POETRY_CACHE_DIR", str(tmp_path / "poetry-cache"))
    monkeypatch.setenv("POETRY_VIRTUALENVS_IN_PROJECT", "true")
    app = tmp_path / "app"
    app.mkdir()
    line = f"lightning-fabric @ {_url(fork_repo)}#subdirectory=distributions/lightning-fabric"
    (app / "pyproject.toml").write_text(
        f'[project]\nname = "app"\nversion = "0"\nrequires-python = ">=3.10,<3.15"\ndependencies = ["{line}"]\n\n'
        "[tool.poetry]\npackage-mode = false\n"
    )
    proc = subprocess.run([poetry_venv / "bin" / "poetry", "lock"], capture_output=True, text=True, cwd=app)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-3000:]
    locked = {package["name"]: package for package in tomllib.loads((app / "poetry.lock").read_text())["package"]}
    assert locked["lightning-fabric"]["version"] == FORK
    assert locked["lightning-fabric"]["source"]["subdirectory"] == "distributions/lightning-fabric"


@pytest.mark.slow
def test_a_folders_sdist_builds_its_distribution(tmp_path: Path, monkeypatch):
    """`python -m build distributions/lightning-fabric` makes an sdist, then a wheel from it: the sdist is the
    project's, with the distribution declared in its pyproject.toml."""
    project = copy_project(tmp_path / "project", include=BUILT_FILES)
    monkeypatch.delenv("PACKAGE_NAME", raising=False)
    monkeypatch.chdir(project / "distributions" / "lightning-fabric")
    (tmp_path / "sdist").mkdir()
    name = backend.build_sdist(str(tmp_path / "sdist"))
    assert name == f"lightning_fabric-{FORK}.tar.gz"
    args = ("wheel", "--no-deps", "--no-build-isolation", "-w", str(tmp_path / "whl"), str(tmp_path / "sdist" / name))
    proc = pip(Path(sys.executable), *args)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert [p.name for p in (tmp_path / "whl").iterdir()] == [f"lightning_fabric-{FORK}-py3-none-any.whl"]
