"""A short tour of what the installed fork fixes.

Run it after `pip install .`; it exits non-zero if a fix is missing.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util

import lightning


def main() -> None:
    """Show each fix at work."""
    print(f"lightning {lightning.__version__} from {lightning.__file__}")
    assert "+patchset." in lightning.__version__, "this is not the patch set's fork"

    requires = importlib.metadata.requires("lightning") or []
    assert not any(r.startswith("pytorch-lightning") for r in requires)
    print("0001 build: the fork does not pull the unpatched pytorch-lightning distribution")
    if importlib.util.find_spec("pytorch_lightning") is not None:
        print("     note: a separately installed pytorch_lightning is unpatched; import lightning.pytorch instead")


def ports() -> None:
    """0002: a port handed out in one process is never handed out in another while it is leased."""
    import os
    import subprocess
    import sys

    from lightning.fabric.plugins.environments import LightningEnvironment
    from lightning.fabric.plugins.environments.lightning import find_free_network_port
    from lightning.fabric.utilities.port_manager import get_port_manager

    mine = find_free_network_port()
    child = "from lightning.fabric.plugins.environments.lightning import find_free_network_port as f; print(f())"
    theirs = [int(subprocess.check_output([sys.executable, "-c", child])) for _ in range(5)]
    assert mine not in theirs, (mine, theirs)
    print(f"0002 fabric: port {mine} is leased here; 5 other processes got {theirs}")
    get_port_manager().release_port(mine)
    os.environ["MASTER_PORT"] = "70000"
    try:
        _ = LightningEnvironment().main_port
    except ValueError as err:
        print(f"     a bad MASTER_PORT is a clear error: {err}")
    else:
        raise AssertionError("a bad MASTER_PORT was accepted")
    finally:
        del os.environ["MASTER_PORT"]


def checkpoints() -> None:
    """0003: under manual optimization, the best checkpoint holds the weights that produced its score."""
    import tempfile
    import warnings

    import torch

    from lightning.pytorch import LightningModule, Trainer
    from lightning.pytorch.callbacks import ModelCheckpoint

    class Model(LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.automatic_optimization = False
            self.layer = torch.nn.Linear(4, 1)
            self.seen: dict[int, torch.Tensor] = {}

        def training_step(self, batch: torch.Tensor, batch_idx: int) -> None:
            opt = self.optimizers()
            loss = self.layer(batch).pow(2).mean()
            self.seen[self.global_step] = self.layer.weight.detach().clone()  # the weights that make this loss
            self.log("loss", loss)
            opt.zero_grad()
            self.manual_backward(loss)
            opt.step()

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.SGD(self.parameters(), lr=0.5)

    torch.manual_seed(0)
    data = torch.utils.data.DataLoader(torch.randn(8, 4), batch_size=2)
    with tempfile.TemporaryDirectory() as tmp, warnings.catch_warnings():
        warnings.simplefilter("ignore")
        best = ModelCheckpoint(dirpath=tmp, monitor="loss", every_n_train_steps=1, save_top_k=1)
        model = Model()
        Trainer(
            max_steps=4,
            callbacks=[best],
            logger=False,
            enable_progress_bar=False,
            enable_model_summary=False,
            accelerator="cpu",
        ).fit(model, data)
        saved = torch.load(best.best_model_path, weights_only=False)
    step = saved["global_step"]
    weights = saved["state_dict"]["layer.weight"]
    assert torch.equal(weights, model.seen[step - 1]), "the best checkpoint holds post-step weights"
    print(
        f"0003 pytorch: best checkpoint (step {step}, loss {float(best.best_model_score):.4f}) holds the weights"
        " that produced that loss"
    )


if __name__ == "__main__":
    main()
    ports()
    checkpoints()
