"""What the fork's distributions say about where they come from: the fork's address, declared once.

The address is ``url`` in ``[tool.patchset]`` of the project's ``pyproject.toml``. Upstream's build writes its own
addresses into the metadata; :func:`fork_metadata` replaces those that tell a user where to get the code and where to
report a bug (``Home-page``, ``Download-URL``, the ``Source Code`` and ``Bug Tracker`` project URLs), so that a bug in
the fork is reported to the fork. Every other field stays upstream's (``Documentation`` still points at upstream's
docs, which describe the fork too).
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

from patchset import PatchsetError

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - Python 3.10: the same parser, from the index (build-system.requires lists it)
    import tomli as tomllib

PYPROJECT = "pyproject.toml"
_URL = re.compile(r"https://[^\s/]+(/[^\s/]+)+")


def fork_url(project: Path) -> str:
    """The fork's public address: ``[tool.patchset] url`` in ``pyproject.toml``."""
    path = project / PYPROJECT
    try:
        with open(path, "rb") as fh:
            settings = tomllib.load(fh)
    except (OSError, tomllib.TOMLDecodeError) as err:
        raise PatchsetError(f"{path}: cannot read the fork's settings ({err})") from err
    url = settings.get("tool", {}).get("patchset", {}).get("url")
    if not isinstance(url, str) or not _URL.fullmatch(url):
        raise PatchsetError(
            f"{path}: [tool.patchset] url must be the fork's https address without a trailing slash, got {url!r}"
        )
    return url


def fork_fields(url: str) -> dict[str, str]:
    """The metadata fields the fork sets, by field (``Project-URL`` entries by their label)."""
    return {
        "Home-page": url,
        "Download-URL": f"{url}/releases",
        "Project-URL: Bug Tracker": f"{url}/issues",
        "Project-URL: Source Code": url,
    }


def fork_metadata(text: str, url: str) -> str:
    """``METADATA`` (core metadata) as upstream's build wrote it, with the fork's address in :func:`fork_fields`.

    A field upstream's build did not write is added at the end of the headers; the description (after the first
    blank line) is left as it is.
    """
    head, sep, body = text.partition("\n\n")
    if not sep:
        head = head.rstrip("\n")
    wanted = fork_fields(url)
    lines = []
    for line in head.split("\n"):
        key, _, value = line.partition(": ")
        if key == "Project-URL":
            key = f"Project-URL: {value.partition(',')[0].strip()}"
        if key in wanted:
            line = _field(key, wanted.pop(key))
        lines.append(line)
    lines += [_field(key, value) for key, value in wanted.items()]
    return "\n".join(lines) + (sep + body if sep else "\n")


def _field(key: str, value: str) -> str:
    if key.startswith("Project-URL: "):
        return f"Project-URL: {key.removeprefix('Project-URL: ')}, {value}"
    return f"{key}: {value}"
