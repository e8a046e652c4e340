"""What index settings the frontend that runs this build was given, as options for the inner ``pip download``.

A PEP 517 frontend hands its hooks no index settings. A hook sees the frontend's process: its environment, which it
inherits (so ``PIP_*`` variables and pip's configuration files reach the inner pip as they are), and, on Linux, its
command line and working folder under ``/proc/<parent pid>/``: pip (23.2 to 26.3) and uv run each hook in a child
process of their own. This reads index options there for pip (``pip install/wheel/download/lock``) and uv
(``uv pip install/sync/compile``, ``uv build/sync/lock/add/export``, ``uv tool install``), and uv's own ``UV_*``
variables when uv is the frontend. Nothing else is read: not requirement files (their ``--index-url`` lines), nor
uv's ``uv.toml`` or ``[tool.uv]`` settings, nor the command lines of ``uv run``, ``uvx`` or other frontends; where
``/proc`` cannot be read (other systems), only the environment counts.
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

# a frontend's option -> (the inner pip's option, whether it takes a value)
PIP_OPTIONS: dict[str, tuple[str, bool]] = {
    "-i": ("--index-url", True),
    "--index-url": ("--index-url", True),
    "--extra-index-url": ("--extra-index-url", True),
    "-f": ("--find-links", True),
    "--find-links": ("--find-links", True),
    "--no-index": ("--no-index", False),
    "--trusted-host": ("--trusted-host", True),
    "--cert": ("--cert", True),
}
UV_OPTIONS: dict[str, tuple[str, bool]] = {
    "-i": ("--index-url", True),
    "--index-url": ("--index-url", True),
    "--default-index": ("--index-url", True),
    "--extra-index-url": ("--extra-index-url", True),
    "--index": ("--extra-index-url", True),
    "-f": ("--find-links", True),
    "--find-links": ("--find-links", True),
    "--no-index": ("--no-index", False),
    "--offline": ("--no-index", False),  # pip has no offline mode: no index, local --find-links only
    "--allow-insecure-host": ("--trusted-host", True),
}
PIP_COMMANDS = {"install", "wheel", "download", "lock"}  # the pip commands that run build hooks
UV_COMMANDS = {("pip", "install"), ("pip", "sync"), ("pip", "compile"), ("tool", "install")}
UV_COMMANDS |= {(command,) for command in ("build", "sync", "lock", "add", "export")}
UV_COMMAND_WORDS = {"pip", "tool", "run", "build", "sync", "lock", "add", "remove", "export", "tree", "venv", "version"}
_PIP_SCRIPT = re.compile(r"pip[0-9.]*")
_UV_INDEX_NAME = re.compile(r"^[A-Za-z0-9._-]+=")  # uv's `--index name=url`
_TRUE = {"1", "true", "yes", "y", "on"}


@dataclass(frozen=True)
class FrontendIndex:
    """The frontend's index settings, translated for the inner ``pip download``."""

    frontend: str  # "pip", "uv", or "" when its command line could not be read or is another program's
    options: list[str]  # to add to the inner pip's command line (they win over its environment)
    environment: dict[str, str]  # to add to the inner pip's environment

    @property
    def no_index(self) -> bool:
        """Whether the frontend was told to use no index."""
        return "--no-index" in self.options or self.environment.get("PIP_NO_INDEX") == "1"


NO_FRONTEND_INDEX = FrontendIndex("", [], {})  # pip's own settings alone


def frontend_index(environ: Mapping[str, str] = os.environ) -> FrontendIndex:
    """The index settings of the frontend running this process (its parent), for an inner ``pip download``.

    Anything unexpected on the way (an option value no URL can be made of, say) gives :data:`NO_FRONTEND_INDEX`: the
    inner pip then runs with its own settings, as before the frontend's were read.
    """
    try:
        return _frontend_index(environ)
    except Exception:  # never fail a build over settings it can do without
        return NO_FRONTEND_INDEX


def _frontend_index(environ: Mapping[str, str]) -> FrontendIndex:
    parent = parent_process()
    frontend, options = command_line_options(*parent) if parent else ("", [])
    cwd = parent[1] if parent else shell_cwd()
    environment = uv_environment_as_pip(environ, cwd) if frontend == "uv" else {}  # never another program's
    links = environ.get("PIP_FIND_LINKS", "").split()  # relative to the frontend's folder, not the hook's
    if any(absolute_location(link, cwd) != link for link in links):
        environment["PIP_FIND_LINKS"] = " ".join(absolute_location(link, cwd) for link in links)
    return FrontendIndex(frontend, options, environment)


