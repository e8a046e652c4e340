"""ModelCheckpoint writes the weights that produced each top-k score (issue #20947).

Every test runs a real ``Trainer`` on a tiny module that records its own weights right before and right after the
optimizer steps of each batch, and compares them with the tensors in the checkpoint files.

"""

import warnings
from datetime import timedelta
from pathlib import Path

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning.pytorch import LightningModule, Trainer, seed_everything
from lightning.pytorch.callbacks import Callback, ModelCheckpoint, StochasticWeightAveraging

PRE_KEY = "pre_optimizer_step"


def _data(n=16, seed=0):
    g = torch.Generator().manual_seed(seed)
    return TensorDataset(torch.randn(n, 4, generator=g), torch.randn(n, 1, generator=g))


def _clone(module):
    return {k: v.detach().clone() for k, v in module.state_dict().items()}


def _same(a, b):
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


class Recorder(LightningModule):
    """Records ``(weights before the batch's first step, weights after the batch)`` by global step."""

    def __init__(self, log_after_step=False, n_optimizers=1, monitor="train_loss", optimizer="sgd", skip_steps=()):
        super().__init__()
        self.automatic_optimization = False
        self.layer = nn.Linear(4, 1)
        self.other = nn.Linear(4, 1) if n_optimizers == 2 else None
        self.log_after_step = log_after_step
        self.n_optimizers = n_optimizers
        self.monitor = monitor
        self.optimizer_name = optimizer
        self.skip_steps = set(skip_steps)  # batch indices (global count) where no optimizer steps
        self.pre = {}  # global_step before the batch -> model weights
        self.post = {}  # global_step after the batch -> model weights
        self.scores = {}  # global_step after the batch -> logged score
        self.batches_seen = 0

    def _loss(self, batch):
        x, y = batch
        out = self.layer(x)
        if self.other is not None:
            out = out + self.other(x)
        return nn.functional.mse_loss(out, y)

    def training_step(self, batch, batch_idx):
        self.pre[self.trainer.global_step] = _clone(self)
        opts = self.optimizers()
        opts = opts if isinstance(opts, list) else [opts]
        loss = self._loss(batch)
        if not self.log_after_step:
            self.log(self.monitor, loss)
        skip = self.batches_seen in self.skip_steps
        self.batches_seen += 1
        if not skip:
            for opt in opts:
                if self.optimizer_name == "lbfgs":

                    def closure(opt=opt):
                        opt.zero_grad()
                        loss = self._loss(batch)
                        self.manual_backward(loss)
                        return loss

                    opt.step(closure=closure)
                else:
                    opt.zero_grad()
                    self.manual_backward(self._loss(batch))
                    opt.step()
        if self.log_after_step:
            self.log(self.monitor, loss)
        self.scores[self.trainer.global_step] = loss.detach().clone()
        return loss

    def on_train_batch_end(self, outputs, batch, batch_idx):
        self.post[self.trainer.global_step] = _clone(self)

    def configure_optimizers(self):
        if self.optimizer_name == "lbfgs":
            return torch.optim.LBFGS(self.parameters(), lr=0.1, max_iter=3)
        if self.n_optimizers == 2:
            return [
                torch.optim.Adam(self.layer.parameters(), lr=0.1),
                torch.optim.Adam(self.other.parameters(), lr=0.1),
            ]
        return torch.optim.Adam(self.parameters(), lr=0.1)

    def train_dataloader(self):
        return DataLoader(_data(), batch_size=2)


@pytest.fixture
def captures(monkeypatch):
    """Records ``(global_step, with_optimizers)`` for every capture of the pre-step state, and still captures."""
    from lightning.pytorch.callbacks._pre_step_snapshot import _PreStepSnapshot

    seen = []
    original = _PreStepSnapshot._capture

    def spy(self, trainer, with_optimizers):
        seen.append((trainer.global_step, with_optimizers))
        return original(self, trainer, with_optimizers)

    monkeypatch.setattr(_PreStepSnapshot, "_capture", spy)
    return seen


def _trainer(tmp_path, callbacks, **kwargs):
    kwargs.setdefault("max_epochs", 1)
    return Trainer(
        default_root_dir=tmp_path,
        callbacks=callbacks,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        accelerator="cpu",
        devices=1,
        **kwargs,
    )


def _fit_recording_warnings(trainer, model, **fit_kwargs):
    """Fits ``model`` and returns every warning raised meanwhile."""
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        trainer.fit(model, **fit_kwargs)
    return record


def _load(path):
    return torch.load(path, map_location="cpu", weights_only=False)


def _topk_files(ckpt_dir):
    return sorted(p for p in Path(ckpt_dir).glob("*.ckpt") if not p.name.startswith("last"))


def _assert_pre_step(model, ckpt, expect_optim=None):
    step = ckpt["global_step"]
    assert PRE_KEY in ckpt, "top-k file must be marked as holding pre-step weights"
    before = ckpt[PRE_KEY]["global_step"]
    assert before < step
    assert _same(ckpt["state_dict"], model.pre[before])
    assert not _same(ckpt["state_dict"], model.post[step])
    if expect_optim is not None:
        assert ckpt[PRE_KEY]["optimizer_states"] is expect_optim
    return before


