"""The fork's own check of 0006: a one-process Fabric run on each ``MASTER_PORT`` value that worked before it still
runs, also a value no store could use when a process group exists already (a subprocess each: marked slow). 0006's
pull request keeps to unit tests in upstream's ``tests_fabric/utilities/test_distributed.py``."""

import json
import os
import socket
import subprocess
import sys

import pytest

pytestmark = pytest.mark.slow

_SCRIPT = """
import json, sys
import torch
from lightning.fabric import Fabric

if len(sys.argv) > 1:  # a process group the user started, on another port
    torch.distributed.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{sys.argv[1]}", rank=0, world_size=1)
fabric = Fabric(strategy="ddp", devices=1, accelerator="cpu")
fabric.launch()
total = fabric.all_reduce(torch.tensor(1.0), reduce_op="sum").item()
print(json.dumps({"sum": total, "port": fabric.strategy.cluster_environment.main_port}))
torch.distributed.destroy_process_group()
"""


def _run(value, *args):
    env = {k: v for k, v in os.environ.items() if k not in ("LOCAL_RANK", "WORLD_SIZE", "STANDALONE_PORT")}
    result = subprocess.run(
        [sys.executable, "-c", _SCRIPT, *args],
        env={**env, "MASTER_PORT": value},
        capture_output=True,
        text=True,
        timeout=250,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    return json.loads(result.stdout.strip().splitlines()[-1]), result.stderr


def _free_port():
    with socket.socket() as sock:
        sock.bind(("", 0))
        return sock.getsockname()[1]


@pytest.mark.timeout(300)
@pytest.mark.parametrize("value", ["0", "+{port}", " {port}\n"])
def test_master_port_values_that_worked_before_still_run(value):
    """A one-process run on each value: ``0`` lets its store bind any port, without a warning."""
    value = value.format(port=_free_port())
    record, stderr = _run(value)
    assert record == {"sum": 1.0, "port": int(value)}
    assert "MASTER_PORT=" not in stderr


@pytest.mark.timeout(300)
@pytest.mark.parametrize("value", ["65536", "-1"])
def test_a_master_port_no_store_uses_still_runs_when_a_process_group_exists(value):
    """Stock runs these (``all_reduce`` gives 1.0): the value is read, but the existing process group is used."""
    record, _ = _run(value, str(_free_port()))
    assert record == {"sum": 1.0, "port": int(value)}
