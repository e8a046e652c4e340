"""`ModelCheckpoint(save_pre_optimizer_step_weights=True)`: every top-k file pairs its score with the weights that
produced it (issue #20947).

The models score their weights on a fixed probe set, so a file pairs correctly exactly when scoring the weights it
holds gives back the score that ranks it (`best_k_models`). Their training batches are noisy, so scores go up and
down and the top-k changes.
"""

import copy
import inspect
import warnings
from contextlib import contextmanager

import pytest
import torch
from lightning_utilities.core.imports import RequirementCache
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import lightning.pytorch.trainer.connectors.checkpoint_connector as checkpoint_connector
from lightning.pytorch import Callback, LightningModule, Trainer, seed_everything
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.utilities.exceptions import MisconfigurationException

PROBE_X = torch.randn(32, 4, generator=torch.Generator().manual_seed(1))
PROBE_Y = PROBE_X @ torch.tensor([[1.0], [-2.0], [0.5], [3.0]])


def score_of(state_dict):
    """The score that the weights in `state_dict` produce."""
    out = PROBE_X @ state_dict["head.weight"].T + state_dict["head.bias"]
    return nn.functional.mse_loss(out, PROBE_Y)


class Net(LightningModule):
    """A linear head; logs `score` (its probe loss) from the hook named by `log_in`.

    `log_in`: "before_step" / "after_step" (`training_step`, before or after `optimizer.step()`), "batch_end" (the
    module's `on_train_batch_end`, after the step), "epoch" (`on_epoch=True` only), "every_other" (`training_step`,
    even batches only), or None.

    """

    def __init__(self, manual=True, log_in="before_step", lr=0.2):
        super().__init__()
        self.automatic_optimization = not manual
        self.log_in = log_in
        self.lr = lr
        self.head = nn.Linear(4, 1)
        self.post_step = {}  # global step -> the live weights at the end of that batch

    def probe_score(self):
        return nn.functional.mse_loss(self.head(PROBE_X), PROBE_Y)

    def _log_score(self, where, batch_idx, score):
        if self.log_in == where or (self.log_in == "every_other" and where == "before_step" and batch_idx % 2 == 0):
            self.log("score", score)

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = nn.functional.mse_loss(self.head(x), y)
        score = self.probe_score()  # computed by the forward at the start of the batch, like the loss
        if self.log_in == "epoch":
            self.log("score", score, on_step=False, on_epoch=True)
        if self.automatic_optimization:
            self._log_score("before_step", batch_idx, score)
            return loss
        self._log_score("before_step", batch_idx, score)
        opt = self.optimizers()
        opt.zero_grad()
        self.manual_backward(loss)
        opt.step()
        self._log_score("after_step", batch_idx, score)  # `self.log` after the step, of a value from before it
        return None

    def on_train_batch_end(self, outputs, batch, batch_idx):
        self.post_step[self.trainer.global_step] = {k: v.detach().clone() for k, v in self.state_dict().items()}
        if self.log_in == "batch_end":
            self._log_score("batch_end", batch_idx, self.probe_score())

    def configure_optimizers(self):
        return torch.optim.Adam(self.parameters(), lr=self.lr)

    def train_dataloader(self):
        g = torch.Generator().manual_seed(0)
        x = torch.randn(64, 4, generator=g)
        y = x @ torch.tensor([[1.0], [-2.0], [0.5], [3.0]]) + 2.0 * torch.randn(64, 1, generator=g)
        return DataLoader(TensorDataset(x, y), batch_size=8)


@contextmanager
def recorded_warnings():
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        yield caught


def messages(caught, text):
    return [str(w.message) for w in caught if text in str(w.message)]


