import functools
import http.server
import os
import re
import shutil
import socket
import subprocess
import sys
import tarfile
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest
from patchset_helpers import REPO, TOOLS, pip, write

from patchset import PatchsetError
from patchset import frontend_index as frontend_index_module
from patchset.frontend_index import command_line_options
from patchset.pin import (
    SDIST_ENV,
    IndexUnreachableError,
    NotInFindLinksError,
    ReleaseNotFoundError,
    cache_dir,
    extract_sdist,
    fetch_sdist,
    file_sha256,
    read_pin,
)


def test_pin_names_the_fork_version(project: Path):
    pin = read_pin(project)
    assert (pin.name, pin.version, pin.sdist) == ("lightning", "2.6.6", "lightning-2.6.6.tar.gz")
    assert pin.fork_version == f"2.6.6+{pin.local_version}"
    assert re.fullmatch(r"patchset\.[1-9][0-9]*", pin.local_version)


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("name = lightning\n", "missing version, sdist, sha256, local-version"),
        ("name lightning\n", "expected `key = value`"),
        ("colour = blue\n", "expected `key = value`"),
        (
            "name = a\nversion = 1\nsdist = a-1.tar.gz\nsha256 = abc\nlocal-version = x.1\n",
            "sha256 must be 64 hex digits, got 'abc'",
        ),
        (
            f"name = lightning\nversion = 2.6.66\nsdist = lightning-2.6.6.tar.gz\nsha256 = {'a' * 64}\n"
            "local-version = x.1\n",
            "sdist lightning-2.6.6.tar.gz is not lightning 2.6.66's sdist",
        ),
    ],
)
def test_bad_pin_is_a_clear_error(project: Path, text: str, message: str):
    write(project / "patches" / "upstream.pin", text)
    with pytest.raises(PatchsetError, match=r"upstream\.pin") as err:
        read_pin(project)
    assert message in str(err.value)


def test_missing_pin(tmp_path: Path):
    with pytest.raises(PatchsetError, match=r"the upstream pin file is missing"):
        read_pin(tmp_path)


def test_local_sdist_override_is_verified(project: Path, upstream_sdist: Path, monkeypatch, tmp_path: Path):
    copy = tmp_path / "mirror" / upstream_sdist.name
    copy.parent.mkdir()
    shutil.copy(upstream_sdist, copy)
    monkeypatch.setenv(SDIST_ENV, str(copy))
    assert fetch_sdist(read_pin(project)) == copy


def test_hash_mismatch_names_the_file_and_both_hashes(project: Path, monkeypatch, tmp_path: Path):
    fake = tmp_path / "lightning-2.6.6.tar.gz"
    src = write(tmp_path / "lightning-2.6.6" / "setup.py", "raise SystemExit('must never run')\n")
    with tarfile.open(fake, "w:gz") as tar:
        tar.add(src.parent, arcname="lightning-2.6.6")
    monkeypatch.setenv(SDIST_ENV, str(fake))
    with pytest.raises(PatchsetError) as err:
        fetch_sdist(read_pin(project))
    message = str(err.value)
    assert str(fake) in message
    assert file_sha256(fake) in message
    assert read_pin(project).sha256 in message
    assert fake.is_file()  # the user's file stays where it is


def _cold_cache_and_local_index(monkeypatch: pytest.MonkeyPatch, tmp_path: Path, upstream_sdist: Path) -> Path:
    """An empty cache, and pip's source seeded with the verified sdist (a local find-links index): no network."""
    monkeypatch.setenv("LIGHTNING_PATCHSET_CACHE", str(tmp_path / "cache"))
    monkeypatch.delenv(SDIST_ENV, raising=False)
    links = tmp_path / "links"
    links.mkdir()
    shutil.copy(upstream_sdist, links / upstream_sdist.name)
    monkeypatch.setenv("PIP_FIND_LINKS", str(links))
    monkeypatch.setenv("PIP_NO_INDEX", "1")
    return links


def test_a_download_with_another_hash_is_not_kept(project: Path, monkeypatch, tmp_path: Path, upstream_sdist: Path):
    pin = project / "patches" / "upstream.pin"
    pin.write_text(pin.read_text().replace(read_pin(project).sha256, "b" * 64))
    _cold_cache_and_local_index(monkeypatch, tmp_path, upstream_sdist)
    with pytest.raises(PatchsetError, match=f"does not match the pinned {'b' * 64}") as err:
        fetch_sdist(read_pin(project))
    assert str(err.value).endswith(f"; your index or --find-links has another file of that name: set {SDIST_ENV}")
    assert not list((tmp_path / "cache").rglob("*.tar.gz"))


