"""materialize -> edit -> export -> check, with real git on the real pinned sdist."""

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from patchset_helpers import FORK, TOOLS, git, write

from patchset import PatchsetError
from patchset.check import check
from patchset.export import export, preview
from patchset.series import read_series
from patchset.workspace import WORKSPACE, changed_names, materialize_workspace, unexported_work


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
    assert (workspace / "src/version.info").read_text() == f"{FORK}\n"
    assert (workspace / "src/lightning/version.info").read_text() == f"{FORK}\n"
    assert git(workspace, "status", "--porcelain") == ""  # our files are excluded, the version label skipped


def test_export_round_trip_is_byte_identical(project: Path):
    before = _patch_bytes(project)
    assert changed_names(*preview(project)) == []  # no workspace: materialize to a temporary one and re-export
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
    git(workspace, "commit", "-qa", "--amend", "--no-edit")
    assert unexported_work(project, workspace) == [first]
    assert changed_names(*preview(project)) == []  # export --check sees the patches as they are, not the workspace
    with pytest.raises(PatchsetError, match=f"has work not exported to patches/ \\({re.escape(first)}\\)"):
        materialize_workspace(project)
    assert export(project) == [first]
    assert "self-contained (edited);" in (project / "patches" / first).read_text()
    assert changed_names(*preview(project)) == []
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
    hunk = re.findall(r"^@@ .* @@.*$", text[: text.index("_PATH_REQUIREMENTS, unfreeze=")], re.M)[-1]  # the broken one
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
    (finding,) = [f for f in check(project) if f.name == names[2]]
    assert finding.ok is False
    assert finding.message == f"{names[2]} is already upstream (it applies in reverse): drop it from patches/series"


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
    assert changed_names(*preview(project)) == [patch.name]
    proc = run_cli(project, "export", "--check")
    assert proc.returncode == 1
    # the diff says what a re-export would change, so a failing CI run shows the fix
    assert f"--- a/patches/{patch.name}\n+++ b/patches/{patch.name}\n" in proc.stdout
    assert re.search(r"^-@@ -\d+,\d+ \+\d+,", proc.stdout, re.M)
    assert proc.stdout.rstrip().endswith("export check: FAILED")


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


def test_export_and_materialize_refuse_a_paused_rebase(project: Path):
    workspace = materialize_workspace(project)
    write(workspace / "src/lightning/fabric/_one.py", "ONE = 1\n")
    git(workspace, "add", "-A")
    git(workspace, "commit", "-qm", "fabric: one\n\nForwarded: no")
    export(project)
    proc = subprocess.run(
        ["git", "-C", str(workspace), "rebase", "-q", "-x", "false", "upstream"], capture_output=True, text=True
    )
    assert proc.returncode != 0  # stopped after the first commit, mid-rebase
    before = {p.name: p.read_bytes() for p in (project / "patches").iterdir()}
    with pytest.raises(PatchsetError, match=r"in the middle of a rebase"):
        export(project)
    with pytest.raises(PatchsetError, match=r"in the middle of a rebase"):
        materialize_workspace(project)
    assert {p.name: p.read_bytes() for p in (project / "patches").iterdir()} == before
    materialize_workspace(project, force=True)
    assert (project / ".work" / "previous-tree" / ".git" / "rebase-merge").is_dir()  # set aside, not deleted


def test_a_stale_workspace_never_reverts_patches_that_changed_since(project: Path):
    materialize_workspace(project)
    patch = read_series(project)[0].path
    patch.write_text(patch.read_text().replace("Forwarded: not-needed", "Forwarded: not-needed\nBug: none"))  # a pull
    pulled = patch.read_bytes()
    with pytest.raises(PatchsetError, match=r"patches/ changed since \.work/tree was materialized \(0001-"):
        export(project)
    assert patch.read_bytes() == pulled
    materialize_workspace(project)  # nothing of the workspace's own is lost, so no complaint
    assert export(project) == []
    assert patch.read_bytes() == pulled
    # --force is the explicit way to let the workspace win
    patch.write_text(patch.read_text().replace("\nBug: none", ""))
    assert export(project, force=True) == [patch.name]
    assert "Bug: none" in patch.read_text()


def test_a_commit_inserted_mid_series_renumbers_the_rest(project: Path):
    workspace = materialize_workspace(project)
    for name in ("alpha", "gamma"):
        write(workspace / f"src/lightning/fabric/_{name}.py", "X = 1\n")
        git(workspace, "add", "-A")
        git(workspace, "commit", "-qm", f"fabric: {name}\n\nForwarded: no")
    export(project)
    assert [p.name for p in read_series(project)][1:] == ["0002-fabric-alpha.patch", "0003-fabric-gamma.patch"]
    git(workspace, "checkout", "-q", "HEAD~1")
    write(workspace / "src/lightning/fabric/_beta.py", "X = 1\n")
    git(workspace, "add", "-A")
    git(workspace, "commit", "-qm", "fabric: beta\n\nForwarded: no")
    git(workspace, "cherry-pick", "main")
    git(workspace, "branch", "-f", "main", "HEAD")
    git(workspace, "checkout", "-q", "main")
    assert export(project) == ["0003-fabric-beta.patch", "0003-fabric-gamma.patch", "0004-fabric-gamma.patch", "series"]
    assert [p.name for p in read_series(project)][1:] == [
        "0002-fabric-alpha.patch",
        "0003-fabric-beta.patch",
        "0004-fabric-gamma.patch",
    ]
    assert not (project / "patches" / "0003-fabric-gamma.patch").exists()


def test_check_tells_a_message_difference_from_an_offset(project: Path):
    patch = read_series(project)[0].path
    patch.write_text(patch.read_text().replace("Forwarded: not-needed", "Forwarded: not-needed  "))
    finding = check(project)[0]
    assert (finding.ok, finding.message) == (False, f"{patch.name} applies, but not in exported form: re-run `export`")