@pytest.mark.parametrize("log_after_step", [False, True])
@pytest.mark.parametrize("save_top_k", [1, -1])
def test_topk_holds_pre_step_weights(tmp_path, log_after_step, save_top_k):
    seed_everything(1)
    model = Recorder(log_after_step=log_after_step)
    ckpt = ModelCheckpoint(dirpath=tmp_path, monitor="train_loss", every_n_train_steps=2, save_top_k=save_top_k)
    _trainer(tmp_path, [ckpt], max_epochs=2).fit(model)

    files = _topk_files(tmp_path)
    assert len(files) == (1 if save_top_k == 1 else 8)
    for f in files:
        c = _load(f)
        before = _assert_pre_step(model, c, expect_optim=True)
        # the score in the file's ranking is the one the saved weights produced
        score = ckpt.best_k_models[str(f)]
        assert torch.allclose(score, model.scores[c["global_step"]])
        assert c["global_step"] == before + 1
    # the best file maps to the smallest score over both epochs
    best = _load(ckpt.best_model_path)
    best_step = min((s for s in model.scores if s % 2 == 0), key=lambda s: model.scores[s].item())
    assert best["global_step"] == best_step
    assert _same(best["state_dict"], model.pre[best_step - 1])


def test_best_score_in_later_epoch_maps_to_right_batch(tmp_path):
    """2.6 picked the largest batch_idx across epochs; the best score here is in epoch 2 at a small batch_idx."""
    seed_everything(2)
    model = Recorder()
    ckpt = ModelCheckpoint(dirpath=tmp_path, monitor="train_loss", mode="max", every_n_train_steps=1, save_top_k=1)

    class Scores(Recorder):
        pass

    # force the max score at epoch 2, batch 0 by scaling the logged value
    orig = model.log

    def log(name, value, *args, **kwargs):
        if model.current_epoch == 2 and model.trainer.fit_loop.epoch_loop.batch_idx == 0:
            value = value + 1000.0
        return orig(name, value, *args, **kwargs)

    model.log = log
    _trainer(tmp_path, [ckpt], max_epochs=3).fit(model)
    best = _load(ckpt.best_model_path)
    assert best["epoch"] == 2
    assert best["global_step"] == 17  # 8 batches per epoch, first batch of epoch 2
    _assert_pre_step(model, best)


@pytest.mark.parametrize("save_weights_only", [False, True])
def test_optimizer_state_from_same_instant(tmp_path, save_weights_only):
    seed_everything(3)
    model = Recorder()
    opt_states = {}

    class OptRecorder(Recorder):
        def training_step(self, batch, batch_idx):
            opt_states[self.trainer.global_step] = {
                k: {kk: vv.clone() if torch.is_tensor(vv) else vv for kk, vv in v.items()}
                for k, v in self.optimizers().optimizer.state_dict()["state"].items()
            }
            return super().training_step(batch, batch_idx)

    model = OptRecorder()
    ckpt = ModelCheckpoint(
        dirpath=tmp_path,
        monitor="train_loss",
        every_n_train_steps=3,
        save_top_k=-1,
        save_weights_only=save_weights_only,
    )
    _trainer(tmp_path, [ckpt]).fit(model)
    files = _topk_files(tmp_path)
    assert len(files) == 2
    for f in files:
        c = _load(f)
        before = _assert_pre_step(model, c, expect_optim=not save_weights_only)
        if save_weights_only:
            assert "optimizer_states" not in c
            continue
        saved = c["optimizer_states"][0]["state"]
        expected = opt_states[before]
        assert saved.keys() == expected.keys()
        assert len(saved) > 0
        for idx in saved:
            for name, value in saved[idx].items():
                assert torch.equal(torch.as_tensor(value), torch.as_tensor(expected[idx][name]))


@pytest.mark.parametrize("save_last", [True, "link"])
def test_last_checkpoint_is_post_step(tmp_path, save_last):
    seed_everything(4)
    model = Recorder()
    ckpt = ModelCheckpoint(
        dirpath=tmp_path, monitor="train_loss", every_n_train_steps=2, save_top_k=1, save_last=save_last
    )
    _trainer(tmp_path, [ckpt], max_steps=6).fit(model)
    last = tmp_path / "last.ckpt"
    assert last.exists()
    if save_last == "link":
        # never a link to a pre-step file
        assert not last.is_symlink() or PRE_KEY not in _load(last)
    c = _load(last)
    assert PRE_KEY not in c
    # "link" points at the most recent save, a post-step copy where that save was a pre-step top-k file
    assert c["global_step"] == (6 if save_last is True else int(Path(ckpt.best_model_path).stem.split("=")[-1]))
    assert _same(c["state_dict"], model.post[c["global_step"]])
    if save_last is True:
        assert _same(c["state_dict"], _clone(model))


def test_live_model_untouched_by_save(tmp_path):
    """The live model is bit-identical after a save, also when the save raises."""
    seed_everything(5)

    class Failing(Recorder):
        def on_save_checkpoint(self, checkpoint):
            if self.trainer.global_step == 4:
                self.live_at_failure = _clone(self)
                raise RuntimeError("disk full")

    model = Failing()
    ckpt = ModelCheckpoint(dirpath=tmp_path, monitor="train_loss", every_n_train_steps=2, save_top_k=-1)
    with pytest.raises(RuntimeError, match="disk full"):
        _trainer(tmp_path, [ckpt]).fit(model)
    # the failing save was writing the pre-step weights of the batch; the live (post-step) weights stay as they were
    assert not _same(model.live_at_failure, model.pre[3])
    assert _same(_clone(model), model.live_at_failure)
    # and the successful save of step 2 did not change the live weights either
    c = _load(tmp_path / "epoch=0-step=2.ckpt")
    _assert_pre_step(model, c)