def fit(tmp_path, model, callbacks=(), trainer_cls=Trainer, max_steps=16, max_epochs=None, **ckpt_kwargs):
    seed_everything(7)
    kwargs = {"monitor": "score", "every_n_train_steps": 2, "save_top_k": 3, "save_pre_optimizer_step_weights": True}
    kwargs.update(ckpt_kwargs)
    ckpt = ModelCheckpoint(dirpath=tmp_path, filename="{step}", **kwargs)
    trainer = trainer_cls(
        default_root_dir=tmp_path,
        max_steps=max_steps,
        max_epochs=max_epochs,
        limit_val_batches=0,
        callbacks=[*callbacks, ckpt],
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.fit(model)
    return trainer, ckpt


def load(path):
    return torch.load(path, map_location="cpu", weights_only=False)


def assert_pairs(ckpt, marked):
    """Every top-k file holds the weights that produced the score that ranks it."""
    assert ckpt.best_k_models
    for path, score in ckpt.best_k_models.items():
        checkpoint = load(path)
        torch.testing.assert_close(score_of(checkpoint["state_dict"]), score.float(), rtol=0, atol=0)
        assert ("pre_optimizer_step" in checkpoint) is marked, path


@pytest.mark.parametrize("manual", [True, False])
@pytest.mark.parametrize("log_in", ["before_step", "after_step"])
def test_training_step_score_pairs_with_the_weights_before_the_step(tmp_path, manual, log_in):
    if not manual and log_in == "after_step":
        pytest.skip("automatic optimization has no 'after the step' inside training_step")
    model = Net(manual=manual, log_in=log_in)
    _trainer, ckpt = fit(tmp_path, model, save_last=True)
    assert_pairs(ckpt, marked=True)
    for path in ckpt.best_k_models:
        checkpoint = load(path)
        step = checkpoint["global_step"]
        assert checkpoint["pre_optimizer_step"] == {"global_step": step - 1}
        # the live weights after the batch would not give the score: this is not stock behaviour by accident
        live = model.post_step[step]
        assert not torch.equal(score_of(live), score_of(checkpoint["state_dict"]))
    last = load(tmp_path / "last.ckpt")
    assert "pre_optimizer_step" not in last
    assert all(torch.equal(last["state_dict"][k], v) for k, v in model.state_dict().items())
    assert ckpt._pre_step is None  # removed at teardown


def test_pre_step_file_holds_the_optimizer_and_scheduler_states_of_before_the_step(tmp_path):
    class Recording(Net):
        def configure_optimizers(self):
            opt = torch.optim.Adam(self.parameters(), lr=self.lr)
            return {"optimizer": opt, "lr_scheduler": torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)}

        def training_step(self, batch, batch_idx):
            self.before[self.trainer.global_step] = (
                {k: v.clone() for k, v in self.optimizers().optimizer.state_dict()["state"].get(0, {}).items()},
                self.lr_schedulers().state_dict()["last_epoch"],
                self.optimizers().optimizer.param_groups[0]["lr"],
            )
            out = super().training_step(batch, batch_idx)
            self.lr_schedulers().step()
            return out

    model = Recording()
    model.before = {}
    fit(tmp_path, model, save_top_k=-1)
    files = sorted(tmp_path.glob("step=*.ckpt"))
    assert len(files) == 8
    for path in files:
        checkpoint = load(path)
        state, last_epoch, lr = model.before[checkpoint["pre_optimizer_step"]["global_step"]]
        saved = checkpoint["optimizer_states"][0]["state"].get(0, {})
        assert saved.keys() == state.keys()
        assert all(torch.equal(saved[k], v) for k, v in state.items())
        assert checkpoint["lr_schedulers"][0]["last_epoch"] == last_epoch
        # the learning rate the scheduler had set then, not the one it set after the step (half of it)
        assert checkpoint["optimizer_states"][0]["param_groups"][0]["lr"] == lr
        assert checkpoint["lr_schedulers"][0]["_last_lr"] == [lr]
    # resuming from a pre-step file trains on with the learning rate of that moment
    resumed = Recording()
    resumed.before = {}
    first = load(files[0])
    trainer = Trainer(
        default_root_dir=tmp_path, max_steps=first["global_step"] + 2, limit_val_batches=0, logger=False,
        enable_progress_bar=False, enable_checkpointing=False,
    )  # fmt: skip
    trainer.fit(resumed, ckpt_path=files[0])
    assert resumed.before[first["global_step"]][2] == first["optimizer_states"][0]["param_groups"][0]["lr"]


@pytest.mark.parametrize("manual", [True, False])
def test_score_logged_in_module_on_train_batch_end_pairs_with_the_weights_that_produced_it(tmp_path, manual):
    # when `ModelCheckpoint.on_train_batch_end` runs, the module's hook has not run yet: the score is the previous
    # batch's, produced by the weights after the previous batch's step, i.e. this batch's pre-step weights
    model = Net(manual=manual, log_in="batch_end")
    with recorded_warnings() as caught:
        _, ckpt = fit(tmp_path, model, max_epochs=2, max_steps=-1, save_top_k=-1)
    assert_pairs(ckpt, marked=True)
    # 16 steps over two epochs of 8; the first save (step 2) has the score of step 1
    assert len(ckpt.best_k_models) == 8
    assert not messages(caught, "skips top-k saves")


