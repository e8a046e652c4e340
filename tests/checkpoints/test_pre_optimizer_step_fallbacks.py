"""`ModelCheckpoint(save_pre_optimizer_step_state=True)` (issue #20947): where the rule cannot apply, the checkpoint
holds the live weights, as without the option, with one warning; nothing is left behind by a fit that raises."""

import gc
import types

import pytest
import torch
from test_pre_optimizer_step import (
    PROBE_X,
    PROBE_Y,
    Net,
    assert_live,
    assert_pairs,
    checkpoint,
    fit,
    load,
    messages,
    own_warning_cache,  # noqa: F401  (autouse here too)
    recorded_warnings,
    score_of,
)
from torch import nn

from lightning.pytorch import Callback, Trainer
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.callbacks.weight_averaging import EMAWeightAveraging
from lightning.pytorch.strategies import SingleDeviceStrategy
from lightning.pytorch.utilities.exceptions import MisconfigurationException

FALLBACK = "saves the live state, as if it were off"
LIVE = "holds the live state, after the optimizer step"


class DuckSGD:
    """An `Optimizable` that is not a `torch.optim.Optimizer`: plain SGD."""

    def __init__(self, params, lr):
        self.param_groups = [{"params": list(params), "lr": lr}]
        self.defaults = {"lr": lr}
        self.state = {}

    def step(self, closure=None):
        loss = closure() if closure is not None else None
        with torch.no_grad():
            for p in self.param_groups[0]["params"]:
                if p.grad is not None:
                    p.sub_(self.param_groups[0]["lr"] * p.grad)
        return loss

    def zero_grad(self, set_to_none=True):
        for p in self.param_groups[0]["params"]:
            p.grad = None

    def state_dict(self):
        return {"state": {}, "param_groups": [{"lr": self.param_groups[0]["lr"], "params": [0, 1]}]}

    def load_state_dict(self, state_dict):
        self.param_groups[0]["lr"] = state_dict["param_groups"][0]["lr"]


@pytest.mark.parametrize("weights_only", [True, False])
def test_any_optimizable_works(tmp_path, weights_only):
    class DuckNet(Net):
        def configure_optimizers(self):
            return DuckSGD(self.parameters(), lr=0.1)

    with recorded_warnings() as caught:
        _, (ckpt,) = fit(
            tmp_path, DuckNet(manual=False), checkpoints=[checkpoint(tmp_path, save_weights_only=weights_only)]
        )
    assert_pairs(ckpt)
    assert not messages(caught, "save_pre_optimizer_step_state")


def test_gradient_accumulation_pairs_with_the_state_before_the_stepping_batch(tmp_path):
    _, (ckpt,) = fit(tmp_path, Net(manual=False), accumulate_grad_batches=2, max_steps=8)
    assert_pairs(ckpt)


def test_a_batch_without_an_optimizer_step_that_enters_the_top_k_does_not_warn(tmp_path):
    """`accumulate_grad_batches=2`: the save at global step 14 ends the stepping batch, whose score does not enter the
    top 1; the next batch takes no step and ends at 14 too, and its score enters. Its live weights are the ones it
    started with, so its file pairs without a copy and without a warning."""
    # some steps climb, so the scores go up and down
    lr_factors = [-1.0, -1.0, 1.0, -1.0, 2.0, -1.0, -1.0, -1.0, -1.0, -1.0, 2.0, 1.0, 2.0, 1.0, -1.0, 1.0]

    class Zigzag(Net):
        def configure_optimizers(self):
            optimizer = torch.optim.SGD(self.parameters(), lr=0.1)
            scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: lr_factors[step % 16])
            return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}

    with recorded_warnings() as caught:
        _, (ckpt,) = fit(
            tmp_path, Zigzag(manual=False), checkpoints=[checkpoint(tmp_path, save_top_k=1)], accumulate_grad_batches=2
        )
    ((path, score),) = ckpt.best_k_models.items()
    saved = load(path)
    assert saved["global_step"] == 14
    assert "pre_optimizer_step" not in saved  # saved by the batch without a step: nothing to swap
    torch.testing.assert_close(score_of(saved["state_dict"]), score.float(), rtol=0, atol=0)
    assert not messages(caught, "save_pre_optimizer_step_state")


class StateDictWithPrefix(Net):
    def state_dict(self, *args, **kwargs):
        return {f"renamed.{k}": v for k, v in super().state_dict(*args, **kwargs).items()}


class OwnStateDictStrategy(SingleDeviceStrategy):
    def lightning_module_state_dict(self):
        return super().lightning_module_state_dict()


class CountingSaves(SingleDeviceStrategy):
    saves = 0

    def save_checkpoint(self, checkpoint, filepath, storage_options=None):
        CountingSaves.saves += 1
        super().save_checkpoint(checkpoint, filepath, storage_options)