@pytest.mark.parametrize(("n", "steps_per_batch"), [(3, 2), (4, 2), (5, 2)])
def test_two_optimizers(tmp_path, n, steps_per_batch):
    seed_everything(6)
    model = Recorder(n_optimizers=2)
    ckpt = ModelCheckpoint(dirpath=tmp_path, monitor="train_loss", every_n_train_steps=n, save_top_k=-1)
    _trainer(tmp_path, [ckpt]).fit(model)
    files = _topk_files(tmp_path)
    expected_steps = [s for s in range(2, 17, 2) if s % n == 0]
    assert sorted(_load(f)["global_step"] for f in files) == expected_steps
    for f in files:
        c = _load(f)
        before = _assert_pre_step(model, c)
        assert before == c["global_step"] - steps_per_batch


def test_batch_without_optimizer_step(tmp_path):
    """A batch that does not step saves the live weights, which produced its score."""
    seed_everything(7)
    model = Recorder(skip_steps={3})  # 4th batch does not step: global steps 1, 2, 3, 3, 4, ...
    ckpt = ModelCheckpoint(dirpath=tmp_path, monitor="train_loss", train_time_interval=timedelta(0), save_top_k=-1)
    _trainer(tmp_path, [ckpt], max_steps=5).fit(model)
    steps = {}
    for f in _topk_files(tmp_path):
        c = _load(f)
        steps[c["global_step"]] = c
    # time-triggered saves happen again under manual optimization (2.6 saved nothing)
    assert sorted(steps) == [1, 2, 3, 4, 5]
    for _step, c in steps.items():
        _assert_pre_step(model, c)


def test_lbfgs_closure_called_many_times(tmp_path):
    seed_everything(8)
    model = Recorder(optimizer="lbfgs")
    ckpt = ModelCheckpoint(dirpath=tmp_path, monitor="train_loss", every_n_train_steps=2, save_top_k=-1)
    _trainer(tmp_path, [ckpt], max_steps=4).fit(model)
    files = _topk_files(tmp_path)
    assert len(files) == 2
    for f in files:
        _assert_pre_step(model, _load(f))


# ----------------------------------------------------------------------------------------------------
# which weights other saves hold, deferrals, warnings, resuming
# ----------------------------------------------------------------------------------------------------


class ValRecorder(Recorder):
    def validation_step(self, batch, batch_idx):
        self.log("val_loss", self._loss(batch))
        self.val_weights = _clone(self)

    def val_dataloader(self):
        return DataLoader(_data(4, seed=1), batch_size=2)


def _post_step_warnings(record):
    return [w for w in record if "after* the optimizer step" in str(w.message)]


@pytest.mark.parametrize("val_check_interval", [4, 0.5])
def test_validation_monitor_deferred_saves_live_weights(tmp_path, val_check_interval):
    seed_everything(10)
    model = ValRecorder()
    ckpt = ModelCheckpoint(dirpath=tmp_path, monitor="val_loss", every_n_train_steps=2, save_top_k=-1)
    trainer = _trainer(tmp_path, [ckpt], val_check_interval=val_check_interval, num_sanity_val_steps=0)
    trainer.fit(model)
    files = _topk_files(tmp_path)
    assert files
    for f in files:
        c = _load(f)
        # a validation score: the live weights that validation saw, never pre-step weights
        assert PRE_KEY not in c
        assert _same(c["state_dict"], model.post[c["global_step"]])
    # the first save (step 2) was deferred until validation produced `val_loss` (after batch 4)
    assert min(_load(f)["global_step"] for f in files) == 4
    # stale value at the last batch (#21106): deferred to the validation after it, also under manual optimization
    assert max(_load(f)["global_step"] for f in files) == 8
    assert _same(_load(ckpt.best_model_path)["state_dict"], model.post[_load(ckpt.best_model_path)["global_step"]])


def test_validation_monitor_captures_at_most_once(tmp_path, captures):
    """A metric only validation logs never needs the pre-step weights: after its first save, nothing is captured."""
    seed_everything(10)
    model = ValRecorder()
    ckpt = ModelCheckpoint(dirpath=tmp_path, monitor="val_loss", every_n_train_steps=2, save_top_k=-1)
    trainer = _trainer(tmp_path, [ckpt], max_epochs=5, val_check_interval=4, num_sanity_val_steps=0)
    record = _fit_recording_warnings(trainer, model)
    assert model.trainer.global_step == 40
    # only until the first save (step 2) showed that `val_loss` is not a training metric: the first batch (steps per
    # batch unknown yet) and the batch of that save
    assert [step for step, _ in captures] == [0, 1]
    assert not _post_step_warnings(record)
    files = _topk_files(tmp_path)
    assert len(files) > 10
    for f in files:
        c = _load(f)
        assert PRE_KEY not in c
        assert _same(c["state_dict"], model.post[c["global_step"]])


