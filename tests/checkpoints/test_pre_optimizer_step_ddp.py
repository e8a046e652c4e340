"""`ModelCheckpoint(save_pre_optimizer_step_state=True)` with DDP on two CPU processes (gloo), issue #20947.

The ranks log differently: each rank logs `score` in batch 0, then rank r only when `batch_idx % 2 == r`. Whether a
rank logged during a batch is its own; no decision that leads into a collective may depend on it. Each file's own
`ModelCheckpoint` state records the score that ranked it (`current_score`).
"""

import atexit
import multiprocessing
import os
import sys

import pytest
import torch
from test_pre_optimizer_step import (
    PROBE_X,
    PROBE_Y,
    Net,
    checkpoint,
    load,
    score_of,
)
from torch import nn

from lightning.pytorch import Callback, Trainer, seed_everything

pytestmark = [
    pytest.mark.timeout(240),
    pytest.mark.skipif(not torch.distributed.is_available(), reason="needs torch.distributed (gloo)"),
]

BATCHES_PER_EPOCH = 8  # 64 samples, 2 ranks, batches of 4


class LogOnAlternateRanks(Net):
    def __init__(self, manual):
        super().__init__(manual=manual, log_in=None)

    def training_step(self, batch, batch_idx):
        if batch_idx == 0 or batch_idx % 2 == self.global_rank:
            self.log("score", nn.functional.mse_loss(self.head(PROBE_X), PROBE_Y))
        return super().training_step(batch, batch_idx)

    def train_dataloader(self):
        loader = super().train_dataloader()
        return torch.utils.data.DataLoader(loader.dataset, batch_size=4)


class SameDeferralOnEveryRank(Callback):
    """Before each validation: every rank deferred the batch's save to it, or none did."""

    def __init__(self, ckpt):
        self.ckpt = ckpt

    def on_validation_start(self, trainer, pl_module):
        deferred = trainer.strategy.all_gather(torch.tensor(self.ckpt._defer_save_until_validation))
        assert deferred.min() == deferred.max(), deferred


def _exit_now():
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


class ExitWithoutGlooTeardown(Callback):
    """Each spawned process exits without gloo's teardown once its fit has succeeded: Lightning leaves a gloo group to
    the interpreter's exit, where gloo's threads now and then abort the process after the test's work is done
    ("terminate called without an active exception", torch #190489), and ``destroy_process_group`` can hang instead
    (torch 2.1). What fails after this hook (the launcher's own collection of the results) exits with 0: for rank 0
    the test then fails by its timeout, as the launcher waits for a result that never comes."""

    def teardown(self, trainer, pl_module, stage):
        if multiprocessing.parent_process() is not None:  # a spawned process, never the test's own
            atexit.register(_exit_now)


def two_rank_trainer(tmp_path, ckpt, **kwargs):
    """A `Trainer` of 2 CPU processes (gloo) with `ckpt` and the callback that checks the ranks defer alike."""
    return Trainer(
        default_root_dir=tmp_path,
        accelerator="cpu",
        devices=2,
        strategy="ddp_spawn",
        callbacks=[SameDeferralOnEveryRank(ckpt), ckpt, ExitWithoutGlooTeardown()],
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        **kwargs,
    )


@pytest.mark.parametrize(
    ("manual", "val_check_interval"), [(True, 1.0), (False, 1.0), (False, 0.5)], ids=["manual", "automatic", "deferral"]
)
def test_ranks_that_log_in_different_batches_neither_hang_nor_pair_wrongly(tmp_path, manual, val_check_interval):
    """Rank 0 writes the files: those of batches in which it logged hold its pre-step state, the others the live
    weights. With `val_check_interval=0.5`, the epoch's last batch (in which only rank 1 logs) would defer its save to
    validation on the ranks that did not log, and not on the others, if the ranks did not agree."""
    seed_everything(5)
    ckpt = checkpoint(tmp_path, every_n_train_steps=1, save_top_k=-1)
    trainer = two_rank_trainer(
        tmp_path,
        ckpt,
        max_steps=16,
        val_check_interval=val_check_interval,
        limit_val_batches=1 if val_check_interval != 1.0 else 0,
    )
    trainer.fit(LogOnAlternateRanks(manual=manual))

    files = sorted(tmp_path.glob("step=*.ckpt"), key=lambda path: load(path)["global_step"])
    assert [load(path)["global_step"] for path in files] == list(range(1, 17))
    for path in files:
        saved = load(path)
        batch_idx = (saved["global_step"] - 1) % BATCHES_PER_EPOCH
        rank_0_logged = batch_idx % 2 == 0
        assert ("pre_optimizer_step" in saved) is rank_0_logged, path
        (state,) = (v for v in saved["callbacks"].values() if v.get("dirpath") == str(tmp_path))
        if rank_0_logged:
            torch.testing.assert_close(score_of(saved["state_dict"]), state["current_score"].float(), rtol=0, atol=0)


class LateOnRankOne(Net):
    """Rank 1 logs `score` in training only from epoch 1 on; validation logs it on every rank."""

    def __init__(self):
        super().__init__(manual=False, log_in=None)

    def training_step(self, batch, batch_idx):
        if self.global_rank == 0 or self.current_epoch > 0:
            self.log("score", nn.functional.mse_loss(self.head(PROBE_X), PROBE_Y))
        return super().training_step(batch, batch_idx)

    def validation_step(self, batch, batch_idx):
        self.log("score", nn.functional.mse_loss(self.head(PROBE_X), PROBE_Y))

    def train_dataloader(self):
        loader = super().train_dataloader()
        return torch.utils.data.DataLoader(loader.dataset, batch_size=4)


def test_a_rank_without_the_monitored_value_defers_as_the_others_do(tmp_path):
    """The first save is the last batch of epoch 0, where rank 1 has no `score` yet: every rank defers it to the end of
    validation, as without the option, and the ranks track the same file names."""
    seed_everything(5)
    kwargs = {"every_n_train_steps": BATCHES_PER_EPOCH, "save_top_k": -1, "save_on_train_epoch_end": False}
    ckpt = checkpoint(tmp_path, enable_version_counter=False, **kwargs)
    trainer = two_rank_trainer(tmp_path, ckpt, max_epochs=2, limit_val_batches=1)
    trainer.fit(LateOnRankOne())
    assert sorted(path.name for path in tmp_path.glob("*.ckpt")) == ["step=16.ckpt", "step=8.ckpt"]