def test_missing_override_file(project: Path, monkeypatch, tmp_path: Path):
    monkeypatch.setenv(SDIST_ENV, str(tmp_path / "nope.tar.gz"))
    with pytest.raises(PatchsetError, match="no such file"):
        fetch_sdist(read_pin(project))


def test_download_goes_through_pip_and_the_cache(project: Path, monkeypatch, tmp_path: Path, upstream_sdist: Path):
    """A cold cache downloads with pip (the user's index settings apply); a warm one does not."""
    links = _cold_cache_and_local_index(monkeypatch, tmp_path, upstream_sdist)
    first = fetch_sdist(read_pin(project))
    assert first == tmp_path / "cache" / "sdist" / read_pin(project).sha256 / "lightning-2.6.6.tar.gz"
    assert file_sha256(first) == read_pin(project).sha256
    (links / upstream_sdist.name).unlink()  # a second fetch must not need pip's source any more
    assert fetch_sdist(read_pin(project)) == first


def test_download_failure_says_how_to_work_offline(project: Path, monkeypatch, tmp_path: Path):
    """--no-index and no copy in --find-links: one line naming what to set, and where to copy the sdist."""
    monkeypatch.setenv("LIGHTNING_PATCHSET_CACHE", str(tmp_path / "cache"))
    monkeypatch.delenv(SDIST_ENV, raising=False)
    monkeypatch.setenv("PIP_NO_INDEX", "1")
    monkeypatch.setenv("PIP_FIND_LINKS", str(tmp_path))
    with pytest.raises(NotInFindLinksError) as err:
        fetch_sdist(read_pin(project))
    assert isinstance(err.value, ReleaseNotFoundError)  # `rebase` reports a release missing there as before
    assert str(err.value) == (
        "could not download the lightning 2.6.6 sdist with pip: it may use no index (--no-index), and no --find-links"
        f" location has it; {_what_to_do(project)}"
    )
    assert not list((tmp_path / "cache").rglob("*.tar.gz"))


def test_the_tests_never_use_the_users_cache(patchset_cache: Path, tmp_path_factory):
    """Fake sdists and trees the tests make land in a cache of the session's own, which starts with the real sdist."""
    assert cache_dir() == patchset_cache.resolve()
    assert patchset_cache.resolve().is_relative_to(tmp_path_factory.getbasetemp().resolve())
    pin = read_pin(REPO)
    assert file_sha256(patchset_cache / "sdist" / pin.sha256 / pin.sdist) == pin.sha256


def test_relative_paths_are_the_shells_not_the_build_hooks(
    project: Path, monkeypatch, tmp_path: Path, upstream_sdist: Path
):
    """pip runs the hook in the project directory; a relative path the user typed is relative to the shell's."""
    shell = tmp_path / "shell"
    copy = shell / "mirror" / upstream_sdist.name
    copy.parent.mkdir(parents=True)
    shutil.copy(upstream_sdist, copy)
    monkeypatch.chdir(project)  # where pip runs the hook
    monkeypatch.setenv("PWD", str(shell))  # where the user typed the command
    monkeypatch.setenv(SDIST_ENV, f"mirror/{upstream_sdist.name}")
    monkeypatch.setenv("LIGHTNING_PATCHSET_CACHE", "cache")
    assert fetch_sdist(read_pin(project)) == copy
    assert cache_dir() == shell / "cache"
    monkeypatch.setenv(SDIST_ENV, "elsewhere/lightning-2.6.6.tar.gz")
    with pytest.raises(PatchsetError) as err:
        fetch_sdist(read_pin(project))
    assert str(err.value) == (
        f"{SDIST_ENV}=elsewhere/lightning-2.6.6.tar.gz ({shell}/elsewhere/lightning-2.6.6.tar.gz): no such file"
        " (expected lightning-2.6.6.tar.gz)"
    )