class LateTrainingMetric(ValRecorder):
    """Monitors ``score``: logged by validation in the first epoch, by ``training_step`` from the second on."""

    def __init__(self):
        super().__init__(monitor="score")

    def training_step(self, batch, batch_idx):
        if self.current_epoch == 0:
            self.pre[self.trainer.global_step] = _clone(self)
            opt = self.optimizers()
            opt.zero_grad()
            self.manual_backward(self._loss(batch))
            opt.step()
            return None
        return super().training_step(batch, batch_idx)

    def validation_step(self, batch, batch_idx):
        if self.current_epoch == 0:
            self.log("score", self._loss(batch))


def test_monitor_that_moves_to_training_is_captured_again(tmp_path):
    """The first save after the metric moved to training was not expected; it says so once, then captures resume."""
    seed_everything(25)
    model = LateTrainingMetric()
    ckpt = ModelCheckpoint(dirpath=tmp_path, monitor="score", every_n_train_steps=2, save_top_k=-1)
    trainer = _trainer(tmp_path, [ckpt], max_epochs=2, val_check_interval=4, num_sanity_val_steps=0)
    record = _fit_recording_warnings(trainer, model)
    found = _post_step_warnings(record)
    assert len(found) == 1
    assert "was not logged during training at the previous save" in str(found[0].message)
    steps = {_load(f)["global_step"]: _load(f) for f in _topk_files(tmp_path)}
    # epoch 0: validation scores (2 and 8 deferred to validation); epoch 1: step 10 unexpected, then pre-step again
    assert sorted(steps) == [4, 6, 8, 10, 12, 14, 16]
    for step in (4, 6, 8, 10):
        assert PRE_KEY not in steps[step]
        assert _same(steps[step]["state_dict"], model.post[step])
    for step in (12, 14, 16):
        _assert_pre_step(model, steps[step])


def test_deferral_that_never_resolves_is_not_silent(tmp_path):
    """The monitored key only comes from validation, which never runs again before training stops."""
    seed_everything(11)
    model = ValRecorder()
    ckpt = ModelCheckpoint(dirpath=tmp_path, monitor="val_loss", every_n_train_steps=3, save_last=True)
    trainer = _trainer(tmp_path, [ckpt], max_steps=3, val_check_interval=4, num_sanity_val_steps=0)
    with pytest.warns(UserWarning, match="validation did not run again"):
        trainer.fit(model)
    last = _load(tmp_path / "last.ckpt")
    assert last["global_step"] == 3
    assert _same(last["state_dict"], model.post[3])


def test_missing_monitor_without_validation_saves_last(tmp_path):
    """No validation at all: nothing to defer to, so the step-triggered save happens (2.6 dropped it)."""
    seed_everything(12)
    model = Recorder()
    ckpt = ModelCheckpoint(dirpath=tmp_path, monitor="val_loss", every_n_train_steps=2, save_last=True)
    _trainer(tmp_path, [ckpt], max_steps=4).fit(model)
    last = _load(tmp_path / "last.ckpt")
    assert last["global_step"] == 4
    assert _same(last["state_dict"], model.post[4])


def test_every_n_epochs_unchanged(tmp_path):
    seed_everything(13)
    model = Recorder()
    ckpt = ModelCheckpoint(dirpath=tmp_path, monitor="train_loss", every_n_epochs=1, save_top_k=-1)
    _trainer(tmp_path, [ckpt], max_epochs=2).fit(model)
    files = _topk_files(tmp_path)
    assert len(files) == 2
    for f in files:
        c = _load(f)
        assert PRE_KEY not in c
        assert _same(c["state_dict"], model.post[c["global_step"]])


class AutoRecorder(LightningModule):
    def __init__(self):
        super().__init__()
        self.layer = nn.Linear(4, 1)
        self.pre, self.post = {}, {}

    def training_step(self, batch, batch_idx):
        self.pre[self.trainer.global_step] = _clone(self)
        x, y = batch
        loss = nn.functional.mse_loss(self.layer(x), y)
        self.log("train_loss", loss)
        return loss

    def on_train_batch_end(self, outputs, batch, batch_idx):
        self.post[self.trainer.global_step] = _clone(self)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)

    def train_dataloader(self):
        return DataLoader(_data(), batch_size=2)


@pytest.mark.parametrize("opt_in", [None, True])
def test_automatic_optimization(tmp_path, opt_in):
    seed_everything(14)
    model = AutoRecorder()
    ckpt = ModelCheckpoint(
        dirpath=tmp_path,
        monitor="train_loss",
        every_n_train_steps=2,
        save_top_k=-1,
        save_pre_optimizer_step_weights=opt_in,
    )
    _trainer(tmp_path, [ckpt]).fit(model)
    files = _topk_files(tmp_path)
    assert len(files) == 4
    for f in files:
        c = _load(f)
        if opt_in:
            _assert_pre_step(model, c)
        else:  # unchanged by default: post-step weights, no marker
            assert PRE_KEY not in c
            assert _same(c["state_dict"], model.post[c["global_step"]])


def test_manual_optimization_opt_out(tmp_path):
    seed_everything(15)
    model = Recorder()
    ckpt = ModelCheckpoint(
        dirpath=tmp_path,
        monitor="train_loss",
        every_n_train_steps=2,
        save_top_k=-1,
        save_pre_optimizer_step_weights=False,
    )
    _trainer(tmp_path, [ckpt], max_steps=4).fit(model)
    for f in _topk_files(tmp_path):
        c = _load(f)
        assert PRE_KEY not in c
        assert _same(c["state_dict"], model.post[c["global_step"]])


