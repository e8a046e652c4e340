"""The feature request a patch's feature needs upstream first: upstream's issue form, filled from the project's file."""

import os
import subprocess
from pathlib import Path

import pytest
from patchset_helpers import PR_TEMPLATE, REPO, git, write

from patchset import PatchsetError
from patchset.feature_request import feature_request, fill_form, form_fields, read_form, request_url
from patchset.materialize import base_repo
from patchset.pin import read_pin
from patchset.pr_text import fill_template
from patchset.series import read_series

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
    fields = form_fields(FORM)
    assert [(f.label, f.required) for f in fields] == [("What and why", True), ("Other options", False)]


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
    assert read_form(upstream_checkout, "HEAD")[0] == ".github/ISSUE_TEMPLATE/3_feature.yaml"  # not the bug form
    (patch,) = read_series(project_with_request)
    text = feature_request(project_with_request, patch, upstream_checkout, "HEAD")
    assert text is not None
    assert text.startswith("# Let the demo do more\n\n### What and why\n\nIt cannot do more.")
    url = request_url(project_with_request, patch)
    assert url is not None
    assert url.endswith("/blob/main/docs/upstream-requests/0001-demo.md")
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
