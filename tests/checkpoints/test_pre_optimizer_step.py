"""`ModelCheckpoint(save_pre_optimizer_step_state=True)` (issue #20947): the rule, case by case.

The rule: a top-k checkpoint written at the end of a training batch, ranked by a value logged before that batch's first
optimizer step, holds the state from before that step; ranked by a value logged later, it holds the live state, with
one warning. The models log `score`, their loss on a fixed probe set, computed in `training_step` by the weights the
batch started with; so a file pairs correctly exactly when scoring the weights it holds gives back the score that ranks
it (`best_k_models`). Their training batches are noisy, so the scores go up and down and the top-k changes.
"""

import warnings
from collections import namedtuple
from contextlib import contextmanager

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning.pytorch import Callback, LightningModule, Trainer, seed_everything
from lightning.pytorch.callbacks import ModelCheckpoint, model_checkpoint
from lightning.pytorch.callbacks._pre_optimizer_step import _PreOptimizerStepState
from lightning.pytorch.utilities.rank_zero import WarningCache

PROBE_X = torch.randn(32, 4, generator=torch.Generator().manual_seed(1))
PROBE_Y = PROBE_X @ torch.tensor([[1.0], [-2.0], [0.5], [3.0]])


def score_of(state_dict):
    """The score that the weights in `state_dict` produce."""
    return nn.functional.mse_loss(PROBE_X @ state_dict["head.weight"].T + state_dict["head.bias"], PROBE_Y)


class Net(LightningModule):
    """A linear head that computes `score` in `training_step`, by the weights the batch started with.

    `log_in` says where `self.log("score", ...)` runs: "before_step" / "after_step" (`training_step`, before or after
    `optimizer.step()` under manual optimization), "module_batch_end" (the module's `on_train_batch_end`, from
    `outputs`), "epoch" (`on_epoch=True` only) or None (a callback logs it).

    """

    def __init__(self, manual=True, log_in="before_step", lr=0.2):
        super().__init__()
        self.automatic_optimization = not manual
        self.log_in = log_in
        self.lr = lr
        self.head = nn.Linear(4, 1)

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = nn.functional.mse_loss(self.head(x), y)
        score = nn.functional.mse_loss(self.head(PROBE_X), PROBE_Y).detach()
        if self.log_in == "before_step":
            self.log("score", score)
        elif self.log_in == "epoch":
            self.log("score", score, on_step=False, on_epoch=True)
        if self.automatic_optimization:
            return {"loss": loss, "score": score}
        opt = self.optimizers()
        opt.zero_grad()
        self.manual_backward(loss)
        opt.step()
        if self.log_in == "after_step":
            self.log("score", score)  # `self.log` after the step, of a value computed before it
        return {"score": score}

    def on_train_batch_end(self, outputs, batch, batch_idx):
        if self.log_in == "module_batch_end":
            self.log("score", outputs["score"])

    def configure_optimizers(self):
        optimizer = torch.optim.Adam(self.parameters(), lr=self.lr)
        scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.9)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}

    def train_dataloader(self):
        g = torch.Generator().manual_seed(0)
        x = torch.randn(64, 4, generator=g)
        y = x @ torch.tensor([[1.0], [-2.0], [0.5], [3.0]]) + 2.0 * torch.randn(64, 1, generator=g)
        return DataLoader(TensorDataset(x, y), batch_size=8)

    def validation_step(self, batch, batch_idx):
        self.log("val_loss", nn.functional.mse_loss(self.head(batch[0]), batch[1]))

    def val_dataloader(self):
        return DataLoader(TensorDataset(PROBE_X, PROBE_Y), batch_size=16)


class LogScoreFromOutputs(Callback):
    """A logging callback: logs the `score` that `training_step` returned, after the step."""

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        pl_module.log("score", outputs["score"])


@pytest.fixture(autouse=True)
def own_warning_cache(monkeypatch):
    """`ModelCheckpoint` warns once per process: these tests must not silence its warnings for the tests after them."""
    monkeypatch.setattr(model_checkpoint, "warning_cache", WarningCache())


@contextmanager
def recorded_warnings():
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        yield caught


def messages(caught, text):
    return [str(w.message) for w in caught if text in str(w.message)]