class SavedModelsModule(Recorder):
    """Written for Lightning 2.6's documented workaround."""

    def training_step(self, batch, batch_idx):
        if not hasattr(self, "saved_models"):
            self.saved_models = {}
        # deliberately wrong content: it must never be loaded into the model or written to a checkpoint
        self.saved_models[batch_idx] = {k: torch.full_like(v, 123.0) for k, v in self.layer.state_dict().items()}
        return super().training_step(batch, batch_idx)


def test_saved_models_workaround_still_gets_right_weights(tmp_path):
    seed_everything(16)
    model = SavedModelsModule()
    ckpt = ModelCheckpoint(dirpath=tmp_path, monitor="train_loss", every_n_train_steps=2, save_top_k=-1)
    record = _fit_recording_warnings(_trainer(tmp_path, [ckpt], max_epochs=2), model)
    told = [w for w in record if "saved_models" in str(w.message)]
    assert len(told) == 1
    assert "no longer needed" in str(told[0].message)
    files = _topk_files(tmp_path)
    assert len(files) == 8
    for f in files:
        _assert_pre_step(model, _load(f))
    for _step, weights in model.post.items():
        assert not any(torch.equal(v, torch.full_like(v, 123.0)) for v in weights.values())


def test_no_warning_in_normal_case(tmp_path):
    seed_everything(17)
    model = Recorder()
    ckpt = ModelCheckpoint(dirpath=tmp_path, monitor="train_loss", every_n_train_steps=1, save_top_k=2)
    record = _fit_recording_warnings(_trainer(tmp_path, [ckpt], max_steps=4), model)
    assert not _post_step_warnings(record)
    assert not [w for w in record if "saved_models" in str(w.message)]


class RawOptimizerModule(Recorder):
    """Steps the first optimizer directly (``use_pl_optimizer=False``) and, if ``raw_first``, before the second."""

    def __init__(self, raw_first=True, lightning_optimizer=True):
        super().__init__(n_optimizers=2)
        self.raw_first = raw_first
        self.lightning_optimizer = lightning_optimizer

    def training_step(self, batch, batch_idx):
        self.pre[self.trainer.global_step] = _clone(self)
        raw, lightning_opt = self.optimizers(use_pl_optimizer=False)[0], self.optimizers()[1]
        loss = self._loss(batch)
        self.log("train_loss", loss)
        steps = [raw, lightning_opt] if self.raw_first else [lightning_opt, raw]
        if not self.lightning_optimizer:
            steps.remove(lightning_opt)
        for opt in steps:
            opt.zero_grad()
            self.manual_backward(self._loss(batch))
            opt.step()
        return loss


def test_warns_once_when_optimizer_bypasses_lightning(tmp_path):
    """The batch's first step bypasses ``LightningOptimizer``: the saves hold post-step weights and say why, once."""
    seed_everything(18)
    model = RawOptimizerModule(raw_first=True)
    ckpt = ModelCheckpoint(dirpath=tmp_path, monitor="train_loss", every_n_train_steps=1, save_top_k=-1)
    record = _fit_recording_warnings(_trainer(tmp_path, [ckpt], max_epochs=1, limit_train_batches=4), model)
    found = _post_step_warnings(record)
    assert len(found) == 1
    assert "`Adam.step()` was called directly" in str(found[0].message)
    assert "use_pl_optimizer=True" in str(found[0].message)
    files = _topk_files(tmp_path)
    assert len(files) == 4
    for f in files:
        c = _load(f)
        assert PRE_KEY not in c
        assert _same(c["state_dict"], model.post[c["global_step"]])


def test_direct_step_after_the_first_is_captured_without_warning(tmp_path):
    """A direct step after the batch's first (Lightning) step does not matter: the capture came before both."""
    seed_everything(18)
    model = RawOptimizerModule(raw_first=False)
    ckpt = ModelCheckpoint(dirpath=tmp_path, monitor="train_loss", every_n_train_steps=1, save_top_k=-1)
    record = _fit_recording_warnings(_trainer(tmp_path, [ckpt], max_epochs=1, limit_train_batches=4), model)
    assert not _post_step_warnings(record)
    files = _topk_files(tmp_path)
    assert len(files) == 4
    for f in files:
        _assert_pre_step(model, _load(f))


def test_no_warning_when_direct_steps_save_nothing(tmp_path):
    """Direct steps only: ``global_step`` never advances, so ``every_n_train_steps`` saves nothing to warn about."""
    seed_everything(18)
    model = RawOptimizerModule(lightning_optimizer=False)
    ckpt = ModelCheckpoint(dirpath=tmp_path, monitor="train_loss", every_n_train_steps=1)
    trainer = _trainer(tmp_path, [ckpt], max_epochs=1, limit_train_batches=4)
    record = _fit_recording_warnings(trainer, model)
    assert trainer.global_step == 0
    assert not _topk_files(tmp_path)
    assert not _post_step_warnings(record)


def test_warns_once_with_weight_averaging(tmp_path):
    seed_everything(19)
    model = AutoRecorder()
    ckpt = ModelCheckpoint(
        dirpath=tmp_path, monitor="train_loss", every_n_train_steps=1, save_pre_optimizer_step_weights=True
    )
    swa = StochasticWeightAveraging(swa_lrs=0.01)
    record = _fit_recording_warnings(_trainer(tmp_path, [ckpt, swa], max_epochs=2), model)
    found = _post_step_warnings(record)
    assert len(found) == 1
    assert "StochasticWeightAveraging" in str(found[0].message)
    for f in _topk_files(tmp_path):
        assert PRE_KEY not in _load(f)


