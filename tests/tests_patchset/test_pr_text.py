"""The PR text (upstream's template, every item answered from the patch and the last `nox -s upstream` run) and the
feature request a patch's feature needs upstream first (upstream's issue form, filled from the project's file)."""

import hashlib
import os
import re
from pathlib import Path

import pytest
from patchset_helpers import PR_TEMPLATE, REPO, copy_project, write

from patchset import PatchsetError
from patchset.flavours import fork_url
from patchset.pr_text import (
    NOT_ANSWERED,
    UPSTREAM_RUNS,
    benchmark_links,
    breaking_changes,
    fill_template,
    unanswered,
)
from patchset.series import read_series

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
    test_files = {s.path for s in patch.sections if s.path.startswith("tests/")}
    if test_files and all(path.endswith("/conftest.py") for path in test_files):  # test tooling is not a new test
        assert "No new tests: the change is to the test tooling" in text


def test_the_benchmark_line_links_the_pages_the_patch_names_in_the_fork():
    with_benchmark = [p for p in UPSTREAM_BOUND if p.trailers.get("Benchmark")]
    assert with_benchmark  # 0002's stress benchmark, 0004's benchmark
    for patch in UPSTREAM_BOUND:
        lines = [line for line in fill_template(PR_TEMPLATE, REPO, patch).splitlines() if line.startswith("Benchmark:")]
        if patch in with_benchmark:
            for page in patch.field("Benchmark").split():
                assert f"]({fork_url(REPO)}/blob/main/{page})" in lines[0]
        else:
            assert lines == []


def test_a_benchmark_page_that_is_not_there_is_one_error(tmp_path: Path):
    project = copy_project(tmp_path / "project")
    patch = read_series(project)[0]
    patch.trailers["Benchmark"] = ["docs/gone.md"]
    with pytest.raises(PatchsetError, match=r"^0001-.*: Benchmark: docs/gone.md is not a file of the project$"):
        benchmark_links(project, patch)


def _tests_line(text: str) -> str:
    (line,) = [line for line in text.splitlines() if "**existing tests pass**" in line]
    return line


def test_the_tests_item_is_what_the_last_upstream_session_found_on_this_version_of_the_patch(tmp_path: Path):
    project = copy_project(tmp_path / "project")
    patch = read_series(project)[2]
    line = _tests_line(fill_template(PR_TEMPLATE, project, patch))
    assert line.startswith("- [ ] ")
    assert f"Not yet: `nox -s upstream -- {patch.name[:4]}`" in line

    result = f"`nox -s upstream -- {patch.name[:4]}` at abc1234 on upstream 7f0c343: 900 passed, 0 failed, 9 skipped"
    saved = project / UPSTREAM_RUNS / f"{patch.name[:4]}.txt"
    write(saved, f"{hashlib.sha256(patch.data).hexdigest()}\n{result}\n0\n")
    line = _tests_line(fill_template(PR_TEMPLATE, project, patch))
    assert line.startswith("- [x] ")
    assert line.endswith(result)

    write(saved, f"{hashlib.sha256(patch.data).hexdigest()}\n{result}\n2\n")  # two failures the base does not have
    assert _tests_line(fill_template(PR_TEMPLATE, project, patch)).startswith("- [ ] ")

    patch.path.write_text(patch.path.read_text() + "\n")  # the patch changed after its run: the result is stale
    assert "Not yet" in _tests_line(fill_template(PR_TEMPLATE, project, read_series(project)[2]))


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


REQUEST = """# Let the demo do more

## What and why

It cannot do more. Run `python -c 'print(1)'`.
"""


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


def test_the_pr_text_refers_to_the_request_to_file_first(project_with_request: Path):
    (patch,) = read_series(project_with_request)
    url = f"{fork_url(project_with_request)}/blob/main/docs/upstream-requests/0001-demo.md"
    description = fill_template(PR_TEMPLATE, project_with_request, patch).splitlines()
    assert f"Implements the feature request to be filed first, from {url}: put its number here." in description
    assert not [line for line in description if line.startswith("Fixes")]
    (agreed,) = [line for line in description if "discussed/agreed" in line]
    assert agreed.endswith(f"Not yet: the feature request ({url}) is to be filed and agreed first.")


def test_a_field_naming_no_file_of_the_project_is_one_error(project_with_request: Path):
    (project_with_request / "docs/upstream-requests/0001-demo.md").unlink()
    (patch,) = read_series(project_with_request)
    with pytest.raises(PatchsetError, match=r"Feature-Request: docs/upstream-requests/0001-demo\.md is not a file"):
        fill_template(PR_TEMPLATE, project_with_request, patch)


@pytest.mark.skipif(not os.environ.get("PATCHSET_UPSTREAM"), reason="PATCHSET_UPSTREAM names no upstream checkout")
def test_each_request_of_the_series_has_the_sections_of_upstreams_feature_form():
    """Each request is ready to file: its sections are the text fields of upstream's form, its required ones filled."""
    yaml = pytest.importorskip("yaml")
    forms = Path(os.environ["PATCHSET_UPSTREAM"], ".github", "ISSUE_TEMPLATE").glob("*.yaml")
    form = next(f for f in map(yaml.safe_load, (p.read_text() for p in forms)) if "feature" in f.get("labels", []))
    fields = [f for f in form["body"] if f.get("type") in ("textarea", "input")]
    requests = [REPO / p.field("Feature-Request") for p in read_series(REPO) if p.field("Feature-Request")]
    assert requests
    for request in requests:
        sections = dict(re.findall(r"(?ms)^## (.+?)\n(.*?)(?=^## |\Z)", request.read_text(encoding="utf-8")))
        assert set(sections) <= {f["attributes"]["label"] for f in fields}, request.name
        for field in (f for f in fields if f.get("validations", {}).get("required")):
            assert sections.get(field["attributes"]["label"], "").strip(), (request.name, field["attributes"]["label"])
