"""Records of test runs: JUnit XML from real pytest and ruff runs, failures attributed, JSON and the pages' tables."""

import ast
import importlib.util
import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
from patchset_helpers import REPO, copy_project, git, upstream_record, write

from patchset import PatchsetError
from patchset.records import (
    JOBS,
    Case,
    add,
    attribute,
    blob_hash,
    carry,
    checkout_commit,
    counts,
    load,
    read_junit,
    stale_matrix,
    stale_upstream,
    store,
    write_junit,
)
from patchset.series import Patch, parse_patch, read_series

TESTS = """import pytest


class TestOuter:
    class TestInner:
        def test_nested(self):
            assert True


@pytest.fixture
def broken_teardown():
    yield
    raise RuntimeError("teardown broke")


def test_fails_and_its_teardown_too(broken_teardown):
    raise AssertionError("first line\\nsecond line")


@pytest.mark.skip(reason="not on this machine")
def test_skipped():
    pass


def test_checkpoints():
    raise AssertionError('No checkpoints found in folder "ROOT/tests/legacy/checkpoints/1.0.0"')
"""


def _pytest(tmp_path: Path) -> dict[str, Case]:
    write(tmp_path / "tests/test_demo.py", TESTS.replace("ROOT", str(tmp_path)))
    write(tmp_path / "pytest.ini", "[pytest]\n")  # its own rootdir, wherever the temporary directory is (nox's is here)
    report = tmp_path / "report.xml"
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-o", "junit_family=xunit1"]
    subprocess.run([*cmd, f"--junitxml={report}", "tests"], cwd=tmp_path, capture_output=True, check=False)
    return read_junit(report, tmp_path)


def test_pytest_s_report_gives_node_ids_outcomes_and_one_line_reasons(tmp_path: Path):
    cases = _pytest(tmp_path)
    assert sorted(cases) == [
        "tests/test_demo.py::TestOuter::TestInner::test_nested",
        "tests/test_demo.py::test_checkpoints",
        "tests/test_demo.py::test_fails_and_its_teardown_too",
        "tests/test_demo.py::test_skipped",
    ]
    failed = cases["tests/test_demo.py::test_fails_and_its_teardown_too"]  # its teardown error is not a second case
    assert (failed.outcome, failed.reason) == ("failed", "AssertionError: first line")
    assert cases["tests/test_demo.py::test_skipped"].outcome == "skipped"
    assert counts(cases.values()) == {"passed": 1, "failed": 2, "skipped": 1}
    assert str(tmp_path) not in cases["tests/test_demo.py::test_checkpoints"].reason  # `<checkout>` instead


def test_a_failure_is_the_patch_s_unless_the_base_has_as_many(tmp_path: Path):
    branch = [Case("a", "failed"), Case("b", "failed"), Case("f::format", "failed"), Case("f::format", "failed")]
    base = [Case("a", "failed"), Case("b", "passed"), Case("f::format", "failed")]
    assert [(f["id"], f["caused"]) for f in attribute(branch, base)] == [
        ("a", False),
        ("b", True),
        ("f::format", False),
        ("f::format", True),  # a second finding of a kind the base has once
    ]