def test_post_step_score_from_a_callback_before_the_checkpoint_pairs_with_the_live_weights(tmp_path):
    # the documented way to score the weights after the step: log from a callback listed before `ModelCheckpoint`
    class PostStepScore(Callback):
        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            pl_module.log("score", pl_module.probe_score())

    model = Net(log_in=None)
    _, ckpt = fit(tmp_path, model, callbacks=[PostStepScore()], save_top_k=-1)
    assert_pairs(ckpt, marked=False)
    for path in ckpt.best_k_models:
        checkpoint = load(path)
        live = model.post_step[checkpoint["global_step"]]
        assert all(torch.equal(checkpoint["state_dict"][k], v) for k, v in live.items())
    assert len(ckpt.best_k_models) == 8


def test_epoch_aggregate_is_saved_with_the_live_weights_and_said_once(tmp_path):
    model = Net(log_in="epoch")
    with recorded_warnings() as caught:
        _, ckpt = fit(tmp_path, model, max_epochs=3, max_steps=-1, save_top_k=-1)
    assert len(messages(caught, "is an epoch aggregate")) == 1
    assert ckpt.best_k_models  # epochs 1 and 2 rank by the previous epoch's mean
    for path in ckpt.best_k_models:
        checkpoint = load(path)
        assert "pre_optimizer_step" not in checkpoint
        live = model.post_step[checkpoint["global_step"]]
        assert all(torch.equal(checkpoint["state_dict"][k], v) for k, v in live.items())


def test_stale_score_skips_the_save_with_one_warning(tmp_path):
    # logged in even batches only: in odd batches the score is an earlier batch's, whose weights are gone
    model = Net(log_in="every_other")
    with recorded_warnings() as caught:
        _, ckpt = fit(tmp_path, model, every_n_train_steps=1, save_top_k=-1)
    assert_pairs(ckpt, marked=True)
    steps = sorted(load(p)["global_step"] for p in ckpt.best_k_models)
    assert steps == [1, 3, 5, 7, 9, 11, 13, 15]  # the batches that logged (batch_idx 0, 2, ...)
    assert len(messages(caught, "skips top-k saves")) == 1


