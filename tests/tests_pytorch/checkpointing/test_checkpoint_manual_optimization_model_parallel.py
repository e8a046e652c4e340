"""Pre-step top-k checkpoints with ``ModelParallelStrategy`` (FSDP2) on two CPU processes (gloo), issue #20947.

Each rank captures its local shards; the distributed checkpoint is compared, after conversion to a single file, with
the full weights the module gathered right before each batch's optimizer step.

"""

import operator
import os
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import torch
from lightning_utilities.core.imports import compare_version
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning.pytorch import LightningModule, Trainer, seed_everything
from lightning.pytorch.callbacks import ModelCheckpoint

# `ModelParallelStrategy` needs torch 2.4, but FSDP2 (`fully_shard`) runs on the CPU only from torch 2.7: 2.5 raises
# "FSDP requires CUDA for streams", and 2.6's CPU streams have no `record_event`
if not compare_version("torch", operator.ge, "2.7.0"):
    pytest.skip("FSDP2 on the CPU needs torch 2.7", allow_module_level=True)


def _full(state_dict):
    try:
        from torch.distributed.tensor import DTensor
    except ImportError:  # torch < 2.5
        from torch.distributed._tensor import DTensor

    return {k: (v.full_tensor() if isinstance(v, DTensor) else v).detach().clone() for k, v in state_dict.items()}


class ShardedRecorder(LightningModule):
    """Shards its layers with ``fully_shard`` and records its full weights before and after each optimizer step."""

    def __init__(self, record_dir):
        super().__init__()
        self.automatic_optimization = False
        self.layer = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 1))
        self.record_dir = record_dir

    def configure_model(self):
        try:
            from torch.distributed.fsdp import fully_shard
        except ImportError:  # torch < 2.6
            from torch.distributed._composable.fsdp import fully_shard

        mesh = self.device_mesh["data_parallel"]
        for module in self.layer:
            if isinstance(module, nn.Linear):
                fully_shard(module, mesh=mesh)
        fully_shard(self.layer, mesh=mesh)

    def _record(self, name):
        # collectives: every rank gathers, rank 0 writes
        weights = _full(self.state_dict())
        optimizer = self.optimizers().optimizer
        names = {param: fqn for fqn, param in self.named_parameters()}
        exp_avg = _full({names[p]: state["exp_avg"] for p, state in optimizer.state.items()})
        if self.global_rank == 0:
            torch.save(weights, Path(self.record_dir) / f"{name}-{self.trainer.global_step}.pt")
            torch.save(exp_avg, Path(self.record_dir) / f"{name}-exp_avg-{self.trainer.global_step}.pt")

    def training_step(self, batch, batch_idx):
        self._record("pre")
        x, y = batch
        loss = nn.functional.mse_loss(self.layer(x), y)
        self.log("train_loss", loss, sync_dist=True)
        opt = self.optimizers()
        opt.zero_grad()
        self.manual_backward(loss)
        opt.step()
        self._record("post")
        return loss

    def configure_optimizers(self):
        return torch.optim.Adam(self.parameters(), lr=0.1)

    def train_dataloader(self):
        g = torch.Generator().manual_seed(0)
        return DataLoader(TensorDataset(torch.randn(16, 4, generator=g), torch.randn(16, 1, generator=g)), batch_size=2)


class AutomaticShardedRecorder(ShardedRecorder):
    """Automatic optimization: the optimizer step runs the closure, so no gradients exist when the first one starts."""

    def __init__(self, record_dir):
        super().__init__(record_dir)
        self.automatic_optimization = True

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = nn.functional.mse_loss(self.layer(x), y)
        self.log("train_loss", loss, sync_dist=True)
        return loss

    def on_train_end(self):
        steps = {float(state["step"]) for state in self.optimizers().optimizer.state.values()}
        if self.global_rank == 0:
            torch.save(steps, Path(self.record_dir) / "adam-steps.pt")