def test_an_override_of_the_strategys_save_checkpoint_writes_the_pre_step_state(tmp_path):
    _, (ckpt,) = fit(tmp_path, Net(manual=False), strategy=CountingSaves(device="cpu"))
    assert CountingSaves.saves >= 3
    assert_pairs(ckpt)


@pytest.mark.parametrize(
    ("kwargs", "expected"),
    [
        ({"strategy": OwnStateDictStrategy(device="cpu")}, "`OwnStateDictStrategy` builds the checkpoint's weights"),
        ({"callbacks": [EMAWeightAveraging()]}, "a weight averaging callback writes averaged weights"),
        ({"model": "lbfgs"}, "`LBFGS` runs the closure several times in one step"),
    ],
)
def test_what_the_rule_cannot_serve_falls_back_with_one_warning(tmp_path, kwargs, expected):
    class LBFGSNet(Net):
        def configure_optimizers(self):
            return torch.optim.LBFGS(self.parameters(), lr=0.1)

    model = LBFGSNet(manual=False) if kwargs.pop("model", None) else Net(manual=False)
    with recorded_warnings() as caught:
        _, (ckpt,) = fit(tmp_path, model, **kwargs)
    assert len(messages(caught, FALLBACK)) == 1
    assert expected in messages(caught, FALLBACK)[0]
    assert ckpt._pre_optimizer_step is None
    assert all("pre_optimizer_step" not in load(path) for path in ckpt.best_k_models)


def test_a_layer_swapped_during_the_fit_falls_back_once(tmp_path):
    """A layer replaced between the step and the save: that file holds the live state, with one warning; the later
    ones pair again."""

    class Swap(Callback):
        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            if trainer.global_step == 8:  # after this batch's step, before the checkpoint's save at its end
                pl_module.head = nn.Linear(4, 1)
                trainer.strategy.setup_optimizers(trainer)

    ckpt = checkpoint(tmp_path, save_top_k=-1)
    with recorded_warnings() as caught:
        fit(tmp_path, Net(manual=False), callbacks=[Swap()], checkpoints=[ckpt])
    assert len(messages(caught, "the module's state dict has tensors that are not")) == 1
    marked = {load(path)["global_step"]: "pre_optimizer_step" in load(path) for path in ckpt.best_k_models}
    assert marked == {2: True, 4: True, 6: True, 8: False, 10: True, 12: True, 14: True, 16: True}
    for path, score in ckpt.best_k_models.items():
        if "pre_optimizer_step" in load(path):
            torch.testing.assert_close(score_of(load(path)["state_dict"]), score.float(), rtol=0, atol=0)


def test_a_state_dict_that_renames_the_parameters_holds_the_state_at_the_step(tmp_path):
    """The file is written by `Trainer.save_checkpoint` with the state at the step in place: hooks see that state."""
    with recorded_warnings() as caught:
        _, (ckpt,) = fit(tmp_path, StateDictWithPrefix(manual=False))
    assert not messages(caught, "save_pre_optimizer_step_state")
    for path, score in ckpt.best_k_models.items():
        saved = load(path)
        state_dict = {k.removeprefix("renamed."): v for k, v in saved["state_dict"].items()}
        torch.testing.assert_close(score_of(state_dict), score.float(), rtol=0, atol=0)
        assert "pre_optimizer_step" in saved


class BoomError(Exception):
    pass


class RaiseAt(Callback):
    def __init__(self, step, in_on_exception=False):
        self.step = step
        self.in_on_exception = in_on_exception

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if trainer.global_step == self.step:
            raise BoomError

    def on_exception(self, trainer, pl_module, exception):
        if self.in_on_exception:
            raise BoomError("from on_exception")


def reaches(start, target, limit=20_000):
    """Whether ``target`` can be reached from ``start`` through object references.

    Not through classes, modules or bound methods: Lightning itself gives every callback the module's `log` methods.

    """
    seen, todo = {id(start)}, [start]
    while todo and len(seen) < limit:
        for ref in gc.get_referents(todo.pop()):
            if ref is target:
                return True
            if id(ref) not in seen and not isinstance(
                ref, (type, types.ModuleType, types.FunctionType, types.MethodType)
            ):
                seen.add(id(ref))
                todo.append(ref)
    assert len(seen) < limit
    return False


