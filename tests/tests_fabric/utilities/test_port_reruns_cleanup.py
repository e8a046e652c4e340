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
"""What the port-conflict rerun plugin cleans up before a rerun: only what the failed test function started.

The inner suites start real processes with Lightning's own subprocess launcher, and a real process group.

"""

import os
import signal
import subprocess
import sys

import pytest

from tests_fabric.helpers.inner_pytest import REGISTER, run_pytest

_LAUNCHES = """
    import subprocess, sys, threading, time
    import pytest
    from lightning.fabric.plugins.environments import LightningEnvironment
    from lightning.fabric.strategies.launchers import subprocess_script

    SLEEP = [sys.executable, "-c", "import time; time.sleep(120)"]
    launched = []  # the launcher's Popen objects, kept across the attempts
    launchers, observers = [], []  # the first attempt's launcher and the observer thread it started

    @pytest.fixture(scope="session")
    def session_helper():
        # a helper of the session, started with LOCAL_RANK as a launcher child would be: never the test's
        helper = subprocess.Popen(SLEEP, env={**os.environ, "LOCAL_RANK": "1"})
        yield helper
        helper.kill()
        helper.wait()

    def test_launches_then_loses_its_port(session_helper, monkeypatch):
        write = lambda name, pids: open(os.path.join(os.environ["OUT"], name), "w").write(" ".join(map(str, pids)))
        write("helper", [session_helper.pid])
        if attempt("launches") == 1:
            monkeypatch.setattr(subprocess_script, "_basic_subprocess_cmd", lambda: SLEEP)
            launcher = subprocess_script._SubprocessScriptLauncher(LightningEnvironment(), num_processes=3, num_nodes=1)
            launcher.launch(lambda: None)
            launched.extend(launcher.procs)
            launchers.append(launcher)
            observers.extend(t for t in threading.enumerate() if isinstance(t, subprocess_script._ChildProcessObserver))
            own_child = subprocess.Popen(SLEEP)  # started by the test, but not by a launcher
            write("launched", [p.pid for p in launched] + [own_child.pid])
            store_on_busy_port()
        # the rerun: the first attempt's launcher children were killed, as their owner's Popen objects say
        write("returncodes", [p.poll() for p in launched])
        # the observer still watches its launcher's own list, and it stopped without killing this process
        observer = observers[0]
        observer.join(timeout=10)
        write("observer", [len(observers), observer._child_processes is launchers[0].procs, observer.is_alive()])
        assert session_helper.poll() is None

    def test_later():
        time.sleep(6)  # the launcher's observer wakes every 5 s: it must not kill this process now
"""


def _alive(pid):
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def _pids(path, name):
    return [int(pid) for pid in (path / name).read_text().split()] if (path / name).exists() else []


@pytest.mark.timeout(300)
@pytest.mark.skipif(sys.platform != "linux", reason="launcher processes are read from /proc")
@pytest.mark.parametrize(("reruns", "rerun"), [("2", True), ("0", False)])
def test_only_the_launcher_children_of_the_failed_test_are_killed_and_only_before_a_rerun(tmp_path, reruns, rerun):
    run = run_pytest(tmp_path, _LAUNCHES, env={"PL_PORT_CONFLICT_RERUNS": reruns})
    launched = _pids(tmp_path, "launched")
    try:
        assert len(launched) == 3, run.result.stdout[-3000:]  # 2 launcher children and the test's own child
        assert run.result.returncode == (0 if rerun else 1), run.result.stdout[-3000:]
        assert "2 passed" in run.result.stdout if rerun else "1 failed, 1 passed" in run.result.stdout
        if rerun:
            assert _pids(tmp_path, "returncodes") == [-signal.SIGKILL] * 2
            assert (tmp_path / "observer").read_text() == "1 True False"
            assert [_alive(pid) for pid in launched] == [False, False, True]
        else:  # no rerun follows: nothing is killed, as without the plugin
            assert all(_alive(pid) for pid in launched)
        assert not _alive(_pids(tmp_path, "helper")[0])  # ended by its own fixture, at the end of the session
    finally:
        for pid in launched:
            if _alive(pid):
                os.kill(pid, signal.SIGKILL)


_KILL_CHILDREN = """
import os, subprocess, sys
from lightning.fabric.strategies.launchers.subprocess_script import _ChildProcessObserver

for _ in range(20):
    children = [subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"]) for _ in range(2)]
    # an observer that looks all the time: it sees the kills at once, and must not take them for a failure
    observer = _ChildProcessObserver(main_pid=os.getpid(), child_processes=children, sleep_period=0)
    observer.start()
    observer.kill_children()
    observer.join(timeout=10)
    assert [child.returncode for child in children] == [-9, -9] and not observer.is_alive()
print("alive")
"""


@pytest.mark.timeout(300)
@pytest.mark.skipif(sys.platform == "win32", reason="SIGKILL")
def test_the_launcher_observer_kills_its_children_without_terminating_the_main_process():
    """``_ChildProcessObserver.kill_children``, which the plugin calls: the observer would kill pytest otherwise."""
    result = subprocess.run([sys.executable, "-c", _KILL_CHILDREN], capture_output=True, text=True, timeout=240)
    assert (result.returncode, result.stdout) == (0, "alive\n"), result.stderr[-3000:]


_SESSION_PROCESS_GROUP = """
    import pytest
    import torch.distributed

    @pytest.fixture(scope="session", autouse=True)
    def process_group():
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT="0")  # one process: the store picks its own port
        torch.distributed.init_process_group("gloo", rank=0, world_size=1)
        yield
        torch.distributed.destroy_process_group()

    def test_loses_its_port():
        if attempt("loses_port") == 1:
            raise OSError(98, "Address already in use")

    def test_uses_the_session_process_group():
        assert torch.distributed.is_initialized()
"""


@pytest.mark.timeout(300)
@pytest.mark.parametrize(("reruns", "expected"), [("2", "2 passed, 1 rerun"), ("0", "1 failed, 1 passed")])
def test_a_process_group_the_test_did_not_create_survives(tmp_path, reruns, expected):
    run = run_pytest(tmp_path, _SESSION_PROCESS_GROUP, env={"PL_PORT_CONFLICT_RERUNS": reruns})
    assert expected in run.result.stdout, run.result.stdout[-3000:]


_CREATES_PROCESS_GROUP = """
    import torch.distributed

    def test_initializes_a_process_group_then_loses_its_port():
        # the process group and the environment the test function set up are undone before the rerun
        assert not torch.distributed.is_initialized()
        assert "LOCAL_RANK" not in os.environ
        assert os.environ["SESSION_SETTING"] == "kept"
        if attempt("creates") == 1:
            os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT="0", LOCAL_RANK="0")
            torch.distributed.init_process_group("gloo", rank=0, world_size=1)
            store_on_busy_port()
"""


@pytest.mark.timeout(300)
def test_what_the_failed_test_set_up_is_undone_before_the_rerun(tmp_path):
    conftest = "import os\nos.environ['SESSION_SETTING'] = 'kept'\n" + REGISTER
    run = run_pytest(tmp_path, _CREATES_PROCESS_GROUP, conftest=conftest)
    assert run.attempts() == {"creates": 2}
    assert "1 passed, 1 rerun" in run.result.stdout, run.result.stdout[-3000:]
