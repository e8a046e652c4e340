"""The patch set's ``lightning``: a warning when another copy of its code is installed beside it."""

import importlib.metadata
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
            others[distribution] = (f"{distribution} {installed}", f"`import {package}`")
    if not others:
        return
    os.environ[_WARNED_ENV] = "1"
    installed, imports = (" and ".join(part) for part in zip(*others.values()))
    verb = "is" if len(others) == 1 else "are"
    rank_zero_warn(
        f"{installed} {verb} installed beside the patch set's lightning {version}: {imports} run that code, without"
        f" the fork's fixes. Run `pip uninstall -y {' '.join(others)}`, or install the fork's own (see its README)."
    )
