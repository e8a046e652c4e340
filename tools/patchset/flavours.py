"""The ``pytorch-lightning`` and ``lightning-fabric`` distributions of the fork, built as upstream builds them.

Upstream's ``setup.py`` builds these flavours when ``PACKAGE_NAME`` is ``pytorch`` or ``fabric`` and ``src/`` holds
the flavour packages: it mirrors ``lightning.pytorch``/``lightning.fabric`` into ``pytorch_lightning``/
``lightning_fabric`` with its own import rewriting (``assistant.create_mirror_package``) and calls the flavour's
``__setup__.py``. Upstream keeps each flavour's ``__setup__.py``, ``__about__.py``, ``__version__.py``,
``MANIFEST.in`` and ``README.md`` in its repository, not in the ``lightning`` sdist, so this module writes our own
into the build copy, for a flavour build only (the default ``lightning`` build is upstream's, untouched). They give
what the index's wheels of the pinned release have: the same requirement bounds (upstream drops the upper bounds of
its requirement files for these two, ``unfreeze="all"``, and keeps them for ``lightning``), extras, classifiers,
``__about__`` values and files. ``README.md`` (the long description) is the sdist's, which upstream writes for
``lightning``; the flavours' own READMEs are not in the sdist.

One file of upstream's repository that the sdist lacks concerns ``lightning`` itself: ``requirements/data/data.txt``,
the only requirement of its ``data`` extra (:func:`add_data_extra`).
"""

from __future__ import annotations

import ast
import os
import shutil
from dataclasses import dataclass
from pathlib import Path

from patchset import PatchsetError

PACKAGE_NAME_ENV = "PACKAGE_NAME"
# The __about__ values the flavours share with `lightning` (read from the sdist's src/lightning/__about__.py).
_SHARED_ABOUT = ("__author__", "__author_email__", "__license__", "__homepage__", "__docs_url__")


@dataclass(frozen=True)
class Flavour:
    """A distribution built from the mirrored packages, and what upstream's index wheel of it says about itself."""

    distribution: str
    package: str
    packages: tuple[str, ...]
    requirements: str
    docs: str  # __docs__, the distribution's Summary
    copyright_since: int
    classifiers: tuple[str, ...]
    console_scripts: tuple[str, ...] = ()


_PYTHONS = ("3", "3.10", "3.11", "3.12", "3.13")
_TOPICS = ("Artificial Intelligence", "Information Analysis")


def _classifiers(status: str, topics: tuple[str, ...], license_classifier: bool) -> tuple[str, ...]:
    return (
        "Environment :: Console",
        "Natural Language :: English",
        f"Development Status :: {status}",
        "Intended Audience :: Developers",
        *(f"Topic :: Scientific/Engineering :: {topic}" for topic in topics),
        *(["License :: OSI Approved :: Apache Software License"] if license_classifier else []),
        "Operating System :: OS Independent",
        *(f"Programming Language :: Python :: {version}" for version in _PYTHONS),
    )


# The flavour packages: each lists itself first (the package whose __setup__.py upstream's setup.py calls).
_FABRIC = ("lightning_fabric",)
FLAVOURS = {
    "pytorch": Flavour(
        "pytorch-lightning",
        "pytorch_lightning",
        ("pytorch_lightning", *_FABRIC),
        "pytorch",
        "PyTorch Lightning is the lightweight PyTorch wrapper for ML researchers."
        " Scale your models. Write less boilerplate.",
        2018,
        _classifiers(
            "5 - Production/Stable", ("Artificial Intelligence", "Image Recognition", "Information Analysis"), True
        ),
    ),
    "fabric": Flavour(
        "lightning-fabric",
        "lightning_fabric",
        _FABRIC,
        "fabric",
        "",
        2022,
        _classifiers("4 - Beta", _TOPICS, False),
        ("fabric = lightning_fabric.cli:_main",),
    ),
}
_BY_PACKAGE = {flavour.package: flavour for flavour in FLAVOURS.values()}

