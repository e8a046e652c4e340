"""Build, install and import the fork for real: the in-tree backend, a fresh venv, an sdist, git+file, editable.

The builds and installs are slow: the tests that only read a build share one (``fork_wheels``), and each of the others
builds the way it is about (from git with a cold cache, editable, from the sdist). The error paths, which fail before
or early in a build, run in the quick mode too.
"""

from __future__ import annotations

import email.parser
import sys
import tarfile
import zipfile
from dataclasses import replace
from pathlib import Path

import pytest
from patchset_helpers import (
    DEMO,
    FORK,
    REPO,
    build_in_process,
    copy_project,
    git,
    make_venv,
    pip,
    run_python,
    site_packages,
    write,
)

from patchset.overlay import overlay_files
from patchset.pin import read_pin, write_pin
from patchset.series import read_series


@pytest.mark.slow
def _fields(metadata: bytes) -> list[tuple[str, str]]:
    """The core metadata's fields, as any setuptools writes them: not the format's version nor the fields a newer
    format adds, and extras normalized (`test_gpu` and `test-gpu` are one extra)."""
    message = email.parser.BytesParser().parsebytes(metadata)
    later = {"metadata-version", "dynamic", "license-file", "license-expression"}
    return sorted((k.lower(), v.replace("_", "-")) for k, v in message.items() if k.lower() not in later)


def test_backend_metadata_matches_the_wheel(fork_wheels: dict[str, Path], tmp_path: Path, monkeypatch, upstream_sdist):
    from patchset import backend

    # a cold cache and a local copy of the sdist (no download): the hook makes the tree from it, and caches nothing
    monkeypatch.setenv("LIGHTNING_PATCHSET_CACHE", str(tmp_path / "cache"))
    monkeypatch.setenv("LIGHTNING_PATCHSET_SDIST", str(upstream_sdist))
    project = copy_project(tmp_path / "project", include=("patches", "tools", "src", "pyproject.toml"))
    monkeypatch.chdir(project)
    meta_name = backend.prepare_metadata_for_build_wheel(str(tmp_path))
    assert meta_name == f"lightning-{FORK}.dist-info"
    with zipfile.ZipFile(fork_wheels["lightning"]) as whl:
        names = whl.namelist()
        metadata = whl.read(f"{meta_name}/METADATA")
        setup = whl.read("lightning/__setup__.py").decode()
        version_file = whl.read("lightning/version.info").decode()
    # the same fields; only the format's version may differ: the hook ran with this environment's setuptools, the
    # wheel with the build's own (as pip runs the hook, in the build's environment, they are the same)
    assert _fields(metadata) == _fields((tmp_path / meta_name / "METADATA").read_bytes())
    assert b"Requires-Dist: pytorch-lightning" not in metadata
    assert f"Version: {FORK}".encode() in metadata
    ours = [rel.removeprefix("src/") for rel in overlay_files(REPO) if rel.startswith("src/lightning/")]
    assert ours
    assert set(ours) <= set(names)
    assert "the index would be an unpatched copy" in setup  # patch 0001 is in the built code
    assert version_file.strip() == FORK
    stray = [n for n in names if not n.startswith(("lightning/", f"lightning-{FORK}.dist-info/"))]
    assert stray == []
    assert not any("/tests/" in n or n.endswith(".pyc") for n in names)
    assert not (project / "build").exists()
    assert not list(project.glob("src/*.egg-info"))
    assert not (tmp_path / "cache").exists()


@pytest.mark.slow
def test_the_three_distributions_install_side_by_side_and_import_the_fixes(fork_wheels: dict[str, Path], tmp_path):
    """`lightning`, and `pytorch-lightning` / `lightning-fabric` (PACKAGE_NAME=pytorch|fabric, upstream's switch): the
    same patched code under the old import names, with upstream's import rewriting applied to our files too."""
    python = make_venv(tmp_path / "venv")
    proc = pip(python, "install", "--no-deps", *map(str, fork_wheels.values()))
    assert proc.returncode == 0, proc.stderr
    site = site_packages(python)
    changed = {s.path for patch in read_series(REPO) for s in patch.sections} | set(overlay_files(REPO))
    ours = sorted(rel for rel in changed if rel.startswith("src/lightning/fabric/") and rel.endswith(".py"))
    assert ours  # the files the patches change or add under lightning.fabric
    modules = [rel.removeprefix("src/").removesuffix(".py").replace("/", ".") for rel in ours]
    mirrored = [m.replace("lightning.fabric", "lightning_fabric", 1) for m in modules]
    files = run_python(python, f"import importlib; print(*[importlib.import_module(m).__file__ for m in {mirrored}])")
    assert all(Path(f).is_relative_to(site) for f in files.split())
    for path in files.split():  # a mirrored file imports the mirrored package, never `lightning.fabric`
        assert "lightning.fabric" not in Path(path).read_text(encoding="utf-8"), path
    for name in ("lightning", "pytorch_lightning", "lightning_fabric"):
        assert run_python(python, f"import {name}; print({name}.__version__)") == FORK


