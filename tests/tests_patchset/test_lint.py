"""The series' own rules: each broken rule is one sentence naming the patch or file, and `check` reports each as a
FAIL line.

The rules read only ``patches/`` and the new files, so most cases run :func:`~patchset.lint.lint` on a copy of one
exported project, made once; the cases that need a workspace or the whole ``check`` make their own.
"""

import re
import shutil
from pathlib import Path

import pytest
from patchset_helpers import commit_as_project, copy_project, first_patch_only, git, write

from patchset import PatchsetError
from patchset.check import check
from patchset.export import export
from patchset.lint import lint, placeholder_author
from patchset.overlay import overlay_files
from patchset.series import read_series
from patchset.workspace import WORKSPACE, materialize_workspace

PROJECT = "Lightning patch set <maintainers@users.noreply.a-seed-28b837d4.example>"


def _failures(project: Path) -> list[str]:
    return lint(project, overlay_files(project))


def _check_failures(project: Path) -> list[str]:
    return [f.message for f in check(project) if not f.ok]


def _edit(patch: Path, old: str, new: str) -> None:
    text = patch.read_text()
    assert old in text
    patch.write_text(text.replace(old, new, 1))


def _add_upstream_patch(project: Path) -> Path:
    """A second, upstream-bound patch, made in the workspace and exported (commits under the project's identity)."""
    write(project / "src/lightning/fabric/utilities/_demo.py", "VALUE = 1\n")
    workspace = materialize_workspace(project)
    init = workspace / "src/lightning/fabric/utilities/__init__.py"
    init.write_text(init.read_text() + "# demo\n")
    message = "fabric: demo\n\nWhy it exists.\n\nForwarded: no\nNew-Files: src/lightning/fabric/utilities/_demo.py\n"
    git(workspace, "commit", "-qam", message)
    export(project)
    return read_series(project)[1].path


@pytest.fixture
def upstream_workspace(project: Path, project_identity: str) -> Path:
    """The project with a second, upstream-bound patch, and the workspace it was made in; the patch passes check."""
    patch = _add_upstream_patch(project)
    assert _check_failures(project) == []
    return patch


@pytest.fixture(scope="session")
def _exported(tmp_path_factory: pytest.TempPathFactory, upstream_sdist: Path) -> Path:
    """One project with the second patch exported, made once: the lint cases copy its ``patches/`` and new files."""
    project = first_patch_only(copy_project(tmp_path_factory.mktemp("lint") / "project"))
    with pytest.MonkeyPatch.context() as mp:
        commit_as_project(mp)
        _add_upstream_patch(project)
    shutil.rmtree(project / WORKSPACE.parent)
    return project


@pytest.fixture
def upstream_patch(_exported: Path, tmp_path: Path) -> Path:
    """A copy of the project with a second, upstream-bound patch that breaks no rule: edit it, then lint."""
    project = tmp_path / "project"
    shutil.copytree(_exported, project, symlinks=True)
    assert _failures(project) == []
    return read_series(project)[1].path


def test_check_reports_each_broken_rule_as_a_fail_line(upstream_workspace: Path):
    _edit(upstream_workspace, "Why it exists.\n\n", "")
    _edit(upstream_workspace, "Forwarded: no", "Forwarded: not needed")
    failures = _check_failures(upstream_workspace.parents[1])
    assert failures == _failures(upstream_workspace.parents[1])
    assert len(failures) == 2, failures


def test_a_patch_file_the_series_does_not_list_and_a_name_listed_twice(project: Path):
    first = read_series(project)[0].name
    write(project / "patches/0002-forgotten.patch", "From: x\n")
    series = project / "patches/series"
    series.write_text(series.read_text() + first + "\n")
    assert _failures(project)[:2] == [
        f"patches/series: {first} is listed more than once",
        "patches/0002-forgotten.patch is not listed in patches/series: add it there, or remove it",
    ]


@pytest.mark.parametrize(
    ("old", "new", "problem"),
    [
        ("Forwarded: no", "Forwarded: not needed", "Forwarded: 'not needed' must be `no`, `not-needed` or the URL"),
        ("Forwarded: no", "Forwarded: no\nApplied-Upstream: no", "Applied-Upstream: 'no' must name the upstream"),
        ("Why it exists.\n\n", "", "no description: say why the patch exists"),
        ("+# demo", "+# demo  ", "src/lightning/fabric/utilities/__init__.py: an added line ends in whitespace"),
        (f"From: {PROJECT}", "From: helper <helper@localhost>", "author 'helper <helper@localhost>' is not `Name"),
        (f"From: {PROJECT}", "From: Dev <dev@example.com>", "author 'Dev <dev@example.com>' is a placeholder address"),
        (
            "_demo.py\n",
            "_demo.py src/lightning/fabric/nothing_*.py\n",
            "glob 'src/lightning/fabric/nothing_*.py' matches",
        ),
        (
            "New-Files: src/lightning/fabric/utilities/_demo.py\n",
            "",
            "src/lightning/fabric/utilities/_demo.py belongs to",
        ),
    ],
)
def test_each_broken_rule_is_named(upstream_patch: Path, old: str, new: str, problem: str):
    _edit(upstream_patch, old, new)
    failures = _failures(upstream_patch.parents[1])
    assert any(problem in f for f in failures), failures


