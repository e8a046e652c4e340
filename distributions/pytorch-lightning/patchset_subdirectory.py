"""The build backend of a folder of ``distributions/``: the project's own (``tools/patchset/backend.py``).

A frontend loads a backend from inside the folder it builds only, so this module, in the folder, puts the project's
``tools`` (two folders up) on the path and hands every hook to the project's backend, which reads the distribution this
folder's ``pyproject.toml`` declares. The folders' copies of this file are identical (a test checks).
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tools"))

from patchset.backend import (  # importable once the project's tools folder is on the path
    build_editable,
    build_sdist,
    build_wheel,
    get_requires_for_build_editable,
    get_requires_for_build_sdist,
    get_requires_for_build_wheel,
    prepare_metadata_for_build_editable,
    prepare_metadata_for_build_wheel,
)

__all__ = [
    "build_editable",
    "build_sdist",
    "build_wheel",
    "get_requires_for_build_editable",
    "get_requires_for_build_sdist",
    "get_requires_for_build_wheel",
    "prepare_metadata_for_build_editable",
    "prepare_metadata_for_build_wheel",
]