_SETUP = '''"""Setup arguments of the {distribution} distribution, as upstream builds it for the index.

Written by the Lightning patch set's build backend: upstream keeps its own in its repository, not in the sdist.
"""

import glob
import os
from importlib.util import module_from_spec, spec_from_file_location

from packaging.requirements import Requirement
from setuptools import find_packages

_PACKAGE_ROOT = os.path.join("src", "{package}")
_PATH_REQUIREMENTS = os.path.join("requirements", "{requirements}")
# upstream's switch: keep the requirement files' upper bounds; by default they go (unless marked `# strict`)
_FREEZE_REQUIREMENTS = os.environ.get("FREEZE_REQUIREMENTS", "0").lower() in ("1", "true")
_UNFREEZE = "none" if _FREEZE_REQUIREMENTS else "all"


def _load(name, *path):
    spec = spec_from_file_location(name, os.path.join(*path))
    module = module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _prepare_extras(assistant):
    extras = {{
        os.path.basename(path)[:-4]: assistant.load_requirements(
            _PATH_REQUIREMENTS, os.path.basename(path), unfreeze=_UNFREEZE
        )
        for path in sorted(glob.glob(os.path.join(_PATH_REQUIREMENTS, "*.txt")))
        if os.path.basename(path) not in ("docs.txt", "base.txt")
    }}
    for line in extras["strategies"]:  # one extra per strategy package
        requirement = line.split("#")[0].strip()
        if requirement:
            extras[Requirement(requirement).name.lower().replace("-", "_")] = [line]
    extras["all"] = extras["extra"] + extras["strategies"] + extras["examples"]
    extras["dev"] = extras["all"] + extras["test"]
    return extras


def _setup_args():
    assistant = _load("assistant", ".actions", "assistant.py")
    about = _load("about", _PACKAGE_ROOT, "__about__.py")
    version = _load("version", _PACKAGE_ROOT, "__version__.py").version
    return {{
        "name": "{distribution}",
        "version": version,
        "description": about.__docs__,
        "author": about.__author__,
        "author_email": about.__author_email__,
        "url": about.__homepage__,
        "download_url": "https://github.com/Lightning-AI/lightning",
        "license": about.__license__,
        "packages": find_packages(where="src", include={includes!r}),
        "package_dir": {{"": "src"}},
        "include_package_data": True,
        "long_description": assistant.load_readme_description(
            _PACKAGE_ROOT, homepage=about.__homepage__, version=version
        ),
        "long_description_content_type": "text/markdown",
        "zip_safe": False,
        "keywords": ["deep learning", "pytorch", "AI"],
        "python_requires": ">=3.10",
        "install_requires": assistant.load_requirements(_PATH_REQUIREMENTS, unfreeze=_UNFREEZE),
        "extras_require": _prepare_extras(assistant),
        "project_urls": {{
            "Bug Tracker": "https://github.com/Lightning-AI/pytorch-lightning/issues",
            "Documentation": "https://pytorch-lightning.rtfd.io/en/latest/",
            "Source Code": "https://github.com/Lightning-AI/lightning",
        }},
        "classifiers": {classifiers!r},{entry_points}
    }}
'''

_ABOUT = '''"""About the {distribution} distribution: the values of upstream's index wheel.

Written by the Lightning patch set's build backend (upstream keeps this file in its repository, not in the sdist).
"""

import time

{shared}
__copyright__ = f"Copyright (c) {since}-{{time.strftime('%Y')}}, {{__author__}}."
__docs__ = {docs!r}

__all__ = [
    "__author__",
    "__author_email__",
    "__copyright__",
    "__docs__",
    "__docs_url__",
    "__homepage__",
    "__license__",
]
'''

_VERSION = """import os

with open(os.path.join(os.path.dirname(__file__), "version.info"), encoding="utf-8") as _fh:
    version = _fh.readline().strip()
"""


