"""The ``pytorch-lightning`` and ``lightning-fabric`` distributions of the fork, built as upstream builds them.

A folder of ``distributions/`` builds one of them (``[tool.patchset] distribution`` in its ``pyproject.toml``); at
the project, ``PACKAGE_NAME`` chooses, as in upstream's repository. The fork's address (``url`` in
``[tool.patchset]`` of ``pyproject.toml``) is where these distributions' metadata send
users for the code and its bugs, as patch 0001 makes ``lightning``'s do.

With ``PACKAGE_NAME`` set to ``pytorch`` or ``fabric``, upstream's ``setup.py`` mirrors ``lightning.pytorch`` /
``lightning.fabric`` into ``pytorch_lightning`` / ``lightning_fabric`` with its own import rewriting and calls the
flavour's ``__setup__.py``. Upstream keeps each flavour's ``__setup__.py``, ``__about__.py``, ``__version__.py`` and
``MANIFEST.in`` in its repository, not in the sdist: this module writes our own into the build copy, giving what the
index's wheels of the pinned release have (the same requirement bounds, extras, classifiers, ``__about__`` values
and files). The default ``lightning`` build is upstream's, but for ``lightning[data]``'s requirement file, which the
sdist lacks too (:func:`add_data_extra`).
"""

from __future__ import annotations

import ast
import os
import re
import shutil
import sys
from dataclasses import dataclass
from pathlib import Path

from patchset import PatchsetError

PACKAGE_NAME_ENV = "PACKAGE_NAME"
_SHARED_ABOUT = ("__author__", "__author_email__", "__license__", "__homepage__", "__docs_url__")
# requirements/data/data.txt of upstream's repository at the pinned release (the comparison with the index's wheel
# in tests/tests_patchset/test_distributions.py catches a change at the next rebase)
DATA_REQUIREMENTS = "litdata >=0.2.0rc, <0.3.0\n"


@dataclass(frozen=True)
class Flavour:
    """A distribution built from the mirrored packages, and what upstream's index wheel of it says about itself."""

    distribution: str
    package: str
    packages: tuple[str, ...]  # the flavour's own package first
    requirements: str
    docs: str  # __docs__, the distribution's Summary
    copyright_since: int
    classifiers: tuple[str, ...]
    console_scripts: tuple[str, ...] = ()


def _classifiers(status: str, topics: tuple[str, ...], license_classifier: bool) -> tuple[str, ...]:
    return (
        "Environment :: Console", "Natural Language :: English", f"Development Status :: {status}",
        "Intended Audience :: Developers", *(f"Topic :: Scientific/Engineering :: {topic}" for topic in topics),
        *(["License :: OSI Approved :: Apache Software License"] if license_classifier else []),
        "Operating System :: OS Independent",
        *(f"Programming Language :: Python :: {v}" for v in ("3", "3.10", "3.11", "3.12", "3.13")),
    )  # fmt: skip


_TOPICS = ("Artificial Intelligence", "Information Analysis")
_PYTORCH_DOCS = "PyTorch Lightning is the lightweight PyTorch wrapper for ML researchers. Scale your models. Write less"
FLAVOURS = {
    "pytorch": Flavour("pytorch-lightning", "pytorch_lightning", ("pytorch_lightning", "lightning_fabric"), "pytorch",
                       _PYTORCH_DOCS + " boilerplate.", 2018, _classifiers("5 - Production/Stable",
                       (_TOPICS[0], "Image Recognition", _TOPICS[1]), True)),
    "fabric": Flavour("lightning-fabric", "lightning_fabric", ("lightning_fabric",), "fabric", "", 2022,
                      _classifiers("4 - Beta", _TOPICS, False), ("fabric = lightning_fabric.cli:_main",)),
}  # fmt: skip

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
        "url": "{url}",
        "download_url": "{url}/releases",
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
            "Bug Tracker": "{url}/issues",
            "Documentation": "https://pytorch-lightning.rtfd.io/en/latest/",
            "Source Code": "{url}",
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


def _settings(folder: Path) -> dict[str, object]:
    """``[tool.patchset]`` of ``folder``'s ``pyproject.toml``."""
    if sys.version_info >= (3, 11):
        import tomllib
    else:  # pragma: no cover - Python 3.10: the same parser, from the index; imported here, where it is used, so that
        import tomli as tomllib  # the commands that never read pyproject.toml (check, export) need nothing but git

    path = folder / "pyproject.toml"
    try:
        settings = tomllib.loads(path.read_text(encoding="utf-8")).get("tool", {}).get("patchset", {})
    except (OSError, tomllib.TOMLDecodeError) as err:
        raise PatchsetError(f"{path}: cannot read the fork's settings ({err})") from err
    return settings if isinstance(settings, dict) else {}


def fork_url(project: Path) -> str:
    """The fork's public address: ``[tool.patchset] url`` in ``pyproject.toml``."""
    url = _settings(project).get("url")
    if not isinstance(url, str) or not re.fullmatch(r"https://[^\s/]+(/[^\s/]+)+", url):
        raise PatchsetError(
            f"{project / 'pyproject.toml'}: [tool.patchset] url must be the fork's https address without a trailing"
            f" slash, got {url!r}"
        )
    return url


