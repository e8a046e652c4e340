"""The PR text (upstream's template, every item answered from the patch and the records of upstream's jobs) and the
feature request a patch's feature needs upstream first (upstream's issue form, filled from the project's file)."""

import os
import re
import subprocess
from pathlib import Path

import pytest
from patchset_helpers import PR_TEMPLATE, REPO, copy_project, git, upstream_record, write

from patchset import PatchsetError
from patchset.distribution import fork_url
from patchset.pin import read_pin
from patchset.pr_text import (
    NOT_ANSWERED,
    breaking_changes,
    feature_request,
    fill_form,
    fill_template,
    form_fields,
    unanswered,
)
from patchset.records import JOBS, add
from patchset.series import read_series
from patchset.workspace import base_repo

UPSTREAM_BOUND = [patch for patch in read_series(REPO) if patch.upstreamable]


def checklist_items(template: str) -> list[str]:
    """The *Before submitting* items of a template (their text, without the box)."""
    block = template.split("Before submitting", 1)[-1].split("</details>", 1)[0]
    return [m.group(2) for line in block.splitlines() if (m := re.match(r"^- (\[[ x]\] )?(.+)$", line))]


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
    (project / "docs/records/upstream-tests.json").unlink(missing_ok=True)
    patch = read_series(project)[2]
    line = _tests_line(fill_template(PR_TEMPLATE, project, patch))
    assert line.startswith("- [ ] ")
    assert "newest torch allowed: not recorded for this version of the patch" in line

    for job in JOBS:
        add(project, "upstream-tests", upstream_record(patch, job))
    line = _tests_line(fill_template(PR_TEMPLATE, project, patch))
    assert line.startswith("- [x] ")
    assert "0 caused by this PR" in line

    failure = {"id": "tests/test_a.py::test", "reason": "AssertionError", "caused": True}
    branch = {"passed": 1, "failed": 1, "skipped": 0}
    add(project, "upstream-tests", upstream_record(patch, "oldest", branch=branch, failures=[failure], caused=1))
    line = _tests_line(fill_template(PR_TEMPLATE, project, patch))
    assert line.startswith("- [ ] ")
    assert "oldest requirements: 1 passed, 1 failed, 0 skipped, 1 caused by this PR" in line

    patch.path.write_text(patch.path.read_text() + "\n")  # the patch changed after its runs: they are stale
    assert "not recorded for this version" in _tests_line(fill_template(PR_TEMPLATE, project, read_series(project)[2]))


def test_the_tests_item_names_the_cause_of_each_failure_the_base_has_too(tmp_path: Path):
    """A maintainer reads why the branch's failures are not the PR's: a known cause of the machine, or the test."""
    project = copy_project(tmp_path / "project", include=("patches", "tools", "pyproject.toml", "docs/maintaining.md"))
    (project / "docs/records/upstream-tests.json").unlink(missing_ok=True)
    patch = read_series(project)[2]
    legacy = 'AssertionError: No checkpoints found in folder "<checkout>/tests/legacy/checkpoints/1.0.0"'
    newest = [
        {"id": "tests/legacy/test_ckpt.py::test_load[1.0.0]", "reason": legacy, "caused": False, "more": 2},
        {"id": "tests/unit/test_b.py::test_b", "reason": "ValueError: flaky", "caused": False},
    ]
    oldest = [
        {"id": "tests/gpu/test_c.py::test_c", "reason": "RuntimeError: only supported on CUDA GPUs.", "caused": False}
    ]
    mypy = [{"id": "src/x.py::return-value: Incompatible return value type", "reason": "Incompatible", "caused": False}]
    counts = {"newest": (5, 4, 0, newest), "oldest": (5, 1, 2, oldest), "mypy": (0, 1, 0, mypy), "ruff": (0, 0, 0, [])}
    for job, (passed, failed, skipped, failures) in counts.items():
        branch = {"passed": passed, "failed": failed, "skipped": skipped}
        add(project, "upstream-tests", upstream_record(patch, job, branch=branch, failures=failures))

    line = _tests_line(fill_template(PR_TEMPLATE, project, patch))
    assert line.startswith("- [x] ")
    assert (
        "newest torch allowed: 5 passed, 4 failed (1 `test_b.py::test_b`; 3 the legacy checkpoints not downloaded,"
        " as on the base), 0 skipped, 0 caused by this PR" in line
    )
    assert "oldest requirements: 5 passed, 1 failed (`test_c.py::test_c`: needs a CUDA GPU, as on the base)" in line
    assert "code-checks.yml runs it: 1 finding (`src/x.py::return-value`, as on the base), 0 caused" in line
    assert "pre-commit hooks run them: no findings, 0 caused by this PR" in line


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