class Frozen(Net):
    """A 95%-frozen fine-tuning model: a frozen backbone, a trainable head; the optimizer gets all parameters."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.backbone = nn.Linear(64, 16)
        self.backbone.requires_grad_(False)
        self.norm = nn.BatchNorm1d(4)

    def probe_score(self):
        return nn.functional.mse_loss(self.head(PROBE_X), PROBE_Y)

    def training_step(self, batch, batch_idx):
        x, _y = batch
        self.norm(x)  # updates the running statistics in the forward, before the step
        return super().training_step(batch, batch_idx)


class CopyMeter(Callback):
    """Listed before the checkpoint: sees the copies of each batch before the checkpoint drops them."""

    def __init__(self, ckpt):
        self.ckpt = ckpt
        self.bytes = []
        self.held_at_train_end = None

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        capture = self.ckpt._pre_step
        params = sum(t.nbytes for t in capture._params.values())
        states = sum(
            t.nbytes
            for per_param in capture._optimizer_states.values()
            for state in per_param.values()
            if state
            for t in state.values()
            if isinstance(t, torch.Tensor)
        )
        self.bytes.append((params, states))

    def on_train_end(self, trainer, pl_module):
        capture = self.ckpt._pre_step
        self.held_at_train_end = len(capture._params) + len(capture._optimizer_states)


@pytest.mark.parametrize("weights_only", [True, False])
def test_copies_only_the_trainable_parameters_and_their_optimizer_states(tmp_path, weights_only):
    model = Frozen(manual=False)
    ckpt = ModelCheckpoint(
        dirpath=tmp_path,
        monitor="score",
        every_n_train_steps=4,
        save_top_k=-1,
        save_weights_only=weights_only,
        save_pre_optimizer_step_weights=True,
    )
    meter = CopyMeter(ckpt)
    trainer = Trainer(
        max_steps=16, limit_val_batches=0, callbacks=[meter, ckpt], logger=False, enable_progress_bar=False
    )
    trainer.fit(model)
    trainable = sum(p.nbytes for p in model.parameters() if p.requires_grad)
    assert trainable < 0.05 * sum(p.nbytes for p in model.parameters())
    # Adam keeps `exp_avg` and `exp_avg_sq` (and a scalar `step`) per parameter that got a gradient: the head's
    head = sum(p.nbytes for p in model.head.parameters())
    expected_states = 0 if weights_only else 2 * head + 2 * torch.tensor(0.0).nbytes
    # one copy every 4 steps (the batches that save), none in between
    assert meter.bytes == [(trainable, expected_states) if i % 4 == 3 else (0, 0) for i in range(16)]
    assert meter.held_at_train_end == 0
    # buffers are read live at save time, under automatic and manual optimization alike
    for path in ckpt.best_k_models:
        checkpoint = load(path)
        live = model.post_step[checkpoint["global_step"]]
        assert torch.equal(checkpoint["state_dict"]["norm.running_mean"], live["norm.running_mean"])
        assert torch.equal(checkpoint["state_dict"]["backbone.weight"], live["backbone.weight"])


@pytest.mark.parametrize("manual", [True, False])
def test_batchnorm_statistics_are_read_live(tmp_path, manual):
    model = Frozen(manual=manual)
    _, ckpt = fit(tmp_path, model, save_top_k=-1)
    assert_pairs(ckpt, marked=True)
    for path in ckpt.best_k_models:
        checkpoint = load(path)
        live = model.post_step[checkpoint["global_step"]]
        for key in ("norm.running_mean", "norm.running_var", "norm.num_batches_tracked"):
            assert torch.equal(checkpoint["state_dict"][key], live[key])


def test_validation_score_copies_nothing_once_known_and_holds_nothing_at_train_end(tmp_path):
    class Validated(Net):
        def validation_step(self, batch, batch_idx):
            self.log("val_score", self.probe_score())

        def val_dataloader(self):
            return self.train_dataloader()

    model = Validated(log_in=None)
    ckpt = ModelCheckpoint(
        dirpath=tmp_path, monitor="val_score", every_n_train_steps=2, save_pre_optimizer_step_weights=True
    )
    meter = CopyMeter(ckpt)
    trainer = Trainer(
        max_epochs=3,
        limit_val_batches=2,
        num_sanity_val_steps=0,
        callbacks=[meter, ckpt],
        logger=False,
        enable_progress_bar=False,
    )
    trainer.fit(model)
    per_epoch = [meter.bytes[i : i + 8] for i in (0, 8, 16)]
    assert any(b != (0, 0) for b in per_epoch[0])  # before the first validation, the kind of score is unknown
    assert all(b == (0, 0) for b in per_epoch[1] + per_epoch[2])
    assert meter.held_at_train_end == 0
    for path in ckpt.best_k_models:
        assert "pre_optimizer_step" not in load(path)


def test_score_known_before_the_step_that_cannot_enter_the_top_k_copies_nothing(tmp_path):
    model = Net(log_in="before_step", lr=0.5)
    ckpt_kwargs = {"every_n_train_steps": 1, "save_top_k": 2, "save_weights_only": True}
    meter_holder = {}

    class Meter(CopyMeter):
        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            entered = self.ckpt.check_monitor_top_k(trainer, trainer.callback_metrics["score"])
            super().on_train_batch_end(trainer, pl_module, outputs, batch, batch_idx)
            self.entered.append(entered)

    seed_everything(7)
    ckpt = ModelCheckpoint(dirpath=tmp_path, monitor="score", save_pre_optimizer_step_weights=True, **ckpt_kwargs)
    meter = meter_holder["m"] = Meter(ckpt)
    meter.entered = []
    trainer = Trainer(
        max_steps=32, limit_val_batches=0, callbacks=[meter, ckpt], logger=False, enable_progress_bar=False
    )
    trainer.fit(model)
    copied = [b != (0, 0) for b in meter.bytes]
    assert copied == meter.entered  # a copy exactly in the batches whose score enters the top-k
    assert 0 < sum(copied) < len(copied)
    assert_pairs(ckpt, marked=True)


def test_off_by_default_and_stock_under_manual_optimization(tmp_path):
    model = Net(manual=True, log_in="before_step")
    seed_everything(7)
    ckpt = ModelCheckpoint(dirpath=tmp_path, filename="{step}", monitor="score", every_n_train_steps=2, save_top_k=-1)
    trainer = Trainer(max_steps=8, limit_val_batches=0, callbacks=[ckpt], logger=False, enable_progress_bar=False)
    trainer.fit(model)
    assert ckpt._pre_step is None
    for path in ckpt.best_k_models:
        checkpoint = load(path)
        assert "pre_optimizer_step" not in checkpoint
        live = model.post_step[checkpoint["global_step"]]
        assert all(torch.equal(checkpoint["state_dict"][k], v) for k, v in live.items())


def test_step_of_an_unwrapped_optimizer_before_the_wrapped_one_is_captured(tmp_path):
    class Unwrapped(Net):
        def configure_optimizers(self):
            return torch.optim.SGD([self.head.bias], lr=0.1), torch.optim.Adam([self.head.weight], lr=self.lr)

        def training_step(self, batch, batch_idx):
            x, y = batch
            self.log("score", self.probe_score())
            raw = self.optimizers(use_pl_optimizer=False)[0]
            wrapped = self.optimizers()[1]
            raw.zero_grad()
            wrapped.zero_grad()
            self.manual_backward(nn.functional.mse_loss(self.head(x), y))
            # SGD without momentum keeps `{"momentum_buffer": None}` per parameter on torch < 2.2, nothing later
            self.before[self.trainer.global_step] = copy.deepcopy(raw.state_dict()["state"])
            raw.step()  # changes the bias first, without `LightningOptimizer` (and without counting a step)
            wrapped.step()

    model = Unwrapped()
    model.before = {}
    _, ckpt = fit(tmp_path, model, save_top_k=-1)
    assert_pairs(ckpt, marked=True)
    assert len(ckpt.best_k_models) == 8
    for path in ckpt.best_k_models:
        # the unwrapped optimizer's state is the pre-step one too
        checkpoint = load(path)
        assert (
            checkpoint["optimizer_states"][0]["state"] == model.before[checkpoint["pre_optimizer_step"]["global_step"]]
        )


def test_step_of_an_optimizer_lightning_never_sees_is_captured(tmp_path):
    class OwnOptimizer(Net):
        def configure_optimizers(self):
            return torch.optim.Adam([self.head.weight], lr=self.lr)

        def on_train_start(self):
            self.own = torch.optim.SGD([self.head.bias], lr=0.1)

        def training_step(self, batch, batch_idx):
            x, y = batch
            self.log("score", self.probe_score())
            opt = self.optimizers()
            self.own.zero_grad()
            opt.zero_grad()
            self.manual_backward(nn.functional.mse_loss(self.head(x), y))
            self.own.step()  # not in `trainer.optimizers`: only torch's global step pre-hook sees it
            opt.step()

    _, ckpt = fit(tmp_path, OwnOptimizer(), save_top_k=-1)
    assert_pairs(ckpt, marked=True)
    assert len(ckpt.best_k_models) == 8


def test_optimizers_recreated_during_fit_are_captured(tmp_path):
    class Recreating(Net):
        def on_train_epoch_start(self):
            if self.current_epoch > 0:
                self.trainer.strategy.setup_optimizers(self.trainer)

    model = Recreating()
    _, ckpt = fit(tmp_path, model, max_epochs=3, max_steps=-1, save_top_k=-1)
    assert_pairs(ckpt, marked=True)
    assert len(ckpt.best_k_models) == 12


def test_pre_step_files_are_written_through_trainer_save_checkpoint(tmp_path):
    class StampingTrainer(Trainer):
        def save_checkpoint(self, filepath, weights_only=None, storage_options=None):
            super().save_checkpoint(filepath, weights_only, storage_options)
            stamped = load(filepath)
            stamped["stamp"] = True
            torch.save(stamped, filepath)

    _, ckpt = fit(tmp_path, Net(), trainer_cls=StampingTrainer, save_top_k=-1, save_last=True)
    assert_pairs(ckpt, marked=True)
    assert all(load(path).get("stamp") for path in ckpt.best_k_models)
    assert load(tmp_path / "last.ckpt").get("stamp")


def test_save_last_link_never_points_to_a_pre_step_file(tmp_path):
    model = Net()
    _, _ckpt = fit(tmp_path, model, save_top_k=-1, save_last="link")
    last = tmp_path / "last.ckpt"
    assert not last.is_symlink()
    checkpoint = load(last)
    assert "pre_optimizer_step" not in checkpoint
    assert all(torch.equal(checkpoint["state_dict"][k], v) for k, v in model.state_dict().items())


def test_core_modules_do_not_import_the_private_callback_module():
    assert "_pre_step_snapshot" not in inspect.getsource(checkpoint_connector)
    import lightning.pytorch.core.optimizer as optimizer_module

    assert "_on_before_update" not in inspect.getsource(optimizer_module)


def test_state_lives_with_each_checkpoint(tmp_path):
    # two trainers fitting in turn: each checkpoint's hooks are its own and gone after its fit
    _first, ckpt_a = fit(tmp_path / "a", Net(), save_top_k=-1)
    _second, ckpt_b = fit(tmp_path / "b", Net(log_in="batch_end"), save_top_k=-1)
    assert_pairs(ckpt_a, marked=True)
    assert_pairs(ckpt_b, marked=True)
    assert ckpt_a._pre_step is None
    assert ckpt_b._pre_step is None
    import lightning.pytorch.callbacks._pre_step_snapshot as module

    mutable = (dict, set, list)
    assert not [k for k, v in vars(module).items() if isinstance(v, mutable) and not k.startswith("__")]


@pytest.mark.parametrize(
    "kwargs",
    [
        {"every_n_train_steps": 2},  # no monitor
        {"monitor": "score", "every_n_train_steps": 2, "save_top_k": 0},
        {"monitor": "score", "every_n_epochs": 1},  # saves at epoch ends only
    ],
)
def test_option_without_a_training_save_to_pair_is_an_error(kwargs):
    with pytest.raises(MisconfigurationException, match="save_pre_optimizer_step_weights=True"):
        ModelCheckpoint(save_pre_optimizer_step_weights=True, **kwargs)


def test_weight_averaging_falls_back_to_the_live_weights_with_one_warning(tmp_path):
    from lightning.pytorch.callbacks import StochasticWeightAveraging

    model = Net(manual=False)
    with recorded_warnings() as caught:
        _, ckpt = fit(
            tmp_path, model, callbacks=[StochasticWeightAveraging(swa_lrs=0.1, swa_epoch_start=1)], save_top_k=-1
        )
    assert len(messages(caught, "as if the option were off")) == 1
    assert ckpt._pre_step is None
    for path in ckpt.best_k_models:
        assert "pre_optimizer_step" not in load(path)


@pytest.mark.skipif(not RequirementCache("torch>=2.7"), reason="FSDP2 runs on the CPU from torch 2.7")
def test_model_parallel_strategy_falls_back_to_the_live_weights_with_one_warning(tmp_path):
    from torch.distributed._composable.fsdp import fully_shard

    from lightning.pytorch.strategies import ModelParallelStrategy

    class Sharded(Net):
        def configure_model(self):
            fully_shard(self.head, mesh=self.device_mesh["data_parallel"])

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.1)

    ckpt = ModelCheckpoint(
        dirpath=tmp_path, monitor="score", every_n_train_steps=2, save_pre_optimizer_step_weights=True
    )
    trainer = Trainer(
        accelerator="cpu",
        devices=1,
        strategy=ModelParallelStrategy(),
        max_steps=4,
        callbacks=[ckpt],
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    with recorded_warnings() as caught:
        trainer.fit(Sharded(manual=False))
    assert len(messages(caught, "`ModelParallelStrategy` builds the checkpoint's weights itself")) == 1
    assert ckpt._pre_step is None
    assert ckpt.best_k_models  # saved as without the option


def test_an_exception_inside_fit_removes_the_hooks_and_the_next_fit_captures_again(tmp_path):
    from torch.optim.optimizer import _global_optimizer_pre_hooks

    class Failing(Net):
        def training_step(self, batch, batch_idx):
            if self.trainer.global_step == 5 and self.fail:
                raise RuntimeError("boom")
            return super().training_step(batch, batch_idx)

    hooks_before = len(_global_optimizer_pre_hooks)
    model = Failing()
    model.fail = True
    ckpt = ModelCheckpoint(
        dirpath=tmp_path, filename="{step}", monitor="score", every_n_train_steps=2, save_top_k=-1,
        save_pre_optimizer_step_weights=True,
    )  # fmt: skip
    trainer = Trainer(
        default_root_dir=tmp_path, max_steps=16, limit_val_batches=0, callbacks=[ckpt], logger=False,
        enable_progress_bar=False,
    )  # fmt: skip
    with pytest.raises(RuntimeError, match="boom"):
        trainer.fit(model)
    # `fit` raised: the trainer calls `on_exception`, not `teardown`; nothing of the capture is left behind
    assert ckpt._pre_step is None
    assert len(_global_optimizer_pre_hooks) == hooks_before
    assert not model.optimizers().optimizer._optimizer_step_pre_hooks
    # the same callback captures again in the next fit
    model.fail = False
    trainer = Trainer(
        default_root_dir=tmp_path, max_steps=8, limit_val_batches=0, callbacks=[ckpt], logger=False,
        enable_progress_bar=False,
    )  # fmt: skip
    trainer.fit(model)
    assert_pairs(ckpt, marked=True)
    assert len(_global_optimizer_pre_hooks) == hooks_before


def test_a_parameter_shared_by_two_optimizers_keeps_both_optimizer_states(tmp_path):
    class Shared(Net):
        """Two optimizers step the head's weight; the second one also owns the bias."""

        def training_step(self, batch, batch_idx):
            for opt in self.optimizers():
                self.before.setdefault(self.trainer.global_step, []).append({
                    k: v.clone() for k, v in opt.optimizer.state_dict()["state"].get(0, {}).items()
                })
            x, y = batch
            loss = nn.functional.mse_loss(self.head(x), y)
            self.log("score", self.probe_score())
            for opt in self.optimizers():
                opt.zero_grad()
            self.manual_backward(loss)
            for opt in self.optimizers():
                opt.step()

        def configure_optimizers(self):
            return [
                torch.optim.Adam([self.head.weight], lr=self.lr),
                torch.optim.Adam([self.head.weight, self.head.bias], lr=self.lr),
            ]

    model = Shared()
    model.before = {}
    _, ckpt = fit(tmp_path, model, save_top_k=-1)
    assert_pairs(ckpt, marked=True)
    for path in ckpt.best_k_models:
        checkpoint = load(path)
        before = model.before[checkpoint["pre_optimizer_step"]["global_step"]]
        assert len(checkpoint["optimizer_states"]) == len(before) == 2
        for i, state in enumerate(before):
            saved = checkpoint["optimizer_states"][i]["state"].get(0, {})
            assert saved.keys() == state.keys()
            assert all(torch.equal(saved[k], v) for k, v in state.items())


