"""Upstream-only sections: hunks for upstream files the sdist does not ship, carried by a patch for its upstream PR.

Real git throughout: the upstream checkout is a repository made from the real sdist plus upstream files the sdist
leaves out (a conftest, a docs index), as upstream's own repository has them.
"""

from pathlib import Path

import pytest
from patchset_helpers import git, write

from patchset import PatchsetError
from patchset.check import check
from patchset.export import export, preview
from patchset.materialize import build_tree
from patchset.pin import read_pin
from patchset.series import read_series, split_patch
from patchset.upstream_pr import import_pr, upstream_pr
from patchset.workspace import NOTES_REF, WORKSPACE, base_repo, changed_names, materialize_workspace

MESSAGE = """fabric: note the demo in the conftest

The demo needs a line in upstream's conftest.

Forwarded: no
New-Files: src/lightning/fabric/utilities/_demo.py
Changelog: fabric Added: Added the demo
"""
CONFTEST = "tests/tests_fabric/conftest.py"
DEMO = "src/lightning/fabric/utilities/_demo.py"


pytestmark = pytest.mark.usefixtures("project_identity")  # upstream-pr refuses the tests' placeholder identity


@pytest.fixture
def upstream(project: Path, tmp_path: Path) -> Path:
    """An upstream checkout: the sdist's files plus files only upstream's repository has."""
    onto = tmp_path / "upstream"
    base_repo(read_pin(project), onto)
    write(onto / CONFTEST, "import pytest\n\n\ndef pytest_configure(config):\n    pass\n")
    write(onto / "docs/source-fabric/index.rst", "Fabric\n======\n\n.. toctree::\n\n   api\n")
    git(onto, "add", "-A")
    git(onto, "commit", "-qm", "upstream's repository has tests and docs")
    return onto


@pytest.fixture
def demo(project: Path, upstream: Path) -> Path:
    """A patch made in the workspace, then given an upstream-only conftest hunk on its PR branch and imported."""
    write(project / "src/lightning/fabric/utilities/_demo.py", "VALUE = 1\n")
    workspace = materialize_workspace(project)
    init = workspace / "src/lightning/fabric/utilities/__init__.py"
    init.write_text(init.read_text() + "from lightning.fabric.utilities._demo import VALUE  # noqa: F401\n")
    git(workspace, "commit", "-qam", MESSAGE)
    export(project)
    upstream_pr(project, "2", upstream)
    conftest = upstream / CONFTEST
    conftest.write_text(conftest.read_text().replace("    pass\n", "    config.addinivalue_line('markers', 'demo')\n"))
    git(upstream, "commit", "-qa", "--amend", "--no-edit")
    result = import_pr(project, "2", upstream)
    assert result == {"upstream-only": [CONFTEST], "new files": [DEMO], "not taken": []}
    git(upstream, "checkout", "-q", "main")
    return project


def test_a_patch_carries_upstream_only_sections_through_the_whole_workflow(demo: Path, upstream: Path):
    patch = read_series(demo)[1].path
    data = patch.read_bytes()
    paths = [s.path for s in split_patch(data)[1]]
    assert paths == ["src/lightning/fabric/utilities/__init__.py", CONFTEST]  # git's order
    assert b"+    config.addinivalue_line('markers', 'demo')" in data

    # the fork's build skips it (the sdist has no tests/), the workspace keeps it as a note
    assert not (build_tree(demo, demo / "tree") / "tests").exists()
    workspace = demo / WORKSPACE
    assert not (workspace / "tests").exists()
    note = git(workspace, "notes", f"--ref={NOTES_REF}", "show", "HEAD").encode() + b"\n"
    assert [s.path for s in split_patch(note)[1]] == [CONFTEST]
    assert all(f.ok for f in check(demo)), [f.message for f in check(demo) if not f.ok]
    assert changed_names(*preview(demo)) == []

    # editing the patch's other hunks in the workspace (amend) keeps the upstream-only section byte for byte
    init = workspace / "src/lightning/fabric/utilities/__init__.py"
    init.write_text(init.read_text() + "# amended\n")
    git(workspace, "commit", "-qa", "--amend", "--no-edit")
    assert export(demo) == [patch.name]
    after = patch.read_bytes()
    assert b"+# amended" in after
    old_conftest = next(s for s in split_patch(data)[1] if s.path == CONFTEST)
    assert old_conftest in split_patch(after)[1]

    # ... and so does a rebase of the series in the workspace
    git(workspace, "rebase", "-q", "--force-rebase", "upstream")
    assert changed_names(*preview(demo)) == []

    # upstream-pr applies it
    upstream_pr(demo, "2", upstream, force=True)
    assert "addinivalue_line('markers', 'demo')" in (upstream / CONFTEST).read_text()
    changed = git(upstream, "show", "--name-only", "--format=", "HEAD").splitlines()
    assert CONFTEST in changed


def test_a_patch_of_only_upstream_only_sections_is_an_empty_commit_in_the_workspace(project: Path, upstream: Path):
    write(project / "src/lightning/fabric/utilities/_demo.py", "VALUE = 1\n")
    workspace = materialize_workspace(project)
    git(workspace, "commit", "-q", "--allow-empty", "-m", MESSAGE)
    export(project)
    upstream_pr(project, "2", upstream)
    (upstream / CONFTEST).write_text("# only a conftest change\n")
    git(upstream, "commit", "-qa", "--amend", "--no-edit")
    import_pr(project, "2", upstream)
    patch = read_series(project)[1].path
    assert [s.path for s in split_patch(patch.read_bytes())[1]] == [CONFTEST]
    assert git(project / WORKSPACE, "diff", "--stat", "HEAD~1", "HEAD") == ""
    assert changed_names(*preview(project)) == []
    assert all(f.ok for f in check(project))


