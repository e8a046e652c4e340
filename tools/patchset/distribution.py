"""What the fork's wheels say about themselves: the fork's address in their metadata, and reproducible bytes.

The address is ``url`` in ``[tool.patchset]`` of ``pyproject.toml``, declared once. It replaces upstream's in the
fields that tell a user where to get the code and where to report a bug (``Home-page``, ``Download-URL``, the
``Source Code`` and ``Bug Tracker`` project URLs); every other field stays upstream's. The wheel is rewritten with one
timestamp (``$SOURCE_DATE_EPOCH``, else 1980-01-01), permissions 644/755, sorted entries (``.dist-info`` last) and a
``RECORD`` computed again, so that two builds of one commit give the same bytes.
"""

from __future__ import annotations

import base64
import csv
import hashlib
import io
import os
import re
import sys
import time
import zipfile
from pathlib import Path

from patchset import PatchsetError

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - Python 3.10: the same parser, from the index (build-system.requires lists it)
    import tomli as tomllib

EPOCH_ENV = "SOURCE_DATE_EPOCH"
_ZIP_EPOCH = 315532800  # 1980-01-01T00:00:00Z, the earliest a zip can hold


def fork_url(project: Path) -> str:
    """The fork's public address: ``[tool.patchset] url`` in ``pyproject.toml``."""
    path = project / "pyproject.toml"
    try:
        url = tomllib.loads(path.read_text(encoding="utf-8")).get("tool", {}).get("patchset", {}).get("url")
    except (OSError, tomllib.TOMLDecodeError) as err:
        raise PatchsetError(f"{path}: cannot read the fork's settings ({err})") from err
    if not isinstance(url, str) or not re.fullmatch(r"https://[^\s/]+(/[^\s/]+)+", url):
        raise PatchsetError(
            f"{path}: [tool.patchset] url must be the fork's https address without a trailing slash, got {url!r}"
        )
    return url


def fork_metadata(text: str, url: str) -> str:
    """Core metadata with the fork's address in its four fields (added at the end of the headers where missing)."""
    head, sep, body = text.partition("\n\n")
    wanted = {"Home-page": url, "Download-URL": f"{url}/releases"}
    wanted |= {"Project-URL: Bug Tracker": f"{url}/issues", "Project-URL: Source Code": url}
    lines = []
    for line in (head if sep else head.rstrip("\n")).split("\n"):
        key, _, value = line.partition(": ")
        key = f"Project-URL: {value.partition(',')[0].strip()}" if key == "Project-URL" else key
        lines.append(_field(key, wanted.pop(key)) if key in wanted else line)
    lines += [_field(key, value) for key, value in wanted.items()]
    return "\n".join(lines) + (sep + body if sep else "\n")


def _field(key: str, value: str) -> str:
    return (
        f"Project-URL: {key.removeprefix('Project-URL: ')}, {value}"
        if key.startswith("Project-URL")
        else f"{key}: {value}"
    )


def build_time() -> tuple[int, int, int, int, int, int]:
    """The timestamp of every entry: ``$SOURCE_DATE_EPOCH``, else 1980-01-01 (earlier values are clamped)."""
    raw = os.environ.get(EPOCH_ENV, "").strip()
    if raw and not raw.isdigit():
        raise PatchsetError(f"{EPOCH_ENV}={raw!r}: expected seconds since 1970 as an integer")
    return time.gmtime(max(int(raw or 0), _ZIP_EPOCH))[:6]


def finish_wheel(wheel: Path, url: str) -> str:
    """Rewrite ``wheel`` in place with the fork's address in its ``METADATA``, reproducibly; its file name."""
    with zipfile.ZipFile(wheel) as archive:
        entries = {
            i.filename: (archive.read(i), bool((i.external_attr >> 16) & 0o111))
            for i in archive.infolist()
            if not i.is_dir()
        }
    records = [name for name in entries if name.endswith(".dist-info/RECORD") and name.count("/") == 1]
    if len(records) != 1:
        raise PatchsetError(f"{wheel.name}: expected one .dist-info/RECORD in the wheel, found {len(records)}")
    record, dist_info = records[0], records[0].partition("/")[0]
    del entries[record]
    metadata, executable = entries[f"{dist_info}/METADATA"]
    entries[f"{dist_info}/METADATA"] = (fork_metadata(metadata.decode("utf-8"), url).encode("utf-8"), executable)
    order = sorted(entries, key=lambda name: (name.startswith(f"{dist_info}/"), name))
    rows = io.StringIO()
    writer = csv.writer(rows, lineterminator="\n")
    for name in order:
        digest = base64.urlsafe_b64encode(hashlib.sha256(entries[name][0]).digest()).rstrip(b"=").decode()
        writer.writerow((name, f"sha256={digest}", len(entries[name][0])))
    writer.writerow((record, "", ""))
    entries[record] = (rows.getvalue().encode("utf-8"), False)
    stamp, partial = build_time(), wheel.with_name(wheel.name + ".part")
    with zipfile.ZipFile(partial, "w") as archive:
        for name in [*order, record]:
            data, executable = entries[name]
            info = zipfile.ZipInfo(name, date_time=stamp)
            info.create_system = 3  # Unix, whatever builds it: the permission bits mean the same everywhere
            info.external_attr = (0o100755 if executable else 0o100644) << 16
            info.compress_type = zipfile.ZIP_DEFLATED
            archive.writestr(info, data)
    os.replace(partial, wheel)
    return wheel.name
