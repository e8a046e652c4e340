"""The scenarios of the v5 review: each top-k file is re-evaluated as a user checks it, on the batch that scored it.

A mean teacher updated after the step, BatchNorm, a loss logged after `optimizer.step()`, a GAN shaped like
Lightning's example (generator first, both losses logged at the end), a gradient norm, steps outside batches,
`train_time_interval`, and the copy's size and lifetime.
"""

import time
from datetime import timedelta

import pytest
import torch
from test_pre_optimizer_step import (
    fit,
    load,
    messages,
    own_warning_cache,  # noqa: F401  (autouse here too)
    recorded_warnings,
)
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning.pytorch import Callback, LightningModule
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.callbacks._pre_optimizer_step import _PreOptimizerStepState


def data(n=64, features=4, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, features, generator=g)
    return DataLoader(
        TensorDataset(x, x @ torch.tensor([[1.0], [-2.0], [0.5], [3.0]]) + torch.randn(n, 1, generator=g)), batch_size=8
    )


def checkpoint(dirpath, monitor="loss", **kwargs):
    kwargs = {"every_n_train_steps": 2, "save_top_k": 3, **kwargs}
    return ModelCheckpoint(dirpath, monitor=monitor, filename="{step}", save_pre_optimizer_step_state=True, **kwargs)


class Recorded(LightningModule):
    """Keeps each batch (by the global step it started at), to score a file on the batch that scored it."""

    def __init__(self):
        super().__init__()
        self.batches = {}

    def on_train_batch_start(self, batch, batch_idx):
        self.batches[self.global_step] = batch

    def train_dataloader(self):
        return data()


def assert_pairs(ckpt, rescore, key="loss"):
    """Every top-k file, loaded into a fresh module and scored as the batch scored it, gives its own score."""
    assert ckpt.best_k_models
    for path, score in ckpt.best_k_models.items():
        saved = load(path)
        assert "pre_optimizer_step" in saved, path
        torch.testing.assert_close(rescore(saved), score.float(), rtol=0, atol=0, msg=path)


def rescore_loss(model, make=None):
    """Scores a file as its batch scored it: ``loss_of`` of a fresh module with the file's state, on that batch."""

    def rescore(saved):
        fresh = make() if make else type(model)()
        fresh.load_state_dict(saved["state_dict"])
        return fresh.loss_of(*model.batches[saved["global_step"] - 1]).detach()

    return rescore


class MeanTeacher(Recorded):
    """A student trained against a frozen teacher, which an EMA moves towards the student after each step."""

    def __init__(self, update_in="training_step"):
        super().__init__()
        self.automatic_optimization = update_in == "callback"
        self.update_in = update_in
        self.student = nn.Linear(4, 1)
        self.teacher = nn.Linear(4, 1).requires_grad_(False)

    def loss_of(self, x, y):
        return nn.functional.mse_loss(self.student(x), y) + nn.functional.mse_loss(self.student(x), self.teacher(x))

    def training_step(self, batch, batch_idx):
        loss = self.loss_of(*batch)
        self.log("loss", loss)
        if self.automatic_optimization:
            return loss
        opt = self.optimizers()
        opt.zero_grad()
        self.manual_backward(loss)
        opt.step()
        self.update_teacher()
        return None

    @torch.no_grad()
    def update_teacher(self):
        for t, s in zip(self.teacher.parameters(), self.student.parameters(), strict=True):
            t.mul_(0.5).add_(0.5 * s)

    def configure_optimizers(self):
        return torch.optim.Adam(self.student.parameters(), lr=0.1)


class UpdateTeacher(Callback):
    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        pl_module.update_teacher()


@pytest.mark.parametrize("update_in", ["training_step", "callback"])
def test_a_mean_teacher_updated_after_the_step_is_saved_as_it_was_at_the_step(tmp_path, update_in):
    """Frozen weights that something other than the optimizer changes are part of the state at the step."""
    model = MeanTeacher(update_in)
    model.automatic_optimization = update_in == "callback"
    callbacks = [UpdateTeacher()] if update_in == "callback" else []
    with recorded_warnings() as caught:
        _, (ckpt,) = fit(tmp_path, model, callbacks=callbacks, checkpoints=[checkpoint(tmp_path)])
    assert not messages(caught, "save_pre_optimizer_step_state")

    assert_pairs(ckpt, rescore_loss(model))