@pytest.mark.parametrize("in_on_exception", [False, True])
def test_a_fit_that_raises_leaves_no_reference_to_the_trainer(tmp_path, in_on_exception):
    """Also when another callback's `on_exception` raises first, so that `ModelCheckpoint`'s never runs: then the
    checkpoint keeps its last copy (not the model) until its next fit."""
    ckpt = checkpoint(tmp_path, every_n_train_steps=1)
    trainer = Trainer(
        default_root_dir=tmp_path,
        max_steps=8,
        callbacks=[RaiseAt(3, in_on_exception), ckpt],
        logger=False,
        enable_progress_bar=False,
        limit_val_batches=0,
    )
    model = Net(manual=False)
    with pytest.raises(BoomError):
        trainer.fit(model)
    assert not reaches(ckpt, trainer)
    assert not reaches(ckpt, model)
    assert (ckpt._pre_optimizer_step is None) is not in_on_exception
    # the next fit captures again
    fit(tmp_path, Net(manual=False), checkpoints=[ckpt])
    assert ckpt._pre_optimizer_step is None
    assert_pairs(ckpt)


def test_a_save_that_raised_leaves_the_next_fit_as_without_the_error(tmp_path, monkeypatch):
    """A save that raises inside the pre-step path must not leave it on for the next fit's other saves."""
    ckpt = checkpoint(tmp_path, every_n_train_steps=4, save_top_k=-1)
    original = SingleDeviceStrategy.save_checkpoint

    def fail_once(self, *args, **kwargs):
        monkeypatch.setattr(SingleDeviceStrategy, "save_checkpoint", original)
        raise OSError("disk full")

    monkeypatch.setattr(SingleDeviceStrategy, "save_checkpoint", fail_once)
    with pytest.raises(OSError, match="disk full"):
        fit(tmp_path / "first", Net(manual=False), checkpoints=[ckpt])
    ckpt.monitor = "val_loss"  # a validation score: its saves are deferred to validation, and hold the live state
    fit(tmp_path, Net(manual=False), checkpoints=[ckpt], val_check_interval=0.5, limit_val_batches=1, max_steps=8)
    assert ckpt.best_k_models
    assert all("pre_optimizer_step" not in load(path) for path in ckpt.best_k_models)


@pytest.mark.parametrize(
    "kwargs", [{"monitor": None}, {"save_top_k": 0}, {"every_n_train_steps": None, "every_n_epochs": 1}]
)
def test_the_option_without_a_top_k_save_at_batch_end_is_an_error(kwargs):
    kwargs = {"monitor": "score", "every_n_train_steps": 2, **kwargs}
    with pytest.raises(MisconfigurationException, match="save_pre_optimizer_step_state=True"):
        ModelCheckpoint(save_pre_optimizer_step_state=True, **kwargs)


def test_without_the_option_files_hold_the_live_weights(tmp_path):
    ckpt = ModelCheckpoint(tmp_path, monitor="score", every_n_train_steps=2, save_top_k=3)
    _, _ = fit(tmp_path, Net(manual=True), checkpoints=[ckpt])
    assert ckpt._pre_optimizer_step is None
    assert_live(ckpt)


def test_a_loss_computed_between_two_steps_pairs_with_the_state_at_its_own_step(tmp_path):
    """A GAN that steps the generator first, then computes the discriminator's loss on samples of the stepped generator
    and backpropagates it: the file holds the stepped generator and the discriminator from before its own step."""

    class GeneratorFirst(Net):
        def __init__(self):
            super().__init__(manual=True, log_in=None)
            self.gen = nn.Linear(4, 4)

        def training_step(self, batch, batch_idx):
            x, y = batch
            opt_g, opt_d = self.optimizers()
            opt_g.zero_grad()
            self.manual_backward(-nn.functional.mse_loss(self.head(self.gen(x)), y))
            opt_g.step()
            d_loss = nn.functional.mse_loss(self.head(self.gen(PROBE_X).detach()), PROBE_Y)
            self.log("score", d_loss.detach())
            opt_d.zero_grad()
            self.manual_backward(d_loss)
            opt_d.step()

        def configure_optimizers(self):
            return torch.optim.SGD(self.gen.parameters(), lr=0.01), torch.optim.SGD(self.head.parameters(), lr=0.05)

    with recorded_warnings() as caught:
        _, (ckpt,) = fit(tmp_path, GeneratorFirst(), checkpoints=[checkpoint(tmp_path, every_n_train_steps=4)])
    assert not messages(caught, "save_pre_optimizer_step_state")
    assert ckpt.best_k_models
    for path, score in ckpt.best_k_models.items():
        saved = load(path)
        sd = saved["state_dict"]
        generated = PROBE_X @ sd["gen.weight"].T + sd["gen.bias"]
        d_loss = nn.functional.mse_loss(generated @ sd["head.weight"].T + sd["head.bias"], PROBE_Y)
        torch.testing.assert_close(d_loss, score.float(), rtol=0, atol=0)
        assert saved["pre_optimizer_step"]["global_step"] % 2 == 1  # the discriminator's step, the batch's second


