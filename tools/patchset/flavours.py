"""The ``pytorch-lightning`` and ``lightning-fabric`` distributions of the fork, built from the same patched tree.

Upstream's ``setup.py`` builds these flavours when ``PACKAGE_NAME`` is ``pytorch`` or ``fabric`` and ``src/`` holds
the flavour packages: it then mirrors ``lightning.pytorch``/``lightning.fabric`` into ``pytorch_lightning``/
``lightning_fabric`` with its own import rewriting (``assistant.create_mirror_package``) and calls the flavour's
``__setup__.py``. The sdist of ``lightning`` does not ship those setup files, so this module writes our own into the
build copy, and only for a flavour build: the default ``lightning`` build is upstream's, untouched.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from patchset import PatchsetError

PACKAGE_NAME_ENV = "PACKAGE_NAME"


@dataclass(frozen=True)
class Flavour:
    """A distribution built from the mirrored packages."""

    distribution: str
    package: str
    packages: tuple[str, ...]
    requirements: str
    summary: str


FLAVOURS = {
    "pytorch": Flavour(
        "pytorch-lightning",
        "pytorch_lightning",
        ("pytorch_lightning", "lightning_fabric"),
        "requirements/pytorch",
        "PyTorch Lightning (the Lightning patch set's fork): pytorch_lightning and lightning_fabric.",
    ),
    "fabric": Flavour(
        "lightning-fabric",
        "lightning_fabric",
        ("lightning_fabric",),
        "requirements/fabric",
        "Lightning Fabric (the Lightning patch set's fork).",
    ),
}

_SETUP = '''"""Setup arguments of the {distribution} flavour, written by the Lightning patch set's build backend."""

import os
from importlib.util import module_from_spec, spec_from_file_location

from setuptools import find_packages


def _assistant():
    spec = spec_from_file_location("assistant", os.path.join(".actions", "assistant.py"))
    module = module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _setup_args():
    with open(os.path.join("src", "version.info"), encoding="utf-8") as fh:
        version = fh.readline().strip()
    freeze = os.environ.get("FREEZE_REQUIREMENTS", "0").lower() in ("1", "true")
    return {{
        "name": "{distribution}",
        "version": version,
        "description": "{summary}",
        "author": "Lightning AI et al.",
        "url": "https://github.com/Lightning-AI/pytorch-lightning",
        "license": "Apache-2.0",
        "packages": find_packages(where="src", include={includes!r}),
        "package_dir": {{"": "src"}},
        "include_package_data": True,
        "zip_safe": False,
        "python_requires": ">=3.10",
        "install_requires": _assistant().load_requirements("{requirements}", unfreeze="none" if freeze else "major"),
    }}
'''

_VERSION = """import os

with open(os.path.join(os.path.dirname(__file__), "version.info"), encoding="utf-8") as _fh:
    version = _fh.readline().strip()
"""


def requested() -> Flavour | None:
    """The flavour ``$PACKAGE_NAME`` asks for; ``None`` (or ``lightning``) is the default ``lightning`` build."""
    name = os.environ.get(PACKAGE_NAME_ENV, "").strip()
    if name in ("", "lightning"):
        return None
    if name not in FLAVOURS:
        raise PatchsetError(f"{PACKAGE_NAME_ENV}={name!r}: expected one of lightning, {', '.join(FLAVOURS)}")
    return FLAVOURS[name]


def prepare(tree: Path, flavour: Flavour) -> None:
    """Give upstream's ``setup.py`` what it needs to build ``flavour`` from ``tree``."""
    includes = [pattern for package in flavour.packages for pattern in (package, f"{package}.*")]
    manifest = []
    for package in ("pytorch_lightning", "lightning_fabric"):
        folder = tree / "src" / package  # both must exist: upstream counts them to decide on a mirrored build
        folder.mkdir(parents=True, exist_ok=True)
        (folder / "__version__.py").write_text(_VERSION, encoding="utf-8")
        (folder / "py.typed").write_text("", encoding="utf-8")
        if package in flavour.packages:
            manifest += [f"include src/{package}/{name}" for name in ("version.info", "py.typed", "CHANGELOG.md")]
    setup = tree / "src" / flavour.package / "__setup__.py"
    setup.write_text(
        _SETUP.format(
            distribution=flavour.distribution,
            summary=flavour.summary,
            includes=includes,
            requirements=flavour.requirements,
        ),
        encoding="utf-8",
    )
    (tree / "src" / flavour.package / "MANIFEST.in").write_text("\n".join(manifest) + "\n", encoding="utf-8")
