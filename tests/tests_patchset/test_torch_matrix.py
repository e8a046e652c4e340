"""The torch matrix: the noxfile and the workflow run the same releases, and the recorder's table says what ran."""

import ast
import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest
from patchset_helpers import REPO

RECORDER = REPO / ".ci" / "torch_matrix.py"


def _noxfile_torch() -> list[str]:
    tree = ast.parse((REPO / "noxfile.py").read_text(encoding="utf-8"))
    for node in tree.body:
        if isinstance(node, ast.Assign) and any(getattr(t, "id", None) == "TORCH" for t in node.targets):
            return list(ast.literal_eval(node.value))
    raise AssertionError("noxfile.py has no TORCH list")


def _version(v: str) -> tuple[int, ...]:
    return tuple(int(p) for p in v.split("."))


def test_the_workflow_runs_every_release_of_the_noxfile_and_no_other():
    workflow = (REPO / ".github" / "workflows" / "ci-tests-fork.yml").read_text(encoding="utf-8")
    cells = re.findall(r'pytorch-version: "([\d.]+)"', workflow)
    torch = _noxfile_torch()
    assert set(cells) == set(torch)
    assert "workflow_dispatch" in workflow  # runnable by hand on a fork
    # every minor release from the oldest to the newest, each once, at its latest patch
    minors = [_version(v)[:2] for v in torch]
    assert minors == sorted(set(minors))
    assert minors == [(2, m) for m in range(minors[0][1], minors[-1][1] + 1)]


def _record(tmp_path: Path, *summary: str, commit: str = "0123456789", **env: str) -> subprocess.CompletedProcess:
    script = tmp_path / "fake_pytest.py"
    script.write_text("".join(f"print({line!r})\n" for line in summary) + "raise SystemExit(0)\n", encoding="utf-8")
    cmd = [sys.executable, str(RECORDER), "record", "--kind", "tests", "--session", "tests(torch='x')"]
    cmd += ["--torch", "2.13.0", "--commit", commit, "--", sys.executable, str(script)]
    environ = {**os.environ, "TORCH_MATRIX_DOC": str(tmp_path / "matrix.md"), **env}
    return subprocess.run(cmd, capture_output=True, text=True, env=environ, check=False)


def _rows(doc: Path) -> list[dict]:
    text = doc.read_text(encoding="utf-8")
    block = text.split("<!-- torch-matrix-results", 1)[1].split("torch-matrix-results -->", 1)[0]
    return [json.loads(line) for line in block.strip().splitlines()]


def test_a_row_records_the_session_wall_time_and_what_it_downloaded(tmp_path):
    started = time.time() - 120  # the session began two minutes before its tests, installing
    proc = _record(
        tmp_path,
        "==== 3 passed, 1 skipped in 1.00s ====",
        TORCH_MATRIX_SESSION_START=repr(started),
        TORCH_MATRIX_DOWNLOADED=str(3 * 2**30),
    )
    assert proc.returncode == 0, proc.stderr
    (row,) = _rows(tmp_path / "matrix.md")
    assert row["counts"] == {"passed": 3, "skipped": 1}
    assert row["wall_s"] >= 120 > row["duration_s"]
    assert row["downloaded_bytes"] == 3 * 2**30
    table = (tmp_path / "matrix.md").read_text(encoding="utf-8")
    assert "| 3.00 GiB |" in table

    # the next session of the same cell finds torch in the wheelhouse: nothing downloaded
    proc = _record(tmp_path, "==== 3 passed in 1.00s ====", TORCH_MATRIX_DOWNLOADED="0")
    assert proc.returncode == 0, proc.stderr
    assert "| 0 (wheelhouse) |" in (tmp_path / "matrix.md").read_text(encoding="utf-8")


def _check(tmp_path: Path) -> subprocess.CompletedProcess:
    environ = {**os.environ, "TORCH_MATRIX_DOC": str(tmp_path / "matrix.md")}
    return subprocess.run(
        [sys.executable, str(RECORDER), "check"], capture_output=True, text=True, env=environ, check=False
    )


def _head(*args: str) -> str:
    return subprocess.run(
        ["git", "-C", str(REPO), "log", "-1", "--format=%h", "--abbrev=10", *args],
        capture_output=True, text=True, check=True,
    ).stdout.strip()  # fmt: skip


def _write_rows(doc: Path, rows: list[dict]) -> None:
    lines = ["<!-- torch-matrix-results", *(json.dumps(row) for row in rows), "torch-matrix-results -->", ""]
    doc.write_text("\n".join(lines), encoding="utf-8")


def test_check_accepts_only_passing_rows_from_one_commit_with_the_checkouts_sources(tmp_path):
    doc = tmp_path / "matrix.md"
    assert _record(tmp_path, "==== 3 passed in 1.00s ====", commit=_head("HEAD")).returncode == 0
    proc = _check(tmp_path)
    assert proc.returncode == 0, proc.stderr
    (row,) = _rows(doc)

    # a second row from another commit
    _write_rows(doc, [row, dict(row, cell="tests:2.1.2:py3.11:Linux", torch_requested="2.1.2", commit="fedcba9876")])
    proc = _check(tmp_path)
    assert proc.returncode == 1
    assert "the rows name 2 commits" in proc.stderr

    # a failed row
    _write_rows(doc, [dict(row, exit_code=1)])
    proc = _check(tmp_path)
    assert proc.returncode == 1
    assert "exit 1" in proc.stderr

    # a row from a commit whose sources differ from the checkout's: the last commit before src/ last changed
    changed_src = _head("--", "src")
    try:
        before = _head(f"{changed_src}~1")
    except subprocess.CalledProcessError:
        pytest.skip("a shallow clone: the commit before src/ last changed is not here")
    _write_rows(doc, [dict(row, commit=before)])
    proc = _check(tmp_path)
    assert proc.returncode == 1
    assert "differs from the checkout" in proc.stderr
