"""The upstream pin (``patches/upstream.pin``) and its sdist, fetched with pip, checked by hash and cached."""

from __future__ import annotations

import hashlib
import importlib.util
import os
import re
import shutil
import subprocess
import sys
import tarfile
import tempfile
from dataclasses import dataclass
from pathlib import Path

from patchset import PatchsetError
from patchset.frontend_index import NO_FRONTEND_INDEX, FrontendIndex, frontend_index, shell_cwd

PIN_FILE = Path("patches") / "upstream.pin"
SDIST_ENV = "LIGHTNING_PATCHSET_SDIST"
CACHE_ENV = "LIGHTNING_PATCHSET_CACHE"
_KEYS = ("name", "version", "sdist", "sha256", "local-version")
# What a build frontend sets for the hook it runs: inside our hook they would steer the inner `pip download` (which
# runs upstream's setuptools hooks) to our backend. pyproject-hooks 1.0 (pip 23 and 24) uses the PEP517_ names, 1.2
# (pip 25 on) the _PYPROJECT_HOOKS_ ones. PATH, PYTHONPATH and PIP_BUILD_TRACKER stay: they make the build environment.
_FRONTEND = ("PEP517_BUILD_BACKEND", "PEP517_BACKEND_PATH", "_PYPROJECT_HOOKS_")


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


class ReleaseNotFoundError(PatchsetError):
    """The index has no sdist of the requested release."""


class NotInFindLinksError(ReleaseNotFoundError):
    """pip may use no index (``--no-index``), and its ``--find-links`` locations have no sdist of the release."""


class IndexUnreachableError(PatchsetError):
    """pip could not reach the package index (no connection, a proxy or TLS failure)."""


def read_pin(project: Path) -> Pin:
    """Parse ``patches/upstream.pin`` (``key = value`` lines, ``#`` comments)."""
    path = project / PIN_FILE
    if not path.is_file():
        raise PatchsetError(f"{path}: the upstream pin file is missing")
    values: dict[str, str] = {}
    for lineno, raw in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
        key, sep, value = (part.strip() for part in raw.split("#", 1)[0].partition("="))
        if (key or sep) and (not sep or key not in _KEYS or not value):
            raise PatchsetError(f"{path}:{lineno}: expected `key = value` with key one of {', '.join(_KEYS)}")
        if key:
            values[key] = value
    missing = [key for key in _KEYS if key not in values]
    if missing:
        raise PatchsetError(f"{path}: missing {', '.join(missing)}: add a `key = value` line for each")
    if values["sdist"] != f"{values['name']}-{values['version']}.tar.gz":
        raise PatchsetError(f"{path}: sdist {values['sdist']} is not {values['name']} {values['version']}'s sdist")
    sha = values["sha256"].lower()
    if len(sha) != 64 or any(c not in "0123456789abcdef" for c in sha):
        raise PatchsetError(f"{path}: sha256 must be 64 hex digits, got {values['sha256']!r}")
    return Pin(values["name"], values["version"], values["sdist"], sha, values["local-version"])


def write_pin(project: Path, pin: Pin) -> None:
    """Rewrite the pin file's values in place, keeping its comments."""
    path = project / PIN_FILE
    values = dict(zip(_KEYS, (pin.name, pin.version, pin.sdist, pin.sha256, pin.local_version), strict=True))
    lines = []
    for raw in path.read_text(encoding="utf-8").splitlines():
        key = raw.split("#", 1)[0].partition("=")[0].strip()
        lines.append(f"{key} = {values.pop(key)}" if key in values else raw)
    path.write_text("\n".join([*lines, *(f"{k} = {v}" for k, v in values.items())]) + "\n", encoding="utf-8")


def user_path(value: str) -> Path:
    """A path from an environment variable; a relative one from the shell's ``$PWD`` (pip runs hooks elsewhere)."""
    path = Path(value).expanduser()
    return (path if path.is_absolute() else shell_cwd() / path).resolve()


def cache_dir() -> Path:
    """Where downloaded sdists are kept (``$LIGHTNING_PATCHSET_CACHE`` overrides)."""
    if os.environ.get(CACHE_ENV):
        return user_path(os.environ[CACHE_ENV])
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "lightning-patchset"


