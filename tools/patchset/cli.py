"""``python -m patchset <command>``, with this checkout's ``tools`` folder on ``PYTHONPATH``."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from patchset import PatchsetError
from patchset.check import check
from patchset.export import diff_text, export, preview
from patchset.pin import fetch_sdist, read_pin
from patchset.pr_text import pr_description, unanswered
from patchset.rebase import rebase
from patchset.release import release
from patchset.series import find_patch
from patchset.upstream_pr import default_base, import_pr, upstream_pr
from patchset.workspace import materialize_workspace


def _materialize(args: argparse.Namespace) -> int:
    print(f"materialized {materialize_workspace(args.project, force=args.force)}: edit, commit there, then `export`")
    return 0


def _export(args: argparse.Namespace) -> int:
    if not args.check:
        changed = export(args.project, force=args.force)
        print("exported: " + (", ".join(changed) if changed else "nothing changed"))
        return 0
    diff = diff_text(*preview(args.project))
    print(diff + "export check: " + ("FAILED" if diff else "patches are exactly what they materialize to"))
    return 1 if diff else 0


def _check(args: argparse.Namespace) -> int:
    findings = check(args.project)
    for finding in findings:
        print(("ok    " if finding.ok else "FAIL  ") + finding.message)
    return 0 if all(f.ok for f in findings) else 1


def _upstream_pr(args: argparse.Namespace) -> int:
    onto, patch = args.onto.resolve(), find_patch(args.project, args.patch)
    branch = upstream_pr(args.project, args.patch, onto, args.branch, args.base, args.force, args.author)
    print(f"created branch {branch} in {onto}")
    try:  # the branch is made: a text that cannot be written is said, and the command still succeeds
        text = pr_description(args.project, patch, onto, args.base or default_base(args.project, patch, onto))
    except PatchsetError as err:
        print(f"no PR description written: {err}", file=sys.stderr)
        return 0
    path = args.description or args.project / ".work" / "pr" / patch.name.replace(".patch", ".md")
    if str(path) == "-":
        print(text, end="")
    else:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text, encoding="utf-8")
        print(f"wrote the PR description to {path}")
    for line in unanswered(text):
        print(f"not answered (upstream's template has an item upstream-pr does not know): {line}", file=sys.stderr)
    return 0


def _import_pr(args: argparse.Namespace) -> int:
    result = import_pr(args.project, args.patch, args.onto.resolve(), args.branch, args.base)
    print(f"{args.patch}: {len(result['upstream-only'])} upstream-only sections, {len(result['new files'])} new files")
    for path in result["not taken"]:
        print(
            f"not taken: {path} (a file the sdist ships, or a new file no New-Files glob owns): edit it in .work/tree"
        )
    return 0


def _rebase(args: argparse.Namespace) -> int:
    result = rebase(args.project, args.version, args.sdist, args.sha256)
    print(f"pinned {result.pin.name} {result.pin.version} (sha256 {result.pin.sha256}) in patches/upstream.pin")
    for subject in result.dropped:
        print(f"dropped (already upstream): {subject}")
    if result.stopped_at:
        print(f"stopped at: {result.stopped_at}\nresolve it in .work/tree, `git rebase --continue`, then `export`")
        return 1
    print(f"replayed {result.replayed} patches; run `export`, then `check`")
    return 0


def _release(args: argparse.Namespace) -> int:
    done = release(args.project, args.date)
    print(
        f"released {done.version}: tag {done.tag} at {done.commit[:12]}; this checkout now builds {done.next_version}"
    )
    print(f"nothing was pushed; to publish: git push origin HEAD {done.tag} (the release workflow attaches the wheels)")
    return 0


def parser() -> argparse.ArgumentParser:
    """The argument parser of ``python -m patchset``."""
    top = argparse.ArgumentParser(prog="patchset", description=__doc__)
    here = Path(__file__).resolve().parents[2]
    top.add_argument("--project", type=Path, default=here, help="the patch set checkout (default: this one)")
    sub = top.add_subparsers(dest="command", required=True)

    def command(name: str, run: object, help: str) -> argparse.ArgumentParser:
        cmd = sub.add_parser(name, help=help)
        cmd.set_defaults(run=run)
        return cmd

    cmd = command("materialize", _materialize, "make .work/tree: upstream base + one commit per patch + new files")
    cmd.add_argument("--force", action="store_true", help="replace a workspace even if it has unexported work")
    cmd = command("export", _export, "write the workspace's commits back to patches/")
    cmd.add_argument("--check", action="store_true", help="only report (with the diff); fail if a patch would change")
    cmd.add_argument("--force", action="store_true", help="overwrite patches/ changed since materialize")
    command("check", _check, "the series' rules; every patch applies to the pinned base with zero fuzz")
    for name, run, what in (("import-pr", _import_pr, "take a PR branch's upstream-only edits and new files back"),
                            ("upstream-pr", _upstream_pr, "make a patch's upstream PR branch and texts")):  # fmt: skip
        cmd = command(name, run, what)
        cmd.add_argument("patch", help="patch file name or number, e.g. 0002")
        cmd.add_argument("--onto", type=Path, required=True, help="an upstream Lightning git checkout")
        cmd.add_argument("--branch", help="the PR branch (default: patchset/<patch name>)")
        cmd.add_argument("--base", help="where the branch starts (default: upstream's default branch, or Depends-On's)")
    cmd.add_argument("--force", action="store_true", help="recreate the branch if it exists")  # upstream-pr's
    cmd.add_argument("--author", help="'Name <address>' for the commit (default: the patch's author)")
    cmd.add_argument("--description", type=Path, metavar="FILE", help="where the PR text goes; - prints it (default:"
                     " .work/pr/<patch>.md)")  # fmt: skip
    cmd = command("rebase", _rebase, "replay the series onto a new upstream release in .work/tree")
    cmd.add_argument("version", help="the new upstream version, e.g. 2.6.7")
    cmd.add_argument("--sdist", type=Path, help="a local copy of the new sdist (default: pip download)")
    cmd.add_argument("--sha256", help="the new sdist's expected sha256")
    cmd = command("release", _release, "tag this commit as the release the pin names, then move to the next label")
    cmd.add_argument("--date", help="the release date for the CHANGELOG (default: today, UTC), as YYYY-MM-DD")
    command("fetch", lambda args: print(fetch_sdist(read_pin(args.project))) or 0, "print the pinned sdist's path")
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
