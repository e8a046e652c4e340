"""`ModelCheckpoint(save_pre_optimizer_step_state=True)` (issue #20947): what the option copies.

A copy is taken only in a batch whose optimizer steps can end on a save, predicted from the steps of the batches
before, and not for a monitor that the batches which saved did not log.
"""

import gc
import time
from datetime import timedelta

import pytest
import torch
from test_pre_optimizer_step import (
    PROBE_X,
    PROBE_Y,
    Gan,
    Net,
    assert_pairs,
    checkpoint,
    count_copies,
    fit,
    load,
    messages,
    own_warning_cache,  # noqa: F401  (autouse here too)
    recorded_warnings,
    score_of,
)
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning.pytorch import Callback, LightningModule, Trainer, seed_everything
from lightning.pytorch.callbacks import ModelCheckpoint


@pytest.mark.parametrize("manual", [False, True])
def test_a_monitor_that_no_training_batch_logs_takes_no_copies(tmp_path, monkeypatch, manual):
    """A validation score is not logged in training batches: once a batch that could save has shown that, no batch
    copies for it (the first batch of manual optimization copies too, as its step count is not known yet)."""
    copies = count_copies(monkeypatch)
    ckpt = checkpoint(tmp_path, monitor="val_loss", save_top_k=-1)
    fit(tmp_path, Net(manual=manual), checkpoints=[ckpt], max_steps=24, limit_val_batches=1, val_check_interval=4)
    assert ckpt.best_k_models
    assert copies == ([0, 1] if manual else [1])


@pytest.mark.parametrize(
    ("model", "copied"), [(Net(log_in="before_step"), [0, 3, 7, 11, 15]), (Gan(), [0, 2, 6, 10, 14])]
)
def test_manual_optimization_copies_only_in_batches_whose_steps_end_on_a_save(tmp_path, monkeypatch, model, copied):
    """`every_n_train_steps=4`, `save_top_k=-1`: the batches copy whose steps, as many as the batches before took (one,
    or the GAN's two), end on a multiple of 4; the first batch copies, as nothing is known yet."""
    copies = count_copies(monkeypatch)
    with recorded_warnings() as caught:
        _, (ckpt,) = fit(tmp_path, model, checkpoints=[checkpoint(tmp_path, every_n_train_steps=4, save_top_k=-1)])
    assert copies == copied  # the global step at each copy, before the batch's steps
    assert sorted(load(path)["global_step"] for path in ckpt.best_k_models) == [4, 8, 12, 16]
    assert_pairs(ckpt)
    assert not messages(caught, "save_pre_optimizer_step_state")


@pytest.mark.parametrize("every_n", [4, 2])
def test_a_batch_that_takes_more_steps_than_those_before_holds_the_live_state_with_one_warning(tmp_path, every_n):
    """One step a batch, but two in the batch that starts at global step 6: it ends on the save at 8, which no batch
    before predicted, so nothing was copied for it. Its file holds the live state, unmarked, as without the option, and
    the warning names that cause, not when the score was logged."""

    class TwoStepsOnce(Net):
        def training_step(self, batch, batch_idx):
            out = super().training_step(batch, batch_idx)
            if self.trainer.global_step == 7:
                self.optimizers().step()
            return out

    with recorded_warnings() as caught:
        _, (ckpt,) = fit(
            tmp_path, TwoStepsOnce(), checkpoints=[checkpoint(tmp_path, every_n_train_steps=every_n, save_top_k=-1)]
        )
    files = {load(path)["global_step"]: (load(path), score) for path, score in ckpt.best_k_models.items()}
    assert sorted(files) == list(range(every_n, 17, every_n))
    saved, score = files.pop(8)
    assert "pre_optimizer_step" not in saved
    assert not torch.equal(score_of(saved["state_dict"]), score.float())
    for saved, score in files.values():
        assert saved["pre_optimizer_step"]["global_step"] == saved["global_step"] - 1
        torch.testing.assert_close(score_of(saved["state_dict"]), score.float(), rtol=0, atol=0)
    (warning,) = messages(caught, "save_pre_optimizer_step_state")
    assert "the batch took 2 optimizer steps where those before took [1], so nothing was copied" in warning


