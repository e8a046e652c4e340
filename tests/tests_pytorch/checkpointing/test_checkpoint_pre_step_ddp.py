"""`ModelCheckpoint(save_pre_optimizer_step_weights=True)` with DDP on two CPU processes (gloo), issue #20947.

Each file's own `ModelCheckpoint` state records the score that ranked it (`current_score`); scoring the weights the
file holds must give it back.
"""

from datetime import timedelta

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning.pytorch import LightningModule, Trainer, seed_everything
from lightning.pytorch.callbacks import ModelCheckpoint

PROBE_X = torch.randn(32, 4, generator=torch.Generator().manual_seed(1))
PROBE_Y = PROBE_X @ torch.tensor([[1.0], [-2.0], [0.5], [3.0]])


def score_of(state_dict):
    return nn.functional.mse_loss(PROBE_X @ state_dict["head.weight"].T + state_dict["head.bias"], PROBE_Y)


class Net(LightningModule):
    def __init__(self, manual, zero=False):
        super().__init__()
        self.automatic_optimization = not manual
        self.zero = zero
        self.head = nn.Linear(4, 1)

    def probe_score(self):
        return nn.functional.mse_loss(self.head(PROBE_X), PROBE_Y)

    def training_step(self, batch, batch_idx):
        x, y = batch
        self.log("score", self.probe_score())
        loss = nn.functional.mse_loss(self.head(x), y)
        if self.automatic_optimization:
            return loss
        opt = self.optimizers()
        opt.zero_grad()
        self.manual_backward(loss)
        opt.step()
        return None

    def on_train_batch_end(self, outputs, batch, batch_idx):
        self.log("post_score", self.probe_score())  # the next batch's pre-step weights produced it

    def configure_optimizers(self):
        if self.zero:
            from torch.distributed.optim import ZeroRedundancyOptimizer

            return ZeroRedundancyOptimizer(self.parameters(), optimizer_class=torch.optim.Adam, lr=0.3)
        return torch.optim.Adam(self.parameters(), lr=0.3)

    def train_dataloader(self):
        g = torch.Generator().manual_seed(0)
        x = torch.randn(64, 4, generator=g)
        y = x @ torch.tensor([[1.0], [-2.0], [0.5], [3.0]]) + 2.0 * torch.randn(64, 1, generator=g)
        return DataLoader(TensorDataset(x, y), batch_size=4)


def _checkpoints(tmp_path, zero):
    kwargs = {"save_top_k": 3, "save_pre_optimizer_step_weights": True, "save_weights_only": zero}
    return [
        ModelCheckpoint(dirpath=tmp_path / "step", monitor="score", every_n_train_steps=2, **kwargs),
        ModelCheckpoint(dirpath=tmp_path / "end", monitor="post_score", every_n_train_steps=3, **kwargs),
        # due in every batch: rank 0's clock decides, broadcast to the other rank
        ModelCheckpoint(dirpath=tmp_path / "timed", monitor="score", train_time_interval=timedelta(0), **kwargs),
    ]


def _assert_pairs(tmp_path, zero):
    for name in ("step", "end", "timed"):
        files = list((tmp_path / name).glob("*.ckpt"))
        assert len(files) == 3, name
        for path in files:
            checkpoint = torch.load(path, map_location="cpu", weights_only=False)
            assert checkpoint["pre_optimizer_step"]["global_step"] == checkpoint["global_step"] - 1
            if zero:
                continue  # weights-only files carry no callback state; the scores are checked in the workers
            (state,) = (v for v in checkpoint["callbacks"].values() if v.get("dirpath") == str(tmp_path / name))
            torch.testing.assert_close(score_of(checkpoint["state_dict"]), state["current_score"].float())


@pytest.mark.timeout(240)
@pytest.mark.parametrize(("manual", "zero"), [(True, False), (False, True)])
def test_ddp_two_processes_pair_each_score_with_its_weights(tmp_path, manual, zero):
    seed_everything(5)
    callbacks = _checkpoints(tmp_path, zero)
    trainer = Trainer(
        default_root_dir=tmp_path,
        accelerator="cpu",
        devices=2,
        strategy="ddp_spawn",
        max_steps=12,
        callbacks=callbacks,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.fit(Net(manual=manual, zero=zero))
    _assert_pairs(tmp_path, zero)


@pytest.mark.timeout(240)
def test_ddp_zero_redundancy_optimizer_states_fall_back_to_the_live_weights(tmp_path):
    seed_everything(5)
    ckpt = ModelCheckpoint(
        dirpath=tmp_path, monitor="score", every_n_train_steps=2, save_top_k=-1, save_pre_optimizer_step_weights=True
    )
    trainer = Trainer(
        default_root_dir=tmp_path,
        accelerator="cpu",
        devices=2,
        strategy="ddp_spawn",
        max_steps=4,
        callbacks=[ckpt],
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    # (the warning that says so is raised in the worker processes)
    trainer.fit(Net(manual=True, zero=True))
    files = list(tmp_path.glob("*.ckpt"))
    assert len(files) == 2
    assert all("pre_optimizer_step" not in torch.load(p, weights_only=False) for p in files)
