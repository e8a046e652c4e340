"""materialize -> edit -> export -> check, with real git on the real pinned sdist."""

import re
from pathlib import Path

import pytest
from patchset import PatchsetError
from patchset.check import check
from patchset.export import export
from patchset.materialize import WORKSPACE, materialize_workspace
from patchset.series import read_series
from patchset_helpers import git, write


def _patch_bytes(project: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted((project / "patches").iterdir())}


def test_workspace_has_base_one_commit_per_patch_and_our_files(project: Path):
    write(project / "src/lightning/fabric/utilities/_demo.py", "VALUE = 1\n")
    workspace = materialize_workspace(project)
    assert workspace == project / WORKSPACE
    commits = git(workspace, "rev-list", "--reverse", "upstream..HEAD").split()
    assert len(commits) == len(read_series(project)) >= 1
    assert git(workspace, "log", "-1", "--format=%s", "upstream").startswith("lightning 2.6.6 (upstream sdist")
    assert 'install_requires += ["pytorch-lightning"]' not in (workspace / "src/lightning/__setup__.py").read_text()
    demo = workspace / "src/lightning/fabric/utilities/_demo.py"
    assert demo.is_symlink()
    assert demo.resolve() == (project / "src/lightning/fabric/utilities/_demo.py").resolve()
    assert (workspace / "src/version.info").read_text() == "2.6.6+patchset.1\n"
    assert (workspace / "src/lightning/version.info").read_text() == "2.6.6+patchset.1\n"
    assert git(workspace, "status", "--porcelain") == ""  # our files are excluded, the version label skipped


def test_export_round_trip_is_byte_identical(project: Path):
    before = _patch_bytes(project)
    assert export(project, check=True) == []  # no workspace: materialize to a temporary one and re-export
    materialize_workspace(project)
    assert export(project) == []
    assert _patch_bytes(project) == before


def test_edit_export_check_cycle(project: Path):
    workspace = materialize_workspace(project)
    first = read_series(project)[0].name
    setup = workspace / "src/lightning/__setup__.py"
    setup.write_text(setup.read_text().replace("self-contained;", "self-contained (edited);"))
    with pytest.raises(PatchsetError, match=r"uncommitted changes"):
        materialize_workspace(project)
    git(workspace, "commit", "-qam", "unused", "--amend", "--no-edit")
    assert export(project, check=True) == [first]
    with pytest.raises(PatchsetError, match=f"has work not exported to patches/ \\({re.escape(first)}\\)"):
        materialize_workspace(project)
    assert export(project) == [first]
    assert "self-contained (edited);" in (project / "patches" / first).read_text()
    assert export(project, check=True) == []
    assert all(f.ok for f in check(project))

    # a new commit becomes a new patch at the end of the series; dropping it removes the patch
    write(workspace / "src/lightning/fabric/__about_fork__.py", "FORK = True\n")
    git(workspace, "add", "-A")
    git(workspace, "commit", "-qm", "fabric: add a fork marker\n\nWhy it exists.\n\nForwarded: no")
    assert export(project) == ["0002-fabric-add-a-fork-marker.patch", "series"]
    assert [p.name for p in read_series(project)] == [first, "0002-fabric-add-a-fork-marker.patch"]
    assert read_series(project)[1].forwarded == "no"
    git(workspace, "reset", "-q", "--hard", "HEAD~1")
    assert export(project) == ["0002-fabric-add-a-fork-marker.patch", "series"]
    assert not (project / "patches/0002-fabric-add-a-fork-marker.patch").exists()
    assert [p.name for p in read_series(project)] == [first]


def test_force_discards_unexported_work(project: Path):
    workspace = materialize_workspace(project)
    (workspace / "src/lightning/__init__.py").write_text("broken\n")
    materialize_workspace(project, force=True)
    assert (workspace / "src/lightning/__init__.py").read_text() != "broken\n"


