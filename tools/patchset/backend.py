"""In-tree PEP 517 / PEP 660 build backend: builds the fork by delegating to upstream's own setuptools build.

It never imports torch or lightning. Each hook makes the fork's tree in a temporary folder (:mod:`patchset.materialize`)
and runs setuptools' backend there. setuptools makes the wheels reproducible: the hooks set ``SOURCE_DATE_EPOCH``
(1980-01-01, the earliest a zip holds) where the user has not, so two builds of one commit give the same bytes.
"""

from __future__ import annotations

import functools
import gzip
import io
import os
import re
import sys
import tarfile
import tempfile
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any, TypeVar

from patchset import PatchsetError, flavours
from patchset.build_label import build_pin
from patchset.gitops import git
from patchset.materialize import build_tree
from patchset.overlay import SKIPPED
from patchset.pin import PIN_FILE, read_pin

_T = TypeVar("_T")
ConfigSettings = dict[str, Any] | None
EPOCH_ENV, ZIP_EPOCH = "SOURCE_DATE_EPOCH", "315532800"
EDITABLE_TREE = Path(".work") / "editable"
# what the patch set's own sdist holds: everything else (caches, build output, editor files) stays out
SDIST_CONTENTS: tuple[str, ...] = (
    "pyproject.toml",
    "README.md",
    "LICENSE",
    "CHANGELOG.md",
    "patches",
    "tools",
    "src",
    "tests",
    "docs",
)
SDIST_CONTENTS += ("demo", "benchmarks")


def _reports_errors(fn: Callable[..., _T]) -> Callable[..., _T]:
    """Turn a :class:`PatchsetError` into one ``patchset: error:`` line and a failed hook, not a traceback."""

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> _T:
        epoch = os.environ.setdefault(EPOCH_ENV, ZIP_EPOCH).strip()
        try:
            if not epoch.isdigit() or int(epoch) < int(ZIP_EPOCH):
                raise PatchsetError(f"{EPOCH_ENV}={epoch!r}: expected seconds since 1970, from 1980 on, as an integer")
            return fn(*args, **kwargs)
        except PatchsetError as err:
            print(f"patchset: error: {err}", file=sys.stderr, flush=True)
            raise SystemExit(1) from None

    return wrapper


@contextmanager
def _inside(tree: Path) -> Iterator[None]:
    cwd = os.getcwd()
    os.chdir(tree)
    try:
        yield
    finally:
        os.chdir(cwd)


@contextmanager
def _fork_tree() -> Iterator[None]:
    flavour = flavours.requested()
    with tempfile.TemporaryDirectory(prefix="lightning-patchset-") as tmp:
        tree = build_tree(Path.cwd(), Path(tmp) / "tree")
        flavours.add_data_extra(tree)
        if flavour is not None:
            flavours.prepare(tree, flavour, flavours.fork_url(Path.cwd()))
        with _inside(tree):
            yield


def _setuptools() -> Any:
    """Setuptools' own backend, imported by the hooks that delegate to it; the sdist hook runs without it."""
    import setuptools.build_meta  # type: ignore[import-untyped,unused-ignore]

    return setuptools.build_meta


def get_requires_for_build_wheel(config_settings: ConfigSettings = None) -> list[str]:
    return []  # build-system.requires already lists what upstream's setup.py needs


get_requires_for_build_editable = get_requires_for_build_sdist = get_requires_for_build_wheel


@_reports_errors
def prepare_metadata_for_build_wheel(metadata_directory: str, config_settings: ConfigSettings = None) -> str:
    with _fork_tree():
        return str(_setuptools().prepare_metadata_for_build_wheel(os.path.abspath(metadata_directory), config_settings))


@_reports_errors
def build_wheel(
    wheel_directory: str, config_settings: ConfigSettings = None, metadata_directory: str | None = None
) -> str:
    with _fork_tree():
        return str(_setuptools().build_wheel(os.path.abspath(wheel_directory), config_settings))


def _lightning_only() -> None:
    if flavours.requested() is not None:
        raise PatchsetError(
            f"{flavours.PACKAGE_NAME_ENV}={os.environ[flavours.PACKAGE_NAME_ENV]}: editable installs build the"
            f" lightning distribution only; install {flavours.requested().distribution} without -e"  # type: ignore[union-attr]
        )


@_reports_errors
def prepare_metadata_for_build_editable(metadata_directory: str, config_settings: ConfigSettings = None) -> str:
    _lightning_only()
    return prepare_metadata_for_build_wheel(metadata_directory, config_settings)


@_reports_errors
def build_editable(
    wheel_directory: str, config_settings: ConfigSettings = None, metadata_directory: str | None = None
) -> str:
    """PEP 660: the installed fork points at ``.work/editable``, whose new files are links to this checkout's."""
    _lightning_only()
    target = os.path.abspath(wheel_directory)
    tree = build_tree(Path.cwd(), Path.cwd() / EDITABLE_TREE, link=True)
    flavours.add_data_extra(tree)
    with _inside(tree):
        return str(_setuptools().build_editable(target, config_settings))


@_reports_errors
def build_sdist(sdist_directory: str, config_settings: ConfigSettings = None) -> str:
    """The patch set's own sdist: pin, patches, new files and this tool; upstream's is fetched when it is built."""
    project = Path.cwd()
    pin = build_pin(project, read_pin(project))
    stem = f"{pin.name}-{pin.fork_version}"
    with tempfile.TemporaryDirectory() as meta_dir:
        pkg_info = (
            Path(meta_dir) / prepare_metadata_for_build_wheel(meta_dir, config_settings) / "METADATA"
        ).read_bytes()
    target, epoch = Path(sdist_directory).resolve() / f"{stem}.tar.gz", int(os.environ[EPOCH_ENV])
    files = [(rel, (project / rel).read_bytes(), os.access(project / rel, os.X_OK)) for rel in sdist_files(project)]
    with (  # reproducible, as the wheels are: one time, normalized modes and owners, sorted names
        open(target, "wb") as raw,
        gzip.GzipFile(fileobj=raw, mode="wb", mtime=epoch) as packed,
        tarfile.open(fileobj=packed, mode="w", format=tarfile.PAX_FORMAT) as tar,
    ):
        for rel, data, executable in [*files, ("PKG-INFO", pkg_info, False)]:
            if Path(rel) == PIN_FILE:  # a build from the sdist, which has no git, keeps the label it was made with
                data = re.sub(rb"(?m)^local-version = .*$", f"local-version = {pin.local_version}".encode(), data)
            info = tarfile.TarInfo(f"{stem}/{rel}")
            info.size, info.mtime, info.mode = len(data), epoch, 0o755 if executable else 0o644
            tar.addfile(info, io.BytesIO(data))
    return target.name


def sdist_files(project: Path) -> list[str]:
    """The files of :data:`SDIST_CONTENTS`: those git knows (tracked or not ignored) in a checkout, else all."""
    if (project / ".git").exists():
        args = ("ls-files", "--cached", "--others", "--exclude-standard", "-z", "--", *SDIST_CONTENTS)
        candidates = git(project, *args, isolated=False).stdout.decode().split("\0")
    else:
        found = (
            p for e in SDIST_CONTENTS for p in ([project / e] if (project / e).is_file() else (project / e).rglob("*"))
        )
        candidates = [path.relative_to(project).as_posix() for path in found]
    return sorted(
        rel
        for rel in candidates
        if rel
        and (project / rel).is_file()
        and not SKIPPED & set(rel.split("/"))
        and not rel.endswith((".pyc", ".pyo"))
    )