@pytest.mark.slow
def test_sdist_is_self_contained_and_builds_the_same_fork(demo_project: Path, tmp_path: Path, monkeypatch):
    from patchset import backend

    monkeypatch.chdir(demo_project)
    (tmp_path / "sdist").mkdir()
    (demo_project / ".work").mkdir(exist_ok=True)
    (demo_project / ".work" / "junk").write_text("not for the sdist\n")
    name = backend.build_sdist(str(tmp_path / "sdist"))
    assert name == f"lightning-{FORK}.tar.gz"
    (demo_project / DEMO).touch()  # a later time on a file: the same sdist, as two builds of one commit give
    assert backend.build_sdist(str(tmp_path)) == name
    assert (tmp_path / name).read_bytes() == (tmp_path / "sdist" / name).read_bytes()
    with tarfile.open(tmp_path / "sdist" / name) as tar:
        members = {m.name.split("/", 1)[1] for m in tar.getmembers() if "/" in m.name}
    for required in ("PKG-INFO", "pyproject.toml", "patches/upstream.pin", "patches/series", DEMO):
        assert required in members
    assert "tools/patchset/backend.py" in members
    assert not any(m.startswith((".work", ".git/")) or m.endswith(".pyc") for m in members)
    assert not any(m.endswith("__init__.py") and m.startswith("src/lightning/") for m in members)  # no upstream code
    args = ("wheel", "--no-deps", "--no-build-isolation", "-w", str(tmp_path / "whl"), str(tmp_path / "sdist" / name))
    proc = pip(Path(sys.executable), *args)
    assert proc.returncode == 0, proc.stderr
    assert [p.name for p in (tmp_path / "whl").iterdir()] == [f"lightning-{FORK}-py3-none-any.whl"]


@pytest.mark.slow
def test_pip_install_from_git_with_a_cold_cache(
    demo_project: Path, tmp_path: Path, upstream_sdist: Path, pip_in_venv: Path, request: pytest.FixtureRequest
):
    """`pip install "lightning @ git+<url>"` in a fresh venv, with the pip it bundles (build isolation, as users run
    it) and with the newest (without). The backend downloads upstream's sdist with pip from inside pip's own hook:
    pip 23 and 24 hand the hook `PEP517_BACKEND_PATH`, pip 25 on `_PYPROJECT_HOOKS_BACKEND_PATH`, and neither must
    reach the inner pip. A build of the fork that `lightning==2.6.6` would match sits next to upstream's sdist."""
    isolation = request.node.callspec.params["pip_in_venv"] == "bundled"
    # a label of its own: the venv also sees this environment's fork, which on a release commit has FORK's version,
    # and pip would take that for the requirement
    write_pin(demo_project, replace(read_pin(demo_project), local_version="patchset.999"))
    git(demo_project, "init", "-q")
    git(demo_project, "add", "-A")
    git(demo_project, "-c", "user.name=t", "-c", "user.email=t@x", "commit", "-qm", "fork")
    links = tmp_path / "links"
    links.mkdir()
    (links / upstream_sdist.name).write_bytes(upstream_sdist.read_bytes())
    (links / f"lightning-{FORK}.tar.gz").write_bytes(b"not upstream's release")
    env = {"LIGHTNING_PATCHSET_CACHE": str(tmp_path / "cache"), "PIP_FIND_LINKS": str(links)}
    if not isolation:  # an isolated build installs its requirements from the index
        env["PIP_NO_INDEX"] = "1"
    # `file://localhost/<path>`: pip before 24.1 refuses `git+file:///<path>` (no host) as an invalid requirement
    url = f"git+file://localhost{demo_project.as_posix()}"
    args = ["install", "--no-deps", *([] if isolation else ["--no-build-isolation"]), f"lightning @ {url}"]
    proc = pip(pip_in_venv, *args, env=env, unset=("LIGHTNING_PATCHSET_SDIST",))
    assert proc.returncode == 0, proc.stderr[-3000:]
    code = "import lightning, lightning.fabric.utilities._patchset_demo as d; print(lightning.__version__, d.GREETING)"
    assert run_python(pip_in_venv, code) == f"{read_pin(demo_project).fork_version} hello"
    assert list((tmp_path / "cache" / "sdist").rglob("lightning-2.6.6.tar.gz"))


