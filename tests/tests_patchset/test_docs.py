"""The user-facing pages say what the patch files and the build say, and nothing that holds on one machine only."""

from __future__ import annotations

import os
import posixpath
import re
import subprocess
import sys
from pathlib import Path

import pytest
from patchset_helpers import PROJECT_EMAIL, REPO, newest_release

from patchset.flavours import fork_url
from patchset.pin import read_pin
from patchset.release import unreleased_notes
from patchset.series import CHANGELOG_SECTIONS, read_series

README = REPO / "README.md"
# the fork's own pages for users and maintainers (benchmark pages record the machine they ran on, as they should)
PAGES = [README, *(REPO / name for name in ("CHANGELOG.md", "docs/maintaining.md"))]
PAGES.append(REPO / "docs" / "torch-matrix.md")


def _table_rows(text: str, heading: str) -> dict[str, list[str]]:
    """The rows of the first table after ``heading``, by their first cell."""
    section = text.split(heading, 1)[1]
    rows = [line for line in section.splitlines() if line.startswith("| 0")]
    return {cells[0]: cells for cells in ([c.strip() for c in row.strip("|").split(" | ")] for row in rows)}


def _link_or_none(cell: str, url: str) -> bool:
    """Whether ``cell`` starts with a link to ``url`` (shown as ``#N``), or with a dash when there is no ``url``."""
    if not url:
        return cell.startswith("—")
    return cell.startswith(f"[#{url.rstrip('/').rsplit('/', 1)[1]}]({url})")


def _issue_cell(patch) -> str:
    """What the table's issue column starts with: `Bug:`, `part of` `Part-Of:`, or none yet and its feature request."""
    if patch.field("Bug"):
        return f"[#{patch.field('Bug').rsplit('/', 1)[1]}]({patch.field('Bug')})"
    if patch.field("Part-Of"):
        return f"part of [#{patch.field('Part-Of').rsplit('/', 1)[1]}]({patch.field('Part-Of')})"
    if patch.field("Feature-Request"):
        request = posixpath.relpath(patch.field("Feature-Request"), "docs")
        return f"none yet: [the feature request to file first]({request})"
    return "—"


def test_the_patch_table_is_the_patch_files_fields():
    rows = _table_rows((REPO / "docs/maintaining.md").read_text(encoding="utf-8"), "## The patches")
    patches = read_series(REPO)
    assert sorted(rows) == [patch.name[:4] for patch in patches]
    for patch in patches:
        _, _, issue, mirrors, forwarded, applied = rows[patch.name[:4]]
        assert issue.startswith(_issue_cell(patch)), (patch.name, issue)
        assert _link_or_none(mirrors, patch.field("Mirrors")), (patch.name, "Mirrors:", mirrors)
        assert forwarded.split()[0] == patch.forwarded, (patch.name, "Forwarded:", forwarded)
        assert applied == (patch.field("Applied-Upstream") or "—"), (patch.name, "Applied-Upstream:", applied)


def test_every_patch_is_authored_by_the_project():
    assert {patch.author for patch in read_series(REPO)} == {f"Lightning patch set <{PROJECT_EMAIL}>"}


def test_install_lines_use_the_address_pyproject_declares():
    url = fork_url(REPO)
    text = README.read_text(encoding="utf-8")
    assert f'pip install "lightning @ git+{url}@' in text
    assert f"{url}/issues" in text
    owner = url.split("/")[3]
    for page in PAGES:
        for found in re.findall(rf"https://github\.com/{owner}/[\w.-]+", page.read_text(encoding="utf-8")):
            assert found.removesuffix(".git") == url, (page.name, found)
    assert "<url of this repository>" not in text


def _git(repo: Path, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["git", "-C", str(repo), *args], capture_output=True, text=True, check=False)


