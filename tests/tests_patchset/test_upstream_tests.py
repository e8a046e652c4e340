"""upstream-tests: the PR branch and its base tested with real pytest runs, and the record CI checks."""

import sys
from pathlib import Path

import pytest
from patchset_helpers import REPO, git, write

from patchset.export import export
from patchset.materialize import base_repo, materialize_workspace
from patchset.pin import read_pin
from patchset.series import read_series
from patchset.upstream_tests import PAGE, blob_hash, recorded_blobs, run_upstream_tests

INIT = "src/lightning/fabric/utilities/__init__.py"
TINY_TESTS = f'''from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def test_unaffected():
    assert ROOT.is_dir()


def test_broken_by_the_patch():
    assert "# the patch" not in (ROOT / "{INIT}").read_text(), "the patch's marker is there"


def test_broken_anyway():
    raise AssertionError("upstream's own failure")


@pytest.mark.skip(reason="not on this machine")
def test_skipped():
    pass


@pytest.mark.standalone
def test_standalone():
    assert True
'''
# upstream's conftest keeps only standalone tests when PL_RUN_STANDALONE_TESTS=1; this one does the same, small
TINY_CONFTEST = """import os


def pytest_configure(config):
    config.addinivalue_line("markers", "standalone: runs in a process of its own")


def pytest_collection_modifyitems(items, config):
    standalone = os.environ.get("PL_RUN_STANDALONE_TESTS") == "1"
    items[:] = [item for item in items if (item.get_closest_marker("standalone") is not None) == standalone]
"""


pytestmark = pytest.mark.usefixtures("project_identity")  # upstream-pr refuses the tests' placeholder identity


def test_branch_and_base_are_tested_and_each_failure_is_attributed(project: Path, tmp_path: Path):
    onto = tmp_path / "upstream"
    base_repo(read_pin(project), onto)
    write(onto / "tests/tests_fabric/test_tiny.py", TINY_TESTS)
    write(onto / "tests/tests_fabric/conftest.py", TINY_CONFTEST)
    git(onto, "add", "-A")
    git(onto, "commit", "-qm", "upstream's tests")
    git(onto, "checkout", "-q", "-b", "work")  # the maintainer is elsewhere; the run must come back here
    workspace = materialize_workspace(project)
    (workspace / INIT).write_text((workspace / INIT).read_text() + "# the patch\n")
    git(workspace, "commit", "-qam", "fabric: mark\n\nWhy.\n\nForwarded: no\nChangelog: fabric Fixed: Fixed it")
    export(project)

    record = run_upstream_tests(project, "2", onto, base="main", python=sys.executable)

    outcomes = {nodeid.split("::")[1]: o.outcome for nodeid, o in record.branch.items()}
    assert outcomes == {
        "test_unaffected": "passed",
        "test_broken_by_the_patch": "failed",
        "test_broken_anyway": "failed",
        "test_skipped": "skipped",
        "test_standalone": "passed",  # in a process of its own
    }
    assert record.on_base["tests/tests_fabric/test_tiny.py::test_broken_by_the_patch"].outcome == "passed"
    assert [o.nodeid.split("::")[1] for o in record.caused] == ["test_broken_by_the_patch"]
    assert git(onto, "rev-parse", "--abbrev-ref", "HEAD") == "work"
    assert git(onto, "status", "--porcelain") == ""

    page = (project / PAGE).read_text()
    patch = read_series(project)[1]
    assert recorded_blobs(project) == {patch.name: blob_hash(patch.path)}
    assert blob_hash(patch.path) == git(tmp_path, "hash-object", str(patch.path))  # what git itself computes
    assert "| on the PR branch | 2 passed, 2 failed, 1 skipped |" in page
    assert "| failures caused by the patch | **1** |" in page
    assert "| `tests/tests_fabric/test_tiny.py::test_broken_by_the_patch` | **the patch** | AssertionError: the" in page
    assert "| `tests/tests_fabric/test_tiny.py::test_broken_anyway` | pre-existing (fails on the base too) |" in page

    # a second run replaces the patch's section instead of adding one
    run_upstream_tests(project, "2", onto, base="main", python=sys.executable, base_runs="failures")
    assert (project / PAGE).read_text().count("<!-- upstream-tests: 0002-") == 1
    assert "| on the base (the tests that failed on the branch) | 1 passed, 1 failed" in (project / PAGE).read_text()


def test_the_page_records_every_upstream_bound_patch_as_it_is_now():
    """CI cannot reach upstream: it checks that the recorded runs are of the patches as committed, with 0 failures
    caused by them."""
    assert (REPO / PAGE).is_file(), f"{PAGE} is missing: run `python -m patchset upstream-tests` for each patch"
    recorded = recorded_blobs(REPO)
    page = (REPO / PAGE).read_text(encoding="utf-8")
    for patch in read_series(REPO):
        if not patch.upstreamable:
            continue
        assert recorded.get(patch.name) == blob_hash(patch.path), (
            f"{PAGE} does not record upstream's tests for {patch.name} as it is now: run"
            f" `python -m patchset upstream-tests {patch.name[:4]} --onto <upstream checkout>`"
        )
        section = page.split(f"<!-- upstream-tests: {patch.name} -->", 1)[1].split("<!-- /upstream-tests -->", 1)[0]
        assert "| failures caused by the patch | **0** |" in section, patch.name


def test_node_ids_keep_classes_and_a_crash_is_a_failure(tmp_path: Path):
    from patchset.upstream_tests import run_selection

    write(
        tmp_path / "tests/pkg/test_x.py",
        "import os\n\nimport pytest\n\n\nclass TestOuter:\n    def test_same(self):\n        pass\n\n"
        "    class TestInner:\n        def test_same(self):\n            assert False\n\n\n"
        "class TestOther:\n    @pytest.mark.parametrize('n', [1, 2])\n    def test_same(self, n):\n        pass\n\n\n"
        "@pytest.mark.standalone\ndef test_crash():\n    os._exit(3)\n",
    )
    write(tmp_path / "tests/conftest.py", TINY_CONFTEST)
    write(tmp_path / "pyproject.toml", "[tool.pytest.ini_options]\n")  # a checkout is its own rootdir, as upstream's
    results = run_selection(Path(sys.executable), tmp_path, ["tests/pkg"], tmp_path / "report.xml")
    assert {nodeid: o.outcome for nodeid, o in results.items()} == {
        "tests/pkg/test_x.py::TestOuter::test_same": "passed",
        "tests/pkg/test_x.py::TestOuter::TestInner::test_same": "failed",
        "tests/pkg/test_x.py::TestOther::test_same[1]": "passed",
        "tests/pkg/test_x.py::TestOther::test_same[2]": "passed",
        "tests/pkg/test_x.py::test_crash": "failed",
    }
    assert results["tests/pkg/test_x.py::test_crash"].reason == "crashed: pytest exited with 3 and no report"