def test_python_before_3_10_gets_one_line_instead_of_a_traceback():
    """What pip shows a Python 3.9 user whose build imports the backend (simulated: this machine has 3.11 only)."""
    code = "import sys; sys.version_info = (3, 9, 18, 'final', 0); import patchset.backend"
    proc = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, env={**os.environ, "PYTHONPATH": str(TOOLS)}
    )
    assert proc.returncode == 1
    assert proc.stderr.strip().splitlines() == [
        f"lightning (the Lightning patch set's fork of Lightning 2.6) requires Python >= 3.10; this is Python"
        f" {sys.version.split()[0]}"
    ]


def test_an_interpreter_without_tars_data_filter_extracts_files_the_user_owns(upstream_sdist, tmp_path, monkeypatch):
    """Before Python 3.10.12 and 3.11.4, ``extractall`` as root gives files the archive's owners (uid 1001 here),
    and git then refuses the repository made of them ("dubious ownership")."""
    monkeypatch.delattr(tarfile, "data_filter")
    extract_sdist(upstream_sdist, tmp_path / "tree")
    owners = {path.stat().st_uid for path in [tmp_path / "tree", *(tmp_path / "tree").rglob("*")]}
    assert owners == {os.getuid()}
    subprocess.run(["git", "-C", str(tmp_path / "tree"), "init", "-q"], check=True)
    status = subprocess.run(["git", "-C", str(tmp_path / "tree"), "status"], capture_output=True, text=True)
    assert status.returncode == 0, status.stderr


def _what_to_do(project: Path) -> str:
    pin = read_pin(project)
    cached = cache_dir() / "sdist" / pin.sha256 / pin.sdist
    return f"set {SDIST_ENV}=<path to {pin.sdist}> (sha256 {pin.sha256}) or copy that file to {cached}"


def _fake_release(project: Path, folder: Path, version: str = "2.6.6") -> Path:
    """A small sdist of ``lightning`` ``version`` that pip can read, in ``folder``; 2.6.6 is pinned in ``project``."""
    top = folder / f"lightning-{version}"
    write(top / "setup.py", f"from setuptools import setup\n\nsetup(name='lightning', version='{version}')\n")
    write(top / "PKG-INFO", f"Metadata-Version: 2.1\nName: lightning\nVersion: {version}\n")
    sdist = folder / f"lightning-{version}.tar.gz"
    with tarfile.open(sdist, "w:gz") as tar:
        tar.add(top, arcname=top.name)
    shutil.rmtree(top)
    if version == "2.6.6":
        pin = project / "patches" / "upstream.pin"
        pin.write_text(pin.read_text().replace(read_pin(project).sha256, file_sha256(sdist)))
    return sdist


@pytest.fixture
def no_pip_settings(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Path:
    """No index settings from this machine (variables, pip's config files) and a cold cache of the test's own."""
    for name in list(os.environ):
        if name.startswith(("PIP_", "UV_")) and not name.startswith(("PIP_DISABLE", "PIP_CERT")):
            monkeypatch.delenv(name)
    monkeypatch.setenv("PIP_CONFIG_FILE", os.devnull)
    monkeypatch.setenv("PIP_RETRIES", "0")  # a refused connection fails at once
    monkeypatch.setenv("LIGHTNING_PATCHSET_CACHE", str(tmp_path / "cache"))
    monkeypatch.delenv(SDIST_ENV, raising=False)
    return tmp_path / "cache"


class _Index:
    """A PEP 503 simple index on localhost (``python -m http.server``'s handler) that records what pip asked it."""

    def __init__(self, root: Path) -> None:
        self.root, self.requests = root, []
        root.mkdir()
        index = self

        class Handler(http.server.SimpleHTTPRequestHandler):
            def log_message(self, format: str, *args: object) -> None:
                index.requests.append(self.path)

        handler = functools.partial(Handler, directory=str(root))
        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}/simple"

    def publish(self, sdist: Path) -> None:
        shutil.copy(sdist, self.root / sdist.name)
        page = self.root / "simple" / "lightning" / "index.html"
        links = page.read_text() if page.is_file() else ""
        write(page, links + f'<a href="../../{sdist.name}#sha256={file_sha256(sdist)}">{sdist.name}</a>\n')


@pytest.fixture
def local_index(tmp_path: Path) -> Iterator[_Index]:
    index = _Index(tmp_path / "index")
    thread = threading.Thread(target=index.server.serve_forever, daemon=True)
    thread.start()
    yield index
    index.server.shutdown()
    index.server.server_close()


def _closed_port_url() -> str:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return f"http://127.0.0.1:{sock.getsockname()[1]}/simple"


