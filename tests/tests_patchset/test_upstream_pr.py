"""upstream-pr against a git repository built from the real sdist."""

import os
import subprocess
from pathlib import Path

import pytest
from patchset_helpers import PR_TEMPLATE, PROJECT_EMAIL, git, write

from patchset import PatchsetError
from patchset.export import export
from patchset.pin import read_pin
from patchset.series import ChangelogEntry
from patchset.upstream_pr import insert_changelog, upstream_pr
from patchset.workspace import base_repo, materialize_workspace

MESSAGE = """fabric: add a demo helper

Why: the demo needs it.

Bug: https://github.com/Lightning-AI/pytorch-lightning/issues/21308
Mirrors: https://github.com/Lightning-AI/pytorch-lightning/pull/21309
Forwarded: no
New-Files: src/lightning/fabric/utilities/_demo.py tests/tests_fabric/utilities/test_demo*.py
Changelog: fabric Fixed: Fixed the demo ([#21308](https://github.com/Lightning-AI/pytorch-lightning/issues/21308))
"""


pytestmark = pytest.mark.usefixtures("project_identity")  # upstream-pr refuses the tests' placeholder identity


@pytest.fixture
def demo_project(project: Path) -> Path:
    write(project / "src/lightning/fabric/utilities/_demo.py", "VALUE = 1\n")
    write(project / "tests/tests_fabric/utilities/test_demo.py", "def test_demo():\n    assert True\n")
    write(project / "tests/tests_fabric/utilities/test_unrelated.py", "def test_other():\n    assert True\n")
    workspace = materialize_workspace(project)
    init = workspace / "src/lightning/fabric/utilities/__init__.py"
    init.write_text(init.read_text() + "from lightning.fabric.utilities._demo import VALUE  # noqa: F401\n")
    git(workspace, "commit", "-qam", MESSAGE)
    export(project)
    return project


@pytest.fixture
def upstream_checkout(project: Path, tmp_path: Path) -> Path:
    onto = tmp_path / "upstream"
    base_repo(read_pin(project), onto)
    return onto


def test_upstream_pr_is_one_clean_commit(demo_project: Path, upstream_checkout: Path):
    onto = upstream_checkout
    branch = upstream_pr(demo_project, "2", onto)
    assert branch == "patchset/fabric-add-a-demo-helper"
    assert git(onto, "rev-parse", "--abbrev-ref", "HEAD") == branch
    assert git(onto, "rev-list", "--count", "upstream..HEAD") == "1"
    changed = git(onto, "show", "--name-only", "--format=", "HEAD").splitlines()
    assert sorted(changed) == [
        "src/lightning/fabric/CHANGELOG.md",
        "src/lightning/fabric/utilities/__init__.py",
        "src/lightning/fabric/utilities/_demo.py",
        "tests/tests_fabric/utilities/test_demo.py",
    ]
    message = git(onto, "log", "-1", "--format=%B")
    assert message.splitlines()[0] == "fabric: add a demo helper"
    for fork_only in ("Forwarded", "Changelog:", "New-Files"):
        assert fork_only not in message
    assert message.rstrip().endswith("Fixes #21308")
    changelog = (onto / "src/lightning/fabric/CHANGELOG.md").read_text()
    unreleased = changelog.split("\n## [2.")[0]
    fixed = unreleased.split("### Fixed")[1]
    assert fixed.strip().startswith("- Fixed the demo ([#21308]")
    assert "\n-\n" not in fixed  # the empty placeholder was replaced


def test_fork_packaging_patch_has_no_upstream_pr(demo_project: Path, upstream_checkout: Path):
    with pytest.raises(PatchsetError, match="fork packaging \\(Forwarded: not-needed\\)"):
        upstream_pr(demo_project, "0001", upstream_checkout)