def test_a_checkpoint_ranked_by_the_step_keeps_the_live_state_without_a_warning(tmp_path):
    """`monitor="step", mode="max"` keeps the newest files: the trainer's count ranks them, which the live state has."""
    with recorded_warnings() as caught:
        _, (ckpt,) = fit(tmp_path, Net(), checkpoints=[checkpoint(tmp_path, monitor="step", mode="max")])
    assert sorted(load(path)["global_step"] for path in ckpt.best_k_models) == [12, 14, 16]
    assert all("pre_optimizer_step" not in load(path) for path in ckpt.best_k_models)
    assert not messages(caught, "save_pre_optimizer_step_state")


class SkipsSuper(ModelCheckpoint):
    """A subclass whose hook overrides do not call `super()`."""

    def __init__(self, hook, **kwargs):
        super().__init__(**kwargs)
        setattr(self, hook, lambda *args, **kwargs: None)


@pytest.mark.parametrize("hook", ["on_train_batch_start", "on_before_optimizer_step"])
def test_a_subclass_that_skips_super_in_a_hook_never_gets_a_wrong_pair(tmp_path, hook):
    """Without the batch start or the step, the checkpoint saves as without the option, and one warning says why.
    Neither raises, and no file is marked."""
    kwargs = {"monitor": "score", "every_n_train_steps": 2, "save_top_k": 3, "filename": "{step}"}
    ckpt = SkipsSuper(hook, dirpath=tmp_path, save_pre_optimizer_step_state=True, **kwargs)
    with recorded_warnings() as caught:
        fit(tmp_path, Net(manual=False), checkpoints=[ckpt])
    assert len(ckpt.best_k_models) == 3
    assert all("pre_optimizer_step" not in load(path) for path in ckpt.best_k_models)
    expected = {
        "on_train_batch_start": "`ModelCheckpoint.on_train_batch_start` did not run",
        "on_before_optimizer_step": "the batch stepped without `ModelCheckpoint.on_before_optimizer_step` running",
    }[hook]
    (warning,) = messages(caught, "save_pre_optimizer_step_state")
    assert expected in warning


def test_an_override_of_trainer_save_checkpoint_writes_every_file(tmp_path):
    """Every file, with the state at the step or not, is written by `Trainer.save_checkpoint`."""
    written = []

    class UploadingTrainer(Trainer):
        def save_checkpoint(self, filepath, weights_only=None, storage_options=None):
            written.append(filepath)
            super().save_checkpoint(filepath, weights_only, storage_options)

    ckpt = checkpoint(tmp_path)
    trainer = UploadingTrainer(
        default_root_dir=tmp_path,
        max_steps=16,
        callbacks=[ckpt],
        logger=False,
        enable_progress_bar=False,
        limit_val_batches=0,
    )
    with recorded_warnings() as caught:
        trainer.fit(Net(manual=False))
    assert not messages(caught, "save_pre_optimizer_step_state")
    assert set(ckpt.best_k_models) <= set(written)
    assert_pairs(ckpt)


class ZeroWeightsOnSave(Callback):
    """Replaces the weights of every checkpoint, as an EMA callback writes its averages in `on_save_checkpoint`."""

    def on_save_checkpoint(self, trainer, pl_module, checkpoint):
        checkpoint["state_dict"] = {name: torch.zeros_like(value) for name, value in checkpoint["state_dict"].items()}


def test_weights_an_on_save_checkpoint_hook_wrote_are_kept(tmp_path):
    with recorded_warnings() as caught:
        _, (ckpt,) = fit(tmp_path, Net(manual=False), callbacks=[ZeroWeightsOnSave()])
    assert not messages(caught, "save_pre_optimizer_step_state")
    for path in ckpt.best_k_models:
        assert all(not value.any() for value in load(path)["state_dict"].values())


@pytest.mark.parametrize("hook", ["on_train_batch_end", "on_train_epoch_end"])
def test_a_step_outside_a_batch_does_not_warn(tmp_path, hook):
    """Manual optimization may step after the checkpoint's batch-end hook (the module's `on_train_batch_end`, which runs
    after it) or at the end of an epoch: after the batch's saves, so the files pair and nothing warns."""

    class StepsLate(Net):
        def training_step(self, batch, batch_idx):
            self.log("score", nn.functional.mse_loss(self.head(PROBE_X), PROBE_Y))
            self.manual_backward(nn.functional.mse_loss(self.head(batch[0]), batch[1]))

        def on_train_batch_end(self, outputs, batch, batch_idx):
            if hook == "on_train_batch_end":
                self.optimizers().step()
                self.optimizers().zero_grad()

        def on_train_epoch_end(self):
            if hook == "on_train_epoch_end":
                self.optimizers().step()
                self.optimizers().zero_grad()

    with recorded_warnings() as caught:
        fit(tmp_path, StepsLate(manual=True), checkpoints=[checkpoint(tmp_path, every_n_train_steps=1)], max_epochs=2)
    assert not messages(caught, "save_pre_optimizer_step_state")