def test_each_warning_names_one_cause(tmp_path):
    """The score logged before the step cannot enter the top 1, so nothing is copied; a better value is logged after the
    step, which enters it. The warning says that, not that the weights changed outside Lightning's steps or that the
    value could not enter the top-k."""

    class BetterAfterTheStep(Net):
        def training_step(self, batch, batch_idx):
            self.log("score", torch.tensor(1e6))  # worse than any score saved, with mode="min"
            super().training_step(batch, batch_idx)
            self.log("score", nn.functional.mse_loss(self.head(PROBE_X), PROBE_Y).detach())

    with recorded_warnings() as caught:
        _, (ckpt,) = fit(tmp_path, BetterAfterTheStep(log_in=None), checkpoints=[checkpoint(tmp_path, save_top_k=1)])
    (warning,) = messages(caught, "save_pre_optimizer_step_state")
    assert warning.endswith(
        "holds the live state, after the optimizer step: 'score' was logged after the batch's first optimizer step"
        " began (in `on_before_optimizer_step`, after `optimizer.step()` or at the end of the batch) and is not a loss"
        " the batch backpropagated (a value reduced across processes with `sync_dist=True` is not), so which state"
        " computed it is unknown."
    )
    assert "pre_optimizer_step" not in load(ckpt.best_model_path)


class Wide(LightningModule):
    """The issue's case: 65,792 trainable parameters under Adam, so a copy of them and their states is 790 KB."""

    def __init__(self, manual):
        super().__init__()
        self.automatic_optimization = not manual
        self.layer = nn.Linear(256, 256)

    def training_step(self, batch, batch_idx):
        loss = self.layer(batch[0]).pow(2).mean()
        if self.automatic_optimization:
            self.log("train_loss", loss)
            return loss
        optimizer = self.optimizers()
        optimizer.zero_grad()
        self.manual_backward(loss)
        optimizer.step()
        self.log("train_loss", loss)  # after the step: the file holds the live state
        return None

    def validation_step(self, batch, batch_idx):
        self.log("val_loss", self.layer(batch[0]).pow(2).mean())

    def configure_optimizers(self):
        return torch.optim.Adam(self.parameters(), lr=1e-3)

    def train_dataloader(self):
        return DataLoader(TensorDataset(torch.randn(48, 256)), batch_size=4)

    def val_dataloader(self):
        return DataLoader(TensorDataset(torch.randn(8, 256)), batch_size=4)


class TensorBytesAtTrainEnd(Callback):
    """What a user finds held at `on_train_end`, as they would measure it: every tensor that gc can reach."""

    def on_train_end(self, trainer, pl_module):
        gc.collect()
        storages = {}
        for obj in gc.get_objects():
            if isinstance(obj, torch.Tensor):
                storage = obj.untyped_storage()
                storages[storage.data_ptr()] = storage.nbytes()
        self.held = sum(storages.values())


@pytest.mark.parametrize(
    ("monitor", "mode", "manual"),
    [("val_loss", "min", False), ("val_loss", "min", True), ("train_loss", "max", False), ("train_loss", "max", True)],
)
def test_no_copy_outlives_the_saves_that_can_use_it(tmp_path, monitor, mode, manual):
    """At `on_train_end` the option holds nothing: not the copy of a batch whose save waited for validation (a
    validation score), nor of a batch whose save did not use it (a falling loss that cannot enter a top-k of the
    largest, logged after the step under manual optimization, so the copy is taken before that is known). Measured
    against the same fit without the option, after a fit that warms up what the first fit allocates once."""
    held = []
    for option in (False, True, False):
        seed_everything(0)
        measure = TensorBytesAtTrainEnd()
        ckpt = ModelCheckpoint(
            dirpath=tmp_path / str(len(held)),
            monitor=monitor,
            every_n_train_steps=2,
            save_top_k=1,
            mode=mode,
            save_pre_optimizer_step_state=option,
        )
        trainer = Trainer(
            default_root_dir=tmp_path,
            max_epochs=3,
            callbacks=[measure, ckpt],
            logger=False,
            enable_progress_bar=False,
            enable_model_summary=False,
        )
        with recorded_warnings():
            trainer.fit(Wide(manual))
        assert ckpt.best_k_models
        held.append(measure.held)
    assert held[1] == held[2]