def test_monitor_none_is_post_step_without_warning(tmp_path):
    seed_everything(20)
    model = Recorder()
    ckpt = ModelCheckpoint(dirpath=tmp_path, every_n_train_steps=2)
    record = _fit_recording_warnings(_trainer(tmp_path, [ckpt], max_steps=4), model)
    assert not _post_step_warnings(record)
    c = _load(_topk_files(tmp_path)[-1])
    assert PRE_KEY not in c
    assert _same(c["state_dict"], model.post[c["global_step"]])


@pytest.mark.parametrize("source", ["last", "topk"])
def test_resume(tmp_path, source):
    seed_everything(21)
    model = Recorder()
    ckpt = ModelCheckpoint(dirpath=tmp_path, monitor="train_loss", every_n_train_steps=2, save_top_k=-1, save_last=True)
    _trainer(tmp_path, [ckpt], max_steps=4).fit(model)
    path = tmp_path / "last.ckpt" if source == "last" else tmp_path / "epoch=0-step=4.ckpt"
    saved = _load(path)

    resumed = Recorder()
    ckpt2 = ModelCheckpoint(dirpath=tmp_path / "resumed", monitor="train_loss", every_n_train_steps=2)
    record = _fit_recording_warnings(_trainer(tmp_path, [ckpt2], max_steps=6), resumed, ckpt_path=path)
    told = [w for w in record if "resuming from a checkpoint that holds the weights from before" in str(w.message)]
    assert len(told) == (1 if source == "topk" else 0)
    # the first resumed batch starts from the weights in the file
    assert _same(resumed.pre[4], saved["state_dict"])
    if source == "topk":
        assert _same(saved["state_dict"], model.pre[3])
    else:
        assert _same(saved["state_dict"], model.post[4])


def test_resume_warns_without_model_checkpoint(tmp_path):
    """The trainer, not the callback, tells: a resume without any ``ModelCheckpoint`` is warned about too."""
    seed_everything(21)
    ckpt = ModelCheckpoint(dirpath=tmp_path, monitor="train_loss", every_n_train_steps=2, save_top_k=1)
    _trainer(tmp_path, [ckpt], max_steps=4).fit(Recorder())
    assert PRE_KEY in _load(ckpt.best_model_path)
    trainer = _trainer(tmp_path, [], max_steps=6, enable_checkpointing=False)
    with pytest.warns(UserWarning, match="resuming from a checkpoint that holds the weights from before") as record:
        trainer.fit(Recorder(), ckpt_path=ckpt.best_model_path)
    assert len([w for w in record if "holds the weights from before" in str(w.message)]) == 1
    assert trainer.global_step == 6


class AmpRecorder(Recorder):
    def training_step(self, batch, batch_idx):
        self.pre[self.trainer.global_step] = _clone(self)
        opt = self.optimizers()
        loss = self._loss(batch)
        self.log("train_loss", loss)
        opt.zero_grad()
        # batch 1 overflows: the scaler skips that step
        self.manual_backward(loss * (float("inf") if batch_idx == 1 else 1.0))
        opt.step()
        return loss


@pytest.mark.skipif(not hasattr(torch.amp, "GradScaler"), reason="`torch.amp.GradScaler('cpu')` needs torch 2.3")
def test_amp_skipped_step(tmp_path):
    from lightning.pytorch.plugins.precision import MixedPrecision

    seed_everything(22)
    model = AmpRecorder()
    ckpt = ModelCheckpoint(dirpath=tmp_path, monitor="train_loss", every_n_train_steps=1, save_top_k=-1)
    plugin = MixedPrecision("16-mixed", "cpu", scaler=torch.amp.GradScaler("cpu", init_scale=1.0))
    _trainer(tmp_path, [ckpt], max_steps=3, plugins=[plugin]).fit(model)
    steps = {_load(f)["global_step"]: _load(f) for f in _topk_files(tmp_path)}
    assert sorted(steps) == [1, 2, 3]
    # skipped step: the weights did not change, and the file holds exactly them
    assert _same(model.pre[1], model.post[2])
    assert _same(steps[2]["state_dict"], model.pre[1])
    for step in (1, 3):
        _assert_pre_step(model, steps[step])


class UnevenSteps(Recorder):
    """Steps once per batch, except twice in the fourth batch."""

    def training_step(self, batch, batch_idx):
        out = super().training_step(batch, batch_idx)
        if batch_idx == 3:
            opt = self.optimizers()
            opt.zero_grad()
            self.manual_backward(self._loss(batch))
            opt.step()
        return out


def test_warns_when_a_batch_takes_more_steps_than_expected(tmp_path):
    """Global steps 1, 2, 3, 5: the save at 5 was not expected before batch 4's first step."""
    seed_everything(23)
    model = UnevenSteps()
    ckpt = ModelCheckpoint(dirpath=tmp_path, monitor="train_loss", every_n_train_steps=5, save_top_k=-1)
    record = _fit_recording_warnings(_trainer(tmp_path, [ckpt], max_steps=5), model)
    found = _post_step_warnings(record)
    assert len(found) == 1
    assert "more optimizer steps than any batch before it" in str(found[0].message)
    (f,) = _topk_files(tmp_path)
    c = _load(f)
    assert c["global_step"] == 5
    assert PRE_KEY not in c
    assert _same(c["state_dict"], model.post[5])


