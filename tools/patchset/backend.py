"""In-tree PEP 517 / PEP 660 build backend: builds the fork by delegating to upstream's own setuptools build.

It never imports torch or lightning. The patched tree is made once per (sdist hash, series) and cached; each hook
works on a fresh copy with our new files and the version label, so upstream's ``setup.py`` can write into it freely.
What setuptools builds is then finished here: the fork's address in the metadata (:mod:`patchset.fork_metadata`) and
a reproducible zip (:mod:`patchset.reproducible`).
"""

from __future__ import annotations

import functools
import io
import os
import re
import subprocess
import sys
import tarfile
import tempfile
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any, TypeVar

from patchset import PatchsetError, flavours
from patchset.build_label import build_pin
from patchset.fork_metadata import fork_metadata, fork_url
from patchset.materialize import build_tree
from patchset.pin import PIN_FILE, read_pin
from patchset.reproducible import finish_wheel

_T = TypeVar("_T")
ConfigSettings = dict[str, Any] | None
EDITABLE_TREE = Path(".work") / "editable"
# What a self-contained sdist of the patch set holds (top-level entries); everything else (caches, build output,
# editor files, coverage data) stays out.
SDIST_CONTENTS = (
    "pyproject.toml",
    "README.md",
    "LICENSE",
    "CHANGELOG.md",
    "patches",
    "tools",
    "src",
    "tests",
    "docs",
    "demo",
    "benchmarks",
)
_SKIP_PARTS = {"__pycache__", ".pytest_cache", ".mypy_cache", ".ruff_cache"}


def _project() -> Path:
    return Path.cwd()


def _reports_errors(fn: Callable[..., _T]) -> Callable[..., _T]:
    """Turn a :class:`PatchsetError` into one ``patchset: error:`` line and a failed hook, not a traceback."""

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> _T:
        try:
            return fn(*args, **kwargs)
        except PatchsetError as err:
            print(f"patchset: error: {err}", file=sys.stderr, flush=True)
            raise SystemExit(1) from None

    return wrapper


@contextmanager
def _inside(tree: Path) -> Iterator[Path]:
    cwd = os.getcwd()
    os.chdir(tree)
    try:
        yield tree
    finally:
        os.chdir(cwd)


@contextmanager
def _fork_tree() -> Iterator[Path]:
    flavour = flavours.requested()
    with tempfile.TemporaryDirectory(prefix="lightning-patchset-") as tmp:
        tree = build_tree(_project(), Path(tmp) / "tree")
        flavours.add_data_extra(tree)
        if flavour is not None:
            flavours.prepare(tree, flavour)
        with _inside(tree):
            yield tree


def _setuptools() -> Any:
    """Setuptools' own backend, imported only by the hooks that delegate to it (metadata, wheel, editable).

    The sdist hook, which does not, runs without importing setuptools at all.
    """
    import setuptools.build_meta  # type: ignore[import-untyped,unused-ignore]

    return setuptools.build_meta


def get_requires_for_build_wheel(config_settings: ConfigSettings = None) -> list[str]:
    return []  # build-system.requires already lists what upstream's setup.py needs


get_requires_for_build_editable = get_requires_for_build_wheel
get_requires_for_build_sdist = get_requires_for_build_wheel


def _finish(wheel: Path, url: str) -> str:
    finish_wheel(wheel, lambda text: fork_metadata(text, url))
    return wheel.name


@_reports_errors
def prepare_metadata_for_build_wheel(metadata_directory: str, config_settings: ConfigSettings = None) -> str:
    target = os.path.abspath(metadata_directory)
    url = fork_url(_project())
    with _fork_tree():
        name = str(_setuptools().prepare_metadata_for_build_wheel(target, config_settings))
    metadata = Path(target) / name / "METADATA"
    metadata.write_bytes(fork_metadata(metadata.read_bytes().decode("utf-8"), url).encode("utf-8"))
    return name