def test_a_workspace_folder_not_made_by_materialize_is_left_alone(project: Path):
    write(project / ".work" / "tree" / "notes.txt", "mine\n")
    with pytest.raises(PatchsetError, match=r"exists but was not made by `materialize`"):
        materialize_workspace(project)
    assert (project / ".work" / "tree" / "notes.txt").read_text() == "mine\n"


def test_python_bytecode_in_the_workspace_is_not_work(project: Path):
    workspace = materialize_workspace(project)
    write(workspace / "src/lightning/__pycache__/x.cpython-311.pyc", "bytes")
    materialize_workspace(project)  # no "uncommitted changes"


def _commit(workspace: Path, name: str, message: str) -> None:
    """A commit that edits a file the sdist ships (a patch never creates one)."""
    init = workspace / "src/lightning/fabric/utilities/__init__.py"
    init.write_text(init.read_text() + f"# {name}\n")
    git(workspace, "commit", "-qam", message)


def test_depends_on_follows_a_reworded_and_renumbered_patch(project: Path, project_identity: str):
    workspace = materialize_workspace(project)
    _commit(workspace, "alpha", "fabric: alpha\n\nWhy.\n\nForwarded: no")
    _commit(workspace, "beta", "fabric: beta\n\nWhy.\n\nDepends-On: 0002-fabric-alpha.patch\nForwarded: no")
    export(project)
    # reword alpha and insert a patch before it: alpha becomes 0003 with another subject, beta 0004
    git(workspace, "checkout", "-q", "HEAD~2")
    seed = workspace / "src/lightning/fabric/utilities/seed.py"
    seed.write_text(seed.read_text() + "# first\n")
    git(workspace, "commit", "-qam", "fabric: first\n\nWhy.\n\nForwarded: no")
    git(workspace, "cherry-pick", "main~1")
    git(workspace, "commit", "-q", "--amend", "-m", "fabric: alpha, reworded\n\nWhy.\n\nForwarded: no")
    git(workspace, "cherry-pick", "main")
    git(workspace, "branch", "-f", "main", "HEAD")
    git(workspace, "checkout", "-q", "main")
    export(project)
    beta = read_series(project)[3]
    assert beta.name == "0004-fabric-beta.patch"
    assert beta.field("Depends-On") == "0003-fabric-alpha-reworded.patch"
    assert all(f.ok for f in check(project)), [f.message for f in check(project) if not f.ok]
    materialize_workspace(project)  # the workspace says what the files say: nothing is left to export


def test_a_stale_depends_on_fails_check(project: Path, project_identity: str):
    workspace = materialize_workspace(project)
    _commit(workspace, "alpha", "fabric: alpha\n\nWhy.\n\nDepends-On: 0001-gone.patch\nForwarded: no")
    export(project)
    assert [f.message for f in check(project) if not f.ok] == [
        "0002-fabric-alpha.patch: Depends-On: 0001-gone.patch is not an earlier, upstream-bound patch of the series"
    ]


def test_a_subject_in_brackets_survives_the_round_trip(project: Path, project_identity: str):
    workspace = materialize_workspace(project)
    _commit(workspace, "alpha", "[fabric] alpha\n\nWhy.\n\nForwarded: no")
    export(project)
    assert read_series(project)[1].subject == "[fabric] alpha"
    assert all(f.ok for f in check(project)), [f.message for f in check(project) if not f.ok]
    materialize_workspace(project, force=True)
    assert git(workspace, "log", "-1", "--format=%s") == "[fabric] alpha"


def test_export_refuses_a_workspace_off_its_branch(project: Path):
    workspace = materialize_workspace(project)
    _commit(workspace, "alpha", "fabric: alpha\n\nWhy.\n\nForwarded: no")
    export(project)
    git(workspace, "checkout", "-q", "HEAD~1")
    before = _patch_bytes(project)
    with pytest.raises(PatchsetError, match=r"is not on its branch main: check out main"):
        export(project)
    assert _patch_bytes(project) == before


def test_export_check_ignores_a_stale_workspace(project: Path):
    materialize_workspace(project)
    patch = read_series(project)[0].path
    patch.write_text(patch.read_text().replace("Forwarded: not-needed", "Forwarded: not-needed\nBug: none"))  # a pull
    assert changed_names(*preview(project)) == []


def test_check_says_which_earlier_patch_failed(project: Path, project_identity: str):
    workspace = materialize_workspace(project)
    setup = workspace / "src/lightning/__setup__.py"
    setup.write_text(setup.read_text().replace("self-contained;", "self-contained (edited);"))
    git(workspace, "commit", "-qam", "fabric: edit\n\nWhy.\n\nForwarded: no")
    export(project)
    first, second = (p.path for p in read_series(project))
    first.write_text(first.read_text().replace("unfreeze=", "defrost=", 1))
    (finding,) = [f for f in check(project) if f.name == second.name]
    assert not finding.ok
    assert finding.message.endswith(f"(after {first.name} failed)")


def test_check_and_export_check_need_nothing_but_git(project: Path):
    """Without tomli or PyYAML importable, as on a Python 3.10 without them."""
    code = (
        "import sys; sys.modules.update(tomli=None, tomllib=None, yaml=None)\n"
        "from patchset.cli import main\n"
        f"sys.exit(main(['--project', {str(project)!r}, 'check']) or main(['--project', {str(project)!r}, 'export',"
        " '--check']))"
    )
    env = {**os.environ, "PYTHONPATH": str(TOOLS)}
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env)
    assert proc.returncode == 0, proc.stdout + proc.stderr
