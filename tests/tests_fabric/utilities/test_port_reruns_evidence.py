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
"""How the port-conflict rerun plugin tells a port conflict in a child process: from what the test captured of it.

The inner suite's scripts and spawned processes really lose their port: their ``TCPStore`` binds a port that has a
live listener.

"""

import subprocess

import pytest

from lightning.fabric.utilities.testing._port_reruns import is_port_conflict
from tests_fabric.helpers.inner_pytest import run_pytest

_CHILDREN = """
    import subprocess, sys
    import torch.multiprocessing

    LOSES_PORT = "from conflict import store_on_busy_port; store_on_busy_port()"

    def test_script_run_with_check_loses_its_port_once():
        if attempt("run") == 1:
            subprocess.run([sys.executable, "-c", LOSES_PORT], capture_output=True, check=True)

    def test_script_output_with_stderr_loses_its_port_once():
        if attempt("check_output") == 1:
            subprocess.check_output([sys.executable, "-c", LOSES_PORT], stderr=subprocess.STDOUT, text=True)

    def _spawned(rank):
        exec(LOSES_PORT)

    def test_spawned_child_loses_its_port_once():
        if attempt("spawn") == 1:
            torch.multiprocessing.spawn(_spawned, nprocs=1)

    def test_command_line_says_eaddrinuse():
        attempt("command_line")
        subprocess.run([sys.executable, "-c", "import sys; sys.exit(1)", "EADDRINUSE"], capture_output=True, check=True)

    def test_script_fails_on_a_line_that_mentions_it(tmp_path):
        attempt("source_line")
        script = tmp_path / "script.py"
        script.write_text("raise ValueError('bad value')  # not the 'address already in use' case\\n")
        subprocess.run([sys.executable, str(script)], capture_output=True, check=True)

    def test_script_output_not_captured():
        attempt("not_captured")
        subprocess.run([sys.executable, "-c", LOSES_PORT], check=True)
"""


@pytest.mark.timeout(300)
def test_a_child_that_lost_its_port_is_told_from_its_captured_output_never_its_command_line(tmp_path):
    run = run_pytest(tmp_path, _CHILDREN)
    assert run.attempts() == {
        "run": 2,  # CalledProcessError.stderr
        "check_output": 2,  # CalledProcessError.output (stderr=STDOUT)
        "spawn": 2,  # ProcessRaisedException, which carries the child's traceback
        "command_line": 1,
        "source_line": 1,
        "not_captured": 1,
    }, run.result.stdout[-3000:]
    assert "3 failed, 3 passed, 3 rerun" in run.result.stdout, run.result.stdout[-3000:]


_TRACEBACK = """Traceback (most recent call last):
  File "/tmp/script.py", line 3, in <module>
    TCPStore(host, port, 1, True)  # {source}
{error}
"""
_STORE_ERROR = "torch.distributed.DistNetworkError: The server socket has failed to listen ... name: EADDRINUSE, ..."


def test_child_output_counts_outside_a_traceback_s_source_lines_and_never_the_command_line():
    taken = _TRACEBACK.format(source="", error=_STORE_ERROR)
    other = _TRACEBACK.format(source="EADDRINUSE: address already in use", error="ValueError: bad value")
    assert is_port_conflict(subprocess.CalledProcessError(1, ["script"], stderr=taken.encode()))
    assert is_port_conflict(subprocess.CalledProcessError(1, ["script"], output=taken))
    assert is_port_conflict(subprocess.TimeoutExpired(["script"], 5, output=taken.encode()))
    assert not is_port_conflict(subprocess.CalledProcessError(1, ["script", "EADDRINUSE"], output="", stderr=b""))
    assert not is_port_conflict(subprocess.CalledProcessError(1, "bind: address already in use"))
    assert not is_port_conflict(subprocess.CalledProcessError(1, ["script"], stderr=other.encode()))
    assert not is_port_conflict(RuntimeError("\n\n-- Process 0 terminated with the following error:\n" + other))
    assert is_port_conflict(RuntimeError("\n\n-- Process 0 terminated with the following error:\n" + taken))
    wrapped = RuntimeError("the launch failed")
    wrapped.__cause__ = subprocess.CalledProcessError(1, ["script"], stderr=taken)
    assert is_port_conflict(wrapped)