def file_sha256(path: Path) -> str:
    """The hex sha256 of a file's content."""
    digest = hashlib.sha256()
    with open(path, "rb") as fh:
        for chunk in iter(lambda: fh.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def fetch_sdist(pin: Pin) -> Path:
    """A verified local copy of the pinned sdist: ``$LIGHTNING_PATCHSET_SDIST``, the cache, or ``pip download``."""
    override = os.environ.get(SDIST_ENV)
    if override:
        path = user_path(override)
        if not path.is_file():
            shown = override if str(path) == override else f"{override} ({path})"
            raise PatchsetError(f"{SDIST_ENV}={shown}: no such file (expected {pin.sdist})")
        origin = f"{SDIST_ENV}={override}"
    else:
        path, origin = cache_dir() / "sdist" / pin.sha256 / pin.sdist, f"downloaded {pin.sdist}"
        if path.is_file() and file_sha256(path) == pin.sha256:
            return path
        path.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(dir=path.parent) as tmp:
            try:
                downloaded = pip_download(pin.name, pin.version, Path(tmp), pin.sha256)
            except (IndexUnreachableError, NotInFindLinksError) as err:
                raise type(err)(
                    f"{err}; set {SDIST_ENV}=<path to {pin.sdist}> (sha256 {pin.sha256}) or copy that file to {path}"
                ) from None
            if downloaded.name != pin.sdist:
                raise PatchsetError(f"pip downloaded {downloaded.name}, but the pin names {pin.sdist}")
            os.replace(downloaded, path)
    actual = file_sha256(path)
    if actual != pin.sha256:
        if not override:  # never kept under a hash it does not have
            path.unlink()
        hint = "" if override else f"; your index or --find-links has another file of that name: set {SDIST_ENV}"
        raise PatchsetError(
            f"{origin}: sha256 {actual} does not match the pinned {pin.sha256} of {pin.sdist} ({PIN_FILE}){hint}"
        )
    return path


def pip_download(name: str, version: str, dest: Path, sha256: str = "") -> Path:
    """The sdist of exactly ``name`` ``version`` (with ``sha256``, if given), downloaded into ``dest`` by pip.

    pip uses the user's index settings: its environment and configuration, and the frontend's
    (:mod:`patchset.frontend_index`). Should the frontend's make the download fail (an index that needs a login the
    inner pip lacks, a mirror without the file), it is tried once more with pip's own settings alone, as before they
    were read; an explicit ``--no-index`` is kept.
    """
    index = frontend_index()
    attempts = [index] if not (index.options or index.environment) or index.no_index else [index, NO_FRONTEND_INDEX]
    for attempt in attempts:
        proc, log = _pip_download(name, version, dest, sha256, attempt)
        found = sorted(dest.glob("*.tar.gz"))
        if proc.returncode == 0 and len(found) == 1:
            return found[0]
    lines = [line.strip() for line in (proc.stderr + proc.stdout).splitlines() if line.strip()]
    got = re.search(r"^Got\s+([0-9a-f]{64})$", "\n".join(lines), re.MULTILINE)  # pip's hash check refused it
    if got:
        raise PatchsetError(
            f"downloaded {name}-{version}.tar.gz: sha256 {got[1]} does not match the pinned {sha256} of"
            f" {name}-{version}.tar.gz ({PIN_FILE}); your index or --find-links has another file of that name: set"
            f" {SDIST_ENV}"
        )
    errors = [line for line in lines if line.lower().startswith("error:") and not line.endswith("Exception:")]
    reason = (errors[0] if errors else lines[-1] if lines else "no output")[:300]  # a traceback's last line names it
    failed = f"could not download the {name} {version} sdist with pip"
    if not any("No matching distribution found" in line for line in lines):
        raise PatchsetError(f"{failed} ({reason}); set {SDIST_ENV} to a local copy for offline use")
    debug = log.read_text(encoding="utf-8", errors="replace") if log.is_file() else ""
    unreachable = unreachable_index(debug)
    if unreachable:
        raise IndexUnreachableError(f"{failed}: it could not reach the package index ({unreachable})")
    if "Ignoring indexes:" in debug:
        raise NotInFindLinksError(f"{failed}: it may use no index (--no-index), and no --find-links location has it")
    raise ReleaseNotFoundError(
        f"{failed} (your index has no sdist of {name} {version}); set {SDIST_ENV} to a local copy for offline use"
    )


def _pip_download(
    name: str, version: str, dest: Path, sha256: str, index: FrontendIndex
) -> tuple[subprocess.CompletedProcess[str], Path]:
    """One ``pip download`` of the sdist with ``index``'s settings; the process and its debug log."""
    log = dest / "pip-download.log"  # pip's debug log: why it found nothing (not shown without -vv)
    log.unlink(missing_ok=True)
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:", "--dest", str(dest)]
    if all(importlib.util.find_spec(module) for module in ("setuptools", "wheel", "packaging")):
        cmd.append("--no-build-isolation")  # pip reads the sdist's metadata: its build requirements are at hand
    # `===`: exactly this version, never a build of the fork (2.6.6+patchset.1, which `==2.6.6` matches); the hash
    # makes pip pass over another index's file of that name; no prompt for a login (a build has no one to answer)
    requirement = f"{name}==={version}" + (f" --hash=sha256:{sha256}" if sha256 else "")
    (requirements := dest / "requirement.txt").write_text(requirement + "\n", encoding="utf-8")
    cmd += ["--no-input", "--log", str(log), *index.options, "-r", str(requirements)]
    environ = {k: v for k, v in os.environ.items() if not k.startswith(_FRONTEND)} | index.environment
    return subprocess.run(cmd, capture_output=True, text=True, env=environ, stdin=subprocess.DEVNULL), log


_NO_CONNECTION = ("connection error", "timed out", "Max retries exceeded", "ssl certificate", "ProxyError")


def unreachable_index(pip_log: str) -> str:
    """Why pip's debug log says it could not use an index (an untrusted http host, no connection); else ""."""
    untrusted = re.search(r"The repository located at (\S+) is not a trusted or secure host", pip_log)
    if untrusted:
        host = untrusted.group(1)
        return f"pip ignores {host}: plain http from a host not trusted, see pip's --trusted-host {host}"
    for url, why in re.findall(r"Could not fetch URL (\S+): (.*?)(?: - skipping)?$", pip_log, re.MULTILINE):
        if any(sign in why for sign in _NO_CONNECTION):
            cause = re.search(r"\[(?:Errno [^\]]*|SSL: [^\]]*)\][^'\"()]*|timed out", why)
            return f"{url.rstrip(':')}: {(cause.group(0) if cause else why[:150]).strip()}"
    return ""


def cache_sdist(path: Path, sha256: str) -> Path:
    """Put a verified sdist into the cache, where :func:`fetch_sdist` looks, and return the cached path."""
    cached = cache_dir() / "sdist" / sha256 / path.name
    if not cached.is_file():
        cached.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(path, cached.with_name(cached.name + ".part"))
        os.replace(cached.with_name(cached.name + ".part"), cached)
    return cached


def sdist_files(sdist: Path) -> frozenset[str]:
    """The files an sdist ships, relative to its top folder."""
    with tarfile.open(sdist) as tar:
        return frozenset(m.name.split("/", 1)[1] for m in tar.getmembers() if m.isfile() and "/" in m.name)


def extract_sdist(sdist: Path, dest: Path) -> None:
    """Unpack ``sdist`` so that its single top-level folder's contents land directly in ``dest``."""
    with tempfile.TemporaryDirectory(dir=dest.parent) as tmp, tarfile.open(sdist) as tar:
        if hasattr(tarfile, "data_filter"):  # refuses links and paths that leave the folder, and the archive's owners
            tar.extractall(tmp, filter="data")
        else:  # Python before 3.10.12 and 3.11.4 (the hash was checked): as root it would keep the archive's owners,
            members = tar.getmembers()  # and git refuses a repository someone else owns
            for member in members:
                member.uid, member.gid, member.uname, member.gname = os.getuid(), os.getgid(), "", ""
            tar.extractall(tmp, members=members)
        roots = list(Path(tmp).iterdir())
        if len(roots) != 1 or not roots[0].is_dir():
            raise PatchsetError(f"{sdist}: expected one top-level folder in the sdist, found {len(roots)} entries")
        shutil.move(str(roots[0]), str(dest))