def test_train_time_interval_copies_only_in_batches_that_can_end_past_the_interval(tmp_path, monkeypatch):
    """Batches of 11 ms on the clock and a save every 50 ms: a batch copies only if, taking 1.5 times as long as the
    batch before, it ends past the interval, which is the batch that saves, not every batch while the top-k fills."""
    clock = [1000.0]
    monkeypatch.setattr(time, "monotonic", lambda: clock[0])  # the clock that ModelCheckpoint and the option read

    class Steady(Net):
        def training_step(self, batch, batch_idx):
            clock[0] += 0.011
            return super().training_step(batch, batch_idx)

    copies, saves = count_copies(monkeypatch), []
    ckpt = checkpoint(tmp_path, every_n_train_steps=None, train_time_interval=timedelta(milliseconds=50), save_top_k=-1)
    save = ckpt._save_checkpoint
    monkeypatch.setattr(ckpt, "_save_checkpoint", lambda trainer, path: saves.append(path) or save(trainer, path))
    with recorded_warnings() as caught:
        fit(tmp_path, Steady(manual=False), checkpoints=[ckpt], max_steps=40)
    assert len(saves) >= 6
    assert len(copies) == len(saves), (copies, saves)  # 40 before: every batch, while the top-k filled
    assert not messages(caught, "save_pre_optimizer_step_state")
    assert_pairs(ckpt)


def test_an_unpredicted_save_after_a_batch_without_a_step_holds_the_live_state_without_a_warning(tmp_path, monkeypatch):
    """`accumulate_grad_batches=2` and a save every 50 ms: a batch that takes no optimizer step runs long and ends past
    the interval, which no batch time predicted, so nothing was copied. None is needed: the batch did not step, so the
    live state computed its score, and its file pairs without a warning."""
    clock, batches = [1000.0], []
    monkeypatch.setattr(time, "monotonic", lambda: clock[0])

    class SlowOnce(Net):
        def training_step(self, batch, batch_idx):
            batches.append((self.trainer.current_epoch, batch_idx))
            clock[0] += 0.2 if batches[-1] == (1, 4) else 0.011
            return super().training_step(batch, batch_idx)

    saved_after = []
    ckpt = checkpoint(tmp_path, every_n_train_steps=None, train_time_interval=timedelta(milliseconds=50), save_top_k=-1)
    save = ckpt._save_checkpoint
    monkeypatch.setattr(ckpt, "_save_checkpoint", lambda t, path: saved_after.append(batches[-1]) or save(t, path))
    with recorded_warnings() as caught:
        fit(tmp_path, SlowOnce(manual=False), checkpoints=[ckpt], max_steps=12, accumulate_grad_batches=2)
    assert (1, 4) in saved_after  # the slow batch without a step (steps end the odd batches) saved
    assert not messages(caught, "save_pre_optimizer_step_state")
    files = [(load(path), score) for path, score in ckpt.best_k_models.items()]
    for saved, score in files:
        torch.testing.assert_close(score_of(saved["state_dict"]), score.float(), rtol=0, atol=0)
    # unmarked: the files of the batches without a step (the even ones); the stepping batches' files hold their copies
    assert sum("pre_optimizer_step" not in saved for saved, _ in files) == sum(b % 2 == 0 for _, b in saved_after)
    assert any("pre_optimizer_step" in saved for saved, _ in files)