class WithBatchNorm(Recorded):
    def __init__(self):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(4, 8), nn.BatchNorm1d(8), nn.ReLU(), nn.Linear(8, 1))
        self.running_mean_at_start = {}

    def loss_of(self, x, y):
        return nn.functional.mse_loss(self.net(x), y)

    def training_step(self, batch, batch_idx):
        loss = self.loss_of(*batch)
        self.log("loss", loss)
        return loss

    def on_train_batch_start(self, batch, batch_idx):
        super().on_train_batch_start(batch, batch_idx)
        self.running_mean_at_start[self.global_step] = self.net[1].running_mean.clone()

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.05)


def test_batchnorm_buffers_are_saved_as_the_forward_found_them(tmp_path):
    """The running statistics are those the batch's forward started from, which it then updated: the loss pairs."""
    model = WithBatchNorm()
    _, (ckpt,) = fit(tmp_path, model, checkpoints=[checkpoint(tmp_path)])

    assert_pairs(ckpt, rescore_loss(model))
    for path in ckpt.best_k_models:
        saved = load(path)
        expected = model.running_mean_at_start[saved["global_step"] - 1]
        torch.testing.assert_close(saved["state_dict"]["net.1.running_mean"], expected, rtol=0, atol=0)


class LogAfterStep(Recorded):
    """The shape of Lightning's manual optimization docs: backward, step, then `self.log` of the loss."""

    def __init__(self):
        super().__init__()
        self.automatic_optimization = False
        self.head = nn.Linear(4, 1)

    def loss_of(self, x, y):
        return nn.functional.mse_loss(self.head(x), y)

    def training_step(self, batch, batch_idx):
        opt = self.optimizers()
        loss = self.loss_of(*batch)
        opt.zero_grad()
        self.manual_backward(loss)
        opt.step()
        self.log("loss", loss)

    def configure_optimizers(self):
        return torch.optim.Adam(self.parameters(), lr=0.2)


def test_a_loss_logged_after_the_step_pairs_with_the_state_at_the_step(tmp_path):
    model = LogAfterStep()
    with recorded_warnings() as caught:
        _, (ckpt,) = fit(tmp_path, model, checkpoints=[checkpoint(tmp_path)])
    assert not messages(caught, "save_pre_optimizer_step_state")

    assert_pairs(ckpt, rescore_loss(model))


class Gan(Recorded):
    """A GAN in the shape of Lightning's GAN example: the generator (with BatchNorm) steps first, then the
    discriminator, on samples of the stepped generator; both losses are logged at the end of `training_step`."""

    def __init__(self):
        super().__init__()
        self.automatic_optimization = False
        self.generator = nn.Sequential(nn.Linear(2, 8), nn.BatchNorm1d(8), nn.LeakyReLU(0.2), nn.Linear(8, 4))
        self.discriminator = nn.Sequential(nn.Linear(4, 8), nn.LeakyReLU(0.2), nn.Linear(8, 1))
        self.noise = {}

    def losses(self, real, z, generated=None):
        ones, zeros = torch.ones(real.shape[0], 1), torch.zeros(real.shape[0], 1)
        bce = nn.functional.binary_cross_entropy_with_logits
        g_loss = bce(self.discriminator(self.generator(z)), ones)
        fake = self.generator(z).detach() if generated is None else generated
        d_loss = (bce(self.discriminator(real), ones) + bce(self.discriminator(fake), zeros)) / 2
        return g_loss, d_loss

    def training_step(self, batch, batch_idx):
        real = batch[0]
        z = self.noise[self.global_step] = torch.randn(real.shape[0], 2)
        opt_g, opt_d = self.optimizers()
        bce = nn.functional.binary_cross_entropy_with_logits

        self.toggle_optimizer(opt_g)
        g_loss = bce(self.discriminator(self.generator(z)), torch.ones(real.shape[0], 1))
        opt_g.zero_grad()
        self.manual_backward(g_loss)
        opt_g.step()
        self.untoggle_optimizer(opt_g)

        self.toggle_optimizer(opt_d)
        real_loss = bce(self.discriminator(real), torch.ones(real.shape[0], 1))
        fake_loss = bce(self.discriminator(self.generator(z).detach()), torch.zeros(real.shape[0], 1))
        d_loss = (real_loss + fake_loss) / 2
        opt_d.zero_grad()
        self.manual_backward(d_loss)
        opt_d.step()
        self.untoggle_optimizer(opt_d)

        self.log_dict({"d_loss": d_loss, "g_loss": g_loss})

    def configure_optimizers(self):
        betas = (0.5, 0.999)
        opt_g = torch.optim.Adam(self.generator.parameters(), lr=0.01, betas=betas)
        return opt_g, torch.optim.Adam(self.discriminator.parameters(), lr=0.01, betas=betas)


