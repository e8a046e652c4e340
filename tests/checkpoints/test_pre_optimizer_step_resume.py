"""`ModelCheckpoint(save_pre_optimizer_step_state=True)` (issue #20947) and resuming: the option keeps the top-k
of a run without it, and a fit resumed from a pre-step file says what it does."""

from test_pre_optimizer_step import (
    Net,
    checkpoint,
    fit,
    load,
    messages,
    own_warning_cache,  # noqa: F401  (autouse here too)
    recorded_warnings,
)

from lightning.pytorch import Trainer, seed_everything
from lightning.pytorch.callbacks import ModelCheckpoint


def test_off_by_default_and_the_option_keeps_the_state_key(tmp_path):
    """A run without the option resumes with it and keeps its top-k: the score falls, so with `mode="max"` the first
    run's files stay the best three, which the second run only knows from the state it loaded."""
    kwargs = {"monitor": "score", "every_n_train_steps": 2, "save_top_k": 3, "mode": "max", "save_last": True}
    off = ModelCheckpoint(dirpath=tmp_path, **kwargs)
    assert not off._save_pre_optimizer_step_state
    fit(tmp_path, Net(), checkpoints=[off], max_steps=8)
    on = ModelCheckpoint(dirpath=tmp_path, save_pre_optimizer_step_state=True, **kwargs)
    assert on.state_key == off.state_key
    seed_everything(7)
    trainer = Trainer(default_root_dir=tmp_path, max_steps=16, callbacks=[on], logger=False, limit_val_batches=0)
    trainer.fit(Net(), ckpt_path=tmp_path / "last.ckpt")
    assert on.best_k_models.keys() == off.best_k_models.keys()


def test_resuming_from_a_pre_step_file_says_what_fit_does(tmp_path):
    """Every `fit(ckpt_path=...)` from such a file warns once: the `ModelCheckpoint` that loads its state says it."""
    _, (ckpt,) = fit(tmp_path, Net(), max_steps=8)
    path = ckpt.best_model_path
    saved = load(path)
    for _ in range(2):
        seed_everything(7)
        trainer = Trainer(
            default_root_dir=tmp_path,
            max_steps=10,
            logger=False,
            limit_val_batches=0,
            callbacks=[checkpoint(tmp_path / "resumed")],
        )
        with recorded_warnings() as caught:
            trainer.fit(Net(), ckpt_path=path)
        (message,) = messages(caught, "The checkpoint holds the state at an optimizer step")
        assert f"of global step {saved['pre_optimizer_step']['global_step']}" in message
    with recorded_warnings() as caught:
        trainer.validate(Net(), ckpt_path=path)
    assert not messages(caught, "The checkpoint holds the state at an optimizer step")  # it only concerns resuming
