"""Each distribution the fork builds is the index's wheel of the pinned release plus our files, and reproducible."""

from __future__ import annotations

import collections
import os
import subprocess
import sys
import time
import zipfile
from pathlib import Path

import pytest
from patchset_helpers import (
    BUILT_FILES,
    DISTRIBUTIONS,
    FORK,
    REPO,
    build_in_process,
    copy_project,
    pip_wheel,
    write,
)

from patchset import PatchsetError
from patchset.flavours import fork_url
from patchset.overlay import overlay_files
from patchset.pin import read_pin
from patchset.series import read_series

URL = "https://github.com/lightning-patchset/lightning-patchset"


@pytest.fixture(scope="session")
def index_wheels(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """The index's wheels of the pinned release (from your pip configuration), downloaded once per session."""
    version = read_pin(REPO).version
    dest = tmp_path_factory.mktemp("index-wheels")
    names = ["lightning", "pytorch-lightning", "lightning-fabric"]
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary", ":all:", "-d", str(dest)]
    # `===`: the release itself, never a build of the fork (which `==` matches) on a find-links path
    proc = subprocess.run([*cmd, *(f"{name}==={version}" for name in names)], capture_output=True, text=True)
    wheels = {path.name.split("-")[0]: path for path in dest.glob("*.whl")}
    if proc.returncode != 0 or len(wheels) != 3:
        pytest.skip(f"the index's {version} wheels are not available: {proc.stderr.strip()[-300:]}")
    return wheels


def _headers(wheel: Path) -> list[str]:
    with zipfile.ZipFile(wheel) as archive:
        metadata = next(n for n in archive.namelist() if n.endswith(".dist-info/METADATA") and n.count("/") == 1)
        return archive.read(metadata).decode().partition("\n\n")[0].split("\n")


def _files(wheel: Path) -> set[str]:
    with zipfile.ZipFile(wheel) as archive:
        return {name.replace(wheel.name.split("-py3")[0], "<dist>", 1) for name in archive.namelist()}


def _ours(distribution: str) -> set[str]:
    """Our new files under src/lightning, where they land in ``distribution``'s wheel."""
    _, places = DISTRIBUTIONS[distribution]
    return {
        place + rel.removeprefix(src)
        for rel in overlay_files(REPO)
        for src, place in places.items()
        if rel.startswith(src)
    }


@pytest.mark.slow
@pytest.mark.parametrize("distribution", list(DISTRIBUTIONS))
def test_each_distribution_is_the_indexs_wheel_apart_from_our_files(
    distribution: str, index_wheels: dict[str, Path], fork_wheels: dict[str, Path]
):
    ours, theirs = _headers(fork_wheels[distribution]), _headers(index_wheels[distribution])
    assert f"Version: {FORK}" in ours
    assert f"Version: {read_pin(REPO).version}" in theirs
    fork_lines = [
        f"Home-page: {URL}",
        f"Download-URL: {URL}/releases",
        f"Project-URL: Bug Tracker, {URL}/issues",
        f"Project-URL: Source Code, {URL}",
    ]
    assert [line for line in ours if line in fork_lines] == fork_lines  # where to get it, where to report its bugs
    keys = ("Version:", "Home-page:", "Download-URL:", "Project-URL: Bug Tracker,", "Project-URL: Source Code,")
    if distribution == "lightning":  # patch 0001: no unpatched second copy of the code
        assert "Requires-Dist: pytorch-lightning" in theirs
        assert not [line for line in ours if line.startswith("Requires-Dist: pytorch-lightning")]
        theirs.remove("Requires-Dist: pytorch-lightning")
    # everything else, requirement bounds and extras included, is the index's (extras in glob order there)
    ours_rest = collections.Counter(line for line in ours if not line.startswith(keys))
    theirs_rest = collections.Counter(line for line in theirs if not line.startswith(keys))
    assert ours_rest == theirs_rest, (ours_rest - theirs_rest, theirs_rest - ours_rest)

    built, index = _files(fork_wheels[distribution]), _files(index_wheels[distribution])
    assert index - built == set()
    assert built - index == _ours(distribution)


@pytest.mark.slow
@pytest.mark.parametrize(
    ("distribution", "package"),
    [("pytorch_lightning", "pytorch_lightning"), ("pytorch_lightning", "lightning_fabric"), ("lightning_fabric",) * 2],
)
def test_about_modules_hold_the_indexs_values(
    distribution: str, package: str, index_wheels: dict[str, Path], fork_wheels: dict[str, Path]
):
    """`pytorch_lightning.__author__`, `__docs__`, ... (what `from .__about__ import *` exports) as from the index."""
    values = []
    for wheel in (fork_wheels[distribution], index_wheels[distribution]):
        namespace: dict[str, object] = {}
        with zipfile.ZipFile(wheel) as archive:
            exec(archive.read(f"{package}/__about__.py"), namespace)
        values.append({name: namespace[name] for name in namespace["__all__"]})  # type: ignore[union-attr]
    assert values[0] == values[1]
    assert "__homepage__" in values[0]


@pytest.mark.slow
@pytest.mark.parametrize(("distribution", "package_name"), [("lightning", None), ("lightning_fabric", "fabric")])
def test_two_builds_of_one_commit_are_byte_identical(
    distribution: str, package_name: str | None, fork_wheels: dict[str, Path], tmp_path: Path, monkeypatch
):
    """A build with a cold cache and one of our files' time and mode changed gives the shared build's bytes; and
    ``PACKAGE_NAME=fabric`` at the project (upstream's switch) builds what ``distributions/lightning-fabric`` does."""
    monkeypatch.setenv("LIGHTNING_PATCHSET_CACHE", str(tmp_path / "cold-cache"))
    monkeypatch.delenv("SOURCE_DATE_EPOCH", raising=False)
    project = copy_project(tmp_path / "project", include=BUILT_FILES)
    ours = project / overlay_files(project)[0]
    later = time.time() + 3600
    os.utime(ours, (later, later))
    ours.chmod(0o664)
    again = pip_wheel(project, tmp_path / "again", package_name)
    assert again.read_bytes() == fork_wheels[distribution].read_bytes()
    with zipfile.ZipFile(again) as archive:
        assert {info.date_time for info in archive.infolist()} == {(1980, 1, 1, 0, 0, 0)}
        assert archive.namelist()[-1] == f"{distribution}-{FORK}.dist-info/RECORD"
        assert archive.testzip() is None


def test_a_bad_source_date_epoch_is_one_line(project: Path, tmp_path: Path, monkeypatch, capsys):
    monkeypatch.setenv("SOURCE_DATE_EPOCH", "yesterday")
    assert build_in_process(project, tmp_path / "dist", monkeypatch, capsys) == (
        "patchset: error: SOURCE_DATE_EPOCH='yesterday': expected seconds since 1970, from 1980 on, as an integer\n"
    )


def test_lightnings_metadata_names_the_address_pyproject_declares():
    """Patch 0001 writes the fork's address into upstream's setup metadata: the one pyproject.toml declares."""
    fork_only = read_series(REPO)[0]
    added = [line for s in fork_only.sections for line in s.text.decode().splitlines() if line.startswith("+ ")]
    addresses = {line.split('"')[3] for line in added if "://" in line}
    assert addresses == {URL, f"{URL}/issues", f"{URL}/releases"}


def test_the_forks_address_is_declared_once_in_pyproject(tmp_path: Path):
    assert fork_url(REPO) == URL
    write(tmp_path / "pyproject.toml", '[tool.patchset]\nurl = "https://github.com/o/r/"\n')
    with pytest.raises(PatchsetError, match=r"\[tool.patchset\] url must be the fork's https address"):
        fork_url(tmp_path)


def test_a_file_under_src_that_no_patch_owns_fails_the_build_in_one_line(
    project: Path, tmp_path: Path, monkeypatch, capsys
):
    write(project / "src/lightning/fabric/utilities/_stray.py", "X = 1\n")
    assert build_in_process(project, tmp_path / "dist", monkeypatch, capsys) == (
        "patchset: error: src/lightning/fabric/utilities/_stray.py belongs to no patch: add it to the `New-Files:`"
        " of the patch whose pull request it is part of (a fork-only file to a `Forwarded: not-needed` patch), or"
        " remove it; nothing was built\n"
    )
