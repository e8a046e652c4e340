"""rebase: replay the series onto a new upstream release made from the real sdist."""

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
    taken = _edit(
        SETUP,
        "    # toto: remove when we realize that this is making confusion as cross pkg import is not fully compatible\n"
        '    install_requires += ["pytorch-lightning"]\n',
        "    # The patch set's `lightning` is self-contained; `pytorch-lightning` from the index would be an unpatched"
        " copy.\n",
    )
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