@pytest.mark.parametrize(
    "field",
    [
        "Applied-Upstream: 2.7.0",
        "Applied-Upstream: https://github.com/Lightning-AI/pytorch-lightning/pull/1",
        "Applied-Upstream: commit:0123456789abcdef",
        "Forwarded: https://github.com/Lightning-AI/pytorch-lightning/pull/1",
    ],
)
def test_dep3_values_that_are_fine(upstream_patch: Path, field: str):
    _edit(upstream_patch, "Forwarded: no", field if field.startswith("Forwarded") else f"Forwarded: no\n{field}")
    assert _failures(upstream_patch.parents[1]) == []


def test_a_fork_only_patch_may_keep_a_placeholder_author_and_own_fork_files(project: Path):
    patch = read_series(project)[0].path
    assert read_series(project)[0].forwarded == "not-needed"
    write(project / "docs/source-fabric/fork-notes.rst", "Fork notes\n")
    _edit(patch, "Forwarded: not-needed", "Forwarded: not-needed\nNew-Files: docs/source-fabric/fork-notes.rst")
    patch.write_text(
        re.sub(r"^From: .*\n( .*\n)*", "From: builder <builder@localhost>\n", patch.read_text(), count=1, flags=re.M)
    )
    assert read_series(project)[0].author == "builder <builder@localhost>"
    assert _failures(project) == []


def test_a_patch_that_creates_a_file_is_refused(upstream_workspace: Path):
    upstream_patch = upstream_workspace
    workspace = upstream_patch.parents[1] / WORKSPACE
    write(workspace / "src/lightning/fabric/utilities/_created.py", "X = 1\n")
    git(workspace, "add", "-f", "src/lightning/fabric/utilities/_created.py")
    git(workspace, "commit", "-q", "--amend", "--no-edit")
    export(upstream_patch.parents[1])
    assert any(
        "creates src/lightning/fabric/utilities/_created.py: new files live in the project's overlay" in f
        for f in _check_failures(upstream_patch.parents[1])
    )


def test_export_refuses_uncommitted_edits_and_names_them(upstream_workspace: Path, run_cli):
    project = upstream_workspace.parents[1]
    init = project / WORKSPACE / "src/lightning/fabric/utilities/__init__.py"
    init.write_text(init.read_text() + "# not committed\n")
    with pytest.raises(
        PatchsetError, match=re.escape("has uncommitted edits (src/lightning/fabric/utilities/__init__.py)")
    ):
        export(project)
    proc = run_cli(project, "export")
    assert proc.returncode == 1
    assert "src/lightning/fabric/utilities/__init__.py" in proc.stderr


@pytest.mark.parametrize(
    ("author", "ok"),
    [
        (PROJECT, True),
        ("A Maintainer <a.maintainer@lightning.ai>", True),
        ("helper <helper@localhost>", False),
        ("ports", False),
        ("Seed maintainers", False),
        ("Tests <tests@patchset.invalid>", False),
        ("Box <root@box.local>", False),
    ],
)
def test_placeholder_authors(author: str, ok: bool):
    assert (placeholder_author(author) is None) == ok


@pytest.mark.parametrize(
    ("old", "new", "problem"),
    [
        ("Forwarded: no", "Forwarded:no", "'Forwarded:no' is not a `Key: value` field"),
        ("Forwarded: no", "forwarded: no", "'forwarded: no' is not a `Key: value` field"),
        ("Forwarded: no", "Forwarded : no", "'Forwarded : no' is not a `Key: value` field"),
        ("Forwarded: no", "ChangeLog: fabric Fixed: x\nForwarded: no", "'ChangeLog: fabric Fixed: x' is not a"),
        ("Forwarded: no", "Forwarded: no\nForwarded: not-needed", "needs exactly one `Forwarded:` field"),
        ("Forwarded: no", "Applied-upstream: 2.7.0\nForwarded: no", "'Applied-upstream: 2.7.0' is not a"),
        ("Forwarded: no\n", "", "needs exactly one `Forwarded:` field"),
        ("Why it exists.", "Why it exists.\nForwarded: not-needed", "is not in the last paragraph, where fields go"),
        ("Forwarded: no", "Forwarded: no\nDepends-On: 0009-missing.patch", "Depends-On: 0009-missing.patch is not an"),
    ],
)
def test_a_typo_in_a_field_never_changes_where_the_patch_goes(upstream_patch: Path, old: str, new: str, problem: str):
    _edit(upstream_patch, old, new)
    failures = _failures(upstream_patch.parents[1])
    assert any(problem in f for f in failures), failures
