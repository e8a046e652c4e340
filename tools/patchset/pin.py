"""The upstream pin: which release the patch set applies to, and fetching its sdist by hash."""

from __future__ import annotations

import hashlib
import importlib.util
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
from dataclasses import dataclass
from pathlib import Path

from patchset import PatchsetError

PIN_FILE = Path("patches") / "upstream.pin"
SDIST_ENV = "LIGHTNING_PATCHSET_SDIST"
CACHE_ENV = "LIGHTNING_PATCHSET_CACHE"
_KEYS = ("name", "version", "sdist", "sha256", "local-version")


@dataclass(frozen=True)
class Pin:
    """The pinned upstream release and the fork's PEP 440 local version label."""

    name: str
    version: str
    sdist: str
    sha256: str
    local_version: str

    @property
    def fork_version(self) -> str:
        """The version the fork's distributions carry, e.g. ``2.6.6+patchset.1``."""
        return f"{self.version}+{self.local_version}"


def read_pin(project: Path) -> Pin:
    """Parse ``patches/upstream.pin`` (``key = value`` lines, ``#`` comments)."""
    path = project / PIN_FILE
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError as err:
        raise PatchsetError(f"{path}: the upstream pin file is missing") from err
    values: dict[str, str] = {}
    for lineno, raw in enumerate(text.splitlines(), 1):
        line = raw.split("#", 1)[0].strip()
        if not line:
            continue
        key, sep, value = (part.strip() for part in line.partition("="))
        if not sep or key not in _KEYS or not value:
            raise PatchsetError(f"{path}:{lineno}: expected `key = value` with key one of {', '.join(_KEYS)}")
        values[key] = value
    missing = [key for key in _KEYS if key not in values]
    if missing:
        raise PatchsetError(f"{path}: missing {', '.join(missing)}")
    sha = values["sha256"].lower()
    if len(sha) != 64 or any(c not in "0123456789abcdef" for c in sha):
        raise PatchsetError(f"{path}: sha256 must be 64 hex digits, got {values['sha256']!r}")
    return Pin(values["name"], values["version"], values["sdist"], sha, values["local-version"])


def user_path(value: str) -> Path:
    """A path the user set in an environment variable, absolute.

    A relative one is taken from the directory the user ran the command in: the shell's ``$PWD``. pip runs the
    build hooks in the project directory (or in a temporary clone, for ``git+`` URLs), so the process's own working
    directory is not the user's.
    """
    path = Path(value).expanduser()
    if not path.is_absolute():
        shell = os.environ.get("PWD", "")
        path = (Path(shell) if os.path.isabs(shell) and os.path.isdir(shell) else Path.cwd()) / path
    return path.resolve()


def cache_dir() -> Path:
    """Where downloaded sdists and materialized trees are kept (``$LIGHTNING_PATCHSET_CACHE`` overrides)."""
    if os.environ.get(CACHE_ENV):
        return user_path(os.environ[CACHE_ENV])
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "lightning-patchset"


def file_sha256(path: Path) -> str:
    """The hex sha256 of a file's content."""
    digest = hashlib.sha256()
    with open(path, "rb") as fh:
        for chunk in iter(lambda: fh.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def _verified(path: Path, pin: Pin, origin: str) -> Path:
    actual = file_sha256(path)
    if actual != pin.sha256:
        raise PatchsetError(
            f"{origin}: sha256 {actual} does not match the pinned {pin.sha256} of {pin.sdist}"
            f" ({PIN_FILE}); nothing was built"
        )
    return path


def fetch_sdist(pin: Pin) -> Path:
    """Return a verified local copy of the pinned sdist.

    ``$LIGHTNING_PATCHSET_SDIST`` may name a local file (offline use, mirrors). Otherwise the cache is used, and on a
    miss the sdist is downloaded with ``pip download`` so the user's index configuration applies.
    """
    override = os.environ.get(SDIST_ENV)
    if override:
        path = user_path(override)
        if not path.is_file():
            shown = override if str(path) == override else f"{override} ({path})"
            raise PatchsetError(f"{SDIST_ENV}={shown}: no such file (expected {pin.sdist})")
        return _verified(path, pin, f"{SDIST_ENV}={override}")

    cached = cache_dir() / "sdist" / pin.sha256 / pin.sdist
    if cached.is_file():
        if file_sha256(cached) == pin.sha256:
            return cached
        cached.unlink()  # a damaged cache entry: fetch it again

    cached.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=cached.parent) as tmp:
        downloaded = pip_download(pin.name, pin.version, Path(tmp))
        if downloaded.name != pin.sdist:
            raise PatchsetError(f"pip downloaded {downloaded.name}, but the pin names {pin.sdist}")
        _verified(downloaded, pin, f"downloaded {pin.sdist}")
        os.replace(downloaded, cached)
    return cached