def test_refuses_a_dirty_checkout_and_unknown_patches(demo_project: Path, upstream_checkout: Path):
    with pytest.raises(PatchsetError, match="9: no such patch in patches/series"):
        upstream_pr(demo_project, "9", upstream_checkout)
    (upstream_checkout / "README.md").write_text("local edit\n")
    with pytest.raises(PatchsetError, match="uncommitted changes"):
        upstream_pr(demo_project, "2", upstream_checkout)


def test_a_new_file_that_exists_upstream_leaves_the_checkout_as_it_was(demo_project: Path, upstream_checkout: Path):
    write(upstream_checkout / "tests/tests_fabric/utilities/test_demo.py", "# upstream's own\n")
    git(upstream_checkout, "add", "-A")
    git(upstream_checkout, "-c", "user.name=u", "-c", "user.email=u@x", "commit", "-qm", "upstream has it")
    head = git(upstream_checkout, "rev-parse", "HEAD")
    with pytest.raises(PatchsetError, match=r"tests/tests_fabric/utilities/test_demo\.py already exists"):
        upstream_pr(demo_project, "2", upstream_checkout)
    assert git(upstream_checkout, "rev-parse", "HEAD") == head
    assert git(upstream_checkout, "status", "--porcelain") == ""
    assert "patchset/" not in git(upstream_checkout, "branch")


