"""The README's requirements lines resolve with uv as written, against a clone of this repository (no tags).

test_docs checks that every pin is the newest release's commit and that a clone has it; test_release installs such
pins with the pip a new venv bundles; test_subdirectories installs all three distributions with pip, uv and Poetry.
Here uv resolves the README's own lines, the three distributions of its requirements.txt.
"""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest
from patchset_helpers import REPO, newest_release, uv_binary

URL = "https://github.com/lightning-patchset/lightning-patchset"
README = (REPO / "README.md").read_text(encoding="utf-8")


def _block(marker: str) -> str:
    """The README's fenced block that starts with the comment line ``marker``."""
    (block,) = [b for b in re.findall(r"```\w*\n(.*?)```", README, flags=re.S) if b.startswith(marker)]
    return block


@pytest.fixture
def clone_url(tmp_path: Path) -> str:
    """A clone of this repository, as the README's URL would give it, as a ``file://`` URL.

    The URL names a host: the pip that a new venv bundles (23.2) rejects a ``git+file:///`` URL without one.
    """
    clone = tmp_path / "lightning-patchset"
    subprocess.run(["git", "clone", "-q", "--bare", str(REPO), str(clone)], check=True)
    return f"file://localhost{clone}"


@pytest.mark.slow
def test_the_requirements_lines_resolve_with_uv(clone_url: str, tmp_path: Path):
    uv = uv_binary()
    _, commit = newest_release()  # what the lines pin (this commit, on the release commit itself)
    lines = [line for line in _block("# requirements.txt").splitlines() if " @ git+" in line]
    assert [line.split()[0] for line in lines] == ["lightning", "pytorch-lightning", "lightning-fabric"]
    # the CPU index is for the user's torch; here only the fork's lines are resolved, without their dependencies
    local = [re.sub(r"@[0-9a-f]{40}", f"@{commit}", line.replace(URL, clone_url)) for line in lines]
    (tmp_path / "requirements.txt").write_text("\n".join(local) + "\n")
    cmd = [uv, "pip", "compile", "--no-deps", "--no-header", "--quiet", "requirements.txt"]
    proc = subprocess.run(cmd, capture_output=True, text=True, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    for line in local:
        name, _, url = line.partition(" @ ")
        assert f"{name} @ {url}" in proc.stdout, proc.stdout
