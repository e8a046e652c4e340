"""Tooling for the Lightning patch set: materialize, check, export, build and upstream the fork.

Standard library and git only: it runs inside a PEP 517 build environment, before torch or lightning exist.
"""

__all__ = ["PatchsetError"]


class PatchsetError(Exception):
    """A problem the user can act on; the CLI and the build backend print it as one line."""