def _fit(tmp_path, save_distributed_checkpoint, automatic=False):
    from lightning.pytorch.strategies import ModelParallelStrategy

    seed_everything(31)
    record_dir = tmp_path / "record"
    record_dir.mkdir(exist_ok=True)
    ckpt = ModelCheckpoint(
        dirpath=tmp_path / "ckpt",
        monitor="train_loss",
        every_n_train_steps=1 if automatic else 2,
        save_top_k=-1,
        save_last=True,
        save_pre_optimizer_step_weights=automatic or None,
    )
    strategy = ModelParallelStrategy(
        data_parallel_size=2, tensor_parallel_size=1, save_distributed_checkpoint=save_distributed_checkpoint
    )
    trainer = Trainer(
        default_root_dir=tmp_path,
        accelerator="cpu",
        devices=2,
        strategy=strategy,
        max_steps=4,
        callbacks=[ckpt],
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        trainer.fit((AutomaticShardedRecorder if automatic else ShardedRecorder)(str(record_dir)))
    if trainer.global_rank == 0:
        told = [str(w.message) for w in record if "after* the optimizer step" in str(w.message)]
        (tmp_path / "warnings.txt").write_text("\n".join(told))


def _run(tmp_path, save_distributed_checkpoint, automatic=False):
    # the strategy launches the other rank by re-running the command line, so run the fit as a script of its own
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([*sys.path[1:], os.environ.get("PYTHONPATH", "")])}
    for key in ("LOCAL_RANK", "NODE_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(key, None)
    result = subprocess.run(
        [sys.executable, __file__, str(tmp_path), str(int(save_distributed_checkpoint)), str(int(automatic))],
        env=env,
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert result.returncode == 0, result.stderr[-4000:]


def _load(path, tmp_path):
    if path.is_dir():  # a distributed checkpoint: convert it to one file
        from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

        single = tmp_path / f"{path.name}.single"
        dcp_to_torch_save(path, single)
        converted = torch.load(single, map_location="cpu", weights_only=False)
        meta = torch.load(path / "meta.pt", map_location="cpu", weights_only=False)
        return {**meta, "state_dict": converted["state_dict"], "optimizer_0": converted.get("optimizer_0")}
    return torch.load(path, map_location="cpu", weights_only=False)


def _same(a, b):
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


@pytest.mark.timeout(300)
def test_model_parallel_captures_local_shards(tmp_path):
    _run(tmp_path, save_distributed_checkpoint=True)
    assert (tmp_path / "warnings.txt").read_text() == ""
    record_dir, ckpt_dir = tmp_path / "record", tmp_path / "ckpt"
    files = sorted(p for p in ckpt_dir.glob("*.ckpt") if p.name != "last.ckpt")
    assert [p.name for p in files] == ["epoch=0-step=2.ckpt", "epoch=0-step=4.ckpt"]
    for f in files:
        assert f.is_dir()
        c = _load(f, tmp_path)
        before = c["pre_optimizer_step"]["global_step"]
        assert before == c["global_step"] - 1
        pre = torch.load(record_dir / f"pre-{before}.pt")
        post = torch.load(record_dir / f"post-{c['global_step']}.pt")
        assert _same(c["state_dict"], pre)
        assert not _same(c["state_dict"], post)
        assert c["pre_optimizer_step"]["optimizer_states"] is True
        # the optimizer state is from the same instant as the weights
        exp_avg = {fqn: state["exp_avg"] for fqn, state in c["optimizer_0"]["state"].items()}
        assert _same(exp_avg, torch.load(record_dir / f"pre-exp_avg-{before}.pt"))
        assert not _same(exp_avg, torch.load(record_dir / f"post-exp_avg-{c['global_step']}.pt"))
    last = _load(ckpt_dir / "last.ckpt", tmp_path)
    assert "pre_optimizer_step" not in last
    assert _same(last["state_dict"], torch.load(record_dir / "post-4.pt"))


@pytest.mark.timeout(300)
def test_model_parallel_full_state_dict_warns(tmp_path):
    _run(tmp_path, save_distributed_checkpoint=False)
    told = (tmp_path / "warnings.txt").read_text()
    assert "save_distributed_checkpoint=False" in told
    assert told.count("after* the optimizer step") == 1
    record_dir = tmp_path / "record"
    for f in sorted(p for p in (tmp_path / "ckpt").glob("*.ckpt") if p.name != "last.ckpt"):
        c = _load(f, tmp_path)
        assert "pre_optimizer_step" not in c
        assert _same(c["state_dict"], torch.load(record_dir / f"post-{c['global_step']}.pt"))


@pytest.mark.timeout(300)
def test_model_parallel_never_initializes_the_optimizer(tmp_path):
    """Reading an empty sharded optimizer state would run a zero-lr step; the first batch captures weights only."""
    _run(tmp_path, save_distributed_checkpoint=True, automatic=True)
    # Adam stepped exactly once per batch: nothing stepped it to read its state
    assert torch.load(tmp_path / "record" / "adam-steps.pt") == {4.0}
    told = (tmp_path / "warnings.txt").read_text()
    assert told.count("after* the optimizer step") == 1
    assert "the optimizer had no state yet" in told
    steps = {}
    for f in (tmp_path / "ckpt").glob("epoch=*.ckpt"):
        c = _load(f, tmp_path)
        steps[c["global_step"]] = c
    assert sorted(steps) == [1, 2, 3, 4]
    assert "pre_optimizer_step" not in steps[1]  # the full save in the first batch could not be pre-step
    for step in (2, 3, 4):
        assert steps[step]["pre_optimizer_step"] == {"global_step": step - 1, "optimizer_states": True}


if __name__ == "__main__":
    _fit(Path(sys.argv[1]), bool(int(sys.argv[2])), bool(int(sys.argv[3])))