def test_ruff_s_junit_and_the_findings_the_sessions_write(tmp_path: Path):
    write(tmp_path / "pkg/mod.py", "import sys\n\n\ndef f():\n    import os\n\n\ndef g():\n    import os\n")
    report = tmp_path / "ruff.xml"
    cmd = [sys.executable, "-m", "ruff", "check", "--no-cache", "--isolated", "--select", "F401", "--output-format"]
    # the file by name: ruff leaves out a folder under `.nox`, where the nox sessions' temporary directories are
    proc = subprocess.run([*cmd, "junit", f"--output-file={report}", "pkg/mod.py"], cwd=tmp_path, capture_output=True)
    if b"No module named ruff" in proc.stderr:
        pytest.skip("ruff is not installed here")
    # ruff's classname is the file less `.py`; a finding's id has its message, and a second of the same is counted
    assert list(read_junit(report, tmp_path)) == [
        "pkg/mod::org.ruff.F401: `sys` imported but unused",
        "pkg/mod::org.ruff.F401: `os` imported but unused",
        "pkg/mod::org.ruff.F401: `os` imported but unused #2",
    ]
    write_junit(tmp_path / "mypy.xml", "mypy", [("pkg/mod.py", "no-redef", f"{Path.home()}/x defined on line 12")])
    (case,) = read_junit(tmp_path / "mypy.xml", tmp_path, {str(Path.home()): "~"}).values()
    # the line the message names is not the finding's: it moves with the patch
    assert case == Case("pkg/mod.py::no-redef: ~/x defined on line N", "failed", "~/x defined on line 12")


def test_a_patch_that_adds_a_second_finding_of_a_kind_the_base_has_caused_it(tmp_path: Path):
    finding = ("src/a.py", "arg-type", "Argument 1 has incompatible type")
    write_junit(tmp_path / "branch.xml", "mypy", [finding, finding, ("src/a.py", "arg-type", "another message")])
    write_junit(tmp_path / "base.xml", "mypy", [finding])
    branch, base = read_junit(tmp_path / "branch.xml"), read_junit(tmp_path / "base.xml")
    assert [f["caused"] for f in attribute(branch.values(), base.values())] == [False, True, True]


def test_the_page_keeps_its_prose_and_groups_failures_from_the_environment(tmp_path: Path):
    patch = read_series(REPO)[1]
    page = write(tmp_path / "docs/upstream-tests.md", "# Prose\n\nBy hand.\n")
    store(tmp_path, "upstream-tests", {})
    page.write_text(page.read_text() + "\n## After the tables\n\nAlso by hand.\n")
    reason = "No checkpoints found in folder <checkout>/tests/legacy/checkpoints/1.0"
    legacy = [{"id": f"t.py::test_{i}", "reason": reason, "caused": False} for i in range(3)]
    failures = [*legacy, {"id": "t.py::test_new", "reason": "AssertionError: x | y", "caused": True}]
    failures.append({"id": "a::F401: `os` | unused", "reason": "`os` | unused", "caused": True})
    add(tmp_path, "upstream-tests", upstream_record(patch, "newest", failures=failures, caused=2))
    text = page.read_text()
    assert text.startswith("# Prose\n\nBy hand.\n")
    assert text.endswith("## After the tables\n\nAlso by hand.\n")
    assert "| `t.py::test_new` | **the patch** | AssertionError: x \\| y |" in text
    assert (
        "| `` a::F401: `os` \\| unused `` | **the patch** | `os` \\| unused |" in text
    )  # one code span, whatever it holds
    assert (
        "| `t.py::test_0` and 2 more | environment: the legacy checkpoints not downloaded (on the base too) |" in text
    )
    assert "| wall time | 10 min |" in text
    assert stale_upstream(tmp_path, {patch.name: patch.path}) == [
        f"{patch.name[:4]} newest: 2 caused by the patch",
        *(f"{patch.name[:4]} {job}: not recorded at blob {blob_hash(patch.path)[:12]}" for job in JOBS[1:]),
    ]  # fmt: skip


def test_every_upstream_bound_patch_has_each_job_recorded_as_it_is_now_with_nothing_caused():
    patches = {p.name: p.path for p in read_series(REPO) if p.upstreamable}
    assert stale_upstream(REPO, patches) == [], (
        "a patch changed after its records: run `nox -s upstream_newest -- NNNN --onto <upstream checkout>`, and"
        " upstream_oldest, upstream_mypy and upstream_ruff, for each"
    )
    text = (REPO / "docs/records/upstream-tests.json").read_text(encoding="utf-8")
    assert not re.search(r"/(home|root|tmp|Users|work)/", text)  # no path of the machine the jobs ran on
    for record in load(REPO, "upstream-tests").values():
        assert re.fullmatch(r"[0-9a-f]{40}", record["upstream"])  # a full commit id anyone can fetch


