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
"""Real DDP runs (2 CPU processes, gloo) launched as scripts, the way users launch them."""

import json
import os
import subprocess
import sys
import textwrap

import pytest
import torch.distributed

from lightning.fabric.utilities.port_manager import probe_port

pytestmark = [
    pytest.mark.skipif(sys.platform == "win32", reason="DDP script launcher on POSIX"),
    pytest.mark.skipif(not torch.distributed.is_available(), reason="torch.distributed"),
]

_FABRIC_SCRIPT = textwrap.dedent(
    """
    import json
    import os
    import sys
    import torch
    from lightning.fabric import Fabric
    from lightning.fabric.utilities.port_manager import get_port_manager

    fabric = Fabric(strategy="ddp", devices=2, accelerator="cpu")
    fabric.launch()
    total = fabric.all_reduce(torch.tensor(fabric.global_rank + 1.0), reduce_op="sum")
    port = fabric.strategy.cluster_environment.main_port
    manager = get_port_manager()
    result = {
        "port": port,
        "master_port": int(os.environ["MASTER_PORT"]),
        "sum": total.item(),
        "leased": port in manager.allocated_ports,
        "reserved": port in manager.reserved_ports,
    }
    with open(os.path.join(sys.argv[1], f"rank{fabric.global_rank}.json"), "w") as f:
        json.dump(result, f)
    fabric.barrier()
    """
)

_TRAINER_SCRIPT = textwrap.dedent(
    """
    import json
    import os
    import sys
    from lightning.pytorch import Trainer
    from lightning.pytorch.demos.boring_classes import BoringModel
    from lightning.fabric.utilities.port_manager import get_port_manager

    import torch.distributed

    # two fits in one script: the children started by the first keep using its port for the second
    for _ in range(2):
        trainer = Trainer(
            strategy="ddp", devices=2, accelerator="cpu", max_steps=2, limit_val_batches=0, logger=False,
            enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
        )
        trainer.fit(BoringModel())
        torch.distributed.destroy_process_group()
    manager = get_port_manager()
    result = {
        "master_port": os.environ.get("MASTER_PORT"),
        "leased": sorted(manager.allocated_ports),
        "reserved": sorted(manager.reserved_ports),
    }
    with open(os.path.join(sys.argv[1], f"rank{trainer.global_rank}.json"), "w") as f:
        json.dump(result, f)
    """
)


def _free_pool(length):
    for start in range(25000, 32000, length):
        if all(probe_port(p) for p in range(start, start + length)):
            return range(start, start + length)
    pytest.skip("no run of free ports")


def _launch(tmp_path, script, name, pool):
    path = tmp_path / f"{name}.py"
    path.write_text(script)
    out = tmp_path / f"{name}_out"
    out.mkdir()
    env = dict(os.environ)
    for var in ("MASTER_PORT", "MASTER_ADDR", "WORLD_SIZE", "LOCAL_RANK", "NODE_RANK", "STANDALONE_PORT"):
        env.pop(var, None)
    env["LIGHTNING_PORT_REGISTRY_DIR"] = str(tmp_path / "registry")
    env["LIGHTNING_PORT_POOL"] = f"{pool.start}-{pool.stop - 1}"
    proc = subprocess.Popen(
        [sys.executable, str(path), str(out)],
        cwd=tmp_path,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    return proc, out


def _results(launched):
    proc, out = launched
    output, _ = proc.communicate(timeout=240)
    assert proc.returncode == 0, output
    return {int(f.stem[len("rank") :]): json.loads(f.read_text()) for f in out.glob("rank*.json")}


@pytest.mark.timeout(300)
def test_fabric_ddp_runs_in_parallel_on_leased_ports(tmp_path):
    """Two Fabric DDP runs at once, with a pool of exactly two ports: each gets one, none collides."""
    pool = _free_pool(2)
    runs = [_launch(tmp_path, _FABRIC_SCRIPT, f"fabric_{i}", pool) for i in range(2)]
    results = [_results(p) for p in runs]
    ports = set()
    for res in results:
        assert set(res) == {0, 1}
        assert res[0]["sum"] == res[1]["sum"] == 3.0
        assert res[0]["port"] == res[1]["port"] == res[0]["master_port"] == res[1]["master_port"]
        # rank 0 launched the run and leased the port; rank 1 inherited MASTER_PORT and only records it
        assert (res[0]["leased"], res[0]["reserved"]) == (True, False)
        assert (res[1]["leased"], res[1]["reserved"]) == (False, True)
        ports.add(res[0]["port"])
    assert ports == set(pool)
    assert os.listdir(tmp_path / "registry") == []  # released at exit


@pytest.mark.timeout(300)
def test_trainer_ddp_leases_and_tears_down(tmp_path):
    pool = _free_pool(4)
    res = _results(_launch(tmp_path, _TRAINER_SCRIPT, "trainer", pool))
    assert set(res) == {0, 1}
    port = int(res[1]["master_port"])
    assert port in pool
    # rank 0 (the launcher) started processes that keep using its port: teardown keeps the lease and MASTER_PORT,
    # so the second fit meets them on the same port (releasing it there hung the second fit)
    assert res[0] == {"master_port": str(port), "leased": [port], "reserved": []}
    # rank 1 inherited MASTER_PORT: teardown leaves it and its record alone
    assert res[1] == {"master_port": str(port), "leased": [], "reserved": [port]}
    assert os.listdir(tmp_path / "registry") == []  # the lease ends with the process
