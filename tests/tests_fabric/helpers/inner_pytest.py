# Copyright The Lightning AI team.
#
# Licensed under the Apache License, Version 2.0 (the "License");
# you may not use this file except in compliance with the License.
# You may obtain a copy of the License at
#
#     http://www.apache.org/licenses/LICENSE-2.0
#
# Unless required by applicable law or agreed to in writing, software
# distributed under the License is distributed on an "AS IS" BASIS,
# WITHOUT WARRANTIES OR CONDITIONS OF ANY KIND, either express or implied.
# See the License for the specific language governing permissions and
# limitations under the License.
"""Run a small test suite with pytest in a subprocess, as a project would, and read back what pytest reported."""

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Optional

#: records every report the session logs (on pytest-xdist's controller: the workers' reports), and the exit status
RECORDER = """
import json, os

def pytest_runtest_logreport(report):
    if not os.environ.get("PYTEST_XDIST_WORKER"):
        with open(os.path.join(os.environ["OUT"], "reports.jsonl"), "a") as f:
            f.write(json.dumps([report.nodeid, report.when, report.outcome, report.user_properties]) + "\\n")

def pytest_sessionfinish(session, exitstatus):
    if not os.environ.get("PYTEST_XDIST_WORKER"):
        with open(os.path.join(os.environ["OUT"], "exitstatus"), "w") as f:
            f.write(str(int(exitstatus)))
"""

#: the plugin registered the way upstream's conftests do
REGISTER = """
from lightning.fabric.utilities.testing import _port_reruns

def pytest_configure(config):
    _port_reruns.register(config)
"""

#: ``store_on_busy_port()`` fails as a ``TCPStore`` fails when another process took its port
CONFLICT = """
import socket
from datetime import timedelta
from torch.distributed import TCPStore

def store_on_busy_port():
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen(1)
        TCPStore("127.0.0.1", listener.getsockname()[1], 1, True, timeout=timedelta(seconds=5))

def attempt(name):
    path = os.path.join(os.environ["OUT"], f"attempts-{name}")
    with open(path, "a") as f:
        f.write("x")
    return len(open(path).read())
"""


class InnerRun:
    def __init__(self, path: Path, result: subprocess.CompletedProcess) -> None:
        self.path = path
        self.result = result
        lines = (path / "reports.jsonl").read_text().splitlines() if (path / "reports.jsonl").exists() else []
        self.reports = [tuple(json.loads(line)[:3]) for line in lines]
        self.properties = [json.loads(line)[3] for line in lines]

    def outcomes(self) -> list[tuple[str, str, str]]:
        """(test, phase, outcome) of every report, in the order pytest logged them for each test."""
        return sorted(self.reports, key=lambda r: r[0])  # stable: keeps the attempts of a test in order

    def attempts(self) -> dict[str, int]:
        return {p.name[len("attempts-") :]: len(p.read_text()) for p in self.path.glob("attempts-*")}


def run_pytest(
    path: Path,
    tests: str,
    *args: str,
    conftest: str = REGISTER,
    ini: str = "",
    env: Optional[dict] = None,
    stdin: str = "",
    cache: bool = False,
) -> InnerRun:
    """Run ``tests`` with pytest in a subprocess whose rootdir is ``path``; ``conftest`` configures the plugins."""
    path.mkdir(parents=True, exist_ok=True)
    for record in ("reports.jsonl", "exitstatus"):  # what an earlier run in `path` reported; its attempts stay counted
        (path / record).unlink(missing_ok=True)
    # the inner suite's own ini file makes `path` its rootdir, wherever the temp dir is
    (path / "pytest.ini").write_text("[pytest]\n" + ini)
    (path / "conftest.py").write_text(RECORDER + conftest)
    (path / "conflict.py").write_text("import os\n" + CONFLICT)
    (path / "test_inner.py").write_text(
        "import os\nfrom conflict import attempt, store_on_busy_port\n" + textwrap.dedent(tests)
    )
    # nothing of the outer session: not its xdist worker's PYTEST_XDIST_WORKER, not its PYTEST_ADDOPTS
    dropped = ("MASTER_PORT", "PL_PORT_CONFLICT_RERUNS", "LOCAL_RANK")
    run_env = {k: v for k, v in os.environ.items() if k not in dropped and not k.startswith("PYTEST_")}
    run_env.update(OUT=str(path), PYTHONPATH=os.pathsep.join(filter(None, [str(path), os.environ.get("PYTHONPATH")])))
    run_env.update(env or {})
    options = ["-p", "no:randomly", *([] if cache else ["-p", "no:cacheprovider"])]
    result = subprocess.run(
        [sys.executable, "-m", "pytest", *options, "-rA", *args, str(path)],
        cwd=path,
        env=run_env,
        input=stdin,
        capture_output=True,
        text=True,
        timeout=300,
    )
    return InnerRun(path, result)
