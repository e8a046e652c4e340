"""The series' own rules, on patch text: each broken rule is one sentence naming the patch or the file.

The rules read only the files of ``patches/`` and the list of new files, so they are tested on text written here;
one test runs them through ``check`` on a real workspace.
"""

import re
from pathlib import Path

import pytest
from patchset_helpers import git, write

from patchset.check import check
from patchset.export import export
from patchset.lint import lint, patch_problems, placeholder_author
from patchset.series import parse_patch
from patchset.workspace import WORKSPACE, materialize_workspace

PROJECT = "Lightning patch set <maintainers@users.noreply.a-seed-28b837d4.example>"
DEMO = "src/lightning/fabric/utilities/_demo.py"
PATCH = f"""From 0000000000000000000000000000000000000000 Mon Sep 17 00:00:00 2001
From: {PROJECT}
Subject: [PATCH] fabric: demo

Why it exists.

Forwarded: no
New-Files: {DEMO}
---
diff --git a/src/lightning/fabric/utilities/__init__.py b/src/lightning/fabric/utilities/__init__.py
index 1111111111111111111111111111111111111111..2222222222222222222222222222222222222222 100644
--- a/src/lightning/fabric/utilities/__init__.py
+++ b/src/lightning/fabric/utilities/__init__.py
@@ -1 +1,2 @@
 VALUE = 1
+# demo
"""
FORK_ONLY = PATCH.replace("fabric: demo", "build: fork packaging").replace("Forwarded: no", "Forwarded: not-needed")


def _problems(text: str) -> list[str]:
    return patch_problems(parse_patch(Path("0002-fabric-demo.patch"), text.encode()))


def _edited(old: str, new: str) -> str:
    assert old in PATCH
    return PATCH.replace(old, new, 1)


def _series(tmp_path: Path, *patches: tuple[str, str], extra: str = "") -> Path:
    """A project of these (name, text) patches in this order, with no new file but ``DEMO``."""
    for name, text in patches:
        write(tmp_path / "patches" / name, text)
    write(tmp_path / "patches/series", "# the order\n" + "".join(f"{name}\n" for name, _ in patches) + extra)
    return tmp_path


def test_a_patch_that_breaks_no_rule():
    assert _problems(PATCH) == []
    assert _problems(FORK_ONLY) == []


@pytest.mark.parametrize(
    ("old", "new", "problem"),
    [
        ("Forwarded: no", "Forwarded: not needed", "Forwarded: 'not needed' must be `no`, `not-needed` or the URL"),
        ("Forwarded: no", "Forwarded: no\nApplied-Upstream: no", "Applied-Upstream: 'no' must name the upstream"),
        ("Forwarded: no", "Forwarded: no\nApplied-Upstream: 2.7\nApplied-Upstream: 2.8", "more than one `Applied-Up"),
        ("Why it exists.\n\n", "", "no description: say why the patch exists"),
        ("+# demo", "+# demo  ", "src/lightning/fabric/utilities/__init__.py: an added line ends in whitespace"),
        (f"From: {PROJECT}", "From: helper <helper@localhost>", "author 'helper <helper@localhost>' is not `Name"),
        (f"From: {PROJECT}", "From: Dev <dev@example.com>", "author 'Dev <dev@example.com>' is a placeholder address"),
        ("Forwarded: no", "Forwarded: no\nChangelog: fabric Fixes: x", "bad Changelog field 'fabric Fixes: x'"),
        ("Forwarded: no", "forwarded: no", "'forwarded: no' is not a `Key: value` field"),
        ("Forwarded: no", "Forwarded : no", "'Forwarded : no' is not a `Key: value` field"),
        ("Forwarded: no", "ChangeLog: fabric Fixed: x\nForwarded: no", "'ChangeLog: fabric Fixed: x' is not a"),
        ("Forwarded: no", "Forwarded: no\nForwarded: not-needed", "needs exactly one `Forwarded:` field"),
        ("Forwarded: no", "Applied-upstream: 2.7.0\nForwarded: no", "'Applied-upstream: 2.7.0' is not a"),
        ("Forwarded: no\n", "", "needs exactly one `Forwarded:` field"),
        ("Why it exists.", "Why it exists.\nForwarded: not-needed", "is not in the last paragraph, where fields go"),
    ],
)
def test_each_broken_rule_is_named_and_a_typo_never_changes_where_the_patch_goes(old: str, new: str, problem: str):
    problems = _problems(_edited(old, new))
    assert any(problem in p for p in problems), problems


