"""Tooling for the Lightning patch set: materialize, check, export, build and upstream the fork.

Standard library and git only (plus ``tomli`` on Python 3.10): it runs inside a PEP 517 build environment, before
torch or lightning exist.
"""

import sys

if sys.version_info < (3, 10):  # noqa: UP036 - the one line an older interpreter gets instead of a traceback
    raise SystemExit(
        "lightning (the Lightning patch set's fork of Lightning 2.6) requires Python >= 3.10;"
        f" this is Python {sys.version.split()[0]}"
    )

__all__ = ["PatchsetError"]


class PatchsetError(Exception):
    """A problem the user can act on; the CLI and the build backend print it as one line."""
