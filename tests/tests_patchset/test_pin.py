import os
import re
import shutil
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest
from patchset_helpers import REPO, TOOLS, write

from patchset import PatchsetError
from patchset.pin import SDIST_ENV, cache_dir, extract_sdist, fetch_sdist, file_sha256, read_pin


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
    with pytest.raises(PatchsetError, match=f"does not match the pinned {'b' * 64}"):
        fetch_sdist(read_pin(project))
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
    monkeypatch.setenv("LIGHTNING_PATCHSET_CACHE", str(tmp_path / "cache"))
    monkeypatch.delenv(SDIST_ENV, raising=False)
    monkeypatch.setenv("PIP_NO_INDEX", "1")
    monkeypatch.setenv("PIP_FIND_LINKS", str(tmp_path))
    with pytest.raises(PatchsetError, match=f"could not download the lightning 2.6.6 sdist with pip.*{SDIST_ENV}"):
        fetch_sdist(read_pin(project))
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