@pytest.mark.slow
def test_editable_install_picks_up_an_edit(demo_project: Path, tmp_path: Path):
    python = make_venv(tmp_path / "venv")
    proc = pip(python, "install", "--no-deps", "--no-build-isolation", "-e", str(demo_project))
    assert proc.returncode == 0, proc.stderr
    code = "import lightning.fabric.utilities._patchset_demo as d; print(d.GREETING)"
    assert run_python(python, code) == "hello"
    (demo_project / DEMO).write_text('GREETING = "edited"\n')
    assert run_python(python, code) == "edited"
    assert run_python(python, "import lightning; print(lightning.__version__)") == FORK


def test_hash_mismatch_fails_with_one_line_and_installs_nothing(demo_project: Path, tmp_path: Path):
    fake_dir = tmp_path / "lightning-2.6.6"
    write(fake_dir / "setup.py", "raise SystemExit('never run')\n")
    fake = tmp_path / "lightning-2.6.6.tar.gz"
    with tarfile.open(fake, "w:gz") as tar:
        tar.add(fake_dir, arcname="lightning-2.6.6")
    python = make_venv(tmp_path / "venv")
    proc = pip(
        python,
        "install",
        "--no-deps",
        "--no-build-isolation",
        str(demo_project),
        env={"LIGHTNING_PATCHSET_SDIST": str(fake)},
    )
    assert proc.returncode != 0
    errors = [line.strip() for line in (proc.stdout + proc.stderr).splitlines() if "does not match the pinned" in line]
    assert len(errors) == 1
    assert errors[0].startswith(f"patchset: error: LIGHTNING_PATCHSET_SDIST={fake}: sha256 ")
    assert not (site_packages(python) / "lightning").exists()


def test_a_bad_pin_is_refused_before_building(tmp_path: Path, monkeypatch, capsys):
    project = copy_project(tmp_path / "project")
    pin = project / "patches" / "upstream.pin"
    pin.write_text(pin.read_text().replace("sha256 = ", "sha256 = 0", 1))
    err = build_in_process(project, tmp_path / "dist", monkeypatch, capsys)
    assert err.startswith("patchset: error: ")
    assert "sha256 must be 64 hex digits" in err
    assert err.count("\n") == 1


def test_sdist_leaves_out_junk_but_keeps_every_project_file(demo_project: Path, tmp_path: Path, monkeypatch):
    from patchset import backend

    for junk in (".coverage.host.123", "coverage.xml", "htmlcov/index.html", ".idea/x.xml", ".mypy_cache/x"):
        write(demo_project / junk, "junk\n")
    write(demo_project / "docs/build/keep.md", "a docs page in a folder named build\n")
    write(demo_project / "tools/patchset/__pycache__/x.cpython-311.pyc", "bytes")
    monkeypatch.chdir(demo_project)
    files = backend.sdist_files(demo_project)
    assert "docs/build/keep.md" in files
    assert "patches/upstream.pin" in files
    assert not [f for f in files if "coverage" in f or ".idea" in f or "cache" in f or f.endswith(".pyc")]


def test_editable_flavour_is_refused_in_one_line(demo_project: Path, tmp_path: Path, monkeypatch, capsys):
    from patchset import backend

    monkeypatch.setenv("PACKAGE_NAME", "fabric")
    monkeypatch.chdir(demo_project)
    with pytest.raises(SystemExit):
        backend.build_editable(str(tmp_path))
    assert capsys.readouterr().err == (
        "patchset: error: PACKAGE_NAME=fabric: editable installs build the lightning distribution only;"
        " install lightning-fabric without -e\n"
    )


def test_a_broken_patch_fails_the_build_in_one_line(demo_project: Path, tmp_path: Path, monkeypatch, capsys):
    patch = next((demo_project / "patches").glob("0001-*.patch"))
    patch.write_text(patch.read_text().replace("unfreeze=", "defrost=", 1))
    err = build_in_process(demo_project, tmp_path / "dist", monkeypatch, capsys)
    assert err.startswith(f"patchset: error: {patch.name} does not apply: src/lightning/__setup__.py, hunk `@@")
    assert err.count("\n") == 1


def test_unknown_flavour_is_one_clear_error(demo_project: Path, tmp_path: Path, monkeypatch, capsys):
    from patchset import backend

    monkeypatch.setenv("PACKAGE_NAME", "app")
    monkeypatch.chdir(demo_project)
    with pytest.raises(SystemExit):
        backend.build_wheel(str(tmp_path))
    assert capsys.readouterr().err == (
        "patchset: error: PACKAGE_NAME='app': expected one of lightning, pytorch, fabric\n"
    )
