"""The fork's own check of 0006: a one-process Fabric run on each ``MASTER_PORT`` value that worked before it still
runs (a subprocess each: marked slow). 0006's pull request keeps to unit tests
(``tests_fabric/plugins/environments/test_lightning_port_values.py``)."""

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

fabric = Fabric(strategy="ddp", devices=1, accelerator="cpu")
fabric.launch()
total = fabric.all_reduce(torch.tensor(1.0), reduce_op="sum").item()
print(json.dumps({"sum": total, "port": fabric.strategy.cluster_environment.main_port}))
torch.distributed.destroy_process_group()
"""


@pytest.mark.timeout(300)
@pytest.mark.parametrize("value", ["0", "+{port}", " {port}\n"])
def test_master_port_values_that_worked_before_still_run(value):
    """A one-process run on each value: ``0`` lets its store bind any port, with one warning."""
    with socket.socket() as sock:
        sock.bind(("", 0))
        value = value.format(port=sock.getsockname()[1])
    env = {k: v for k, v in os.environ.items() if k not in ("LOCAL_RANK", "WORLD_SIZE", "STANDALONE_PORT")}
    result = subprocess.run(
        [sys.executable, "-c", _SCRIPT], env={**env, "MASTER_PORT": value}, capture_output=True, text=True, timeout=250
    )
    assert result.returncode == 0, result.stderr[-3000:]
    record = json.loads(result.stdout.strip().splitlines()[-1])
    assert record == {"sum": 1.0, "port": int(value)}
    assert result.stderr.count("MASTER_PORT=0: the rendezvous store binds") == (value == "0")