# requirements/data/data.txt in upstream's repository at the pinned release: `lightning[data]`, which upstream's
# lightning/__setup__.py makes from it (with the upper bound widened to the next major version, as for every extra)
DATA_REQUIREMENTS = "litdata >=0.2.0rc, <0.3.0\n"


def add_data_extra(tree: Path) -> None:
    """Write the requirement file of ``lightning[data]``, which the sdist does not ship, unless it ships one."""
    path = tree / "requirements" / "data" / "data.txt"
    if not path.exists():
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(DATA_REQUIREMENTS, encoding="utf-8")


def requested() -> Flavour | None:
    """The flavour ``$PACKAGE_NAME`` asks for; ``None`` (or ``lightning``) is the default ``lightning`` build."""
    name = os.environ.get(PACKAGE_NAME_ENV, "").strip()
    if name in ("", "lightning"):
        return None
    if name not in FLAVOURS:
        raise PatchsetError(f"{PACKAGE_NAME_ENV}={name!r}: expected one of lightning, {', '.join(FLAVOURS)}")
    return FLAVOURS[name]


def shared_about(tree: Path) -> dict[str, str]:
    """The ``__about__`` strings every distribution shares, as the sdist's ``src/lightning/__about__.py`` has them."""
    path = tree / "src" / "lightning" / "__about__.py"
    values = {}
    for node in ast.parse(path.read_text(encoding="utf-8")).body:
        if not isinstance(node, ast.Assign) or len(node.targets) != 1 or not isinstance(node.value, ast.Constant):
            continue
        target = node.targets[0]
        if isinstance(target, ast.Name) and target.id in _SHARED_ABOUT:
            values[target.id] = str(node.value.value)
    missing = [key for key in _SHARED_ABOUT if key not in values]
    if missing:
        raise PatchsetError(f"{path}: no string {', '.join(missing)}: cannot write the flavours' __about__.py")
    return values


def prepare(tree: Path, flavour: Flavour) -> None:
    """Give upstream's ``setup.py`` what it needs to build ``flavour`` from ``tree``, as upstream's repository does."""
    shared = "\n".join(f"{key} = {value!r}" for key, value in shared_about(tree).items())
    for package, own in _BY_PACKAGE.items():
        folder = tree / "src" / package  # both must exist: upstream counts them to decide on a mirrored build
        folder.mkdir(parents=True, exist_ok=True)
        (folder / "__version__.py").write_text(_VERSION, encoding="utf-8")
        (folder / "py.typed").write_text("", encoding="utf-8")
        about = _ABOUT.format(distribution=own.distribution, shared=shared, since=own.copyright_since, docs=own.docs)
        (folder / "__about__.py").write_text(about, encoding="utf-8")
        (folder / "__setup__.py").write_text(_setup(own), encoding="utf-8")
    shutil.copyfile(tree / "README.md", tree / "src" / flavour.package / "README.md")
    # package data, as upstream's MANIFEST.in of the flavour lists it (the others are for upstream's own sdists)
    files = ("version.info", "py.typed", "CHANGELOG.md")
    manifest = [f"include src/{package}/{name}" for package in flavour.packages for name in files]
    manifest.append(f"include src/{flavour.package}/README.md")
    (tree / "src" / flavour.package / "MANIFEST.in").write_text("\n".join(manifest) + "\n", encoding="utf-8")


def _setup(flavour: Flavour) -> str:
    includes = [pattern for package in flavour.packages for pattern in (package, f"{package}.*")]
    entry_points = (
        f'\n        "entry_points": {{"console_scripts": {list(flavour.console_scripts)!r}}},'
        if flavour.console_scripts
        else ""
    )
    return _SETUP.format(
        distribution=flavour.distribution,
        package=flavour.package,
        requirements=flavour.requirements,
        includes=includes,
        classifiers=list(flavour.classifiers),
        entry_points=entry_points,
    )