def test_import_pr_leaves_files_the_sdist_ships_to_the_workspace(demo: Path, upstream: Path):
    upstream_pr(demo, "2", upstream, force=True)
    init = upstream / "src/lightning/fabric/utilities/__init__.py"
    init.write_text(init.read_text() + "# edited on the branch\n")
    git(upstream, "commit", "-qa", "--amend", "--no-edit")
    before = read_series(demo)[1].path.read_bytes()
    result = import_pr(demo, "2", upstream)
    assert result["not taken"] == ["src/lightning/fabric/utilities/__init__.py"]
    assert read_series(demo)[1].path.read_bytes() == before


def test_import_pr_refuses_unexported_work(demo: Path, upstream: Path):
    (demo / WORKSPACE / "src/lightning/__init__.py").write_text("# not exported\n")
    git(demo / WORKSPACE, "commit", "-qam", "wip\n\nWhy.\n\nForwarded: no")
    with pytest.raises(PatchsetError, match="has work not exported"):
        import_pr(demo, "2", upstream)


def _second_patch(project: Path, upstream: Path, subject: str, depends: str | None, change: str) -> None:
    """Add a patch in the workspace (stacked: on __init__.py after 0002; else on seed.py), then a conftest hunk."""
    workspace = project / WORKSPACE
    init = workspace / ("src/lightning/fabric/utilities/" + ("__init__.py" if depends else "seed.py"))
    init.write_text(init.read_text() + f"# {subject}\n")
    fields = "Forwarded: no\n" + (f"Depends-On: {depends}\n" if depends else "")
    git(workspace, "commit", "-qam", f"fabric: {subject}\n\nWhy.\n\n{fields}")
    export(project)
    upstream_pr(project, "3", upstream, force=True)
    conftest = upstream / CONFTEST
    conftest.write_text(conftest.read_text() + change)
    git(upstream, "commit", "-qa", "--amend", "--no-edit")
    import_pr(project, "3", upstream)
    git(upstream, "checkout", "-q", "main")


def test_import_pr_of_a_stacked_patch_takes_only_its_own_change(demo: Path, upstream: Path):
    first = read_series(demo)[1].name
    _second_patch(demo, upstream, "stacked", first, "# stacked\n")
    upstream_pr(demo, "2", upstream, force=True)  # the PR it stacks on is made again (each upstream_* session does)
    git(upstream, "checkout", "-q", "main")
    result = import_pr(demo, "3", upstream)
    assert result["upstream-only"] == [CONFTEST]
    assert result["not taken"] == []
    section = next(s for s in split_patch(read_series(demo)[2].path.read_bytes())[1] if s.path == CONFTEST)
    assert b"+# stacked" in section.text
    assert b"addinivalue_line" not in section.text.split(b"@@", 2)[2].replace(b" config.addinivalue", b"")
    git(upstream, "checkout", "-q", "main")
    upstream_pr(demo, "3", upstream, force=True)  # it applies on its PR's base, 0002's branch


def test_export_refuses_to_lose_or_garble_upstream_only_sections(demo: Path, upstream: Path):
    first = read_series(demo)[1].name
    _second_patch(demo, upstream, "second", None, "# second\n")
    workspace = demo / WORKSPACE
    # a squash joins two notes that both change the conftest: refuse, say how to combine them
    git(workspace, "reset", "-q", "--soft", "HEAD~1")
    git(workspace, "commit", "-q", "--amend", "--no-edit")
    git(
        workspace,
        "notes",
        f"--ref={NOTES_REF}",
        "append",
        "-C",
        git(workspace, "notes", f"--ref={NOTES_REF}", "list", "ORIG_HEAD"),
        "HEAD",
    )
    with pytest.raises(PatchsetError, match=f"two upstream-only sections for {CONFTEST}"):
        export(demo)
    # a cherry-pick recreates a commit without its note: refuse rather than drop the section
    materialize_workspace(demo, force=True)
    git(workspace, "reset", "-q", "--hard", "HEAD~1")
    git(workspace, "cherry-pick", "ORIG_HEAD")
    with pytest.raises(PatchsetError, match=f"would drop upstream-only sections .*second: {CONFTEST}"):
        export(demo)
    # ... and so is one that is reworded as well: the patch is still found, by its diff
    git(workspace, "commit", "-q", "--amend", "-m", "fabric: the second, reworded\n\nWhy.\n\nForwarded: no")
    with pytest.raises(PatchsetError, match=f"would drop upstream-only sections .*reworded: {CONFTEST}"):
        export(demo)
    assert first in [p.name for p in read_series(demo)]


def test_unusual_paths_in_upstream_only_sections(project: Path, upstream: Path):
    odd = ["docs/source-fabric/a b/c.md", "tests/tests_fabric/tést data.txt"]
    for rel in odd:
        write(upstream / rel, "line\n")
    git(upstream, "add", "-A")
    git(upstream, "commit", "-qm", "odd names")
    write(project / "src/lightning/fabric/utilities/_demo.py", "VALUE = 1\n")
    workspace = materialize_workspace(project)
    git(workspace, "commit", "-q", "--allow-empty", "-m", MESSAGE)
    export(project)
    upstream_pr(project, "2", upstream)
    for rel in odd:
        (upstream / rel).write_text("line\nchanged\n")
    git(upstream, "commit", "-qa", "--amend", "--no-edit")
    assert sorted(import_pr(project, "2", upstream)["upstream-only"]) == sorted(odd)
    assert changed_names(*preview(project)) == []
    assert all(f.ok for f in check(project))
    upstream_pr(project, "2", upstream, force=True, base="main")
    assert all((upstream / rel).read_text() == "line\nchanged\n" for rel in odd)
