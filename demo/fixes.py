"""A short tour of what the installed fork fixes.

Run it after `pip install .`; it exits non-zero if a fix is missing.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util

import lightning


def main() -> None:
    """Show each fix at work."""
    print(f"lightning {lightning.__version__} from {lightning.__file__}")
    assert "+patchset." in lightning.__version__, "this is not the patch set's fork"

    requires = importlib.metadata.requires("lightning") or []
    assert not any(r.startswith("pytorch-lightning") for r in requires)
    print("0001 build: the fork does not pull the unpatched pytorch-lightning distribution")
    if importlib.util.find_spec("pytorch_lightning") is not None:
        print("     note: a separately installed pytorch_lightning is unpatched; import lightning.pytorch instead")


def ports() -> None:
    """0002: a port handed out in one process is never handed out in another while it is leased."""
    import os
    import subprocess
    import sys

    from lightning.fabric.plugins.environments import LightningEnvironment
    from lightning.fabric.plugins.environments.lightning import find_free_network_port

    from lightning.fabric.utilities.port_manager import get_port_manager

    mine = find_free_network_port()
    child = "from lightning.fabric.plugins.environments.lightning import find_free_network_port as f; print(f())"
    theirs = [int(subprocess.check_output([sys.executable, "-c", child])) for _ in range(5)]
    assert mine not in theirs, (mine, theirs)
    print(f"0002 fabric: port {mine} is leased here; 5 other processes got {theirs}")
    get_port_manager().release_port(mine)
    os.environ["MASTER_PORT"] = "70000"
    try:
        _ = LightningEnvironment().main_port
    except ValueError as err:
        print(f"     a bad MASTER_PORT is a clear error: {err}")
    else:
        raise AssertionError("a bad MASTER_PORT was accepted")
    finally:
        del os.environ["MASTER_PORT"]


if __name__ == "__main__":
    main()
    ports()