# What a build frontend sets for the hook it runs. Inside our hook, they would steer the inner ``pip download`` (which
# runs upstream's setuptools hooks to read the sdist's metadata) to *our* backend and backend-path: pyproject-hooks
# 1.0 (vendored by pip 23 and 24, e.g. the pip 23.2 a fresh venv bundles) and the ``pep517`` package use the
# ``PEP517_*`` names, 1.2 (pip 25 and later) ``_PYPROJECT_HOOKS_*``. pip's other variables stay: ``PATH`` and
# ``PYTHONPATH`` make the hook's build environment, and ``PIP_BUILD_TRACKER`` is shared on purpose so that pip notices
# a build that recursively needs itself.
_FRONTEND_VARIABLES = ("PEP517_BUILD_BACKEND", "PEP517_BACKEND_PATH")
_FRONTEND_PREFIXES = ("_PYPROJECT_HOOKS_",)


class ReleaseNotFoundError(PatchsetError):
    """The index has no sdist of the requested release."""


def hook_free_environ() -> dict[str, str]:
    """``os.environ`` without the variables a build frontend sets for the hook it runs (see above)."""
    return {
        key: value
        for key, value in os.environ.items()
        if key not in _FRONTEND_VARIABLES and not key.startswith(_FRONTEND_PREFIXES)
    }


def pip_download(name: str, version: str, dest: Path) -> Path:
    """Download the sdist of exactly ``name`` ``version`` into ``dest`` with pip (the user's index settings apply).

    Raises :class:`ReleaseNotFoundError` when the index has no such release.
    """
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:"]
    if all(importlib.util.find_spec(module) for module in ("setuptools", "wheel", "packaging")):
        # pip reads the sdist's metadata; with its build requirements at hand, skip an isolated environment
        cmd.append("--no-build-isolation")
    # `===`: exactly this version, so a local build of the fork (`2.6.6+patchset.1`, which `==2.6.6` matches) on a
    # find-links path is never taken for upstream's release
    cmd += ["--dest", str(dest), f"{name}==={version}"]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=hook_free_environ())
    found = sorted(dest.glob("*.tar.gz"))
    if proc.returncode == 0 and len(found) == 1:
        return found[0]
    lines = [line.strip() for line in (proc.stderr + proc.stdout).splitlines() if line.strip()]
    errors = [line for line in lines if line.lower().startswith("error:") and not line.endswith("Exception:")]
    # pip's own errors first; for a traceback, its last line names the exception
    reason = errors[0] if errors else (lines[-1] if lines else "no output")
    if len(reason) > 300:
        reason = reason[:300] + "..."
    missing = any("No matching distribution found" in line for line in lines)
    if missing:
        reason = f"your index has no sdist of {name} {version}"
    message = (
        f"could not download the {name} {version} sdist with pip ({reason}); set {SDIST_ENV} to a local copy"
        " for offline use"
    )
    raise ReleaseNotFoundError(message) if missing else PatchsetError(message)


def cache_sdist(path: Path, sha256: str) -> Path:
    """Put a verified sdist into the cache (where :func:`fetch_sdist` looks) and return the cached path."""
    cached = cache_dir() / "sdist" / sha256 / path.name
    if not cached.is_file():
        cached.parent.mkdir(parents=True, exist_ok=True)
        tmp = cached.with_name(cached.name + ".part")
        shutil.copyfile(path, tmp)
        os.replace(tmp, cached)
    return cached


def write_pin(project: Path, pin: Pin) -> None:
    """Rewrite the pin file's values in place, keeping its comments."""
    path = project / PIN_FILE
    values = {"name": pin.name, "version": pin.version, "sdist": pin.sdist, "sha256": pin.sha256}
    values["local-version"] = pin.local_version
    lines = []
    for raw in path.read_text(encoding="utf-8").splitlines():
        key = raw.split("#", 1)[0].partition("=")[0].strip()
        lines.append(f"{key} = {values.pop(key)}" if key in values else raw)
    lines += [f"{key} = {value}" for key, value in values.items()]
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")


def extract_sdist(sdist: Path, dest: Path) -> None:
    """Unpack ``sdist`` so that its single top-level folder's contents land directly in ``dest``."""
    with tempfile.TemporaryDirectory(dir=dest.parent) as tmp:
        with tarfile.open(sdist) as tar:
            # the "data" filter (3.10.12+) refuses links and paths that leave the folder
            if hasattr(tarfile, "data_filter"):
                tar.extractall(tmp, filter="data")
            else:  # pragma: no cover - older interpreters; the archive's hash was verified against the pin
                tar.extractall(tmp)
        roots = list(Path(tmp).iterdir())
        if len(roots) != 1 or not roots[0].is_dir():
            raise PatchsetError(f"{sdist}: expected one top-level folder in the sdist, found {len(roots)} entries")
        shutil.move(str(roots[0]), str(dest))