def fit(tmp_path, model, callbacks=(), checkpoints=None, max_steps=16, **trainer_kwargs):
    seed_everything(7)
    if checkpoints is None:
        checkpoints = [checkpoint(tmp_path)]
    trainer_kwargs.setdefault("limit_val_batches", 0)
    trainer = Trainer(
        default_root_dir=tmp_path,
        max_steps=max_steps,
        callbacks=[*callbacks, *checkpoints],
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        **trainer_kwargs,
    )
    trainer.fit(model)
    return trainer, checkpoints


def checkpoint(dirpath, **kwargs):
    kwargs = {"monitor": "score", "every_n_train_steps": 2, "save_top_k": 3, **kwargs}
    return ModelCheckpoint(dirpath=dirpath, filename="{step}", save_pre_optimizer_step_state=True, **kwargs)


def load(path):
    """The file, with the marker that a file holding the state at a step carries in its checkpoint's state."""
    saved = torch.load(path, map_location="cpu", weights_only=False)
    for state in saved.get("callbacks", {}).values():
        if "pre_optimizer_step" in state:
            saved["pre_optimizer_step"] = state["pre_optimizer_step"]
    return saved


def assert_pairs(ckpt, marked=True):
    """Every top-k file holds the weights that produced the score that ranks it, and says whether they are pre-step."""
    assert len(ckpt.best_k_models) == ckpt.save_top_k or ckpt.save_top_k == -1
    for path, score in ckpt.best_k_models.items():
        saved = load(path)
        torch.testing.assert_close(score_of(saved["state_dict"]), score.float(), rtol=0, atol=0)
        if "callbacks" not in saved:
            continue  # a weights-only file has no checkpoint state to carry the marker
        assert ("pre_optimizer_step" in saved) is marked, path
        if marked:
            assert saved["pre_optimizer_step"]["global_step"] < saved["global_step"]


def assert_live(ckpt):
    """No file is marked, and each holds the weights of after its batch's step (as without the option)."""
    for path, score in ckpt.best_k_models.items():
        saved = load(path)
        assert "pre_optimizer_step" not in saved
        assert not torch.equal(score_of(saved["state_dict"]), score.float()), path


@pytest.mark.parametrize("manual", [False, True])
def test_a_score_logged_in_training_step_before_the_step_pairs_with_the_state_from_before_it(tmp_path, manual):
    with recorded_warnings() as caught:
        _, (ckpt,) = fit(tmp_path, Net(manual=manual, log_in="before_step"))
    assert_pairs(ckpt)
    assert not messages(caught, "save_pre_optimizer_step_state")


class ScoreTheLiveModel(Callback):
    """A callback that scores the model in `on_train_batch_end`: after the step, with the weights it left."""

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        pl_module.log("score", nn.functional.mse_loss(pl_module.head(PROBE_X), PROBE_Y).detach())


@pytest.mark.parametrize(
    ("manual", "log_in", "callback"),
    [(True, "after_step", None), (False, None, LogScoreFromOutputs), (False, None, ScoreTheLiveModel)],
)
def test_a_score_logged_after_the_step_holds_the_live_state_with_one_warning(tmp_path, manual, log_in, callback):
    """Logged after the step, the value may have been computed before it (`outputs`, a loss logged late) or after it
    (a callback scoring the live model): the rule does not guess, so no file is marked pre-step."""
    callbacks = [callback()] if callback else []
    with recorded_warnings() as caught:
        _, (ckpt,) = fit(tmp_path, Net(manual=manual, log_in=log_in), callbacks=callbacks)
    (warning,) = messages(caught, "save_pre_optimizer_step_state")
    assert "'score' was logged after the batch's first optimizer step began" in warning
    assert "is not a loss the batch backpropagated" in warning
    assert len(ckpt.best_k_models) == 3
    assert all("pre_optimizer_step" not in load(path) for path in ckpt.best_k_models)


def test_the_file_holds_the_optimizer_and_scheduler_states_of_before_the_step(tmp_path):
    """Resuming from the file trains on with the optimizer state, learning rate and scheduler that its weights had."""

    class RecordStates(Callback):
        def __init__(self):
            self.before_step = {}

        def on_before_optimizer_step(self, trainer, pl_module, optimizer):
            self.before_step[trainer.global_step] = (
                {k: v.clone() for k, v in optimizer.state_dict()["state"][0].items()} if optimizer.state else {},
                optimizer.param_groups[0]["lr"],
                trainer.lr_scheduler_configs[0].scheduler.state_dict()["last_epoch"],
            )

    record = RecordStates()
    _, (ckpt,) = fit(tmp_path, Net(manual=False), callbacks=[record])
    assert_pairs(ckpt)
    for path in ckpt.best_k_models:
        saved = load(path)
        state, lr, last_epoch = record.before_step[saved["pre_optimizer_step"]["global_step"]]
        (optimizer_state,) = saved["optimizer_states"]
        assert optimizer_state["param_groups"][0]["lr"] == lr
        assert saved["lr_schedulers"][0]["last_epoch"] == last_epoch
        assert optimizer_state["state"].keys() == ({0, 1} if state else set())
        for key, value in state.items():
            torch.testing.assert_close(optimizer_state["state"][0][key], value, rtol=0, atol=0)


