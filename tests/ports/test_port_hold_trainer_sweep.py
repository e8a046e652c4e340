"""The Trainer's spawn launchers free the port Lightning picked and put ``MASTER_PORT`` back once their processes exit.

The fork's own check of 0002, a sweep of Trainers in one script (seconds each: marked slow). The pull request checks the
same property in-process, in upstream's ``tests/tests_pytorch/strategies/launchers/test_multiprocessing.py``.

"""

import json
import os
import subprocess
import sys

import pytest

from tests_pytorch.helpers.runif import RunIf

pytestmark = pytest.mark.slow

_SCRIPT = """
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
        reservation = trainer.strategy.cluster_environment._reserved_port
        held = reservation is not None and reservation.held
        records.append(
            {"picked": picked, "held_after": held, "after_fit": after_fit, "after_test": os.environ.get("MASTER_PORT")}
        )
    print(json.dumps(records))
"""


@pytest.mark.timeout(400)
@RunIf(linux_only=True)
@pytest.mark.parametrize("strategy", ["ddp_spawn", "ddp_fork"])
def test_every_trainer_of_a_sweep_holds_a_port_of_its_own(tmp_path, strategy):
    """``MASTER_PORT`` is unset after ``fit`` and after ``test`` on the same port: the next Trainer picks its own."""
    script = tmp_path / "fit.py"
    script.write_text(_SCRIPT)
    env = {k: v for k, v in os.environ.items() if k not in ("MASTER_PORT", "LOCAL_RANK", "WORLD_SIZE")}
    result = subprocess.run(
        [sys.executable, str(script), strategy], env=env, capture_output=True, text=True, timeout=350
    )
    assert result.returncode == 0, result.stderr[-3000:]
    records = json.loads(result.stdout.strip().splitlines()[-1])
    assert records == [{"picked": True, "held_after": False, "after_fit": None, "after_test": None}] * 2