def declared(folder: Path) -> Flavour | None:
    """The flavour ``[tool.patchset] distribution`` names in ``folder``'s ``pyproject.toml``; ``None`` for lightning.

    A folder of ``distributions/`` declares one, and so does an sdist built from such a folder.
    """
    path = folder / "pyproject.toml"
    if "distribution" not in (path.read_text(encoding="utf-8") if path.is_file() else ""):
        return None  # the project's own: no need of a TOML parser (Python 3.10 may build without tomli)
    name = _settings(folder).get("distribution", "lightning")
    by_name = {flavour.distribution: flavour for flavour in FLAVOURS.values()}
    if name != "lightning" and name not in by_name:
        raise PatchsetError(
            f"{folder / 'pyproject.toml'}: [tool.patchset] distribution must be one of lightning,"
            f" {', '.join(by_name)}, got {name!r}"
        )
    return by_name.get(name)  # type: ignore[arg-type]


def package_name(flavour: Flavour) -> str:
    """The ``PACKAGE_NAME`` value with which upstream's ``setup.py`` builds ``flavour``."""
    return next(key for key, own in FLAVOURS.items() if own is flavour)


def add_data_extra(tree: Path) -> None:
    """Write the requirement file of ``lightning[data]``, which the sdist does not ship, unless it ships one."""
    path = tree / "requirements" / "data" / "data.txt"
    if not path.exists():
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(DATA_REQUIREMENTS, encoding="utf-8")


def requested() -> Flavour | None:
    """The flavour ``$PACKAGE_NAME`` asks for; ``None`` (or ``lightning``) is the default ``lightning`` build."""
    name = os.environ.get(PACKAGE_NAME_ENV, "").strip()
    if name not in ("", "lightning", *FLAVOURS):
        raise PatchsetError(f"{PACKAGE_NAME_ENV}={name!r}: expected one of lightning, {', '.join(FLAVOURS)}")
    return FLAVOURS.get(name)


def chosen(folder: Path, shown: str) -> Flavour | None:
    """The flavour a build in ``folder`` (``shown`` in messages) makes.

    The one its ``pyproject.toml`` declares, else the one ``$PACKAGE_NAME`` asks for. In a folder that declares one,
    ``PACKAGE_NAME`` is left alone (it is a common variable of other projects' builds) unless it names another of
    Lightning's distributions, which is an error.
    """
    flavour, name = declared(folder), os.environ.get(PACKAGE_NAME_ENV, "").strip()
    if flavour is None:
        return requested()
    if (name in FLAVOURS and FLAVOURS[name] is not flavour) or name == "lightning":
        raise PatchsetError(
            f"{PACKAGE_NAME_ENV}={name}, but {shown} builds {flavour.distribution}: unset {PACKAGE_NAME_ENV} (the"
            " folder names its distribution) or install from the URL that builds the one you want"
        )
    return flavour


def prepare(tree: Path, flavour: Flavour, url: str) -> None:
    """Give upstream's ``setup.py`` what it needs to build ``flavour`` from ``tree``, as upstream's repository does."""
    about = tree / "src" / "lightning" / "__about__.py"
    values = {}
    for node in ast.parse(about.read_text(encoding="utf-8")).body:
        if isinstance(node, ast.Assign) and isinstance(node.value, ast.Constant) and len(node.targets) == 1:
            name = node.targets[0].id if isinstance(node.targets[0], ast.Name) else ""
            values.update({name: str(node.value.value)} if name in _SHARED_ABOUT else {})
    if missing := [key for key in _SHARED_ABOUT if key not in values]:
        raise PatchsetError(f"{about}: no string {', '.join(missing)}: cannot write the flavours' __about__.py")
    shared = "\n".join(f"{key} = {value!r}" for key, value in values.items())
    for own in FLAVOURS.values():  # both packages must exist: upstream counts them to decide on a mirrored build
        folder = tree / "src" / own.package
        folder.mkdir(parents=True, exist_ok=True)
        (folder / "__version__.py").write_text(_VERSION, encoding="utf-8")
        (folder / "py.typed").write_text("", encoding="utf-8")
        text = _ABOUT.format(distribution=own.distribution, shared=shared, since=own.copyright_since, docs=own.docs)
        (folder / "__about__.py").write_text(text, encoding="utf-8")
        scripts = (
            f'\n        "entry_points": {{"console_scripts": {list(own.console_scripts)!r}}},'
            if own.console_scripts
            else ""
        )
        includes = [pattern for package in own.packages for pattern in (package, f"{package}.*")]
        text = _SETUP.format(distribution=own.distribution, package=own.package, requirements=own.requirements, url=url,
                             includes=includes, classifiers=list(own.classifiers), entry_points=scripts)  # fmt: skip
        (folder / "__setup__.py").write_text(text, encoding="utf-8")
    shutil.copyfile(tree / "README.md", tree / "src" / flavour.package / "README.md")
    # package data, as upstream's MANIFEST.in of the flavour lists it (the others are for upstream's own sdists)
    files = ("version.info", "py.typed", "CHANGELOG.md")
    manifest = [f"include src/{package}/{name}" for package in flavour.packages for name in files]
    (tree / "src" / flavour.package / "MANIFEST.in").write_text(
        "\n".join([*manifest, f"include src/{flavour.package}/README.md"]) + "\n", encoding="utf-8"
    )