# an issue form as GitHub reads them: a markdown block, two text fields (one required), a dropdown
FORM = """name: Ask for something
description: A form of the tests' own
labels: ["needs triage", "feature"]
body:
  - type: markdown
    attributes:
      value: Thanks!
  - type: textarea
    attributes:
      label: What and why
    validations:
      required: true
  - type: dropdown
    attributes:
      label: Area
      options: [a, b]
  - type: textarea
    attributes:
      label: Other options
    validations:
      required: false
"""
BUG_FORM = 'name: Bug\nlabels: ["bug"]\nbody:\n  - type: textarea\n    attributes:\n      label: What broke\n'

REQUEST = """# Let the demo do more

## What and why

It cannot do more. Run `python -c 'print(1)'`.
"""


def test_the_form_s_text_fields_are_read_in_order_with_what_they_require():
    assert form_fields(FORM) == [("What and why", True), ("Other options", False)]


def test_each_field_gets_its_section_and_a_missing_optional_one_says_no_response():
    body = fill_form(form_fields(FORM), REQUEST.split("\n", 1)[1], "request.md")
    assert (
        body
        == "### What and why\n\nIt cannot do more. Run `python -c 'print(1)'`.\n\n### Other options\n\n_No response_\n"
    )


@pytest.mark.parametrize(
    ("text", "error"),
    [
        ("## Other options\n\nnone\n", "request.md: upstream's form requires 'What and why'; add a `## What and why`"),
        ("## What and why\n\nx\n\n## Pitch\n\ny\n", "request.md: no field 'Pitch' in upstream's form (it has Other"),
    ],
)
def test_a_required_field_left_out_or_a_section_the_form_lacks_is_one_error(text, error):
    with pytest.raises(PatchsetError) as err:
        fill_form(form_fields(FORM), text, "request.md")
    assert str(err.value).startswith(error)


@pytest.fixture
def upstream_checkout(project: Path, tmp_path: Path) -> Path:
    onto = tmp_path / "upstream"
    base_repo(read_pin(project), onto)
    return onto


@pytest.fixture
def project_with_request(project: Path) -> Path:
    """The project's first patch given a `Feature-Request:` field naming a request file of the project."""
    write(project / "docs/upstream-requests/0001-demo.md", REQUEST)
    (patch,) = read_series(project)
    text = patch.path.read_text()
    patch.path.write_text(
        text.replace("\nForwarded:", "\nFeature-Request: docs/upstream-requests/0001-demo.md\nForwarded:", 1)
    )
    return project


def test_the_request_is_upstream_s_feature_form_filled_and_the_pr_text_refers_to_it(
    project_with_request: Path, upstream_checkout: Path
):
    write(upstream_checkout / ".github/ISSUE_TEMPLATE/1_bug.yaml", BUG_FORM)
    write(upstream_checkout / ".github/ISSUE_TEMPLATE/3_feature.yaml", FORM)
    git(upstream_checkout, "add", "-A")
    git(upstream_checkout, "commit", "-qm", "issue forms")
    (patch,) = read_series(project_with_request)
    text = feature_request(project_with_request, patch, upstream_checkout, "HEAD")
    assert text is not None
    assert text.startswith("# Let the demo do more\n\n### What and why\n\nIt cannot do more.")  # not the bug form
    url = f"{fork_url(project_with_request)}/blob/main/docs/upstream-requests/0001-demo.md"
    description = fill_template(PR_TEMPLATE, project_with_request, patch).splitlines()
    assert f"Implements the feature request to be filed first, from {url}: put its number here." in description
    assert not [line for line in description if line.startswith("Fixes")]
    (agreed,) = [line for line in description if "discussed/agreed" in line]
    assert agreed.endswith(f"Not yet: the feature request ({url}) is to be filed and agreed first.")


def test_a_field_naming_no_file_of_the_project_is_one_error(project_with_request: Path, upstream_checkout: Path):
    (project_with_request / "docs/upstream-requests/0001-demo.md").unlink()
    (patch,) = read_series(project_with_request)
    with pytest.raises(PatchsetError, match=r"Feature-Request: docs/upstream-requests/0001-demo\.md is not a file"):
        feature_request(project_with_request, patch, upstream_checkout, "HEAD")


def test_a_patch_without_the_field_has_no_request(project: Path, upstream_checkout: Path):
    (patch,) = read_series(project)
    assert feature_request(project, patch, upstream_checkout, "HEAD") is None


@pytest.mark.skipif(not os.environ.get("PATCHSET_UPSTREAM"), reason="PATCHSET_UPSTREAM names no upstream checkout")
def test_each_request_of_the_series_fills_upstream_s_own_form():
    onto = Path(os.environ["PATCHSET_UPSTREAM"])
    base = subprocess.run(["git", "-C", str(onto), "rev-parse", "origin/HEAD"], capture_output=True, text=True).stdout
    requests = [p for p in read_series(REPO) if p.field("Feature-Request")]
    assert requests
    for patch in requests:
        assert feature_request(REPO, patch, onto, base.strip())