def test_a_score_logged_in_an_earlier_batch_cannot_be_paired_and_warns_once(tmp_path):
    """The module's `on_train_batch_end` runs after the checkpoint's: its value is the previous batch's."""
    with recorded_warnings() as caught:
        _, (ckpt,) = fit(tmp_path, Net(manual=True, log_in="module_batch_end"))
    assert len(messages(caught, "'score' was not logged during the batch")) == 1
    assert_live(ckpt)


def test_an_epoch_aggregate_cannot_be_paired_and_warns_once(tmp_path):
    with recorded_warnings() as caught:
        _, (ckpt,) = fit(tmp_path, Net(log_in="epoch"), max_steps=40)
    assert len(messages(caught, "'score' was not logged during the batch")) == 1
    assert all("pre_optimizer_step" not in load(path) for path in ckpt.best_k_models)


def test_a_save_deferred_to_validation_holds_its_batchs_pre_step_state(tmp_path):
    """`val_check_interval=0.5`: the epoch's last batch defers its save to `on_validation_end` (#21106), as without the
    option; the value that ranks it is still the batch's, so the file holds the batch's pre-step state."""
    ckpt = checkpoint(tmp_path, every_n_train_steps=4, save_top_k=-1)
    fit(tmp_path, Net(manual=False), checkpoints=[ckpt], val_check_interval=0.5, limit_val_batches=1, max_steps=24)
    assert sorted(load(path)["global_step"] for path in ckpt.best_k_models) == [4, 8, 12, 16, 20, 24]
    assert_pairs(ckpt)


def test_a_value_logged_anew_by_validation_ranks_as_without_the_option(tmp_path):
    """The monitored key is logged in `training_step` and in `validation_step`: a save deferred to the end of validation
    is ranked by the validation value, with the live weights that computed it, as without the option."""

    class AlsoInValidation(Net):
        def validation_step(self, batch, batch_idx):
            self.log("score", nn.functional.mse_loss(self.head(PROBE_X), PROBE_Y) + 1.0)

    scores = {}
    for option in (False, True):
        ckpt = ModelCheckpoint(
            tmp_path / str(option),
            monitor="score",
            every_n_train_steps=4,
            save_top_k=-1,
            filename="{step}",
            save_pre_optimizer_step_state=option,
        )
        seed_everything(3)  # the same initial weights in both runs
        fit(tmp_path, AlsoInValidation(manual=False), checkpoints=[ckpt], val_check_interval=0.5, limit_val_batches=1)
        scores[option] = {load(path)["global_step"]: score.item() for path, score in ckpt.best_k_models.items()}
        marked = {load(path)["global_step"] for path in ckpt.best_k_models if "pre_optimizer_step" in load(path)}
    assert scores[True] == scores[False]
    assert marked == {4, 12}  # not the epochs' last batches (8, 16), whose saves validation ranked


def test_a_validation_score_keeps_the_deferral_and_the_live_weights(tmp_path):
    ckpt = checkpoint(tmp_path, monitor="val_loss", every_n_train_steps=4, save_top_k=-1)
    with recorded_warnings() as caught:
        fit(tmp_path, Net(manual=False), checkpoints=[ckpt], val_check_interval=0.5, limit_val_batches=1)
    assert ckpt.best_k_models
    assert all("pre_optimizer_step" not in load(path) for path in ckpt.best_k_models)
    assert len(messages(caught, "'val_loss' was not logged during the batch")) == 1


def count_copies(monkeypatch, holders=None):
    """The global steps of the batches in which the state was copied."""
    copies = []
    original = _PreOptimizerStepState.on_before_optimizer_step

    def spy(self, trainer, optimizer):
        copied = bool(self._params)
        original(self, trainer, optimizer)
        if self._params and not copied:
            copies.append(trainer.global_step)
        if holders is not None:
            holders.add(id(self))

    monkeypatch.setattr(_PreOptimizerStepState, "on_before_optimizer_step", spy)
    return copies