def parent_process() -> tuple[list[str], Path] | None:
    """The parent process's command line and working folder, from Linux's ``/proc``; None where unreadable."""
    try:
        argv = Path(f"/proc/{os.getppid()}/cmdline").read_bytes().split(b"\0")[:-1]
        cwd = os.readlink(f"/proc/{os.getppid()}/cwd")
    except OSError:
        return None
    return [os.fsdecode(arg) for arg in argv], Path(cwd)


def shell_cwd() -> Path:
    """The folder the user typed the command in: the shell's ``$PWD`` (pip runs hooks elsewhere), else ours."""
    shell = os.environ.get("PWD", "")
    return Path(shell) if os.path.isabs(shell) and os.path.isdir(shell) else Path.cwd()


def command_line_options(argv: list[str], cwd: Path) -> tuple[str, list[str]]:
    """The frontend named by ``argv`` ("pip", "uv" or "") and its index options, as the inner pip's options."""
    if argv and Path(argv[0]).name == "uv":
        words = argv[1:]
        first = next((i for i, word in enumerate(words) if word in UV_COMMAND_WORDS), len(words))
        if tuple(words[first : first + 1]) in UV_COMMANDS or tuple(words[first : first + 2]) in UV_COMMANDS:
            return "uv", _translate(words, UV_OPTIONS, cwd, uv=True)
        return "uv", []
    for i, arg in enumerate(argv):
        if (arg == "-m" and argv[i + 1 : i + 2] == ["pip"]) or (i < 2 and _PIP_SCRIPT.fullmatch(Path(arg).name)):
            rest = argv[i + (2 if arg == "-m" else 1) :]
            if any(word in PIP_COMMANDS for word in rest):
                return "pip", _translate(rest, PIP_OPTIONS, cwd, uv=False)
            return "pip", []
    return "", []


def _translate(args: list[str], table: dict[str, tuple[str, bool]], cwd: Path, uv: bool) -> list[str]:
    options: list[str] = []
    args = args[: args.index("--")] if "--" in args else args
    for i, arg in enumerate(args):
        name, _, value = arg.partition("=") if arg.startswith("--") else (arg[:2], "", arg[2:].lstrip("="))
        if name not in table:
            continue
        option, takes_value = table[name]
        if not takes_value:
            options += [] if value or option in options else [option]
        elif value or i + 1 < len(args):
            options += [option, pip_value(option, value or args[i + 1], cwd, uv)]
    return options


def pip_value(option: str, value: str, cwd: Path, uv: bool) -> str:
    """A frontend's option value as the inner pip (which runs elsewhere) needs it: paths absolute, indexes URLs."""
    if option in ("--find-links", "--cert"):
        return absolute_location(value, cwd)
    if uv and option in ("--index-url", "--extra-index-url"):
        value = _UV_INDEX_NAME.sub("", value, count=1)
        return value if "://" in value else Path(absolute_location(value, cwd)).as_uri()  # uv takes a folder too
    return value


def absolute_location(value: str, cwd: Path) -> str:
    """A ``--find-links`` location: a relative path made absolute against ``cwd``; URLs and absolute paths as given."""
    if "://" in value or value.startswith("file:") or os.path.isabs(value):
        return value
    return str(cwd / value)


def uv_environment_as_pip(environ: Mapping[str, str], cwd: Path) -> dict[str, str]:
    """The ``PIP_*`` equivalents of uv's index variables, for each the user has not set."""
    default = environ.get("UV_DEFAULT_INDEX") or environ.get("UV_INDEX_URL")
    extra = [*environ.get("UV_INDEX", "").split(), *environ.get("UV_EXTRA_INDEX_URL", "").split()]
    links = [link for link in environ.get("UV_FIND_LINKS", "").split(",") if link.strip()]
    no_index = any(environ.get(name, "").strip().lower() in _TRUE for name in ("UV_NO_INDEX", "UV_OFFLINE"))
    wanted = {
        "PIP_INDEX_URL": pip_value("--index-url", default, cwd, uv=True) if default else "",
        "PIP_EXTRA_INDEX_URL": " ".join(pip_value("--extra-index-url", url, cwd, uv=True) for url in extra),
        "PIP_FIND_LINKS": " ".join(absolute_location(link.strip(), cwd) for link in links),
        "PIP_NO_INDEX": "1" if no_index else "",
        "PIP_TRUSTED_HOST": " ".join(environ.get("UV_INSECURE_HOST", "").split()),
    }
    return {name: value for name, value in wanted.items() if value and not environ.get(name)}