@_reports_errors
def build_wheel(
    wheel_directory: str, config_settings: ConfigSettings = None, metadata_directory: str | None = None
) -> str:
    target = os.path.abspath(wheel_directory)
    url = fork_url(_project())
    with _fork_tree():
        name = str(_setuptools().build_wheel(target, config_settings))
    return _finish(Path(target) / name, url)


@_reports_errors
def prepare_metadata_for_build_editable(metadata_directory: str, config_settings: ConfigSettings = None) -> str:
    if flavours.requested() is not None:
        raise PatchsetError(f"{flavours.PACKAGE_NAME_ENV}: editable installs build the lightning distribution only")
    return prepare_metadata_for_build_wheel(metadata_directory, config_settings)


@_reports_errors
def build_editable(
    wheel_directory: str, config_settings: ConfigSettings = None, metadata_directory: str | None = None
) -> str:
    """PEP 660: the installed fork points at ``.work/editable``, whose new files are links to this checkout's.

    Edits to our new files take effect at once; after changing patches or adding files, install again.
    """
    flavour = flavours.requested()
    if flavour is not None:
        raise PatchsetError(
            f"{flavours.PACKAGE_NAME_ENV}={os.environ[flavours.PACKAGE_NAME_ENV]}: editable installs build the"
            f" lightning distribution only; install {flavour.distribution} without -e"
        )
    target = os.path.abspath(wheel_directory)
    url = fork_url(_project())
    tree = build_tree(_project(), _project() / EDITABLE_TREE, link=True)
    flavours.add_data_extra(tree)
    with _inside(tree):
        name = str(_setuptools().build_editable(target, config_settings))
    return _finish(Path(target) / name, url)


@_reports_errors
def build_sdist(sdist_directory: str, config_settings: ConfigSettings = None) -> str:
    """A self-contained sdist of the patch set: pin, patches, our files and this tool; upstream is fetched at build."""
    project = _project()
    pin = build_pin(project, read_pin(project))
    stem = f"{pin.name}-{pin.fork_version}"
    with tempfile.TemporaryDirectory() as meta_dir:
        dist_info = prepare_metadata_for_build_wheel(meta_dir, config_settings)
        pkg_info = (Path(meta_dir) / dist_info / "METADATA").read_bytes()
    target = Path(sdist_directory).resolve() / f"{stem}.tar.gz"
    with tarfile.open(target, "w:gz", format=tarfile.PAX_FORMAT) as tar:
        for rel in sdist_files(project):
            info = tar.gettarinfo(str(project / rel), arcname=f"{stem}/{rel}")
            info.uid = info.gid = 0
            info.uname = info.gname = ""
            data = (project / rel).read_bytes()
            if Path(rel) == PIN_FILE:  # a build from the sdist, which has no git, keeps the label it was made with
                data = re.sub(rb"(?m)^local-version = .*$", f"local-version = {pin.local_version}".encode(), data)
                info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
        info = tarfile.TarInfo(f"{stem}/PKG-INFO")
        info.size = len(pkg_info)
        info.mode = 0o644
        tar.addfile(info, io.BytesIO(pkg_info))
    return target.name


def sdist_files(project: Path) -> list[str]:
    """The files of :data:`SDIST_CONTENTS`: those git knows (tracked or not ignored) in a checkout, else all."""
    if (project / ".git").exists():
        listed = subprocess.run(
            [
                "git",
                "-C",
                str(project),
                "ls-files",
                "--cached",
                "--others",
                "--exclude-standard",
                "-z",
                "--",
                *SDIST_CONTENTS,
            ],
            capture_output=True,
            check=True,
        ).stdout.decode()
        candidates = [f for f in listed.split("\0") if f]
    else:
        candidates = [
            path.relative_to(project).as_posix()
            for entry in SDIST_CONTENTS
            for path in ([project / entry] if (project / entry).is_file() else sorted((project / entry).rglob("*")))
        ]
    return sorted(
        rel
        for rel in candidates
        if (project / rel).is_file() and not _SKIP_PARTS & set(rel.split("/")) and not rel.endswith((".pyc", ".pyo"))
    )