@pytest.mark.parametrize("fast_dev_run", [False, True])
def test_capture_only_in_batches_that_can_save(tmp_path, captures, fast_dev_run):
    seed_everything(24)
    model = Recorder()
    # two callbacks that save in the same batches share one capture; only one of them needs the optimizer states
    a = ModelCheckpoint(dirpath=tmp_path / "a", monitor="train_loss", every_n_train_steps=4, save_weights_only=True)
    b = ModelCheckpoint(dirpath=tmp_path / "b", monitor="train_loss", every_n_train_steps=4, mode="max")
    _trainer(tmp_path, [a, b], fast_dev_run=fast_dev_run).fit(model)
    if fast_dev_run:
        assert captures == []
        return
    # the first batch (steps per batch not known yet), then the batches whose step reaches 4 and 8
    assert captures == [(0, True), (3, True), (7, True)]
    for cb in (a, b):
        _assert_pre_step(model, _load(cb.best_model_path))
    # the capture had optimizer states for `b`; `a`'s weights-only file does not claim them
    assert _load(a.best_model_path)[PRE_KEY]["optimizer_states"] is False
    assert "optimizer_states" not in _load(a.best_model_path)
    assert _load(b.best_model_path)[PRE_KEY]["optimizer_states"] is True


class BufferProbe(Callback):
    """Records where the captured state lives after each batch, to see that the buffers are reused."""

    def __init__(self):
        self.pointers = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        from lightning.pytorch.callbacks._pre_step_snapshot import _SNAPSHOTS

        captured = _SNAPSHOTS[trainer]._captured
        if captured is not None:
            tensors = [*captured.state_dict.values()]
            tensors += [s for o in captured.optimizer_states for st in o["state"].values() for s in st.values()]
            self.pointers.append({(t.device.type, t.data_ptr()) for t in tensors if t.dim() > 0})


def test_buffers_are_reused_across_saves(tmp_path):
    """Memory does not grow with the number of saves: every capture writes into the same tensors."""
    seed_everything(26)
    model = Recorder()
    probe = BufferProbe()
    ckpt = ModelCheckpoint(dirpath=tmp_path, monitor="train_loss", every_n_train_steps=1, save_top_k=-1)
    _trainer(tmp_path, [ckpt, probe], max_steps=6).fit(model)
    assert len(probe.pointers) == 6
    assert all(p == probe.pointers[1] for p in probe.pointers[1:])  # the first capture has no optimizer state yet
    assert all(device == "cpu" for device, _ in probe.pointers[-1])
    files = _topk_files(tmp_path)
    assert len(files) == 6
    for f in files:
        _assert_pre_step(model, _load(f), expect_optim=True)


class AmpThenDirect(Recorder):
    """Batch 1 overflows (the scaler skips the step); batch 2 steps directly first, then through Lightning."""

    def training_step(self, batch, batch_idx):
        self.pre[self.trainer.global_step] = _clone(self)
        loss = self._loss(batch)
        self.log("train_loss", loss)
        if batch_idx == 2:
            raw = self.optimizers(use_pl_optimizer=False)
            raw.zero_grad()
            self.manual_backward(self._loss(batch))
            raw.step()
        opt = self.optimizers()
        opt.zero_grad()
        self.manual_backward(self._loss(batch) * (float("inf") if batch_idx == 1 else 1.0))
        opt.step()
        return loss


@pytest.mark.skipif(not hasattr(torch.amp, "GradScaler"), reason="`torch.amp.GradScaler('cpu')` needs torch 2.3")
def test_direct_first_step_after_skipped_amp_step(tmp_path):
    """A step the scaler skipped leaves nothing behind that would hide the next batch's direct first step."""
    from lightning.pytorch.plugins.precision import MixedPrecision

    seed_everything(27)
    model = AmpThenDirect()
    ckpt = ModelCheckpoint(dirpath=tmp_path, monitor="train_loss", every_n_train_steps=1, save_top_k=-1)
    plugin = MixedPrecision("16-mixed", "cpu", scaler=torch.amp.GradScaler("cpu", init_scale=1.0))
    record = _fit_recording_warnings(_trainer(tmp_path, [ckpt], max_steps=4, plugins=[plugin]), model)
    found = _post_step_warnings(record)
    assert len(found) == 1
    assert "was called directly" in str(found[0].message)
    steps = {_load(f)["global_step"]: _load(f) for f in _topk_files(tmp_path)}
    assert sorted(steps) == [1, 2, 3, 4]
    assert PRE_KEY not in steps[3]
    assert _same(steps[3]["state_dict"], model.post[3])
    for step in (1, 2, 4):
        assert PRE_KEY in steps[step]
        assert _same(steps[step]["state_dict"], model.pre[step - 1])


