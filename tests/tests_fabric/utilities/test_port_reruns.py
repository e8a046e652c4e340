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
import os
import re
import socket
import subprocess
import sys
import textwrap
from datetime import timedelta

import pytest
from torch.distributed import TCPStore

from lightning.fabric.utilities.testing.port_reruns import is_port_conflict


def _bind_conflict():
    with socket.socket() as blocker:
        blocker.bind(("", 0))
        blocker.listen(1)
        port = blocker.getsockname()[1]
        try:
            TCPStore("127.0.0.1", port, 1, True, timeout=timedelta(seconds=5))
        except RuntimeError as ex:
            return ex
    raise AssertionError("the store bound a port that has a live listener")


def test_is_port_conflict_on_real_errors():
    store_error = _bind_conflict()
    assert is_port_conflict(store_error)
    with socket.socket() as a, socket.socket() as b:
        a.bind(("127.0.0.1", 0))
        a.listen(1)
        with pytest.raises(OSError, match="in use") as os_error:
            b.bind(("127.0.0.1", a.getsockname()[1]))
    assert is_port_conflict(os_error.value)
    # found through `raise ... from ...` and through implicit chaining
    implicit = ValueError("launcher failed")
    implicit.__context__ = store_error
    assert is_port_conflict(implicit)
    assert not is_port_conflict(RuntimeError("something else"))
    # an assertion that quotes such an error is a test failure, not a conflict
    assert not is_port_conflict(AssertionError(f"unexpected: {store_error}"))
    wrapped = RuntimeError("wrapped")
    wrapped.__cause__ = store_error
    assert is_port_conflict(wrapped)
    # suppressed context is not followed
    suppressed = RuntimeError("other")
    suppressed.__context__ = store_error
    suppressed.__suppress_context__ = True
    assert not is_port_conflict(suppressed)


def test_timeout_is_not_a_port_conflict():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # bound, never listening: connections are refused until the timeout
        with pytest.raises((RuntimeError, TimeoutError)) as timeout:  # torch 2.1 raises the built-in TimeoutError
            TCPStore("127.0.0.1", port, 2, False, timeout=timedelta(seconds=1))
    assert not is_port_conflict(timeout.value)


_INNER_TESTS = textwrap.dedent(
    """
    import os
    import socket
    import subprocess
    import sys
    from datetime import timedelta

    import torch.distributed
    from torch.distributed import TCPStore

    from lightning.fabric.plugins.environments import LightningEnvironment

    STATE = os.environ["RERUN_STATE"]


    def attempt(name):
        path = os.path.join(STATE, name)
        n = int(open(path).read()) + 1 if os.path.exists(path) else 1
        open(path, "w").write(str(n))
        return n


    def write(name, value):
        open(os.path.join(STATE, name), "w").write(str(value))


    def start_store_on_taken_port(port):
        with socket.socket() as blocker:  # another process took the port between pick and bind
            blocker.bind(("", port))
            blocker.listen(1)
            try:
                TCPStore("127.0.0.1", port, 1, True, timeout=timedelta(seconds=5))
            except RuntimeError as ex:
                raise RuntimeError("rank 0 could not start the store") from ex


    def test_conflict_once():
        n = attempt("conflict_once")
        write(f"master_port_at_start_{n}", os.environ.get("MASTER_PORT"))
        write(f"initialized_at_start_{n}", torch.distributed.is_initialized())
        port = LightningEnvironment().main_port
        os.environ["MASTER_PORT"] = str(port)
        write(f"port_{n}", port)
        if n == 1:
            torch.distributed.init_process_group("gloo", store=torch.distributed.HashStore(), rank=0, world_size=1)
            child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
            write("child", child.pid)
            start_store_on_taken_port(port)
        TCPStore("127.0.0.1", port, 1, True, timeout=timedelta(seconds=5))


    def test_conflict_always():
        attempt("conflict_always")
        start_store_on_taken_port(LightningEnvironment().main_port)


    def test_other_failure():
        attempt("other_failure")
        assert 1 == 2, "not a port problem"


    def test_timeout():
        attempt("timeout")
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            TCPStore("127.0.0.1", s.getsockname()[1], 2, False, timeout=timedelta(seconds=1))
    """
)


@pytest.mark.timeout(180)
@pytest.mark.skipif(sys.platform != "linux", reason="uses /proc to find leftover children")
def test_port_conflicts_are_rerun_end_to_end(tmp_path):
    suite, state = tmp_path / "suite", tmp_path / "state"
    suite.mkdir()
    state.mkdir()
    (suite / "conftest.py").write_text('pytest_plugins = ["lightning.fabric.utilities.testing.port_reruns"]\n')
    (suite / "test_inner.py").write_text(_INNER_TESTS)
    env = dict(os.environ, RERUN_STATE=str(state), LIGHTNING_PORT_REGISTRY_DIR=str(tmp_path / "registry"))
    env.pop("MASTER_PORT", None)
    env.pop("PYTEST_ADDOPTS", None)
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-rAR", "-q", str(suite)],
        cwd=suite,
        env=env,
        capture_output=True,
        text=True,
        timeout=150,
    )
    out = proc.stdout + proc.stderr
    assert proc.returncode == 1, out

    def read(name):
        return (state / name).read_text()

    # reruns happened only for port conflicts, up to the default bound of 2
    assert read("conflict_once") == "2"
    assert read("conflict_always") == "3"
    assert read("other_failure") == "1"
    assert read("timeout") == "1"
    assert re.search(r"3 failed, 1 passed, 3 rerun", out), out
    assert re.search(r"^RERUN .*test_conflict_once", out, re.MULTILINE), out
    assert re.search(r"^PASSED .*test_conflict_once", out, re.MULTILINE), out
    assert re.search(r"^FAILED .*test_other_failure", out, re.MULTILINE), out
    assert "port conflicts" in out
    assert re.search(rf"test_conflict_once: EADDRINUSE on port {read('port_1')}", out), out
    # before the rerun: MASTER_PORT cleared, process group destroyed, the attempt's child gone, a fresh port
    assert read("master_port_at_start_2") == "None"
    assert read("initialized_at_start_1") == read("initialized_at_start_2") == "False"
    assert read("port_2") != read("port_1")
    child = int(read("child"))
    with pytest.raises(ProcessLookupError):
        os.kill(child, 0)