def test_manual_gradient_accumulation_keeps_the_first_save(tmp_path):
    class Accumulating(Net):
        """Steps every other batch, logging the score of the weights the stepping batch starts with."""

        def training_step(self, batch, batch_idx):
            x, y = batch
            self.manual_backward(nn.functional.mse_loss(self.head(x), y))
            if batch_idx % 2 == 1:
                self.log("score", self.probe_score())
                opt = self.optimizers()
                opt.step()
                opt.zero_grad()

    with recorded_warnings() as caught:
        _, ckpt = fit(tmp_path, Accumulating(), max_steps=4, every_n_train_steps=1, save_top_k=-1)
    assert_pairs(ckpt, marked=True)
    assert sorted(load(p)["global_step"] for p in ckpt.best_k_models) == [1, 2, 3, 4]
    assert not messages(caught, "skips top-k saves")


def test_parameters_added_to_the_module_and_its_optimizer_during_fit_are_captured(tmp_path):
    class Growing(Net):
        """Replaces its head at the second epoch and hands the new parameters to the optimizer."""

        def on_train_epoch_start(self):
            if self.current_epoch == 1:
                self.head = nn.Linear(4, 1)
                self.optimizers().optimizer.add_param_group({"params": list(self.head.parameters())})

    _, ckpt = fit(tmp_path, Growing(), max_epochs=2, max_steps=-1, save_top_k=-1)
    assert_pairs(ckpt, marked=True)
    assert len(ckpt.best_k_models) == 8