def test_unexpected_full_save_in_a_weights_only_capture(tmp_path):
    """A full checkpoint never pairs pre-step weights with post-step optimizer states.

    Global steps 1, 2, 3, 5: the batch from 3 to 5 captures weights only, for the weights-only callback expecting
    step 4; the full callback's save at step 5 was not expected and writes the live state, consistently.

    """
    seed_everything(28)
    model = UnevenSteps()
    a = ModelCheckpoint(dirpath=tmp_path / "a", monitor="train_loss", every_n_train_steps=4, save_weights_only=True)
    b = ModelCheckpoint(dirpath=tmp_path / "b", monitor="train_loss", every_n_train_steps=5, save_top_k=-1)
    record = _fit_recording_warnings(_trainer(tmp_path, [a, b], max_steps=5), model)
    found = _post_step_warnings(record)
    assert len(found) == 1
    assert "only the weights were captured" in str(found[0].message)
    (f,) = _topk_files(tmp_path / "b")
    c = _load(f)
    assert c["global_step"] == 5
    assert PRE_KEY not in c
    assert _same(c["state_dict"], model.post[5])
    assert c["optimizer_states"][0]["state"][0]["step"].item() == 5


class LogsAfterStep(Recorder):
    """Logs its score in ``on_train_batch_end``, from a forward pass on the weights after the step."""

    def __init__(self):
        super().__init__(monitor="unused")

    def on_train_batch_end(self, outputs, batch, batch_idx):
        super().on_train_batch_end(outputs, batch, batch_idx)
        self.log("post_loss", self._loss(batch))


def test_score_logged_after_the_step_saves_live_weights(tmp_path, captures):
    """A score from a hook that runs after the optimizer step was produced by the live weights."""
    seed_everything(29)
    model = LogsAfterStep()
    ckpt = ModelCheckpoint(dirpath=tmp_path, monitor="post_loss", every_n_train_steps=2, save_top_k=-1)
    record = _fit_recording_warnings(_trainer(tmp_path, [ckpt], max_steps=8), model)
    assert not _post_step_warnings(record)
    assert [step for step, _ in captures] == [0, 1]  # until the first save showed where the score comes from
    files = _topk_files(tmp_path)
    assert len(files) == 4
    for f in files:
        c = _load(f)
        assert PRE_KEY not in c
        assert _same(c["state_dict"], model.post[c["global_step"]])


class TiedRecorder(Recorder):
    def __init__(self):
        super().__init__()
        self.encoder = nn.Linear(4, 4, bias=False)
        self.decoder = nn.Linear(4, 4, bias=False)
        self.decoder.weight = self.encoder.weight

    def _loss(self, batch):
        x, y = batch
        return nn.functional.mse_loss(self.layer(self.decoder(self.encoder(x))), y)


def test_tied_weights_share_one_copy(tmp_path):
    seed_everything(30)
    model = TiedRecorder()
    ckpt = ModelCheckpoint(dirpath=tmp_path, monitor="train_loss", every_n_train_steps=2, save_top_k=-1)
    _trainer(tmp_path, [ckpt], max_steps=4).fit(model)
    for f in _topk_files(tmp_path):
        c = _load(f)
        _assert_pre_step(model, c)
        sd = c["state_dict"]
        assert sd["encoder.weight"].untyped_storage().data_ptr() == sd["decoder.weight"].untyped_storage().data_ptr()


class PruneFirstSave(Callback):
    """Drops a key from the first checkpoint written in each batch, as an ``on_save_checkpoint`` hook may."""

    def __init__(self):
        self.pruned_at = set()

    def on_save_checkpoint(self, trainer, pl_module, checkpoint):
        if trainer.global_step not in self.pruned_at:
            self.pruned_at.add(trainer.global_step)
            del checkpoint["state_dict"]["layer.bias"]


def test_hooks_changing_one_checkpoint_do_not_change_the_next(tmp_path):
    seed_everything(31)
    model = Recorder()
    a = ModelCheckpoint(dirpath=tmp_path / "a", monitor="train_loss", every_n_train_steps=2, save_top_k=-1)
    b = ModelCheckpoint(dirpath=tmp_path / "b", monitor="train_loss", every_n_train_steps=2, save_top_k=-1, mode="max")
    _trainer(tmp_path, [a, b, PruneFirstSave()], max_steps=4).fit(model)
    for f in _topk_files(tmp_path / "a"):
        assert "layer.bias" not in _load(f)["state_dict"]
    for f in _topk_files(tmp_path / "b"):
        _assert_pre_step(model, _load(f))


def test_offload_without_pre_step_weights_is_an_error():
    from lightning.pytorch.utilities.exceptions import MisconfigurationException

    with pytest.raises(MisconfigurationException, match="pre_optimizer_step_offload=True"):
        ModelCheckpoint(monitor="train_loss", save_pre_optimizer_step_weights=False, pre_optimizer_step_offload=True)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="offloading to pinned memory needs CUDA")
def test_offload_to_pinned_memory(tmp_path):
    """Not run where there is no GPU: the captured copy lives in pinned CPU memory and holds the pre-step weights."""
    seed_everything(32)
    model = Recorder()
    probe = BufferProbe()
    ckpt = ModelCheckpoint(
        dirpath=tmp_path, monitor="train_loss", every_n_train_steps=1, save_top_k=-1, pre_optimizer_step_offload=True
    )
    trainer = Trainer(
        default_root_dir=tmp_path,
        callbacks=[ckpt, probe],
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        accelerator="cuda",
        devices=1,
        max_steps=4,
    )
    trainer.fit(model)
    assert all(device == "cpu" for device, _ in probe.pointers[-1])
    assert all(p == probe.pointers[1] for p in probe.pointers[1:])
    for f in _topk_files(tmp_path):
        c = _load(f)
        before = c[PRE_KEY]["global_step"]
        assert all(torch.equal(c["state_dict"][k], v.cpu()) for k, v in model.pre[before].items())