def test_overlay_that_shadows_an_upstream_file_is_refused(project: Path, run_cli):
    write(project / "src/lightning/fabric/utilities/seed.py", "# a copy would go here\n")
    with pytest.raises(PatchsetError, match=r"src/lightning/fabric/utilities/seed\.py would shadow an upstream file"):
        materialize_workspace(project)
    assert not (project / WORKSPACE).exists()
    proc = run_cli(project, "materialize")
    assert proc.returncode == 1
    assert proc.stderr.strip().splitlines() == [
        "patchset: error: src/lightning/fabric/utilities/seed.py would shadow an upstream file: change upstream"
        " files through a patch, not by overlaying them"
    ]
    findings = check(project)
    assert [f.ok for f in findings if f.name == "overlay"] == [False]


def test_patch_that_no_longer_applies_names_patch_file_and_hunk(project: Path, run_cli):
    patch = read_series(project)[0].path
    text = patch.read_text()
    broken = text.replace("_PATH_REQUIREMENTS, unfreeze=", "_PATH_REQUIREMENTS, defrost=", 1)
    assert broken != text
    patch.write_text(broken)
    hunk = re.search(r"^@@ .* @@.*$", text, re.M).group(0)
    expected = f"{patch.name} does not apply: src/lightning/__setup__.py, hunk `{hunk}`"
    with pytest.raises(PatchsetError) as err:
        materialize_workspace(project)
    assert str(err.value) == expected
    assert not (project / WORKSPACE).exists()
    findings = check(project)
    assert (findings[0].ok, findings[0].message) == (False, expected)
    proc = run_cli(project, "check")
    assert proc.returncode == 1
    assert f"FAIL  {expected}" in proc.stdout


def test_patch_already_upstream_is_reported(project: Path, tmp_path: Path):
    """A patch whose change the base already has applies in reverse: report it as upstream, not as broken."""
    workspace = materialize_workspace(project)
    target = workspace / "src/lightning/fabric/utilities/seed.py"
    original = target.read_text()
    target.write_text(original.replace('"""', '""" ', 1))
    git(workspace, "commit", "-qam", "tmp: drift")
    target.write_text(original)
    git(workspace, "commit", "-qam", "fabric: restore the seed docstring\n\nForwarded: no")
    export(project)
    series = project / "patches" / "series"
    names = [p.name for p in read_series(project)]
    (project / "patches" / names[1]).unlink()  # keep only the restoring patch: its change is already in the base
    series.write_text("\n".join([names[0], names[2]]) + "\n")
    findings = check(project)
    assert findings[1].ok is False
    assert findings[1].message == f"{names[2]} is already upstream (it applies in reverse): drop it from patches/series"


def test_patch_applying_only_with_offsets_must_be_re_exported(project: Path, run_cli):
    patch = read_series(project)[0].path
    text = patch.read_text()
    patch.write_text(
        re.sub(
            r"^@@ -(\d+),(\d+) \+(\d+),",
            lambda m: f"@@ -{int(m[1]) - 3},{m[2]} +{int(m[3]) - 3},",
            text,
            count=1,
            flags=re.M,
        )
    )
    findings = check(project)
    assert findings[0].ok is False
    assert findings[0].message == f"{patch.name} applies, but only with offsets: re-run `export`"
    assert export(project, check=True) == [patch.name]
    proc = run_cli(project, "export", "--check")
    assert proc.returncode == 1
    assert f"re-export would change patches/{patch.name}" in proc.stdout


def test_cli_check_passes_on_this_repository(run_cli):
    from patchset_helpers import REPO

    proc = run_cli(REPO, "check")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert proc.stdout.splitlines()[0].startswith("ok    0001-")


def test_bad_series_entry(project: Path):
    (project / "patches" / "series").write_text("0009-missing.patch\n")
    with pytest.raises(PatchsetError, match=r"series:1: names 0009-missing\.patch, which is not in patches/"):
        check(project)


def test_python_dash_m_patchset_runs_as_a_program(tmp_path: Path):
    import os
    import subprocess
    import sys

    from patchset_helpers import TOOLS

    env = {**os.environ, "PYTHONPATH": str(TOOLS)}
    proc = subprocess.run(
        [sys.executable, "-m", "patchset", "--project", str(tmp_path), "check"], capture_output=True, text=True, env=env
    )
    assert proc.returncode == 1
    assert proc.stderr == f"patchset: error: {tmp_path}/patches/upstream.pin: the upstream pin file is missing\n"
