"""Make a built wheel reproducible: two builds of one commit give the same bytes.

setuptools writes each file's build time into the zip and takes permissions from the file system. :func:`finish_wheel`
rewrites the archive with one timestamp (``$SOURCE_DATE_EPOCH`` if set, as reproducible-builds.org defines it, else
1980-01-01, the earliest a zip can hold), permissions reduced to 644/755, entries in sorted order with the
``.dist-info`` folder last, and a ``RECORD`` computed again; the ``METADATA`` text can be changed on the way (the
fork's address, see :mod:`patchset.fork_metadata`). File contents are upstream's build output otherwise.
"""

from __future__ import annotations

import base64
import csv
import hashlib
import io
import os
import time
import zipfile
from collections.abc import Callable
from pathlib import Path

from patchset import PatchsetError

EPOCH_ENV = "SOURCE_DATE_EPOCH"
_ZIP_EPOCH = 315532800  # 1980-01-01T00:00:00Z


def build_time() -> tuple[int, int, int, int, int, int]:
    """The timestamp every entry gets: ``$SOURCE_DATE_EPOCH``, else 1980-01-01 (earlier values are clamped)."""
    raw = os.environ.get(EPOCH_ENV, "").strip()
    if not raw:
        return time.gmtime(_ZIP_EPOCH)[:6]
    if not raw.isdigit():
        raise PatchsetError(f"{EPOCH_ENV}={raw!r}: expected seconds since 1970 as an integer")
    return time.gmtime(max(int(raw), _ZIP_EPOCH))[:6]


def _digest(data: bytes) -> str:
    return "sha256=" + base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()


def finish_wheel(wheel: Path, metadata: Callable[[str], str] | None = None) -> None:
    """Rewrite ``wheel`` in place, reproducibly; ``metadata`` maps the ``METADATA`` text to what the wheel holds."""
    with zipfile.ZipFile(wheel) as archive:
        entries = {
            info.filename: (archive.read(info), bool((info.external_attr >> 16) & 0o111))
            for info in archive.infolist()
            if not info.is_dir()
        }
    records = [name for name in entries if name.endswith(".dist-info/RECORD") and name.count("/") == 1]
    if len(records) != 1:
        raise PatchsetError(f"{wheel.name}: expected one .dist-info/RECORD in the wheel, found {len(records)}")
    record = records[0]
    dist_info = record.partition("/")[0]
    del entries[record]
    if metadata is not None:
        data, executable = entries[f"{dist_info}/METADATA"]
        entries[f"{dist_info}/METADATA"] = (metadata(data.decode("utf-8")).encode("utf-8"), executable)
    order = sorted(name for name in entries if not name.startswith(f"{dist_info}/"))
    order += sorted(name for name in entries if name.startswith(f"{dist_info}/"))
    rows = io.StringIO()
    writer = csv.writer(rows, delimiter=",", quotechar='"', lineterminator="\n")
    for name in order:
        writer.writerow((name, _digest(entries[name][0]), len(entries[name][0])))
    writer.writerow((record, "", ""))
    entries[record] = (rows.getvalue().encode("utf-8"), False)
    stamp = build_time()
    partial = wheel.with_name(wheel.name + ".part")
    with zipfile.ZipFile(partial, "w") as archive:
        for name in [*order, record]:
            data, executable = entries[name]
            info = zipfile.ZipInfo(name, date_time=stamp)
            info.create_system = 3  # Unix, whatever builds it: the permission bits below mean the same everywhere
            info.external_attr = (0o100755 if executable else 0o100644) << 16
            info.compress_type = zipfile.ZIP_DEFLATED
            archive.writestr(info, data)
    os.replace(partial, wheel)
