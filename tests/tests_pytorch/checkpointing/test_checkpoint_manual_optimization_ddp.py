"""Pre-step top-k checkpoints with DDP on two CPU processes (gloo), issue #20947."""

import os
import subprocess
import sys
from datetime import timedelta
from pathlib import Path

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning.pytorch import LightningModule, Trainer, seed_everything
from lightning.pytorch.callbacks import ModelCheckpoint


class DDPRecorder(LightningModule):
    """Saves its weights before each batch's optimizer step to files, so that ``ddp_spawn`` workers can report them."""

    def __init__(self, record_dir, zero=False):
        super().__init__()
        self.automatic_optimization = False
        self.layer = nn.Linear(4, 1)
        self.record_dir = record_dir
        self.zero = zero

    def training_step(self, batch, batch_idx):
        weights = {k: v.detach().clone() for k, v in self.state_dict().items()}
        if self.global_rank == 0:
            torch.save(weights, Path(self.record_dir) / f"pre-{self.trainer.global_step}.pt")
        x, y = batch
        loss = nn.functional.mse_loss(self.layer(x), y)
        self.log("train_loss", loss, sync_dist=True)
        opt = self.optimizers()
        opt.zero_grad()
        self.manual_backward(loss)
        opt.step()
        if self.global_rank == 0:
            post = {k: v.detach().clone() for k, v in self.state_dict().items()}
            torch.save(post, Path(self.record_dir) / f"post-{self.trainer.global_step}.pt")
        return loss

    def configure_optimizers(self):
        if self.zero:
            from torch.distributed.optim import ZeroRedundancyOptimizer

            # reading its state consolidates it on rank 0, a collective inside the capture
            return ZeroRedundancyOptimizer(self.parameters(), optimizer_class=torch.optim.Adam, lr=0.1)
        return torch.optim.Adam(self.parameters(), lr=0.1)

    def train_dataloader(self):
        g = torch.Generator().manual_seed(0)
        return DataLoader(TensorDataset(torch.randn(16, 4, generator=g), torch.randn(16, 1, generator=g)), batch_size=2)


def _fit(strategy, tmp_path, zero=False):
    seed_everything(30)
    record_dir = tmp_path / "record"
    record_dir.mkdir(exist_ok=True)
    ckpt = ModelCheckpoint(
        dirpath=tmp_path / "ckpt", monitor="train_loss", every_n_train_steps=2, save_top_k=-1, save_last=True
    )
    # due in every batch: rank 0's time decision is broadcast as each batch starts, on every rank
    timed = ModelCheckpoint(
        dirpath=tmp_path / "timed",
        monitor="train_loss",
        train_time_interval=timedelta(0),
        save_top_k=-1,
        filename="timed-{step}",
    )
    trainer = Trainer(
        default_root_dir=tmp_path,
        accelerator="cpu",
        devices=2,
        strategy=strategy,
        max_steps=4,
        callbacks=[ckpt, timed],
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.fit(DDPRecorder(str(record_dir), zero=zero))


def _check(tmp_path):
    record_dir, ckpt_dir = tmp_path / "record", tmp_path / "ckpt"
    files = sorted(p for p in ckpt_dir.glob("*.ckpt") if p.name != "last.ckpt")
    assert len(files) == 2
    for f in files:
        c = torch.load(f, map_location="cpu", weights_only=False)
        before = c["pre_optimizer_step"]["global_step"]
        assert before == c["global_step"] - 1
        pre = torch.load(record_dir / f"pre-{before}.pt")
        post = torch.load(record_dir / f"post-{c['global_step']}.pt")
        assert all(torch.equal(c["state_dict"][k], pre[k]) for k in pre)
        assert not all(torch.equal(c["state_dict"][k], post[k]) for k in post)
        assert len(c["optimizer_states"][0]["state"]) > 0
    timed = sorted((tmp_path / "timed").glob("*.ckpt"))
    assert len(timed) == 4
    for f in timed:
        c = torch.load(f, map_location="cpu", weights_only=False)
        pre = torch.load(record_dir / f"pre-{c['global_step'] - 1}.pt")
        assert c["pre_optimizer_step"]["global_step"] == c["global_step"] - 1
        assert all(torch.equal(c["state_dict"][k], pre[k]) for k in pre)
    last = torch.load(ckpt_dir / "last.ckpt", map_location="cpu", weights_only=False)
    assert "pre_optimizer_step" not in last
    post = torch.load(record_dir / "post-4.pt")
    assert all(torch.equal(last["state_dict"][k], post[k]) for k in post)


@pytest.mark.timeout(180)
def test_ddp_spawn_two_processes(tmp_path):
    _fit("ddp_spawn", tmp_path)
    _check(tmp_path)


@pytest.mark.timeout(180)
def test_ddp_spawn_zero_redundancy_optimizer(tmp_path):
    _fit("ddp_spawn", tmp_path, zero=True)
    _check(tmp_path)


@pytest.mark.timeout(180)
def test_ddp_two_processes(tmp_path):
    # `ddp` launches the other rank by re-running the command line, so run the fit as a script of its own
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([*sys.path[1:], os.environ.get("PYTHONPATH", "")])}
    for key in ("LOCAL_RANK", "NODE_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(key, None)
    result = subprocess.run(
        [sys.executable, __file__, "ddp", str(tmp_path)], env=env, capture_output=True, text=True, timeout=150
    )
    assert result.returncode == 0, result.stderr[-4000:]
    _check(tmp_path)


if __name__ == "__main__":
    _fit(sys.argv[1], Path(sys.argv[2]))
