"""Runs on the port Lightning picked, two CPU processes (gloo) in a script: Fabric runs, and a sweep of Trainers.

How long each launcher holds the port, and that ``MASTER_PORT`` outlives the run as on stock. The fork's own checks of
0002 (each script takes seconds: marked slow).

"""

import inspect
import json
import os
import subprocess
import sys

import port_checks
import pytest

from tests_fabric.helpers.runif import RunIf

pytestmark = pytest.mark.slow

_SCRIPT = """
import atexit, json, os, sys
import torch
from lightning.fabric import Fabric

# Lightning leaves a gloo group to the interpreter's exit, where gloo's threads now and then abort the process
# ("terminate called without an active exception", torch #190489), and destroy_process_group can hang instead
# (torch 2.1): once its work is done, a process of the script exits without that teardown (and without any atexit
# work left, such as subprocess coverage, which this suite does not collect).
def exit_now():
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)

def run(fabric, spawned):
    # inputs differ per rank: 1 + 2
    total = fabric.all_reduce(torch.tensor(fabric.global_rank + 1.0), reduce_op="sum").item()
    if spawned:  # at the interpreter's exit, after the launcher's wrapper has queued rank 0's result
        atexit.register(exit_now)
    return total

if __name__ == "__main__":
    out, strategy, devices, runs = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
    for i in range(runs):
        picked = "MASTER_PORT" not in os.environ
        fabric = Fabric(strategy=strategy, devices=devices, accelerator="cpu")
        total = fabric.launch(run, strategy == "ddp_spawn")
        port = fabric.strategy.cluster_environment.main_port
        if fabric.global_rank == 0:  # the launching process, with its Fabric still alive
            record = {"sum": total, "port": port, "picked": picked, "held_after": held_here(port)}
            record["master_port_after"] = os.environ.get("MASTER_PORT")
            with open(os.path.join(out, f"run{i}.json"), "w") as f:
                json.dump(record, f)
    if torch.distributed.is_initialized():  # ddp: every rank ran every run in the process group of the first
        fabric.barrier()  # both ranks are past their last collective
        exit_now()
"""