@pytest.mark.parametrize("every_n", [4, 2])
def test_two_checkpoints_with_the_option_share_one_copy(tmp_path, monkeypatch, every_n):
    """One copy per batch in which either checkpoint may save, owned by the first and read by both."""
    holders = set()
    copies = count_copies(monkeypatch, holders)
    every_2 = checkpoint(tmp_path / "a", save_top_k=-1)
    other = checkpoint(tmp_path / "b", every_n_train_steps=every_n, save_top_k=-1, save_weights_only=True, mode="max")
    fit(tmp_path, Net(manual=False), checkpoints=[every_2, other])
    assert every_2._pre_optimizer_step is None  # released at the end of training
    assert other._pre_optimizer_step is None
    assert len(holders) == 1
    assert copies == [1, 3, 5, 7, 9, 11, 13, 15]
    for ckpt in (every_2, other):
        for path, score in ckpt.best_k_models.items():
            torch.testing.assert_close(score_of(load(path)["state_dict"]), score.float(), rtol=0, atol=0)
    assert "optimizer_states" not in load(next(iter(other.best_k_models)))


def two_part_score(head_weight, head_bias, tail_weight, tail_bias):
    return nn.functional.mse_loss(PROBE_X @ (head_weight + tail_weight).T + head_bias + tail_bias, PROBE_Y)


def test_several_optimizers_pair_with_the_state_from_before_the_first_step(tmp_path):
    """Two optimizers step one after the other in each batch (a GAN's pattern): the file holds both parts as they
    were before the first step, which computed the score, not the first part after its step."""

    class TwoParts(Net):
        def __init__(self):
            super().__init__(manual=True, log_in=None)
            self.tail = nn.Linear(4, 1)

        def training_step(self, batch, batch_idx):
            x, y = batch
            self.log("score", two_part_score(self.head.weight, self.head.bias, self.tail.weight, self.tail.bias))
            for opt in self.optimizers():
                opt.zero_grad()
                self.manual_backward(nn.functional.mse_loss(self.head(x) + self.tail(x), y))
                opt.step()

        def configure_optimizers(self):
            return torch.optim.SGD(self.head.parameters(), lr=0.05), torch.optim.SGD(self.tail.parameters(), lr=0.05)

    _, (ckpt,) = fit(tmp_path, TwoParts(), checkpoints=[checkpoint(tmp_path, every_n_train_steps=2)], max_steps=16)
    assert len(ckpt.best_k_models) == 3
    for path, score in ckpt.best_k_models.items():
        state_dict = load(path)["state_dict"]
        parts = (state_dict[f"{layer}.{name}"] for layer in ("head", "tail") for name in ("weight", "bias"))
        head_weight, head_bias, tail_weight, tail_bias = parts
        score_of_file = two_part_score(head_weight, head_bias, tail_weight, tail_bias)
        torch.testing.assert_close(score_of_file, score.float(), rtol=0, atol=0)
        assert "pre_optimizer_step" in load(path)


def test_a_frozen_teacher_updated_in_place_before_the_score_does_not_matter(tmp_path):
    """Frozen parameters are read live, and their in-place updates (an EMA teacher) are not steps of the module."""

    class WithTeacher(Net):
        def __init__(self):
            super().__init__(manual=False)
            self.teacher = nn.Linear(4, 1).requires_grad_(False)

        def training_step(self, batch, batch_idx):
            with torch.no_grad():
                self.teacher.weight.mul_(0.9).add_(0.1 * self.head.weight)
            return super().training_step(batch, batch_idx)

    with recorded_warnings() as caught:
        _, (ckpt,) = fit(tmp_path, WithTeacher())
    assert not messages(caught, "save_pre_optimizer_step_state")
    assert_pairs(ckpt)


@pytest.mark.parametrize("manual", [False, True])
def test_a_known_score_that_cannot_enter_the_top_k_is_not_copied(tmp_path, monkeypatch, manual):
    """The score is known at the step (logged in `training_step`); it falls, so with `mode="max"` only the first
    save enters the top 1. Under manual optimization the first batch is copied too: how many steps a batch takes is
    not known before one has ended."""
    copies = count_copies(monkeypatch)
    _, (ckpt,) = fit(tmp_path, Net(manual=manual), checkpoints=[checkpoint(tmp_path, save_top_k=1, mode="max")])
    assert_pairs(ckpt)
    assert load(ckpt.best_model_path)["global_step"] == 2
    assert copies == ([0, 1] if manual else [1])