@pytest.mark.parametrize("monitor", ["d_loss", "g_loss"])
def test_both_losses_of_a_gan_in_the_shape_of_lightnings_example_pair(tmp_path, monitor):
    """`g_loss` pairs with the state at the generator's step, `d_loss` with the state at the discriminator's (the
    stepped generator, the discriminator before its step); `global_step` counts both steps."""
    model = Gan()
    ckpt = checkpoint(tmp_path, monitor=monitor, every_n_train_steps=4)
    with recorded_warnings() as caught:
        fit(tmp_path, model, checkpoints=[ckpt], max_steps=32)
    assert not messages(caught, "save_pre_optimizer_step_state")

    def rescore(saved):
        fresh = Gan()
        fresh.load_state_dict(saved["state_dict"])
        start = saved["global_step"] - 2
        real, z = model.batches[start][0], model.noise[start]
        if monitor == "g_loss":
            return fresh.losses(real, z)[0].detach()
        # the discriminator's loss was computed with the stepped generator: the file holds it
        return fresh.losses(real, z)[1].detach()

    assert_pairs(ckpt, rescore, key=monitor)
    assert {load(p)["pre_optimizer_step"]["global_step"] % 2 for p in ckpt.best_k_models} == {monitor == "d_loss"}


class GradNorm(LogAfterStep):
    def training_step(self, batch, batch_idx):
        opt = self.optimizers()
        opt.zero_grad()
        self.manual_backward(nn.functional.mse_loss(self.head(batch[0]), batch[1]))
        opt.step()

    def on_before_optimizer_step(self, optimizer):
        self.log("grad_norm", torch.cat([p.grad.flatten() for p in self.parameters()]).norm())


def test_a_value_logged_in_the_modules_on_before_optimizer_step_names_that_hook(tmp_path):
    with recorded_warnings() as caught:
        _, (ckpt,) = fit(tmp_path, GradNorm(), checkpoints=[checkpoint(tmp_path, monitor="grad_norm")])
    (warning,) = messages(caught, "save_pre_optimizer_step_state")
    assert (
        "'grad_norm' was logged after the batch's first optimizer step began (in `on_before_optimizer_step`" in warning
    )
    assert all("pre_optimizer_step" not in load(path) for path in ckpt.best_k_models)


class StepsAtEpochStart(LogAfterStep):
    def on_train_epoch_start(self):
        opt = self.optimizers()
        opt.zero_grad()
        self.manual_backward(self.head(torch.ones(1, 4)).sum())
        opt.step()


def test_a_step_before_the_epochs_first_batch_does_not_warn(tmp_path):
    model = StepsAtEpochStart()
    with recorded_warnings() as caught:
        _, (ckpt,) = fit(tmp_path, model, checkpoints=[checkpoint(tmp_path, every_n_train_steps=3)], max_steps=24)
    assert not messages(caught, "save_pre_optimizer_step_state")
    for path, score in ckpt.best_k_models.items():
        saved = load(path)
        fresh = LogAfterStep()
        fresh.load_state_dict(saved["state_dict"])
        x, y = model.batches[saved["global_step"] - 1]
        torch.testing.assert_close(nn.functional.mse_loss(fresh.head(x), y).detach(), score.float(), rtol=0, atol=0)