def test_offline_is_one_line_naming_the_override_and_the_cache(project: Path, no_pip_settings: Path):
    """No connection to the index: say so, not that the index lacks the release."""
    index = _closed_port_url()
    os.environ["PIP_INDEX_URL"] = index  # no_pip_settings's monkeypatch restores it
    with pytest.raises(IndexUnreachableError) as err:
        fetch_sdist(read_pin(project))
    assert not isinstance(err.value, ReleaseNotFoundError)
    assert str(err.value) == (
        "could not download the lightning 2.6.6 sdist with pip: it could not reach the package index"
        f" ({index}/lightning/: [Errno 111] Connection refused); {_what_to_do(project)}"
    )
    assert _what_to_do(project).endswith(f"{no_pip_settings}/sdist/{read_pin(project).sha256}/lightning-2.6.6.tar.gz")


def test_an_http_index_pip_does_not_trust_is_named(project: Path, no_pip_settings: Path, monkeypatch):
    monkeypatch.setenv("PIP_INDEX_URL", "http://mirror.invalid/simple")  # pip ignores it before connecting
    with pytest.raises(IndexUnreachableError, match=r"pip ignores mirror\.invalid: .* --trusted-host mirror\.invalid"):
        fetch_sdist(read_pin(project))


def test_a_release_missing_from_a_reachable_index(project: Path, no_pip_settings: Path, local_index, monkeypatch):
    local_index.publish(_fake_release(project, project.parent / "other", "2.6.5"))
    monkeypatch.setenv("PIP_INDEX_URL", local_index.url)
    with pytest.raises(ReleaseNotFoundError) as err:
        fetch_sdist(read_pin(project))
    assert not isinstance(err.value, NotInFindLinksError)
    assert str(err.value) == (
        "could not download the lightning 2.6.6 sdist with pip (your index has no sdist of lightning 2.6.6); set"
        f" {SDIST_ENV} to a local copy for offline use"
    )
    assert "/simple/lightning/" in local_index.requests


def test_uvs_index_variables_apply_where_pips_are_not_set(
    project: Path, no_pip_settings: Path, local_index, monkeypatch, tmp_path: Path
):
    """Under uv, UV_OFFLINE and UV_FIND_LINKS become pip's settings; UV_INDEX_URL does not replace a PIP_INDEX_URL."""
    monkeypatch.setattr(frontend_index_module, "parent_process", lambda: (["/bin/uv", "pip", "install", "x"], tmp_path))
    _fake_release(project, tmp_path / "links")
    monkeypatch.setenv("UV_FIND_LINKS", f"{tmp_path / 'empty'},{tmp_path / 'links'}")
    monkeypatch.setenv("UV_OFFLINE", "1")
    monkeypatch.setenv("UV_INDEX_URL", _closed_port_url())
    monkeypatch.setenv("PIP_INDEX_URL", local_index.url)  # set: UV_INDEX_URL does not replace it
    assert file_sha256(fetch_sdist(read_pin(project))) == read_pin(project).sha256
    assert local_index.requests == []  # UV_OFFLINE: no index at all


FETCH_HOOK = """
import os, sys
from pathlib import Path

sys.path.insert(0, os.environ["PATCHSET_TOOLS"])
from patchset import PatchsetError
from patchset.pin import fetch_sdist, read_pin


def get_requires_for_build_wheel(config_settings=None):
    return []


def build_wheel(wheel_directory, config_settings=None, metadata_directory=None):  # uv's first hook, pip's second
    try:
        print("fetched", fetch_sdist(read_pin(Path(os.environ["PATCHSET_PROJECT"]))), file=sys.stderr)
    except PatchsetError as err:
        print(f"patchset: error: {err}", file=sys.stderr)
    raise SystemExit(1)  # the hook's output is the point, not a build


prepare_metadata_for_build_wheel = build_wheel  # pip's first hook
"""


def _fetching_project(root: Path) -> Path:
    """A project whose build hook only fetches the pinned sdist, run by a frontend as the fork's backend is."""
    write(root / "fetch_hook.py", FETCH_HOOK)
    pyproject = '[build-system]\nrequires = []\nbuild-backend = "fetch_hook"\nbackend-path = ["."]\n'
    write(root / "pyproject.toml", pyproject + '[project]\nname = "fetching"\nversion = "1"\n')
    return root


