"""In-tree PEP 517 / PEP 660 build backend: builds the fork by delegating to upstream's own setuptools build.

It never imports torch or lightning. Each hook makes the fork's tree in a temporary folder (:mod:`patchset.materialize`)
and runs setuptools' backend there. Run in the project, it builds ``lightning`` (or the flavour ``PACKAGE_NAME``
asks for); run in ``distributions/<name>/`` (a git URL's ``#subdirectory=``), it builds the project two folders up as
the distribution that folder's ``pyproject.toml`` declares (:func:`patchset.flavours.declared`).

setuptools makes the wheels reproducible: the hooks set ``SOURCE_DATE_EPOCH``
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
from dataclasses import dataclass
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
DISTRIBUTIONS_DIR = "distributions"  # a folder per flavour, each building the project two folders up
# where pip (23.2 to 26.3, checked; older pips the second) tracks the requirement whose metadata it prepares: a folder
# with one file, which holds the requirement as pip prints it (`pytorch-lightning@ git+https://... from git+https://...`)
_PIP_TRACKERS = ("PIP_BUILD_TRACKER", "PIP_REQ_TRACKER")
_DIRECT_REQUIREMENT = re.compile(r"\s*([A-Za-z0-9][A-Za-z0-9._-]*)\s*(?:\[[^\]]*\])?\s*@\s*(\S+)")


@dataclass(frozen=True)
class _Source:
    """What a hook builds: the project (where patches/upstream.pin is), the flavour, and what chose it."""

    project: Path
    flavour: flavours.Flavour | None
    chosen_by: str  # `PACKAGE_NAME=fabric` or `distributions/lightning-fabric`, for messages


def _source() -> _Source:
    """The project and flavour of a hook run in the current folder: the project, or a folder of ``distributions/``."""
    here = Path.cwd()
    project = here if (here / PIN_FILE).is_file() or len(here.parents) < 2 else here.parents[1]
    if not (project / PIN_FILE).is_file():
        raise PatchsetError(f"{here}: no {PIN_FILE.as_posix()} here or two folders up: not a folder of the patch set")
    folder = here.relative_to(project).as_posix() if project != here else "pyproject.toml"
    flavour = flavours.chosen(here, folder)
    if flavours.declared(here) is None:
        folder = f"{flavours.PACKAGE_NAME_ENV}={os.environ.get(flavours.PACKAGE_NAME_ENV, '').strip()}"
    return _Source(project, flavour, folder)


def _requested_of_pip() -> tuple[str, str] | None:
    """The name and URL of the direct requirement whose metadata pip prepares now, from pip's build tracker.

    ``None`` when it cannot tell: another frontend, no tracker, several requirements tracked (a nested build), or a
    requirement without a name (a path).
    """
    root = next((os.environ[name] for name in _PIP_TRACKERS if os.environ.get(name)), None)
    try:
        entries = [path for path in Path(root).iterdir() if path.is_file()] if root else []
        text = entries[0].read_text(encoding="utf-8") if len(entries) == 1 else ""
    except (OSError, UnicodeDecodeError):
        return None
    match = _DIRECT_REQUIREMENT.match(text)
    return (match[1], match[2]) if match else None


def _refuse_another_name(source: _Source) -> None:
    """Fail in one line where pip would fail in many: a ``lightning`` build of a URL asked for as another flavour."""
    requested = _requested_of_pip()
    if source.flavour is not None or requested is None:
        return
    name = re.sub(r"[-_.]+", "-", requested[0]).lower()
    if name in {flavour.distribution for flavour in flavours.FLAVOURS.values()}:
        raise PatchsetError(
            f"{requested[0]} @ {requested[1]}: this URL builds lightning; add #subdirectory={DISTRIBUTIONS_DIR}/{name}"
        )


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
def _package_name(flavour: flavours.Flavour | None) -> Iterator[None]:
    """``PACKAGE_NAME`` as upstream's ``setup.py`` needs it to build ``flavour``, as it was afterwards."""
    saved = os.environ.get(flavours.PACKAGE_NAME_ENV)
    if flavour is not None:
        os.environ[flavours.PACKAGE_NAME_ENV] = flavours.package_name(flavour)
    try:
        yield
    finally:
        if saved is None:
            os.environ.pop(flavours.PACKAGE_NAME_ENV, None)
        else:
            os.environ[flavours.PACKAGE_NAME_ENV] = saved


@contextmanager
def _fork_tree() -> Iterator[None]:
    source = _source()
    _refuse_another_name(source)
    with tempfile.TemporaryDirectory(prefix="lightning-patchset-") as tmp:
        tree = build_tree(source.project, Path(tmp) / "tree")
        flavours.add_data_extra(tree)
        if source.flavour is not None:
            flavours.prepare(tree, source.flavour, flavours.fork_url(source.project))
        with _inside(tree), _package_name(source.flavour):
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


def _lightning_only() -> Path:
    """The project of an editable install, which builds ``lightning`` only."""
    source = _source()
    if source.flavour is not None:
        raise PatchsetError(
            f"{source.chosen_by}: editable installs build the lightning distribution only; install"
            f" {source.flavour.distribution} without -e"
        )
    return source.project


@_reports_errors
def prepare_metadata_for_build_editable(metadata_directory: str, config_settings: ConfigSettings = None) -> str:
    _lightning_only()
    return prepare_metadata_for_build_wheel(metadata_directory, config_settings)


@_reports_errors
def build_editable(
    wheel_directory: str, config_settings: ConfigSettings = None, metadata_directory: str | None = None
) -> str:
    """PEP 660: the installed fork points at ``.work/editable``, whose new files are links to this checkout's."""
    project = _lightning_only()
    target = os.path.abspath(wheel_directory)
    tree = build_tree(project, project / EDITABLE_TREE, link=True)
    flavours.add_data_extra(tree)
    with _inside(tree):
        return str(_setuptools().build_editable(target, config_settings))


@_reports_errors
def build_sdist(sdist_directory: str, config_settings: ConfigSettings = None) -> str:
    """The patch set's own sdist: pin, patches, new files and this tool; upstream's is fetched when it is built.

    A flavour's sdist (from a folder of ``distributions/``, or with ``PACKAGE_NAME``) is the project's with the
    flavour declared in its ``pyproject.toml``: it builds that distribution, with no folder and no variable.
    """
    source = _source()
    project, pin = source.project, build_pin(source.project, read_pin(source.project))
    name = source.flavour.distribution if source.flavour else pin.name
    stem = f"{name.replace('-', '_')}-{pin.fork_version}"
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
            if rel == "pyproject.toml" and source.flavour and not flavours.declared(project):
                declaration = f'[tool.patchset]\ndistribution = "{source.flavour.distribution}"\n'.encode()
                data, found = re.subn(rb"(?m)^\[tool\.patchset\]\r?\n", declaration, data, count=1)
                if not found:
                    raise PatchsetError("pyproject.toml: no `[tool.patchset]` line to declare the distribution under")
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