class SlowEvery4th(LogAfterStep):
    def training_step(self, batch, batch_idx):
        super().training_step(batch, batch_idx)
        if batch_idx % 4 == 3:
            time.sleep(0.6)


def test_train_time_interval_counts_the_files_that_hold_the_live_state(tmp_path):
    """A batch that ends past the interval sooner than the one before it predicted holds the live state: one warning
    at the end of the fit says how many."""
    ckpt = checkpoint(tmp_path, every_n_train_steps=None, train_time_interval=timedelta(seconds=0.5), save_top_k=-1)
    with recorded_warnings() as caught:
        fit(tmp_path, SlowEvery4th(), checkpoints=[ckpt], max_steps=16)
    (summary,) = messages(caught, "top-k checkpoints saved by `train_time_interval`")
    live = [path for path in ckpt.best_k_models if "pre_optimizer_step" not in load(path)]
    assert summary.startswith(f"{len(live)} of {len(ckpt.best_k_models)} top-k checkpoints")
    assert live


def test_the_copy_is_one_copy_of_the_state_for_any_number_of_checkpoints(tmp_path, monkeypatch):
    """At the saves, the shared copy holds no more than the module's tensors and optimizer states, plus 1 MiB."""
    sizes = []
    original = _PreOptimizerStepState.save_checkpoint

    def spy(self, trainer, ckpt, filepath):
        held = sum(v.nbytes for _, _, v, _, _ in self._params.values())
        held += sum(
            v.nbytes
            for _, _, _, state, _ in self._params.values()
            for v in (state or {}).values()
            if isinstance(v, torch.Tensor)
        )
        held += sum(v.nbytes for values in self._others.values() for _, v in values)
        module = trainer.lightning_module
        one_copy = sum(t.nbytes for t in (*module.parameters(), *module.buffers()))
        one_copy += sum(
            v.nbytes
            for o in trainer.optimizers
            for s in o.state.values()
            for v in s.values()
            if isinstance(v, torch.Tensor)
        )
        sizes.append((held, one_copy))
        original(self, trainer, ckpt, filepath)

    monkeypatch.setattr(_PreOptimizerStepState, "save_checkpoint", spy)
    checkpoints = [checkpoint(tmp_path / str(i), monitor="d_loss", every_n_train_steps=2 * (i + 1)) for i in range(3)]
    fit(tmp_path, Gan(), checkpoints=checkpoints, max_steps=24)
    assert sizes
    assert all(0 < held <= one_copy + (1 << 20) for held, one_copy in sizes), sizes


class RaiseAfterTheStep(Callback):
    def __init__(self, in_on_exception=False):
        self.in_on_exception = in_on_exception
        self.holder = None

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if trainer.global_step == 6:
            self.holder = trainer.checkpoint_callback._pre_optimizer_step
            assert self.holder._params  # the copy for this batch's save
            raise RuntimeError("boom")

    def on_exception(self, trainer, pl_module, exception):
        if self.in_on_exception:
            raise ValueError("from on_exception")


def test_an_exception_drops_the_copy(tmp_path):
    raising = RaiseAfterTheStep()
    ckpt = checkpoint(tmp_path)
    with pytest.raises(RuntimeError, match="boom"):
        fit(tmp_path, LogAfterStep(), callbacks=[raising], checkpoints=[ckpt])
    assert ckpt._pre_optimizer_step is None
    assert not raising.holder._params
    assert not raising.holder._others