def test_a_batch_with_more_steps_than_before_saves_the_live_weights_with_one_warning(tmp_path):
    class MoreSteps(Net):
        """From the fifth batch on, two optimizer steps per batch (an extra critic step, say); best score there."""

        def training_step(self, batch, batch_idx):
            x, y = batch
            score = self.probe_score()
            self.log("score", score - 100.0 if batch_idx == 4 else score)
            opt = self.optimizers()
            for _ in range(1 if batch_idx < 4 else 2):
                opt.zero_grad()
                self.manual_backward(nn.functional.mse_loss(self.head(x), y))
                opt.step()

    model = MoreSteps()
    with recorded_warnings() as caught:
        _, ckpt = fit(tmp_path, model, max_epochs=1, max_steps=-1, save_top_k=1)
    # stock would save the batch with the best score (global step 6, after its two steps); so does the option, with
    # the live weights, unmarked, as it could not copy them before the steps
    best = load(ckpt.best_model_path)
    assert best["global_step"] == 6
    assert "pre_optimizer_step" not in best
    assert all(torch.equal(best["state_dict"][k], v) for k, v in model.post_step[6].items())
    assert len(messages(caught, "did not copy the weights")) == 1


def test_lbfgs_falls_back_to_the_live_weights_with_one_warning(tmp_path):
    class WithLBFGS(Net):
        def configure_optimizers(self):
            return torch.optim.LBFGS(self.parameters(), lr=0.1, max_iter=3)

    with recorded_warnings() as caught:
        _, ckpt = fit(tmp_path, WithLBFGS(manual=False), save_top_k=-1)
    assert len(messages(caught, "`LBFGS` evaluates the closure several times")) == 1
    assert ckpt._pre_step is None
    assert ckpt.best_k_models
    assert not [p for p in ckpt.best_k_models if "pre_optimizer_step" in load(p)]