def test_a_batch_with_more_optimizer_steps_than_any_before_is_copied(tmp_path):
    class MoreSteps(Net):
        def training_step(self, batch, batch_idx):
            out = super().training_step(batch, batch_idx)
            if batch_idx == 5:  # steps twice: the save at its end is at a global step no earlier batch could reach
                self.optimizers().step()
            return out

    _, (ckpt,) = fit(tmp_path, MoreSteps(manual=True), checkpoints=[checkpoint(tmp_path, every_n_train_steps=1)])
    steps = {load(path)["global_step"] for path in ckpt.best_k_models}
    assert_pairs(ckpt)
    assert len(steps) == 3


def test_save_last_link_never_points_to_a_pre_step_file(tmp_path):
    fit(tmp_path, Net(), checkpoints=[checkpoint(tmp_path, save_last="link")])
    last = tmp_path / "last.ckpt"
    assert not last.is_symlink()
    assert "pre_optimizer_step" not in load(last)
    assert load(last)["global_step"] == 16


class Gan(Net):
    """Lightning's GAN recipe: two optimizers, each stepped between `toggle_optimizer` and `untoggle_optimizer`.

    `head` plays the discriminator, whose `score` is logged before either step; `gen` the generator.

    """

    def __init__(self):
        super().__init__(manual=True)
        self.gen = nn.Linear(4, 4)

    def training_step(self, batch, batch_idx):
        x, y = batch
        opt_d, opt_g = self.optimizers()
        self.log("score", nn.functional.mse_loss(self.head(PROBE_X), PROBE_Y).detach())
        self.toggle_optimizer(opt_d)
        d_loss = nn.functional.mse_loss(self.head(self.gen(x).detach()), y)
        opt_d.zero_grad()
        self.manual_backward(d_loss)
        opt_d.step()
        self.untoggle_optimizer(opt_d)
        self.toggle_optimizer(opt_g)
        g_loss = -nn.functional.mse_loss(self.head(self.gen(x)), y)
        opt_g.zero_grad()
        self.manual_backward(g_loss)
        opt_g.step()
        self.untoggle_optimizer(opt_g)

    def configure_optimizers(self):
        return torch.optim.Adam(self.head.parameters(), lr=0.2), torch.optim.Adam(self.gen.parameters(), lr=0.01)


def test_lightnings_gan_recipe_with_toggled_optimizers_pairs_each_score(tmp_path):
    """Toggling changes which parameters require grad between the batch start and the first step: the copy and its
    check use the optimizers' parameters, fixed for the fit, so the files still hold the weights behind their scores."""
    with recorded_warnings() as caught:
        _, (ckpt,) = fit(tmp_path, Gan())
    assert_pairs(ckpt)
    assert not messages(caught, "save_pre_optimizer_step_state")


class FreezeHeadBias(Callback):
    """Freezes the head's bias for the second half of the fit, as a fine-tuning schedule freezes a submodule."""

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        pl_module.head.bias.requires_grad_(trainer.global_step < 8)


def test_freezing_a_parameter_during_the_fit_keeps_the_pairs(tmp_path):
    with recorded_warnings() as caught:
        _, (ckpt,) = fit(tmp_path, Net(manual=False), callbacks=[FreezeHeadBias()], max_steps=16)
    assert_pairs(ckpt)
    assert not messages(caught, "save_pre_optimizer_step_state")


Warmup = namedtuple("Warmup", ["steps", "factor"])


def test_a_scheduler_state_with_a_namedtuple_is_copied(tmp_path):
    """The copied states are rebuilt as they are (a namedtuple, a dataclass), their tensors cloned."""

    class WithWarmup(torch.optim.lr_scheduler.StepLR):
        def __init__(self, *args, **kwargs):
            self.warmup = Warmup(steps=2, factor=torch.tensor(0.5))
            super().__init__(*args, **kwargs)

    class Scheduled(Net):
        def configure_optimizers(self):
            optimizer = torch.optim.Adam(self.parameters(), lr=self.lr)
            scheduler = WithWarmup(optimizer, step_size=1, gamma=0.9)
            return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}

    _, (ckpt,) = fit(tmp_path, Scheduled(manual=False))
    assert_pairs(ckpt)
    warmup = load(ckpt.best_model_path)["lr_schedulers"][0]["warmup"]
    assert isinstance(warmup, Warmup)
    assert warmup.steps == 2