def _run(tmp_path, strategy, devices, runs, **env):
    script = tmp_path / "train.py"
    script.write_text("import os, socket\n" + inspect.getsource(port_checks.held_here) + _SCRIPT)
    run_env = {k: v for k, v in os.environ.items() if k not in ("MASTER_PORT", "LOCAL_RANK", "WORLD_SIZE")}
    result = subprocess.run(
        [sys.executable, str(script), str(tmp_path), strategy, str(devices), str(runs)],
        env={**run_env, **env},
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    return [json.loads((tmp_path / f"run{i}.json").read_text()) for i in range(runs)], result


@RunIf(linux_only=True)
@pytest.mark.timeout(400)
def test_spawn_releases_the_port_when_the_processes_end_and_leaves_master_port_as_stock(tmp_path):
    """``ddp_spawn``: the first run picks and holds a port until its processes exit; ``MASTER_PORT`` stays set, so the
    second run reuses that port (unheld), as on stock: one port for the whole sweep, no more ports in TIME_WAIT."""
    records, _ = _run(tmp_path, "ddp_spawn", 2, 2)
    assert [r["sum"] for r in records] == [3.0, 3.0]
    assert [r["picked"] for r in records] == [True, False]
    assert not any(r["held_after"] for r in records)
    assert records[0]["port"] == records[1]["port"] == int(records[1]["master_port_after"])


@RunIf(linux_only=True)
@pytest.mark.timeout(400)
def test_spawn_keeps_a_users_master_port(tmp_path):
    port = port_checks.free_port()
    records, _ = _run(tmp_path, "ddp_spawn", 2, 2, MASTER_PORT=str(port))
    assert [(r["sum"], r["port"], r["master_port_after"]) for r in records] == [(3.0, port, str(port))] * 2


@RunIf(linux_only=True)
@pytest.mark.timeout(400)
def test_ddp_releases_the_hold_once_the_store_is_up_and_keeps_the_port_for_later_runs(tmp_path):
    """``ddp``: the launching process is rank 0; its store holds the port from then on, not Lightning.

    The launched processes run the whole script, so later runs of the script join the same process group, on the same
    ``MASTER_PORT``.

    """
    records, _ = _run(tmp_path, "ddp", 2, 2)
    assert [r["sum"] for r in records] == [3.0, 3.0]
    assert not records[0]["held_after"]
    assert records[0]["picked"]
    assert not records[1]["picked"]  # read back from MASTER_PORT
    assert not records[1]["held_after"]  # and not held again
    assert records[1]["port"] == records[0]["port"] == int(records[1]["master_port_after"])


_TRAINER_SWEEP = """
import atexit, json, multiprocessing, os, sys
from lightning.pytorch import Callback, Trainer
from lightning.pytorch.demos.boring_classes import BoringModel

def exit_now():
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)

class ExitWithoutGlooTeardown(Callback):
    # once its fit has succeeded, each spawned process exits without gloo's teardown: a group left to the interpreter's
    # exit now and then aborts it (torch #190489), and destroy_process_group can hang instead (torch 2.1)
    def teardown(self, trainer, pl_module, stage):
        if multiprocessing.parent_process() is not None:
            atexit.register(exit_now)

if __name__ == "__main__":
    records = []
    for _ in range(2):  # a sweep: several Trainers in one process, each fits and then tests on one port
        picked = "MASTER_PORT" not in os.environ
        trainer = Trainer(
            strategy=sys.argv[1], devices=2, accelerator="cpu", max_steps=1, limit_val_batches=0, limit_test_batches=1,
            logger=False, enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
            callbacks=[ExitWithoutGlooTeardown()],
        )
        model = BoringModel()
        trainer.fit(model)
        after_fit = os.environ.get("MASTER_PORT")
        trainer.test(model, verbose=False)
        held = trainer.strategy.cluster_environment._held_socket is not None
        records.append(
            {"picked": picked, "held_after": held, "after_fit": after_fit, "after_test": os.environ.get("MASTER_PORT")}
        )
    print(json.dumps(records))
"""


@pytest.mark.timeout(400)
@RunIf(linux_only=True)
@pytest.mark.parametrize("strategy", ["ddp_spawn", "ddp_fork"])
def test_a_sweep_of_trainers_reuses_the_first_port_as_stock(tmp_path, strategy):
    """The first Trainer picks and holds a port until its processes exit; ``MASTER_PORT`` stays set after ``fit`` and
    ``test``, so the next Trainer reuses it, as on stock."""
    script = tmp_path / "fit.py"
    script.write_text(_TRAINER_SWEEP)
    env = {k: v for k, v in os.environ.items() if k not in ("MASTER_PORT", "LOCAL_RANK", "WORLD_SIZE")}
    result = subprocess.run(
        [sys.executable, str(script), strategy], env=env, capture_output=True, text=True, timeout=350
    )
    assert result.returncode == 0, result.stderr[-3000:]
    records = json.loads(result.stdout.strip().splitlines()[-1])
    port = records[0]["after_fit"]
    assert port is not None
    assert records == [
        {"picked": True, "held_after": False, "after_fit": port, "after_test": port},
        {"picked": False, "held_after": False, "after_fit": port, "after_test": port},
    ]


_EXISTING_GROUP = """
import json, os, sys
import torch
from lightning.fabric import Fabric

def socket_fds():
    count = 0
    for fd in os.listdir("/proc/self/fd"):
        try:
            count += os.readlink(f"/proc/self/fd/{fd}").startswith("socket:")
        except OSError:  # the listing's own descriptor
            pass
    return count

torch.distributed.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{sys.argv[1]}", rank=0, world_size=1)
before = socket_fds()
fabric = Fabric(strategy="ddp", devices=1, accelerator="cpu")
fabric.launch()
total = fabric.all_reduce(torch.tensor(1.0), reduce_op="sum").item()
port = fabric.strategy.cluster_environment.main_port
print(json.dumps({"sum": total, "fds": socket_fds() - before, "held": held_here(port)}))
"""


@RunIf(linux_only=True)
@pytest.mark.timeout(300)
def test_a_launch_into_a_process_group_that_exists_holds_no_port(tmp_path):
    """A user's ``init_process_group(init_method="tcp://...")``, then Fabric ``ddp`` with ``MASTER_PORT`` unset: the
    port the launcher picked is not held while the Fabric object lives (292ce66 kept it: one socket more than stock)."""
    script = tmp_path / "existing.py"
    script.write_text("import os, socket\n" + inspect.getsource(port_checks.held_here) + _EXISTING_GROUP)
    env = {k: v for k, v in os.environ.items() if k not in ("MASTER_PORT", "LOCAL_RANK", "WORLD_SIZE")}
    result = subprocess.run(
        [sys.executable, str(script), str(port_checks.free_port())],
        env=env,
        capture_output=True,
        text=True,
        timeout=250,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert json.loads(result.stdout.strip().splitlines()[-1]) == {"sum": 1.0, "fds": 0, "held": False}
