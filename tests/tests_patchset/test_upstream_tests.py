"""upstream-tests: the PR branch and its base tested with real pytest runs, and the record CI checks."""

import re
import sys
from pathlib import Path

import pytest
from patchset_helpers import REPO, git, write
from test_upstream_ci import TESTS_WORKFLOW

from patchset.export import export
from patchset.materialize import base_repo
from patchset.pin import read_pin
from patchset.series import read_series
from patchset.upstream_record import (
    BY_HAND,
    PAGE,
    RUNS,
    Context,
    Outcome,
    Record,
    blob_hash,
    caused_count,
    portable,
    recorded_blobs,
    sections,
)
from patchset.upstream_tests import run_upstream_tests, upstream_ancestor
from patchset.workspace import materialize_workspace

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


def test_future_warning():
    import warnings

    warnings.warn("soon", FutureWarning)  # an error under upstream's filters, not under the oldest job's
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


@pytest.mark.slow  # real pytest runs of upstream's jobs, on a branch and its base
def test_branch_and_base_are_tested_and_each_failure_is_attributed(project: Path, tmp_path: Path):
    onto = tmp_path / "upstream"
    base_repo(read_pin(project), onto)
    write(onto / "tests/tests_fabric/test_tiny.py", TINY_TESTS)
    write(onto / "tests/tests_fabric/conftest.py", TINY_CONFTEST)
    write(onto / ".github/workflows/ci-tests-fabric.yml", TESTS_WORKFLOW)
    git(onto, "add", "-A")
    git(onto, "commit", "-qm", "upstream's tests")
    git(onto, "checkout", "-q", "-b", "work")  # the maintainer is elsewhere; the run must come back here
    workspace = materialize_workspace(project)
    (workspace / INIT).write_text((workspace / INIT).read_text() + "# the patch\n")
    write(project / "tests/tests_fabric/test_added.py", "def test_added():\n    assert False\n")  # not on the base
    fields = "Forwarded: no\nChangelog: fabric Fixed: Fixed it\nNew-Files: tests/tests_fabric/test_added.py"
    git(workspace, "commit", "-qam", f"fabric: mark\n\nWhy.\n\n{fields}")
    export(project)

    newest, oldest = run_upstream_tests(
        project, "2", onto, runs=["newest", "oldest"], base="main", interpreters={"oldest": Path(sys.executable)},
        python=sys.executable,
    )  # fmt: skip

    assert isinstance(newest, Record)
    outcomes = {nodeid.split("::")[1]: o.outcome for nodeid, o in newest.branch.items()}
    assert outcomes == {
        "test_unaffected": "passed",
        "test_broken_by_the_patch": "failed",
        "test_broken_anyway": "failed",
        "test_skipped": "skipped",
        "test_standalone": "passed",  # in a process of its own
        "test_future_warning": "failed",
        "test_added": "failed",
    }
    assert newest.on_base["tests/tests_fabric/test_tiny.py::test_broken_by_the_patch"].outcome == "passed"
    assert {o.nodeid.split("::")[1] for o in newest.caused} == {"test_broken_by_the_patch", "test_added"}
    assert "tests/tests_fabric/test_added.py::test_added" not in newest.on_base  # nothing to run there
    assert newest.context.local_commits == ["not checked: the checkout has no remote to compare with"]
    # the oldest job's warning filters (upstream's, without error::FutureWarning), on the same branch and base
    assert isinstance(oldest, Record)
    assert oldest.branch["tests/tests_fabric/test_tiny.py::test_future_warning"].outcome == "passed"
    assert {o.nodeid.split("::")[1] for o in oldest.caused} == {"test_broken_by_the_patch", "test_added"}
    assert git(onto, "rev-parse", "--abbrev-ref", "HEAD") == "work"
    assert git(onto, "status", "--porcelain") == ""

    page = (project / PAGE).read_text()
    patch = read_series(project)[1]
    assert recorded_blobs(project) == {
        (patch.name, "newest"): blob_hash(patch.path),
        (patch.name, "oldest"): blob_hash(patch.path),
    }
    assert blob_hash(patch.path) == git(tmp_path, "hash-object", str(patch.path))  # what git itself computes
    newest_section, oldest_section = (
        sections(project)[(patch.name, "newest")],
        sections(project)[(patch.name, "oldest")],
    )
    assert page.index(newest_section) < page.index(oldest_section)
    assert "| on the PR branch | 2 passed, 4 failed, 1 skipped |" in newest_section
    assert "| on the PR branch | 3 passed, 3 failed, 1 skipped |" in oldest_section
    assert caused_count(newest_section) == caused_count(oldest_section) == 2
    assert "`base.txt`, `test.txt` pinned as `==` (`set-oldest`)" in oldest_section
    assert "| `tests/tests_fabric/test_tiny.py::test_broken_by_the_patch` | **the patch** | AssertionError: the" in page
    assert "| `tests/tests_fabric/test_tiny.py::test_broken_anyway` | pre-existing (fails on the base too) |" in page

    # a second run replaces the job's section and keeps the other job's, and what was added by hand at the end
    by_hand = f"{BY_HAND}\n\n## Runs by hand\n\nA run with `--pdb`.\n"
    (project / PAGE).write_text(page + "\n" + by_hand)
    run_upstream_tests(project, "2", onto, runs=["newest"], base="main", python=sys.executable, base_runs="failures")
    page = (project / PAGE).read_text()
    assert page.count("<!-- upstream-tests: 0002-") == 2
    assert page.endswith("\n" + by_hand)
    assert "| on the base (the tests that failed on the branch) | 1 passed, 2 failed" in page
    assert oldest_section in page


