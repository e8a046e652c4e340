"""The PR description: upstream's template with every item answered from the patch and from the recorded runs."""

import os
import re
from pathlib import Path

import pytest
from patchset_helpers import PR_TEMPLATE, REPO, copy_project

from patchset.fork_metadata import fork_url
from patchset.pr_text import NOT_ANSWERED, breaking_changes, checklist_items, fill_template, unanswered
from patchset.series import read_series
from patchset.upstream_record import PAGE, RUNS, Context, Outcome, Record, blob_hash, write_record

UPSTREAM_BOUND = [patch for patch in read_series(REPO) if patch.upstreamable]


@pytest.mark.parametrize("patch", UPSTREAM_BOUND, ids=lambda p: p.name[:4])
def test_every_item_of_the_template_gets_an_answer(patch):
    text = fill_template(PR_TEMPLATE, REPO, patch)
    assert unanswered(text) == []
    items = checklist_items(PR_TEMPLATE)
    assert len(items) == 8
    for item in items:  # each item once, followed by its answer
        (line,) = [line for line in text.splitlines() if item in line]
        assert len(line.split(item, 1)[1].strip()) > 3, line
    assert patch.description.splitlines()[0] in text
    assert "<issue_number>" not in text
    assert "Say what changes and why" not in text  # the prompt is replaced by the answer
    for field, verb in (("Bug", "Fixes"), ("Part-Of", "Part of")):
        for value in patch.trailers.get(field, []):
            issue = re.search(r"/issues/(\d+)", value)
            assert issue
            assert f"{verb} #{issue.group(1)}" in text.splitlines()
    # each upstream-bound patch names its issue, or the feature request it needs first
    assert patch.trailers.get("Bug") or patch.trailers.get("Part-Of") or patch.trailers.get("Feature-Request")
    if not patch.trailers.get("Bug") and patch.trailers.get("Feature-Request"):
        assert any(line.startswith("Implements the feature request to be filed first") for line in text.splitlines())
    for entry in breaking_changes(patch):
        assert f"- {entry}" in text.splitlines()
    if not breaking_changes(patch):
        assert "No breaking changes." in text.splitlines()
    assert "- [ ] Is this pull request ready for review?" in text  # the reviewers' checklist is theirs


def test_the_benchmark_line_links_the_tables_benchmark_pages_in_the_fork():
    table = (REPO / "docs/maintaining.md").read_text(encoding="utf-8")
    with_benchmark = [p for p in UPSTREAM_BOUND if re.search(rf"^\| {p.name[:4]} \|.*benchmark\]", table, re.M)]
    assert with_benchmark  # 0002's stress benchmark, 0004's benchmark
    for patch in UPSTREAM_BOUND:
        lines = [line for line in fill_template(PR_TEMPLATE, REPO, patch).splitlines() if line.startswith("Benchmark:")]
        if patch in with_benchmark:
            assert lines
            assert f"]({fork_url(REPO)}/blob/main/docs/" in lines[0]
        else:
            assert lines == []


def _tests_line(text: str) -> str:
    (line,) = [line for line in text.splitlines() if "**existing tests pass**" in line]
    return line


def test_the_tests_item_is_ticked_only_when_every_job_is_recorded_on_this_patch_with_nothing_caused(tmp_path: Path):
    project = copy_project(tmp_path / "project", include=("patches", "tools", "pyproject.toml", "docs/maintaining.md"))
    (project / PAGE).unlink(missing_ok=True)
    patch = read_series(project)[2]
    line = _tests_line(fill_template(PR_TEMPLATE, project, patch))
    assert line.startswith("- [ ] ")
    assert "newest torch allowed: not recorded for this version of the patch" in line

    context = Context(patch.name, blob_hash(patch.path), "1" * 40, "upstream")
    for run in RUNS:
        write_record(project, Record(context, run, "torch 2.9.1", ["tests"]))
    line = _tests_line(fill_template(PR_TEMPLATE, project, patch))
    assert line.startswith("- [x] ")
    assert "0 caused by this PR" in line

    failing = Record(context, "oldest", "torch 2.1.0", ["tests"])
    failing.branch = {"t::x": Outcome("t::x", "failed", "AssertionError")}
    write_record(project, failing)
    line = _tests_line(fill_template(PR_TEMPLATE, project, patch))
    assert line.startswith("- [ ] ")
    assert "oldest requirements: 0 passed, 1 failed, 0 skipped, 1 caused by this PR" in line

    patch.path.write_text(patch.path.read_text() + "\n")  # the patch changed after its runs: they are stale
    assert "not recorded for this version" in _tests_line(fill_template(PR_TEMPLATE, project, read_series(project)[2]))


def test_an_item_the_rules_do_not_know_is_marked_and_named():
    template = PR_TEMPLATE.replace(
        "- Did you list all", "- [ ] Did you add a **new kind of item**?\n- Did you list all"
    )
    text = fill_template(template, REPO, UPSTREAM_BOUND[0])
    assert unanswered(text) == [f"- [ ] Did you add a **new kind of item**? {NOT_ANSWERED}"]


@pytest.mark.skipif(not os.environ.get("PATCHSET_UPSTREAM"), reason="PATCHSET_UPSTREAM names no upstream checkout")
def test_upstreams_own_template():
    """Upstream's template itself, from the checkout ``PATCHSET_UPSTREAM`` names (CI has none: the fixture mirrors
    it, item for item)."""
    template = (Path(os.environ["PATCHSET_UPSTREAM"]) / ".github/PULL_REQUEST_TEMPLATE.md").read_text(encoding="utf-8")
    assert len(checklist_items(template)) == len(checklist_items(PR_TEMPLATE))
    for patch in UPSTREAM_BOUND:
        assert unanswered(fill_template(template, REPO, patch)) == []
