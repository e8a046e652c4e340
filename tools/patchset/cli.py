"""Command line: ``python -m patchset <command>``, with this checkout's ``tools`` folder on ``PYTHONPATH``."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from patchset import PatchsetError

_DEFAULT_PROJECT = Path(__file__).resolve().parents[2]


def _materialize(args: argparse.Namespace) -> int:
    from patchset.materialize import materialize_workspace

    workspace = materialize_workspace(args.project, force=args.force)
    print(f"materialized {workspace}: edit, commit there, then run `export`")
    return 0


def _export(args: argparse.Namespace) -> int:
    from patchset.export import export

    changed = export(args.project, check=args.check)
    if args.check:
        for name in changed:
            print(f"re-export would change patches/{name}")
        print("export check: " + ("FAILED" if changed else "patches are exactly what they materialize to"))
        return 1 if changed else 0
    print("exported: " + (", ".join(changed) if changed else "nothing changed"))
    return 0


def _check(args: argparse.Namespace) -> int:
    from patchset.check import check

    findings = check(args.project)
    for finding in findings:
        print(("ok    " if finding.ok else "FAIL  ") + finding.message)
    return 0 if all(f.ok for f in findings) else 1


def _upstream_pr(args: argparse.Namespace) -> int:
    from patchset.upstream_pr import upstream_pr

    branch = upstream_pr(args.project, args.patch, args.onto.resolve(), args.branch, args.format_patch)
    print(f"created branch {branch} in {args.onto}")
    return 0


def _rebase(args: argparse.Namespace) -> int:
    from patchset.rebase import rebase

    result = rebase(args.project, args.version, args.sdist, args.sha256)
    print(f"pinned {result.pin.name} {result.pin.version} (sha256 {result.pin.sha256}) in patches/upstream.pin")
    for subject in result.dropped:
        print(f"dropped (already upstream): {subject}")
    if result.stopped_at:
        print(f"stopped at: {result.stopped_at}")
        print("resolve the conflict in .work/tree, `git rebase --continue`, then run `export`")
        return 1
    print(f"replayed {result.replayed} patches; run `export`, then `check`")
    return 0


def _fetch(args: argparse.Namespace) -> int:
    from patchset.pin import fetch_sdist, read_pin

    print(fetch_sdist(read_pin(args.project)))
    return 0


def _build(args: argparse.Namespace) -> int:
    from patchset.wheels import build

    print(build(args.project, args.dist, args.flavour))
    return 0


def _install(args: argparse.Namespace) -> int:
    from patchset.wheels import install

    print(f"installed {install(args.project, args.dist, args.python, args.pip_args, args.flavour).name}")
    return 0


def parser() -> argparse.ArgumentParser:
    """The argument parser of ``python -m patchset``."""
    top = argparse.ArgumentParser(prog="patchset", description=__doc__)
    top.add_argument(
        "--project", type=Path, default=_DEFAULT_PROJECT, help="the patch set checkout (default: this one)"
    )
    sub = top.add_subparsers(dest="command", required=True)

    cmd = sub.add_parser("materialize", help="make .work/tree: upstream base + one commit per patch + our files")
    cmd.add_argument("--force", action="store_true", help="replace a workspace even if it has unexported work")
    cmd.set_defaults(run=_materialize)

    cmd = sub.add_parser("export", help="write the workspace's commits back to patches/")
    cmd.add_argument("--check", action="store_true", help="only report; fail if a re-export would change a patch")
    cmd.set_defaults(run=_export)

    cmd = sub.add_parser("check", help="every patch applies to the pinned base with zero fuzz")
    cmd.set_defaults(run=_check)

    cmd = sub.add_parser("upstream-pr", help="make a clean upstream branch for one patch")
    cmd.add_argument("patch", help="patch file name or number, e.g. 0002")
    cmd.add_argument("--onto", type=Path, required=True, help="an upstream Lightning git checkout")
    cmd.add_argument("--branch", help="branch name (default: patchset/<patch name>)")
    cmd.add_argument("--format-patch", type=Path, metavar="DIR", help="also write the commit as a patch file here")
    cmd.set_defaults(run=_upstream_pr)

    cmd = sub.add_parser("rebase", help="replay the series onto a new upstream release in .work/tree")
    cmd.add_argument("version", help="the new upstream version, e.g. 2.6.7")
    cmd.add_argument("--sdist", type=Path, help="a local copy of the new sdist (default: pip download)")
    cmd.add_argument("--sha256", help="the new sdist's expected sha256")
    cmd.set_defaults(run=_rebase)

    cmd = sub.add_parser("fetch", help="download (or find in the cache) the pinned sdist and print its path")
    cmd.set_defaults(run=_fetch)

    for name, run, text in (("build", _build, "build the fork's wheel"), ("install", _install, "build, then install")):
        cmd = sub.add_parser(name, help=text)
        cmd.add_argument("--dist", type=Path, default=Path("dist"), help="where the wheel goes (default: dist)")
        cmd.add_argument(
            "--flavour",
            choices=["pytorch", "fabric"],
            help="build pytorch-lightning (pytorch_lightning + lightning_fabric) or lightning-fabric instead",
        )
        if name == "install":
            cmd.add_argument("--python", help="install into this interpreter's environment (default: the running one)")
            cmd.add_argument("pip_args", nargs="*", help="extra arguments for pip install (after --)")
        cmd.set_defaults(run=run)
    return top


def main(argv: list[str] | None = None) -> int:
    """Run one command; a :class:`PatchsetError` becomes one ``patchset: error:`` line and exit code 1."""
    args = parser().parse_args(argv)
    args.project = args.project.resolve()
    try:
        return int(args.run(args))
    except PatchsetError as err:
        print(f"patchset: error: {err}", file=sys.stderr)
        return 1