@pytest.mark.parametrize(
    "field",
    [
        "Applied-Upstream: 2.7.0",
        "Applied-Upstream: https://github.com/Lightning-AI/pytorch-lightning/pull/1",
        "Applied-Upstream: commit:0123456789abcdef",
        "Forwarded: https://github.com/Lightning-AI/pytorch-lightning/pull/1",
    ],
)
def test_dep3_values_that_are_fine(field: str):
    edited = _edited("Forwarded: no", field if field.startswith("Forwarded") else f"Forwarded: no\n{field}")
    assert _problems(edited) == []


def test_a_fork_only_patch_may_keep_a_placeholder_author():
    assert _problems(FORK_ONLY.replace(f"From: {PROJECT}", "From: builder <builder@localhost>")) == []


def test_a_patch_that_creates_a_file_is_refused():
    created = f"""diff --git a/{DEMO} b/{DEMO}
new file mode 100644
index 0000000000000000000000000000000000000000..1111111111111111111111111111111111111111
--- /dev/null
+++ b/{DEMO}
@@ -0,0 +1 @@
+X = 1
"""
    assert _problems(PATCH + created) == [
        f"creates {DEMO}: new files live in the project's overlay, owned by New-Files"
    ]


def test_series_file_new_files_and_dependencies(tmp_path: Path):
    project = _series(
        tmp_path,
        ("0001-build.patch", FORK_ONLY.replace(f"New-Files: {DEMO}\n", "")),
        ("0002-demo.patch", _edited("Forwarded: no", "Forwarded: no\nDepends-On: 0009-missing.patch")),
        ("0003-again.patch", _edited(f"New-Files: {DEMO}", f"New-Files: {DEMO} src/lightning/nothing_*.py")),
        extra="0001-build.patch\n",
    )
    write(project / "patches/0004-forgotten.patch", "From: x\n")
    assert lint(project, [DEMO, "src/lightning/fabric/_orphan.py"]) == [
        "patches/series: 0001-build.patch is listed more than once",
        "patches/0004-forgotten.patch is not listed in patches/series: add it there, or remove it",
        "0002-demo.patch: Depends-On: 0009-missing.patch is not an earlier, upstream-bound patch of the series",
        "0003-again.patch: New-Files glob 'src/lightning/nothing_*.py' matches no new file",
        f"{DEMO} belongs to more than one patch (0002-demo.patch, 0003-again.patch)",
        "src/lightning/fabric/_orphan.py belongs to no patch: add it to the `New-Files:` of the patch whose pull"
        " request it is part of (a fork-only file to a `Forwarded: not-needed` patch)",
    ]


def test_a_series_that_names_a_missing_file(tmp_path: Path):
    project = _series(tmp_path, ("0001-build.patch", FORK_ONLY), extra="0002-gone.patch\n")
    assert lint(project, [DEMO])[-1].endswith("names 0002-gone.patch, which is not in patches/")


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


def test_check_reports_each_broken_rule_as_a_fail_line(project: Path, project_identity: str):
    """The rules as ``check`` runs them, on a patch made in a real workspace and exported."""
    write(project / DEMO, "VALUE = 1\n")
    workspace = materialize_workspace(project)
    init = workspace / "src/lightning/fabric/utilities/__init__.py"
    init.write_text(init.read_text() + "# demo\n")
    git(workspace, "commit", "-qam", f"fabric: demo\n\nForwarded: not needed\nNew-Files: {DEMO}\n")
    export(project)
    failures = [f.message for f in check(project) if not f.ok]
    assert len(failures) == 2, failures
    assert re.search(r"0002-fabric-demo.patch: no description", failures[0] + failures[1])
    assert (project / WORKSPACE).is_dir()