def test_the_page_records_every_upstream_bound_patch_as_it_is_now():
    """CI cannot reach upstream: it checks that each of upstream's jobs was recorded on the patches as committed, with
    nothing caused by them."""
    assert (REPO / PAGE).is_file(), f"{PAGE} is missing: run `python -m patchset upstream-tests` for each patch"
    recorded, found = recorded_blobs(REPO), sections(REPO)
    missing = []
    for patch in read_series(REPO):
        if not patch.upstreamable:
            continue
        for run in RUNS:
            if recorded.get((patch.name, run)) != blob_hash(patch.path):
                missing.append(f"{patch.name[:4]} {run}")
            elif caused_count(found[(patch.name, run)]) != 0:
                missing.append(
                    f"{patch.name[:4]} {run} (caused by the patch: {caused_count(found[(patch.name, run)])})"
                )
    assert not missing, (
        f"{PAGE} does not record upstream's jobs on these patches as they are now: {', '.join(missing)}; run"
        " `python -m patchset upstream-tests NNNN --onto <upstream checkout>` for each"
    )


def test_a_fabric_patch_with_entries_in_both_changelogs_runs_fabrics_jobs():
    """0002 changes the Trainer's launchers too, so it has pytorch entries; its subject says whose jobs it runs."""
    from patchset.upstream_tests import SELECTIONS, package_of

    (patch,) = [p for p in read_series(REPO) if p.name.startswith("0002-")]
    assert {entry.package for entry in patch.changelog} == {"fabric", "pytorch"}
    assert package_of(patch) == "fabric"
    assert SELECTIONS[package_of(patch)] == ["tests/tests_fabric"]


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


def test_the_record_names_a_commit_upstream_has_and_what_each_local_commit_changes(project: Path, tmp_path: Path):
    """A maintainer elsewhere can run it again: the remote's commit, then the local ones (a dropped blob, a PR)."""
    remote = tmp_path / "remote"
    write(remote / "docs/big.gif", "GIF89a")
    write(remote / "src/code.py", "X = 1\n")
    git(tmp_path, "init", "-q", "-b", "master", str(remote))
    git(remote, "add", "-A")
    git(remote, "commit", "-qm", "upstream's master")
    onto = tmp_path / "checkout"
    git(tmp_path, "clone", "-q", str(remote), str(onto))
    git(onto, "rm", "-q", "docs/big.gif")
    git(onto, "commit", "-qm", "local: drop a blob")
    git(onto, "checkout", "-q", "-b", "patchset/first")
    write(onto / "src/code.py", "X = 2\n")
    git(onto, "commit", "-qam", "the first PR")
    upstream, local = upstream_ancestor(onto, git(onto, "rev-parse", "HEAD"), "patchset/first")
    assert upstream == git(remote, "rev-parse", "HEAD")
    dropped, pr = git(onto, "rev-parse", "HEAD~1"), git(onto, "rev-parse", "HEAD")
    assert local == [
        f"`{dropped[:12]}` deletes `docs/big.gif`, nothing else",
        f"`{pr[:12]}` the PR branch `patchset/first`",
    ]
    assert upstream_ancestor(onto, upstream, "master") == (upstream, [])


def test_environment_failures_take_one_row_with_their_cause_and_no_machine_path(tmp_path: Path):
    checkout = tmp_path / "upstream"
    legacy = [f"tests/tests_pytorch/checkpointing/test_legacy_checkpoints.py::test_load[1.{i}.0]" for i in range(3)]
    reason = f'AssertionError: No checkpoints found in folder "{checkout}/tests/legacy/checkpoints/1.0.0"'
    failures = {nodeid: Outcome(nodeid, "failed", portable(reason, {checkout: "<checkout>"})) for nodeid in legacy}
    failures["tests/x.py::test_mine"] = Outcome("tests/x.py::test_mine", "failed", "AssertionError: mine")
    failures["tests/y.py::test_old"] = Outcome("tests/y.py::test_old", "failed", "ValueError: old")
    record = Record(Context("0003-x.patch", "0" * 40, "1" * 40), "newest", "torch 2.9.1", ["tests"], branch=failures)
    record.on_base = {n: o for n, o in failures.items() if n != "tests/x.py::test_mine"}
    rows = [line for line in record.markdown().splitlines() if line.startswith("| `")]
    assert rows == [
        "| `tests/x.py::test_mine` | **the patch** | AssertionError: mine |",
        f"| `{legacy[0]}` and 2 more | environment: upstream's CI downloads the legacy checkpoints first"
        " (`.actions/pull_legacy_checkpoints.sh`) (fails on the base too) | AssertionError: No checkpoints found in"
        ' folder "<checkout>/tests/legacy/checkpoints/1.0.0" |',
        "| `tests/y.py::test_old` | pre-existing (fails on the base too) | ValueError: old |",
    ]
    assert "| local commits on it | none |" in record.markdown()


def test_the_page_holds_no_machine_path_and_only_full_upstream_commit_ids():
    page = (REPO / PAGE).read_text(encoding="utf-8")
    for machine in ("/work/", "/home/", "/root/", "/tmp/", "site-packages"):
        assert machine not in page
    commits = re.findall(r"\| upstream commit \| `([^`]*)`", page)
    assert commits
    assert all(re.fullmatch(r"[0-9a-f]{40}", commit) for commit in commits)
    assert "local: drop a gif" not in page  # a local commit is listed as such, never as the upstream commit
