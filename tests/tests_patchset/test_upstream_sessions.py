"""The nox sessions of upstream's jobs, run for real: ``upstream_ruff`` on a patch's PR branch and on its base.

The test jobs (``upstream_newest``, ``upstream_oldest``) install upstream's requirements, torch among them: their
runs are the records in ``docs/upstream-tests.md``, not tests here.
"""

import os
import subprocess
import sys
from pathlib import Path

import pytest
from patchset_helpers import copy_project, first_patch_only, git, write

from patchset.export import export
from patchset.pin import read_pin
from patchset.records import load
from patchset.workspace import base_repo, materialize_workspace

PRE_COMMIT = """repos:
  - repo: https://github.com/astral-sh/ruff-pre-commit
    rev: v0.15.9
    hooks:
      - id: ruff-check
"""


@pytest.mark.slow
def test_upstream_ruff_records_each_finding_of_the_branch_and_whether_the_base_has_it(
    tmp_path: Path, upstream_sdist: Path, project_identity: str
):
    include = ("patches", "tools", "pyproject.toml", "noxfile.py", "docs/upstream-tests.md")
    project = first_patch_only(copy_project(tmp_path / "project", include=include))
    onto = tmp_path / "upstream"
    base_repo(read_pin(project), onto)
    write(onto / ".pre-commit-config.yaml", PRE_COMMIT)
    write(onto / "src/lightning/fabric/utilities/_old.py", "import os\n")  # a finding upstream has already
    git(onto, "add", "-A")
    git(onto, "commit", "-qm", "upstream's hooks")
    workspace = materialize_workspace(project)
    init = workspace / "src/lightning/fabric/utilities/__init__.py"
    init.write_text(init.read_text() + "import os\n")  # a finding the patch adds
    git(workspace, "commit", "-qam", "fabric: a demo\n\nWhy.\n\nForwarded: no\nChangelog: fabric Fixed: the demo\n")
    export(project)

    env = {k: v for k, v in os.environ.items() if not k.startswith("NOX")}
    nox = [sys.executable, "-m", "nox", "-f", str(project / "noxfile.py"), "--envdir", str(tmp_path / "nox")]
    proc = subprocess.run(
        [*nox, "-s", "upstream_ruff", "--", "2", "--onto", str(onto)], capture_output=True, text=True, env=env
    )
    assert proc.returncode == 1, proc.stderr[-2000:]  # the patch caused a finding: the session fails
    assert "1 failures caused by the patch" in proc.stderr
    (record,) = load(project, "upstream-tests").values()
    failures = {f["id"]: f["caused"] for f in record["failures"]}
    assert failures == {
        "src/lightning/fabric/utilities/__init__::org.ruff.F401: `os` imported but unused": True,
        "src/lightning/fabric/utilities/_old::org.ruff.F401: `os` imported but unused": False,
    }
    assert (record["job"], record["caused"], record["local_commits"]) == (
        "ruff", 1, ["not checked: the checkout has no remote to compare with"],
    )  # fmt: skip
    assert git(onto, "status", "--porcelain") == ""
    assert git(onto, "rev-parse", "--abbrev-ref", "HEAD") == "main"  # the checkout is left on its branch
    page = (project / "docs/upstream-tests.md").read_text(encoding="utf-8")
    assert (
        "| `` src/lightning/fabric/utilities/__init__::org.ruff.F401: `os` imported but unused `` | **the patch** |"
        in page
    )
