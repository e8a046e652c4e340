"""`ModelCheckpoint` under manual optimization without the `saved_models` workaround of #21239 (issue #20947).

Manual optimization takes the same path as automatic optimization: `train_time_interval`, the deferral of a save whose
monitored metric is stale before validation (#21106) and `last.ckpt` behave alike; a deferred save that no
validation performs is dropped, silently, as under automatic optimization in stock.
"""

import warnings
from unittest import mock

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning.pytorch import LightningModule, Trainer, seed_everything
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.callbacks import model_checkpoint as model_checkpoint_module

PROBE_X = torch.randn(32, 4, generator=torch.Generator().manual_seed(1))
PROBE_Y = PROBE_X.sum(dim=1, keepdim=True)


def score_of(state_dict):
    return nn.functional.mse_loss(PROBE_X @ state_dict["layer.weight"].T + state_dict["layer.bias"], PROBE_Y)


class Manual(LightningModule):
    """Manual optimization; `train_loss` is the batch loss, `val_loss` scores the weights on a fixed probe set."""

    def __init__(self, manual=True):
        super().__init__()
        self.automatic_optimization = not manual
        self.layer = nn.Linear(4, 1)

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = nn.functional.mse_loss(self.layer(x), y)
        self.log("train_loss", loss)
        if self.automatic_optimization:
            return loss
        opt = self.optimizers()
        opt.zero_grad()
        self.manual_backward(loss)
        opt.step()
        return None

    def validation_step(self, batch, batch_idx):
        self.log("val_loss", nn.functional.mse_loss(self.layer(PROBE_X), PROBE_Y))

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.05)

    def train_dataloader(self):
        g = torch.Generator().manual_seed(0)
        x = torch.randn(32, 4, generator=g)
        return DataLoader(TensorDataset(x, x.sum(dim=1, keepdim=True) + torch.randn(32, 1, generator=g)), batch_size=8)

    def val_dataloader(self):
        return DataLoader(TensorDataset(PROBE_X), batch_size=32)


def fit(tmp_path, model, ckpt, **trainer_kwargs):
    seed_everything(3)
    kwargs = {"max_epochs": 3, "logger": False, "enable_progress_bar": False, "enable_model_summary": False}
    kwargs.update(trainer_kwargs)
    trainer = Trainer(default_root_dir=tmp_path, callbacks=[ckpt], num_sanity_val_steps=0, **kwargs)
    model_checkpoint_module.warning_cache.clear()  # it warns once per process
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer.fit(model)
    return trainer, [str(w.message) for w in caught]


def load(path):
    return torch.load(path, map_location="cpu", weights_only=False)


def test_train_time_interval_saves_under_manual_optimization(tmp_path):
    # the clock is read in `model_checkpoint`, where upstream's own test mocks it too
    ckpt = ModelCheckpoint(dirpath=tmp_path, train_time_interval=__import__("datetime").timedelta(seconds=10))
    clock = iter(range(0, 10_000, 6))  # 6 s per read: due every other batch
    with mock.patch("lightning.pytorch.callbacks.model_checkpoint.time") as time:
        time.monotonic.side_effect = lambda: next(clock)
        fit(tmp_path, Manual(), ckpt, limit_val_batches=0, max_epochs=2)
    assert len(list(tmp_path.glob("*.ckpt"))) > 0  # 2.6.0 to 2.6.6 saved nothing: `train_time_interval` was ignored
    assert ckpt._last_global_step_saved > 0


def test_save_before_validation_waits_for_fresh_metrics_under_manual_optimization(tmp_path):
    # every 4 steps is the last batch of each epoch: validation runs right after it, so the save waits for it (#21106)
    ckpt = ModelCheckpoint(
        dirpath=tmp_path, monitor="val_loss", every_n_train_steps=4, save_top_k=-1, save_on_train_epoch_end=False
    )
    model = Manual()
    _, caught = fit(tmp_path, model, ckpt)
    assert len(ckpt.best_k_models) == 3
    for path, score in ckpt.best_k_models.items():
        # the score of the validation after the batch, of the weights the file holds; 2.6 ranked by the previous one
        torch.testing.assert_close(score_of(load(path)["state_dict"]), score, rtol=0, atol=0)
    assert not [m for m in caught if "ModelCheckpoint" in m]


def test_last_checkpoint_holds_the_live_weights_and_saved_models_is_no_longer_read(tmp_path):
    class Workaround(Manual):
        """Written as the 2.6 docs recommended: clones its weights before each step into `saved_models`."""

        def training_step(self, batch, batch_idx):
            self.saved_models = getattr(self, "saved_models", {})
            self.saved_models[batch_idx] = {k: v.detach().clone() for k, v in self.layer.state_dict().items()}
            return super().training_step(batch, batch_idx)

    ckpt = ModelCheckpoint(dirpath=tmp_path, monitor="train_loss", every_n_train_steps=2, save_last=True)
    model = Workaround()
    _, caught = fit(tmp_path, model, ckpt, limit_val_batches=0, max_steps=6)
    assert len([m for m in caught if "no longer reads the `saved_models`" in m]) == 1
    live = model.state_dict()
    for path in (tmp_path / "last.ckpt", ckpt.best_model_path):
        checkpoint = load(path)
        if checkpoint["global_step"] == 6:
            assert all(torch.equal(checkpoint["state_dict"][k], v) for k, v in live.items())
    last = load(tmp_path / "last.ckpt")
    assert last["global_step"] == 6
    assert all(torch.equal(last["state_dict"][k], v) for k, v in live.items())


@pytest.mark.parametrize("manual", [True, False])
def test_deferred_save_that_validation_never_performs_is_dropped_silently_as_in_stock(tmp_path, manual):
    # the metric only validation logs is missing at step 2, so the save waits for validation, which never comes;
    # stock drops it without a word under both kinds of optimization, and so does the patch
    ckpt = ModelCheckpoint(dirpath=tmp_path, monitor="val_loss", every_n_train_steps=2)
    _, caught = fit(tmp_path, Manual(manual=manual), ckpt, max_steps=3)
    assert not [m for m in caught if "ModelCheckpoint" in m or "monitored" in m or "val_loss" in m]
    assert not list(tmp_path.glob("*.ckpt"))
    assert ckpt._defer_save_until_validation  # still waiting, as in stock


@pytest.mark.parametrize("manual", [True, False])
def test_validation_every_epoch_saves_as_stock_and_warns_nothing(tmp_path, manual):
    # the monitored metric is missing in epoch 0 (the saves wait), then stale from the last validation, as in stock
    ckpt = ModelCheckpoint(dirpath=tmp_path, monitor="val_loss", every_n_train_steps=2, save_top_k=-1)
    _, caught = fit(tmp_path, Manual(manual=manual), ckpt)
    assert sorted(load(p)["global_step"] for p in ckpt.best_k_models) == [6, 8, 10, 12]
    assert not [m for m in caught if "ModelCheckpoint" in m or "monitored" in m]