def test_install_lines_pin_the_newest_release_by_a_commit_that_a_fresh_clone_has(tmp_path: Path):
    """Every ref in the README's install lines is the newest release's commit, as the CHANGELOG names it, and a clone
    of the repository (which has main's commits, and no tags) resolves it to a commit whose pin builds that release."""
    url = fork_url(REPO)
    text = README.read_text(encoding="utf-8")
    refs = re.findall(rf'{re.escape(url)}(?:\.git)?[@#]([^"\s#]+)', text)
    refs += re.findall(r'\b(?:rev|tag|branch) = "([^"]+)"', text)  # Poetry's table
    changelog = (REPO / "CHANGELOG.md").read_text(encoding="utf-8")
    releases = re.findall(r"^## \[([^\]]+)\] - [0-9-]+\n\nCommit: `([0-9a-f]{40})`$", changelog, re.MULTILINE)
    assert releases, "the CHANGELOG names no release's commit"
    version, commit = releases[0]
    assert len(refs) >= 6
    assert set(refs) == {commit}, refs
    assert f"`{version}` is commit `{commit}`" in text
    if not (REPO / ".git").exists() or _git(REPO, "rev-parse", "--is-shallow-repository").stdout.strip() != "false":
        pytest.skip("not a full git clone of the repository")
    clone = tmp_path / "clone"
    proc = subprocess.run(["git", "clone", "-q", "--no-checkout", "--no-tags", str(REPO), str(clone)], check=False)
    assert proc.returncode == 0
    assert _git(clone, "tag", "-l").stdout == ""
    assert _git(clone, "rev-parse", "--verify", "-q", f"{commit}^{{commit}}").stdout.strip() == commit
    assert _git(clone, "merge-base", "--is-ancestor", commit, "HEAD").returncode == 0, "not on main's history"
    pin = _git(clone, "show", f"{commit}:patches/upstream.pin").stdout
    assert f"local-version = {version.split('+', 1)[1]}" in pin.splitlines(), pin


@pytest.mark.slow
def test_the_release_the_readme_pins_has_every_option_the_readme_names(tmp_path: Path):
    """Each `Callable(keyword=...)` of the README exists in the build of the newest release's commit, which its install
    lines pin (on the release commit itself, before its README names it: that commit's own build)."""
    names = sorted({
        name for call in re.findall(r"`(\w+)\((\w+)=", README.read_text(encoding="utf-8")) for name in call
    })
    assert "save_pre_optimizer_step_state" in names, names
    if not (REPO / ".git").exists() or _git(REPO, "rev-parse", "--is-shallow-repository").stdout.strip() != "false":
        pytest.skip("not a full git clone of the repository")
    version, commit = newest_release()
    clone, tree = tmp_path / "clone", tmp_path / "tree"
    subprocess.run(["git", "clone", "-q", "--no-checkout", str(REPO), str(clone)], check=True)
    subprocess.run(["git", "-C", str(clone), "checkout", "-q", commit], check=True)
    build = "import sys, pathlib, patchset.materialize as m; m.build_tree(*map(pathlib.Path, sys.argv[1:]))"
    env = {**os.environ, "PYTHONPATH": str(clone / "tools")}  # that commit's own tool builds it
    proc = subprocess.run([sys.executable, "-c", build, str(clone), str(tree)], capture_output=True, text=True, env=env)
    assert proc.returncode == 0, proc.stderr[-2000:]
    code = "\n".join(path.read_text(encoding="utf-8") for path in sorted((tree / "src" / "lightning").rglob("*.py")))
    missing = [name for name in names if not re.search(rf"\b{name}\b", code)]
    assert not missing, f"{version} (commit {commit[:12]}) has no {', '.join(missing)}"


@pytest.mark.parametrize("page", PAGES, ids=lambda page: page.name)
def test_no_page_describes_one_machine_only(page: Path):
    text = page.read_text(encoding="utf-8")
    for machine in ("/work/", "/root/", "/home/", "/etc/xdg", "/opt/", "local CPU wheel", "this machine"):
        assert machine not in text, (page.name, machine)
    assert "pypi.org" not in text  # the index is the user's configured one


def test_the_changelog_keeps_a_changelog_and_has_a_section_to_release():
    """Something under `[Unreleased]`, except on the release commit (whose section is the release's) and on the commit
    with which `release` starts the next label."""
    text = (REPO / "CHANGELOG.md").read_text(encoding="utf-8")
    pin = read_pin(REPO)
    if "\n## [Unreleased]" not in text:  # the release commit
        assert f"\n## [{pin.fork_version}] - " in text
    else:
        _, notes = unreleased_notes(text)
        label = int(pin.local_version.removeprefix("patchset."))
        assert notes or f"\n## [{pin.version}+patchset.{label - 1}] - " in text
    assert set(re.findall(r"^### (.+)$", text, flags=re.MULTILINE)) <= set(CHANGELOG_SECTIONS)


def test_ci_checks_run_the_nox_lint_session():
    """`nox -s lint` is what ci-checks.yml runs, so the two cannot drift apart."""
    workflow = (REPO / ".github" / "workflows" / "ci-checks.yml").read_text(encoding="utf-8")
    runs = [line.strip() for line in workflow.splitlines() if line.strip().startswith(("run:", "- run:"))]
    assert any("nox" in run and "-s lint" in run for run in runs), runs
    assert not any(tool in run for run in runs for tool in ("ruff ", "mypy ", "patchset check", "export --check"))