def test_a_hook_left_behind_by_a_failing_on_exception_is_inert(tmp_path):
    from torch.optim.optimizer import _global_optimizer_pre_hooks

    class Failing(Net):
        def training_step(self, batch, batch_idx):
            if self.trainer.global_step == 3:
                raise RuntimeError("boom")
            return super().training_step(batch, batch_idx)

    class BrokenOnException(Callback):
        def on_exception(self, trainer, pl_module, exception):
            raise ValueError("the callback's own bug")

    hooks_before = len(_global_optimizer_pre_hooks)
    model = Failing()
    with pytest.raises(ValueError, match="own bug"):
        fit(tmp_path, model, callbacks=[BrokenOnException()])
    # Lightning stopped calling `on_exception` at the broken callback: the global hook is still registered...
    assert len(_global_optimizer_pre_hooks) == hooks_before + 1
    (capture,) = [hook.__self__ for hook in list(_global_optimizer_pre_hooks.values())[hooks_before:]]
    try:
        # ...but it copies nothing when the module is trained on after the fit, with an optimizer of its own or with
        # the fit's optimizer, whose own hook is still registered too
        for opt in (torch.optim.SGD(model.parameters(), lr=0.1), model.trainer.optimizers[0]):
            model.probe_score().backward()
            capture._armed = True
            opt.step()
            assert not capture._params
    finally:
        capture.stop()
    assert len(_global_optimizer_pre_hooks) == hooks_before


