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


if __name__ == "__main__":
    main()