def _hook_said(proc: subprocess.CompletedProcess[str]) -> list[str]:
    lines = (line.strip() for line in (proc.stdout + proc.stderr).splitlines())
    return [line for line in lines if line.startswith(("fetched ", "patchset: error: "))]


def test_the_frontends_no_index_and_relative_find_links_reach_the_download(
    pip_in_venv: Path, project: Path, no_pip_settings: Path, local_index, tmp_path: Path
):
    """`pip install --no-index --find-links DIR`: the inner pip asks no index, and finds DIR from the user's folder."""
    shell = tmp_path / "shell"
    local_index.publish(_fake_release(project, shell / "links"))  # the inner pip's source without the options
    env = {"PATCHSET_TOOLS": str(TOOLS), "PATCHSET_PROJECT": str(project), "PIP_INDEX_URL": local_index.url}
    fetching = str(_fetching_project(shell / "p"))
    args = ("install", "--no-build-isolation", "--no-index", "-f", "links", fetching)
    proc = pip(pip_in_venv, *args, env=env, cwd=shell)
    pin = read_pin(project)
    assert _hook_said(proc) == [f"fetched {no_pip_settings / 'sdist' / pin.sha256 / pin.sdist}"], proc.stderr
    assert local_index.requests == []


def test_the_frontends_index_url_wins_over_the_environment(
    bundled_pip_venv: Path, project: Path, no_pip_settings: Path, local_index, tmp_path: Path
):
    """`pip install -i MIRROR`: the mirror is asked, not PIP_INDEX_URL's; unreachable, it is one clear line."""
    local_index.publish(_fake_release(project, tmp_path / "served"))
    env = {"PATCHSET_TOOLS": str(TOOLS), "PATCHSET_PROJECT": str(project), "PIP_INDEX_URL": _closed_port_url()}
    fetching = str(_fetching_project(tmp_path / "p"))
    proc = pip(bundled_pip_venv, "install", "--no-build-isolation", "-i", local_index.url, fetching, env=env)
    pin = read_pin(project)
    assert _hook_said(proc) == [f"fetched {no_pip_settings / 'sdist' / pin.sha256 / pin.sdist}"], proc.stderr
    assert "/simple/lightning/" in local_index.requests

    # the frontend's mirror fails: pip's own settings, as before the frontend's were read
    closed = _closed_port_url()
    (no_pip_settings / "sdist" / pin.sha256 / pin.sdist).unlink()
    env["PIP_INDEX_URL"] = local_index.url
    proc = pip(bundled_pip_venv, "install", "--no-build-isolation", f"--index-url={closed}", fetching, env=env)
    assert _hook_said(proc) == [f"fetched {no_pip_settings / 'sdist' / pin.sha256 / pin.sdist}"], proc.stderr
    # both fail: one line
    (no_pip_settings / "sdist" / pin.sha256 / pin.sdist).unlink()
    env["PIP_INDEX_URL"] = closed
    proc = pip(bundled_pip_venv, "install", "--no-build-isolation", f"--index-url={closed}", fetching, env=env)
    assert _hook_said(proc) == [
        "patchset: error: could not download the lightning 2.6.6 sdist with pip: it could not reach the package index"
        f" ({closed}/lightning/: [Errno 111] Connection refused); {_what_to_do(project)}"
    ]


def test_uvs_default_index_reaches_the_download(
    bundled_pip_venv: Path, project: Path, no_pip_settings: Path, local_index, tmp_path: Path
):
    """`uv pip install --default-index MIRROR`: uv runs the hook, the inner pip asks the mirror."""
    uv = pytest.importorskip("uv")
    local_index.publish(_fake_release(project, tmp_path / "served"))
    env = {
        **os.environ,
        "PATCHSET_TOOLS": str(TOOLS),
        "PATCHSET_PROJECT": str(project),
        "PIP_INDEX_URL": _closed_port_url(),
        "UV_CACHE_DIR": str(tmp_path / "uv-cache"),
    }
    cmd = [uv.find_uv_bin(), "pip", "install", "--python", str(bundled_pip_venv), "--no-build-isolation"]
    cmd += ["--default-index", local_index.url, str(_fetching_project(tmp_path / "p"))]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env)
    pin = read_pin(project)
    said = " ".join(proc.stderr.split())  # uv wraps the hook's output
    assert f"fetched {no_pip_settings / 'sdist' / pin.sha256 / pin.sdist} " in said, proc.stderr
    assert "/simple/lightning/" in local_index.requests


