"""rebase: replay the series onto a new upstream release made from the real sdist."""

import os
import re
import subprocess
import tarfile
from pathlib import Path

import pytest
from patchset_helpers import git

from patchset import PatchsetError
from patchset.check import check
from patchset.export import export
from patchset.pin import extract_sdist, file_sha256, read_pin
from patchset.rebase import rebase
from patchset.series import read_series
from patchset.workspace import materialize_workspace

SETUP = "src/lightning/__setup__.py"


def _release(upstream_sdist: Path, tmp_path: Path, version: str, edit) -> Path:
    """A new upstream release: the real sdist, one file edited, the version bumped, packed as an sdist."""
    tree = tmp_path / f"lightning-{version}"
    extract_sdist(upstream_sdist, tree)
    edit(tree)
    for info in tree.rglob("version.info"):
        info.write_text(version + "\n")
    out = tmp_path / "dl" / f"lightning-{version}.tar.gz"
    out.parent.mkdir(exist_ok=True)
    with tarfile.open(out, "w:gz") as tar:
        tar.add(tree, arcname=tree.name)
    return out


def _edit(path: str, old: str, new: str):
    def edit(tree: Path) -> None:
        target = tree / path
        text = target.read_text()
        assert old in text
        target.write_text(text.replace(old, new, 1))

    return edit


def test_clean_rebase_pins_the_new_release(project: Path, upstream_sdist: Path, tmp_path: Path):
    sdist = _release(upstream_sdist, tmp_path, "2.6.7", _edit(SETUP, "import glob\n", "import glob\nimport sys\n"))
    result = rebase(project, "2.6.7", sdist=sdist)
    assert (result.replayed, result.dropped, result.stopped_at) == (1, [], None)
    pin = read_pin(project)
    assert (pin.version, pin.sdist, pin.sha256, pin.fork_version) == (
        "2.6.7",
        "lightning-2.6.7.tar.gz",
        file_sha256(sdist),
        "2.6.7+patchset.1",
    )
    assert "# The upstream release" in (project / "patches/upstream.pin").read_text()  # comments kept
    workspace = project / ".work/tree"
    assert (workspace / "src/version.info").read_text() == "2.6.7+patchset.1\n"
    assert git(workspace, "status", "--porcelain") == ""
    name = read_series(project)[0].name
    assert export(project) == [name]  # the hunk moved down one line
    assert "@@ -76,8 +76,7 @@" in (project / "patches" / name).read_text()
    assert all(f.ok for f in check(project))


def test_a_patch_upstream_took_is_dropped(project: Path, upstream_sdist: Path, tmp_path: Path):
    patch = read_series(project)[0].path

    def taken(tree: Path) -> None:  # upstream's release has the patch's whole change
        # not a repository, wherever the temporary folder is: inside one (nox's), `git apply` would skip every path
        ceiling = {**os.environ, "GIT_CEILING_DIRECTORIES": str(tree.parent)}
        subprocess.run(["git", "apply", str(patch)], cwd=tree, check=True, env=ceiling)

    sdist = _release(upstream_sdist, tmp_path, "2.7.0", taken)
    result = rebase(project, "2.7.0", sdist=sdist, sha256=file_sha256(sdist))
    assert result.dropped == ["build: do not pull the unpatched pytorch-lightning distribution"]
    assert result.replayed == 0
    assert export(project) == ["0001-build-do-not-pull-the-unpatched-pytorch-lightning-di.patch", "series"]
    assert read_series(project) == []


def test_a_conflict_stops_in_the_workspace(project: Path, upstream_sdist: Path, tmp_path: Path, run_cli):
    sdist = _release(
        upstream_sdist, tmp_path, "2.7.1", _edit(SETUP, 'install_requires += ["pytorch-lightning"]', "pass")
    )
    proc = run_cli(project, "rebase", "2.7.1", "--sdist", str(sdist))
    assert proc.returncode == 1
    assert "stopped at: build: do not pull the unpatched pytorch-lightning distribution" in proc.stdout
    assert (project / ".work/tree/.git/rebase-merge").is_dir()
    with pytest.raises(PatchsetError, match=r"in the middle of a rebase"):
        export(project)


def test_a_wrong_hash_changes_nothing(project: Path, upstream_sdist: Path, tmp_path: Path):
    sdist = _release(upstream_sdist, tmp_path, "2.6.8", lambda tree: None)
    pin_before = (project / "patches/upstream.pin").read_text()
    with pytest.raises(PatchsetError, match=r"does not match the given 00"):
        rebase(project, "2.6.8", sdist=sdist, sha256="00" * 32)
    assert (project / "patches/upstream.pin").read_text() == pin_before


def test_a_release_that_does_not_exist_changes_nothing(project: Path, tmp_path: Path, monkeypatch, run_cli):
    """The download comes first: no such release is one short error, and the workspace is not made again."""
    workspace = materialize_workspace(project)
    head = git(workspace, "rev-parse", "HEAD")
    (workspace / "marker").write_text("made before the rebase\n")
    pin_before = (project / "patches/upstream.pin").read_text()
    monkeypatch.setenv("PIP_NO_INDEX", "1")
    monkeypatch.setenv("PIP_FIND_LINKS", str(tmp_path))  # an index with nothing on it
    monkeypatch.delenv("LIGHTNING_PATCHSET_SDIST", raising=False)
    proc = run_cli(project, "rebase", "9.9.9")
    assert proc.returncode == 1
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1
    assert lines[0].startswith("patchset: error: your index has no sdist of lightning 9.9.9: nothing was changed.")
    assert "--sdist lightning-9.9.9.tar.gz --sha256" in lines[0]
    assert len(lines[0]) < 300
    assert (workspace / "marker").is_file()
    assert git(workspace, "rev-parse", "HEAD") == head
    assert not (project / ".work/previous-tree").exists()
    assert (project / "patches/upstream.pin").read_text() == pin_before


def test_each_rebase_keeps_the_workspace_it_replaces(project: Path, upstream_sdist: Path, tmp_path: Path):
    """Backups of replaced workspaces pile up, timestamped: the second rebase does not overwrite the first's."""
    materialize_workspace(project)
    first = _release(upstream_sdist, tmp_path, "2.6.7", _edit(SETUP, "import glob\n", "import glob\nimport sys\n"))
    rebase(project, "2.6.7", sdist=first)
    export(project)
    second = _release(upstream_sdist, tmp_path, "2.6.8", _edit(SETUP, "import glob\n", "import glob\nimport os\n"))
    rebase(project, "2.6.8", sdist=second)
    backups = sorted((project / ".work").glob("previous-tree*"))
    assert len(backups) == 2
    assert backups[0].name == "previous-tree"
    assert re.fullmatch(r"previous-tree-\d{8}T\d{6}Z", backups[1].name)
    # the timestamped one is the workspace from before the first rebase, the plain one from before the second
    assert git(backups[1], "log", "-1", "--format=%s", "upstream").startswith("lightning 2.6.6 ")
    assert git(backups[0], "log", "-1", "--format=%s", "upstream").startswith("lightning 2.6.7 ")
    assert git(project / ".work/tree", "log", "-1", "--format=%s", "upstream").startswith("lightning 2.6.8 ")