def test_cli_upstream_pr_makes_the_branch_and_writes_the_pr_description(
    demo_project: Path, upstream_checkout: Path, run_cli, tmp_path: Path
):
    write(upstream_checkout / ".github/PULL_REQUEST_TEMPLATE.md", PR_TEMPLATE)
    git(upstream_checkout, "add", "-A")
    git(upstream_checkout, "commit", "-qm", "upstream's PR template")
    proc = run_cli(demo_project, "upstream-pr", "0002", "--onto", str(upstream_checkout), "--branch", "pr-demo")
    assert proc.returncode == 0, proc.stderr
    written = demo_project / ".work/pr/0002-fabric-add-a-demo-helper.md"
    assert proc.stdout.splitlines() == [
        f"created branch pr-demo in {upstream_checkout}",
        f"wrote the PR description to {written}",
    ]
    text = written.read_text()
    assert text.startswith("## What does this PR do?\n\nWhy: the demo needs it.\n")
    assert "Fixes #21308\n" in text
    # an issue alone is no agreement: the box stays unticked and says so
    assert (
        "- Was this **discussed/agreed** via a GitHub issue? (not for typos and docs) Not yet: reported in #21308,"
        " with no maintainer's agreement to this change." in text
    )
    assert "Yes: `src/lightning/fabric/utilities/_demo.py`" not in text  # not a test, not docs
    assert "Yes: `tests/tests_fabric/utilities/test_demo.py`." in text
    assert proc.stderr == ""
    assert git(upstream_checkout, "status", "--porcelain") == ""  # nothing written into the upstream checkout

    proc = run_cli(
        demo_project, "upstream-pr", "0002", "--onto", str(upstream_checkout), "--branch", "pr-demo", "--force",
        "--description", "-",
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.split("\n", 1)[1] == text  # printed, the same text


def test_cli_upstream_pr_without_a_template_makes_the_branch_and_says_why_there_is_no_description(
    demo_project: Path, upstream_checkout: Path, run_cli
):
    proc = run_cli(demo_project, "upstream-pr", "0002", "--onto", str(upstream_checkout), "--branch", "pr-demo")
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == f"created branch pr-demo in {upstream_checkout}"
    assert "no PR description written" in proc.stderr
    assert ".github/PULL_REQUEST_TEMPLATE.md" in proc.stderr


@pytest.mark.parametrize(
    ("before", "after"),
    [
        ("## [unreleased]\n\n### Fixed\n\n-\n\n## [1.0]\n", "## [unreleased]\n\n### Fixed\n\n- X\n\n## [1.0]\n"),
        (
            "## [unreleased]\n\n### Fixed\n\n- A\n\n### Removed\n",
            "## [unreleased]\n\n### Fixed\n\n- A\n\n- X\n\n### Removed\n",
        ),
        (
            "# C\n\n## [unreleased]\n\n### Added\n\n- A\n",
            "# C\n\n## [unreleased]\n\n### Fixed\n\n- X\n\n### Added\n\n- A\n",
        ),
    ],
)
def test_insert_changelog(before: str, after: str):
    assert insert_changelog(before, ChangelogEntry("fabric", "Fixed", "X")) == after


@pytest.mark.parametrize("text", ["# Changelog\n", "# Changelog\n\n## [2.6.6] - 2026-11-01\n\n### Fixed\n\n- A\n"])
def test_insert_changelog_needs_an_unreleased_heading(text: str):
    with pytest.raises(PatchsetError, match=r"first `## ` heading is not `## \[unreleased\]`"):
        insert_changelog(text, ChangelogEntry("fabric", "Fixed", "X"))


def test_bad_changelog_field_is_named(demo_project: Path):
    from patchset.check import check

    patch = demo_project / "patches" / "0002-fabric-add-a-demo-helper.patch"
    patch.write_text(patch.read_text().replace("Changelog: fabric Fixed:", "Changelog: fabric Repaired:"))
    (finding,) = [f for f in check(demo_project) if "Changelog" in f.message]
    assert finding.ok is False
    assert "0002-fabric-add-a-demo-helper.patch: bad Changelog field 'fabric Repaired:" in finding.message


def test_only_fork_fields_are_dropped_and_folded_lines_go_with_them(project: Path, upstream_checkout: Path):
    workspace = materialize_workspace(project)
    init = workspace / "src/lightning/fabric/utilities/__init__.py"
    init.write_text(init.read_text() + "# touched\n")
    message = (
        "fabric: touch utilities\n\nWhy.\n\n"
        "Bug: https://github.com/Lightning-AI/pytorch-lightning/issues/1\n"
        "Changelog: fabric Fixed: Fixed a long entry that wraps\n"
        " onto a second line\n"
        "Signed-off-by: A Dev <dev@example.com>\n"
        "Forwarded: no\n"
    )
    git(workspace, "commit", "-qam", message)
    export(project)
    from patchset.series import read_series

    patch = read_series(project)[1]
    assert patch.changelog[0].text == "Fixed a long entry that wraps onto a second line"
    upstream_pr(project, "2", upstream_checkout)
    upstream_message = git(upstream_checkout, "log", "-1", "--format=%B")
    assert upstream_message.splitlines()[-2:] == ["Signed-off-by: A Dev <dev@example.com>", "Fixes #1"]
    assert "onto a second line" not in upstream_message
    assert (
        "- Fixed a long entry that wraps onto a second line"
        in (upstream_checkout / "src/lightning/fabric/CHANGELOG.md").read_text()
    )
    # the maintainer's own identity commits in their checkout, not the tool's
    assert git(upstream_checkout, "log", "-1", "--format=%cn <%ce>") == f"Lightning patch set <{PROJECT_EMAIL}>"


def test_the_branch_starts_at_upstreams_default_branch_not_at_the_current_head(
    demo_project: Path, upstream_checkout: Path
):
    main = git(upstream_checkout, "rev-parse", "HEAD")
    git(upstream_checkout, "checkout", "-q", "-b", "other-pr")
    write(upstream_checkout / "README.md", "someone else's PR\n")
    git(upstream_checkout, "commit", "-qam", "another PR")
    branch = upstream_pr(demo_project, "2", upstream_checkout)
    assert git(upstream_checkout, "rev-parse", f"{branch}~1") == main  # not stacked on other-pr


def test_a_second_run_needs_force_and_force_recreates_the_branch(demo_project: Path, upstream_checkout: Path):
    branch = upstream_pr(demo_project, "2", upstream_checkout)
    first = git(upstream_checkout, "rev-parse", branch)
    git(upstream_checkout, "checkout", "-q", "main")
    with pytest.raises(PatchsetError, match=f"branch {branch} exists; pass --force to recreate it from main"):
        upstream_pr(demo_project, "2", upstream_checkout)
    write(upstream_checkout / "NEWS", "upstream moved on\n")
    git(upstream_checkout, "add", "-A")
    git(upstream_checkout, "commit", "-qm", "upstream moved on")
    upstream_pr(demo_project, "2", upstream_checkout, force=True)
    assert git(upstream_checkout, "rev-parse", branch) != first
    assert git(upstream_checkout, "rev-parse", f"{branch}~1") == git(upstream_checkout, "rev-parse", "main")


def test_a_patch_that_does_not_apply_shows_gits_reason_and_leaves_the_checkout_clean(
    demo_project: Path, upstream_checkout: Path
):
    init = upstream_checkout / "src/lightning/fabric/utilities/__init__.py"
    init.write_text("# upstream rewrote this file\n")
    git(upstream_checkout, "commit", "-qam", "upstream rewrote it")
    git(upstream_checkout, "checkout", "-q", "-b", "mine")
    with pytest.raises(PatchsetError) as err:
        upstream_pr(demo_project, "2", upstream_checkout, base="main")
    assert "does not apply to" in str(err.value)
    assert "git said:" in str(err.value)
    assert "src/lightning/fabric/utilities/__init__.py" in str(err.value)  # git's own words name the file
    assert git(upstream_checkout, "rev-parse", "--abbrev-ref", "HEAD") == "mine"
    assert git(upstream_checkout, "status", "--porcelain", "--ignored") == ""
    assert not (upstream_checkout / ".git" / "rebase-apply").exists()
    assert "patchset/" not in git(upstream_checkout, "branch")


def test_the_author_is_the_patchs_real_identity_or_the_one_given(demo_project: Path, upstream_checkout: Path):
    upstream_pr(demo_project, "2", upstream_checkout)
    assert git(upstream_checkout, "log", "-1", "--format=%an <%ae>") == f"Lightning patch set <{PROJECT_EMAIL}>"
    upstream_pr(demo_project, "2", upstream_checkout, force=True, base="main", author="A Dev <a.dev@lightning.ai>")
    assert git(upstream_checkout, "log", "-1", "--format=%an <%ae>") == "A Dev <a.dev@lightning.ai>"
    with pytest.raises(PatchsetError, match="is a placeholder address; fix the patch's From: or pass --author"):
        upstream_pr(demo_project, "2", upstream_checkout, force=True, base="main", author="X <x@example.com>")


def test_a_checkout_without_a_git_identity_commits_as_the_author(
    demo_project: Path, upstream_checkout: Path, monkeypatch
):
    for role in ("AUTHOR", "COMMITTER"):
        monkeypatch.delenv(f"GIT_{role}_NAME")
        monkeypatch.delenv(f"GIT_{role}_EMAIL")
    monkeypatch.delenv("EMAIL", raising=False)
    monkeypatch.setenv("GIT_CONFIG_GLOBAL", "/dev/null")
    monkeypatch.setenv("GIT_CONFIG_NOSYSTEM", "1")
    upstream_pr(demo_project, "2", upstream_checkout)
    assert git(upstream_checkout, "log", "-1", "--format=%cn <%ce>") == f"Lightning patch set <{PROJECT_EMAIL}>"


@pytest.mark.parametrize("operation", ["am", "rebase"])
def test_a_paused_operation_in_the_checkout_is_left_alone(
    demo_project: Path, upstream_checkout: Path, tmp_path: Path, operation: str
):
    onto = upstream_checkout
    readme = onto / "README.md"
    if operation == "am":
        bad = write(
            tmp_path / "bad.patch", git(onto, "format-patch", "-1", "--stdout", "HEAD").replace("\n+", "\n+x", 1)
        )
        subprocess.run(["git", "-C", str(onto), "am", str(bad)], capture_output=True)
    else:
        git(onto, "checkout", "-q", "-b", "userwork")
        readme.write_text("user commit\n")
        git(onto, "commit", "-qam", "user commit 1")
        env = {**os.environ, "GIT_SEQUENCE_EDITOR": "sed -i 1s/^pick/edit/"}
        subprocess.run(["git", "-C", str(onto), "rebase", "-i", "HEAD~1"], env=env, capture_output=True, check=True)
    head = git(onto, "rev-parse", "HEAD")
    with pytest.raises(PatchsetError, match="is in the middle of a rebase"):
        upstream_pr(demo_project, "2", onto)
    assert git(onto, "rev-parse", "HEAD") == head
    marker = "rebase-apply" if operation == "am" else "rebase-merge"
    assert (onto / ".git" / marker).is_dir()  # the user's session is still there to continue


def test_a_branch_checked_out_in_another_worktree_is_not_recreated(demo_project: Path, upstream_checkout: Path):
    branch = upstream_pr(demo_project, "2", upstream_checkout)
    git(upstream_checkout, "checkout", "-q", "main")
    other = upstream_checkout.with_name("other-worktree")
    git(upstream_checkout, "worktree", "add", "-q", str(other), branch)
    with pytest.raises(PatchsetError, match=f"{branch} is checked out in the worktree {other}"):
        upstream_pr(demo_project, "2", upstream_checkout, force=True)
    # a branch whose name only starts with the PR branch's is another branch
    git(other, "checkout", "-q", "-b", f"{branch}-other")
    assert upstream_pr(demo_project, "2", upstream_checkout, force=True) == branch


def test_a_linked_worktree_is_cleaned_up_after_a_conflict(demo_project: Path, upstream_checkout: Path):
    init = upstream_checkout / "src/lightning/fabric/utilities/__init__.py"
    init.write_text("# upstream rewrote this file\n")
    git(upstream_checkout, "commit", "-qam", "upstream rewrote it")
    linked = upstream_checkout.with_name("linked")
    git(upstream_checkout, "worktree", "add", "-q", "--detach", str(linked), "main")
    with pytest.raises(PatchsetError, match="does not apply"):
        upstream_pr(demo_project, "2", linked, base="main")
    assert git(linked, "status", "--porcelain") == ""
    assert not Path(git(linked, "rev-parse", "--git-path", "rebase-apply")).exists()


def test_a_patch_that_fixes_part_of_an_issue_says_part_of_and_an_agreement_ticks_the_box(
    project: Path, upstream_checkout: Path
):
    from patchset.check import check
    from patchset.pr_text import fill_template
    from patchset.series import read_series

    workspace = materialize_workspace(project)
    init = workspace / "src/lightning/fabric/utilities/__init__.py"
    init.write_text(init.read_text() + "# touched\n")
    message = (
        "fabric: touch utilities\n\nWhy.\n\n"
        "Part-Of: https://github.com/Lightning-AI/pytorch-lightning/issues/7\n"
        "Agreed: https://github.com/Lightning-AI/pytorch-lightning/issues/7#issuecomment-1\n"
        "Forwarded: no\n"
    )
    git(workspace, "commit", "-qam", message)
    export(project)
    assert [f.message for f in check(project) if not f.ok] == []  # the fields are known to the lint
    upstream_pr(project, "2", upstream_checkout)
    upstream_message = git(upstream_checkout, "log", "-1", "--format=%B")
    assert upstream_message.rstrip().splitlines()[-1] == "Part of #7"
    assert "Fixes" not in upstream_message
    assert "Agreed" not in upstream_message
    text = fill_template(PR_TEMPLATE, project, read_series(project)[1])
    assert "Part of #7" in text.splitlines()
    assert not [line for line in text.splitlines() if line.startswith("Fixes")]
    (agreed,) = [line for line in text.splitlines() if "discussed/agreed" in line]
    assert agreed.endswith("Yes: https://github.com/Lightning-AI/pytorch-lightning/issues/7#issuecomment-1.")