def _commit(project: Path, message: str) -> None:
    git(project, "add", "-A")
    git(project, "-c", "user.name=t", "-c", "user.email=t@example.org", "commit", "-qm", message)


def _recorded_project(tmp_path: Path) -> tuple[Path, dict[str, Patch]]:
    """A git copy of the series with 0002's and 0006's jobs recorded, each owning one new file on disk."""
    project = copy_project(tmp_path / "project", include=("patches", "docs/upstream-tests.md"))
    patches = {p.name[:4]: p for p in read_series(project)}
    for patch in (patches["0002"], patches["0006"]):
        write(project / patch.new_files[-1].replace("*", "x"), f"# a new file of {patch.name[:4]}\n")
        for job in JOBS:
            add(project, "upstream-tests", upstream_record(patch, job))
    git(project, "init", "-q")
    _commit(project, "the patches as their jobs ran them")
    return project, patches


def _reword(patch: Patch, words: str = "A reworded paragraph.") -> Patch:
    patch.path.write_text(patch.path.read_text(encoding="utf-8").replace("\n\n", f"\n\n{words}\n\n", 1))
    return parse_patch(patch.path)


def test_records_move_to_a_new_blob_only_when_the_message_alone_changed(tmp_path: Path):
    """A job ran on the diff and the new files: a reworded message keeps its records, any other change does not."""
    project, patches = _recorded_project(tmp_path)
    patch, ran = patches["0002"], blob_hash(patches["0002"].path)
    text = patch.path.read_text(encoding="utf-8")
    reworded = _reword(patch)
    _commit(project, "a reworded message")
    assert carry(project, reworded) == [f"{patch.name} {job}" for job in sorted(JOBS)]
    assert stale_upstream(project, {patch.name: patch.path}) == []
    record = load(project, "upstream-tests")[f"{patch.name} newest"]
    assert record["ran_on"]["blob"] == ran
    assert record["blob"] == blob_hash(patch.path)
    assert f"the job ran on blob `{ran[:12]}`" in (project / "docs/upstream-tests.md").read_text(encoding="utf-8")
    assert carry(project, reworded) == []  # nothing left to move

    last = text.rstrip("\n").rsplit("\n", 1)[1]  # the diff's last line
    patch.path.write_text(text.rstrip("\n").removesuffix(last) + last + " changed\n", encoding="utf-8")
    with pytest.raises(PatchsetError, match="0002's diff or New-Files differ from commit"):
        carry(project, parse_patch(patch.path))
    assert load(project, "upstream-tests")[f"{patch.name} oldest"]["ran_on"]["blob"] == ran


def test_a_record_is_not_carried_over_new_files_or_a_stacked_on_patch_that_changed_since_its_run(tmp_path: Path):
    project, patches = _recorded_project(tmp_path)
    p2, p6 = patches["0002"], patches["0006"]
    assert carry(project, _reword(p2))
    _commit(project, "reworded")
    assert stale_upstream(project, {p2.name: p2.path}) == []

    owned = write(project / p2.new_files[0], "# owned by 0002, and not in git\n")  # untracked, as upstream-pr takes it
    with pytest.raises(PatchsetError, match="0002's new files differ"):
        carry(project, _reword(p2, "Reworded again."))
    assert stale_upstream(project, {p2.name: p2.path})  # the carried record no longer holds
    owned.unlink()
    assert carry(project, _reword(p6)) == [f"{p6.name} {job}" for job in sorted(JOBS)]

    p2.path.write_text(p2.path.read_text(encoding="utf-8").rstrip("\n") + " changed\n", encoding="utf-8")
    _commit(project, "0002's diff changed, and with it the branch 0006 stacks on")
    with pytest.raises(PatchsetError, match="0002's diff or New-Files differ"):
        carry(project, _reword(p6, "Reworded again."))


