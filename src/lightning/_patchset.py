"""The patch set's ``lightning``: a warning when another copy of its code is installed beside it."""

import importlib.metadata
import logging
import os

from lightning.fabric.utilities.rank_zero import rank_zero_warn

# the distributions that mirror lightning.pytorch / lightning.fabric under other import names
_MIRRORS = {"pytorch-lightning": "pytorch_lightning", "lightning-fabric": "lightning_fabric"}
# set once warned: processes this one starts (ddp_spawn, DataLoader workers) inherit it and stay quiet
_WARNED_ENV = "LIGHTNING_PATCHSET_WARNED_UNPATCHED"


def _warn_about_unpatched_copies(version: str) -> None:
    """Warn once when ``pytorch-lightning`` or ``lightning-fabric`` is installed at another version than ``version``.

    Those distributions hold a second copy of the code, which ``import pytorch_lightning`` and ``import
    lightning_fabric`` run: stock Lightning's (stock ``lightning`` requires ``pytorch-lightning``), or another build's,
    without this build's fixes.
    """
    if os.environ.get(_WARNED_ENV):
        return
    others = {}
    for distribution, package in _MIRRORS.items():
        try:
            installed = importlib.metadata.version(distribution)
        except importlib.metadata.PackageNotFoundError:
            continue
        if installed != version:
            others[distribution] = (f"{distribution} {installed}", f"`import {package}`", "+patchset" in installed)
    if not others:
        return
    os.environ[_WARNED_ENV] = "1"
    installed, imports = (" and ".join(part) for part in list(zip(*others.values()))[:2])
    readme = importlib.metadata.metadata("lightning").get("Home-page") or "the fork's README"
    if any(fork for *_, fork in others.values()):  # the fork's own, built from another commit
        advice = f"install all three of the fork's distributions from one commit ({readme})"
    else:
        advice = f"run `pip uninstall -y {' '.join(others)}`, or install the fork's own ({readme})"
    message = (
        f"{installed} {'is' if len(others) == 1 else 'are'} installed beside the patch set's lightning {version}:"
        f" {imports} {'runs' if len(others) == 1 else 'run'} that code, without this build's fixes. To fix it,"
        f" {advice}."
    )
    try:
        rank_zero_warn(message)
    except Warning:  # warnings turned into errors (`-W error`): an import that stock lets through must not fail
        logging.getLogger(__name__).warning(message)