class _LoginRequired(http.server.BaseHTTPRequestHandler):
    """A private index: every request gets 401 and a request for a login."""

    def do_GET(self) -> None:
        self.send_response(401)
        self.send_header("WWW-Authenticate", 'Basic realm="private"')
        self.end_headers()

    def log_message(self, format: str, *args: object) -> None:
        pass


def test_the_frontends_extra_index_can_neither_swap_the_file_nor_ask_for_a_login(
    bundled_pip_venv: Path, project: Path, no_pip_settings: Path, local_index, tmp_path: Path
):
    """`pip install -i MAIN --extra-index-url A --extra-index-url B`: A serves another file of the sdist's name, B wants
    a login the inner pip does not have; the pinned hash takes MAIN's file and nothing prompts (pip's own settings
    reach no index: the download must work with the frontend's)."""
    swapped = _fake_release(project, tmp_path / "swapped")
    write(tmp_path / "swapped" / "lightning-2.6.6" / "setup.py", "raise SystemExit('another file of that name')\n")
    with tarfile.open(swapped, "w:gz") as tar:
        tar.add(tmp_path / "swapped" / "lightning-2.6.6", arcname="lightning-2.6.6")
    local_index.publish(swapped)
    main = _Index(tmp_path / "main")
    main.publish(_fake_release(project, tmp_path / "pinned"))
    assert file_sha256(swapped) != read_pin(project).sha256
    private = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _LoginRequired)
    servers = [main.server, private]
    for server in servers:
        threading.Thread(target=server.serve_forever, daemon=True).start()
    env = {"PATCHSET_TOOLS": str(TOOLS), "PATCHSET_PROJECT": str(project), "PIP_INDEX_URL": _closed_port_url()}
    options = ["-i", main.url, "--extra-index-url", local_index.url]
    options += ["--extra-index-url", f"http://127.0.0.1:{private.server_port}/", "--trusted-host", "127.0.0.1"]
    try:
        fetching = str(_fetching_project(tmp_path / "p"))
        proc = pip(bundled_pip_venv, "install", "--no-build-isolation", *options, fetching, env=env)
    finally:
        for server in servers:
            server.shutdown()
            server.server_close()
    pin = read_pin(project)
    assert _hook_said(proc) == [f"fetched {no_pip_settings / 'sdist' / pin.sha256 / pin.sdist}"], proc.stderr
    assert "/simple/lightning/" in local_index.requests  # the frontend's extra index was asked


def test_a_frontend_command_line_it_cannot_translate_leaves_pips_own_settings(monkeypatch, tmp_path: Path):
    argv = ["/bin/uv", "pip", "install", "--index-url", "file:/abs/dir", "x"]  # no file URI can be made of it
    with pytest.raises(ValueError, match="relative path"):
        frontend_index_module.command_line_options(argv, tmp_path)
    monkeypatch.setattr(frontend_index_module, "parent_process", lambda: (argv, tmp_path))
    assert frontend_index_module.frontend_index() == frontend_index_module.NO_FRONTEND_INDEX


@pytest.mark.parametrize(
    ("command", "frontend", "options"),
    [
        ("/v/bin/python /v/bin/pip3 install -iU --no-index x", "pip", "--index-url U --no-index"),
        ("py -m pip wheel --index-url=U -f d -- -f e", "pip", "--index-url U --find-links /c/d"),
        ("py -m pip install --extra-index-url E --trusted-host h", "pip", "--extra-index-url E --trusted-host h"),
        ("py -m pip list -i U", "pip", ""),
        (
            "/b/uv --offline pip install --index n=http://i --default-index idx",
            "uv",
            "--no-index --extra-index-url http://i --index-url file:///c/idx",
        ),
        ("/b/uv pip install -i http://u x", "uv", "--index-url http://u"),
        ("/b/uv build --find-links=/l", "uv", "--find-links /l"),
        ("/b/uv run --with x train.py -i 5", "uv", ""),
        ("py -m build -i U", "", ""),
    ],
)
def test_the_frontends_command_line(command: str, frontend: str, options: str):
    """What is read from a frontend's command line: pip's and uv's index options, as the inner pip's, only them."""
    assert command_line_options(command.split(), Path("/c")) == (frontend, options.split())