def _noxfile_torch() -> list[str]:
    tree = ast.parse((REPO / "noxfile.py").read_text(encoding="utf-8"))
    for node in tree.body:
        if isinstance(node, ast.Assign) and any(getattr(t, "id", None) == "TORCH" for t in node.targets):
            return list(ast.literal_eval(node.value))
    raise AssertionError("noxfile.py has no TORCH list")


def test_the_workflow_runs_every_release_of_the_noxfile_and_no_other():
    workflow = (REPO / ".github" / "workflows" / "ci-tests-fork.yml").read_text(encoding="utf-8")
    torch = _noxfile_torch()
    assert set(re.findall(r'pytorch-version: "([\d.]+)"', workflow)) == set(torch)
    assert "workflow_dispatch" in workflow  # runnable by hand on a fork
    minors = [tuple(int(p) for p in v.split("."))[:2] for v in torch]  # every minor release, once, oldest to newest
    assert minors == [(2, m) for m in range(minors[0][1], minors[-1][1] + 1)]


def _cell(commit: str, **fields) -> dict:
    cell = {
        "key": "tests:2.13.0:py3.11:Linux", "kind": "tests", "session": "tests(torch='2.13.0')", "torch": "2.13.0+cpu",
        "torch_requested": "2.13.0", "python": "3.11.7", "platform": "Linux x86_64", "commit": commit,
        "date": "2026-12-04 10:00", "duration_s": 240.0, "wall_s": 400.0, "downloaded_bytes": 3 * 2**30,
        "exit_code": 0, "counts": {"passed": 3, "failed": 0, "skipped": 1}, "failures": [], "command": "pytest",
    }  # fmt: skip
    return {**cell, **fields}


def test_the_matrix_is_checked_against_the_checkout_and_merged_from_ci_s_cells(tmp_path: Path, monkeypatch, capsys):
    project = tmp_path / "project"
    subprocess.run(["git", "clone", "-q", str(REPO), str(project)], check=True)
    head = checkout_commit(project)
    store(project, "torch-matrix", {"tests:2.13.0:py3.11:Linux": _cell(head)})
    assert "| 3.00 GiB |" in (project / "docs/torch-matrix.md").read_text(encoding="utf-8")
    assert stale_matrix(project) == []
    add(project, "torch-matrix", _cell("fedcba9876", key="tests:2.1.2:py3.11:Linux", torch_requested="2.1.2"))
    assert stale_matrix(project)[-1] == f"the cells name 2 commits: {head}, fedcba9876"
    store(project, "torch-matrix", {"only": _cell(head, exit_code=1, key="only")})
    assert stale_matrix(project) == ["only: exit 1"]
    (project / "src/new.py").write_text("")  # sources that are not the recorded commit's
    subprocess.run(["git", "-C", str(project), "add", "-A"], check=True)
    subprocess.run(["git", "-C", str(project), "commit", "-qm", "new source", "--no-verify"], check=True)
    store(project, "torch-matrix", {"only": _cell(head, key="only")})
    assert stale_matrix(project) == [f"{head} is not this checkout's patches, src, tests, tools, pyproject.toml"]

    cells = write(tmp_path / "cell.json", json.dumps({"other": _cell(head, key="other", date="2026-12-05 10:00")}))
    spec = importlib.util.spec_from_file_location("torch_matrix", REPO / ".ci/torch_matrix.py")
    assert spec is not None
    assert spec.loader is not None
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    monkeypatch.setattr(script, "ROOT", project)
    assert script.main(["merge", str(cells)]) == 0
    assert sorted(load(project, "torch-matrix")) == ["only", "other"]
    assert script.main(["check"]) == 1
    assert capsys.readouterr().out == f"{head} is not this checkout's patches, src, tests, tools, pyproject.toml\n"