def test_a_checkpoint_with_the_option_and_one_without_can_run_side_by_side(tmp_path):
    # the same monitor and triggers: the option is part of the state key, so both keep their own state
    plain = ModelCheckpoint(dirpath=tmp_path / "plain", monitor="score", every_n_train_steps=2, save_top_k=-1)
    _, ckpt = fit(tmp_path / "pre", Net(), callbacks=[plain], save_top_k=-1)
    assert plain.state_key != ckpt.state_key
    assert plain.state_key == ModelCheckpoint(monitor="score", every_n_train_steps=2).state_key  # as before
    assert_pairs(ckpt, marked=True)
    assert len(plain.best_k_models) == len(ckpt.best_k_models) == 8
    assert not [p for p in plain.best_k_models if "pre_optimizer_step" in load(p)]


def test_a_layer_swapped_in_place_during_fit_is_captured(tmp_path):
    class SwapHead(Callback):
        """Replaces the module's head at step 4 and points the optimizer's param group at the new parameters."""

        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
            if trainer.global_step == 4:
                optimizer, old = trainer.optimizers[0], list(pl_module.head.parameters())
                pl_module.head = nn.Linear(4, 1)
                optimizer.param_groups[0]["params"] = list(pl_module.head.parameters())
                for p in old:
                    del optimizer.state[p]

    _, ckpt = fit(tmp_path, Net(), callbacks=[SwapHead()], save_top_k=-1)
    assert_pairs(ckpt, marked=True)
    assert len(ckpt.best_k_models) == 8