class Probed(WithBatchNorm):
    """Scores in eval mode before the training forward, which then updates the running statistics."""

    def __init__(self, spectral=False):
        super().__init__()
        if spectral:
            self.net[0] = nn.utils.parametrizations.spectral_norm(self.net[0])

    def probe(self, batch):
        self.eval()
        score = nn.functional.mse_loss(self.net(batch[0]), batch[1]).detach()
        self.train()
        return score

    def training_step(self, batch, batch_idx):
        self.log("probe", self.probe(batch))
        loss = nn.functional.mse_loss(self.net(batch[0]), batch[1])
        self.log("loss", loss)
        return loss


@pytest.mark.parametrize("spectral", [False, True])
def test_a_score_from_the_buffers_the_forward_updates_pairs(tmp_path, spectral):
    """An eval-mode probe before the forward reads the running statistics the forward then updates; spectral norm's
    forward runs a power iteration on its vectors before computing the loss. Both pair with the batch start's."""
    model = Probed(spectral)
    with recorded_warnings() as caught:
        _, (ckpt,) = fit(tmp_path, model, checkpoints=[checkpoint(tmp_path, monitor="probe")])
    assert not messages(caught, "save_pre_optimizer_step_state")

    def rescore(saved):
        fresh = Probed(spectral)
        fresh.load_state_dict(saved["state_dict"])
        return fresh.probe(model.batches[saved["global_step"] - 1])

    assert_pairs(ckpt, rescore, key="probe")


def test_a_train_mode_loss_through_spectral_norm_pairs(tmp_path):
    """The forward's power iteration starts from the vectors the file holds, so re-running it gives the loss."""
    model = Probed(spectral=True)
    _, (ckpt,) = fit(tmp_path, model, checkpoints=[checkpoint(tmp_path)])

    assert_pairs(ckpt, rescore_loss(model, lambda: Probed(spectral=True)))


class ExtraState(LogAfterStep):
    """A `state_dict` override that adds a tensor that is neither a parameter nor a buffer (an EMA shadow)."""

    def __init__(self):
        super().__init__()
        self.shadow = torch.zeros(1, 4)

    def state_dict(self, *args, **kwargs):
        return {**super().state_dict(*args, **kwargs), "shadow": self.shadow}

    def load_state_dict(self, state_dict, strict=True):
        self.shadow = state_dict.pop("shadow")
        return super().load_state_dict(state_dict, strict)


class SteppedTwice(LogAfterStep):
    """One optimizer stepped twice a batch; the loss of the second step is logged."""

    def training_step(self, batch, batch_idx):
        opt = self.optimizers()
        for _ in range(2):
            loss = self.loss_of(*batch)
            opt.zero_grad()
            self.manual_backward(loss)
            opt.step()
        self.log("loss", loss)


@pytest.mark.parametrize(
    ("model", "cause"),
    [
        (ExtraState(), "a `state_dict` override that adds tensors"),
        (SteppedTwice(), "was changed by an earlier step of the batch too"),
    ],
    ids=["extra-state", "stepped-twice"],
)
def test_a_state_that_was_not_kept_is_saved_live_with_its_cause(tmp_path, model, cause):
    with recorded_warnings() as caught:
        _, (ckpt,) = fit(tmp_path, model, checkpoints=[checkpoint(tmp_path, every_n_train_steps=4)])
    (warning,) = messages(caught, "save_pre_optimizer_step_state")
    assert cause in warning
    assert ckpt.best_k_models
    assert all("pre_optimizer_step" not in load(path) for path in ckpt.best_k_models)


class MaxNormBeforeTheLoss(LogAfterStep):
    """Projects the weights onto a ball in place before computing the loss: the step's state includes it."""

    def training_step(self, batch, batch_idx):
        with torch.no_grad():
            self.head.weight.mul_(torch.clamp(1.0 / self.head.weight.norm(), max=1.0))
        super().training_step(batch, batch_idx)


def test_an_in_place_projection_before_the_loss_pairs_without_a_warning(tmp_path):
    model = MaxNormBeforeTheLoss()
    with recorded_warnings() as caught:
        _, (ckpt,) = fit(tmp_path, model, checkpoints=[checkpoint(tmp_path)])
    assert not messages(caught, "save_pre_optimizer_step_state")
    assert_pairs(ckpt, rescore_loss(model, LogAfterStep))
