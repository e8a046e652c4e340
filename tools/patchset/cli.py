"""Command line: ``python -m patchset <command>``, with this checkout's ``tools`` folder on ``PYTHONPATH``."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from patchset import PatchsetError
from patchset.check import check, check_upstream
from patchset.export import diff_text, export, preview
from patchset.feature_request import default_request_path, feature_request
from patchset.import_pr import import_pr
from patchset.pin import fetch_sdist, read_pin
from patchset.pr_text import default_path, pr_description, unanswered
from patchset.rebase import rebase
from patchset.release import release
from patchset.series import find_patch
from patchset.upstream_pr import default_base, upstream_pr
from patchset.upstream_record import PAGE, RUNS
from patchset.upstream_tests import run_upstream_tests
from patchset.workspace import materialize_workspace

_DEFAULT_PROJECT = Path(__file__).resolve().parents[2]


def _materialize(args: argparse.Namespace) -> int:
    workspace = materialize_workspace(args.project, force=args.force)
    print(f"materialized {workspace}: edit, commit there, then run `export`")
    return 0


def _export(args: argparse.Namespace) -> int:
    if args.check:
        old, new = preview(args.project)
        diff = diff_text(old, new)
        if diff:
            print(diff, end="")
        print("export check: " + ("FAILED" if diff else "patches are exactly what they materialize to"))
        return 1 if diff else 0
    changed = export(args.project, force=args.force)
    print("exported: " + (", ".join(changed) if changed else "nothing changed"))
    return 0


def _check(args: argparse.Namespace) -> int:
    findings = check(args.project)
    if args.upstream is not None:
        findings += check_upstream(args.project, args.upstream.resolve(), args.base)
    for finding in findings:
        print(("ok    " if finding.ok else "FAIL  ") + finding.message)
    return 0 if all(f.ok for f in findings) else 1


def _upstream_pr(args: argparse.Namespace) -> int:
    branch = upstream_pr(
        args.project,
        args.patch,
        args.onto.resolve(),
        args.branch,
        args.format_patch,
        base=args.base,
        force=args.force,
        author=args.author,
    )
    print(f"created branch {branch} in {args.onto}")
    return _write_description(args)


def _write_description(args: argparse.Namespace) -> int:
    patch = find_patch(args.project, args.patch)
    onto = args.onto.resolve()
    try:
        text = pr_description(args.project, args.patch, onto, args.base or default_base(args.project, patch, onto))
    except PatchsetError as err:  # the branch is made: say why there is no description, and succeed
        print(f"no PR description written: {err}", file=sys.stderr)
        return 0
    if str(args.description) == "-":
        print(text, end="")
    else:
        path = args.description or default_path(args.project, patch)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text, encoding="utf-8")
        print(f"wrote the PR description to {path}")
    for line in unanswered(text):
        print(f"not answered (upstream's template has an item upstream-pr does not know): {line}", file=sys.stderr)
    return _write_feature_request(args)


def _write_feature_request(args: argparse.Namespace) -> int:
    patch = find_patch(args.project, args.patch)
    onto = args.onto.resolve()
    try:
        text = feature_request(args.project, patch, onto, args.base or default_base(args.project, patch, onto))
    except PatchsetError as err:
        print(f"no feature request written: {err}", file=sys.stderr)
        return 0
    if text is not None:
        path = default_request_path(args.project, patch)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text, encoding="utf-8")
        print(f"wrote the feature request to file upstream before the PR to {path}")
    return 0


def _import_pr(args: argparse.Namespace) -> int:
    result = import_pr(args.project, args.patch, args.onto.resolve(), args.branch, args.base)
    print(f"{result.patch}: {len(result.upstream_only)} upstream-only sections, {len(result.new_files)} new files")
    for path in result.not_taken:
        print(
            f"not taken: {path} (a file the sdist ships, or a new file no New-Files glob owns): edit it in .work/tree"
        )
    return 0


def _upstream_tests(args: argparse.Namespace) -> int:
    records = run_upstream_tests(
        args.project,
        args.patch,
        args.onto.resolve(),
        runs=args.runs,
        base=args.base,
        torch=args.torch,
        python=args.python,
        select=args.select,
        base_runs=args.base_runs,
        author=args.author,
        oldest_python=args.oldest_python,
    )
    for record in records:
        print(f"{record.context.patch} {record.summary()}")
    print(f"recorded in {PAGE}")
    return 0 if not any(record.caused for record in records) else 1


def _rebase(args: argparse.Namespace) -> int:
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


def _release(args: argparse.Namespace) -> int:
    done = release(args.project, args.date)
    print(f"released {done.version}: tag {done.tag} at {done.commit[:12]}; this checkout now builds", done.next_version)
    print(f"nothing was pushed; to publish: git push origin HEAD {done.tag} (the release workflow attaches the wheels)")
    return 0


def _fetch(args: argparse.Namespace) -> int:
    print(fetch_sdist(read_pin(args.project)))
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
    cmd.add_argument("--check", action="store_true", help="only report (with the diff); fail if a patch would change")
    cmd.add_argument("--force", action="store_true", help="overwrite patches/ changed since materialize")
    cmd.set_defaults(run=_export)

    cmd = sub.add_parser("check", help="the series' rules; every patch applies to the pinned base with zero fuzz")
    cmd.add_argument(
        "--upstream",
        type=Path,
        metavar="CHECKOUT",
        help="also apply each upstream-bound patch, whole, to this checkout",
    )
    cmd.add_argument("--base", help="with --upstream: the branch or commit (default: upstream's default branch)")
    cmd.set_defaults(run=_check)

    cmd = sub.add_parser("upstream-pr", help="make a clean upstream branch for one patch")
    cmd.add_argument("patch", help="patch file name or number, e.g. 0002")
    cmd.add_argument("--onto", type=Path, required=True, help="an upstream Lightning git checkout")
    cmd.add_argument("--branch", help="branch name (default: patchset/<patch name>)")
    cmd.add_argument("--format-patch", type=Path, metavar="DIR", help="also write the commit as a patch file here")
    cmd.add_argument("--base", help="start the branch here (default: upstream's default branch, or the Depends-On PR)")
    cmd.add_argument("--force", action="store_true", help="recreate the branch if it exists")
    cmd.add_argument("--author", help="'Name <address>' for the commit (default: the patch's author)")
    cmd.add_argument(
        "--description",
        type=Path,
        metavar="FILE",
        help="write the PR description (upstream's template, answered) here; - prints it"
        " (default: .work/pr/<patch>.md in this checkout)",
    )
    cmd.set_defaults(run=_upstream_pr)

    cmd = sub.add_parser("import-pr", help="take a PR branch's upstream-only edits and new files back into the patch")
    cmd.add_argument("patch", help="patch file name or number, e.g. 0002")
    cmd.add_argument("--onto", type=Path, required=True, help="the upstream checkout holding the PR branch")
    cmd.add_argument("--branch", help="the PR branch (default: patchset/<patch name>)")
    cmd.add_argument("--base", help="what the branch started from (default: as upstream-pr)")
    cmd.set_defaults(run=_import_pr)

    cmd = sub.add_parser(
        "upstream-tests",
        help="run upstream's CI jobs (tests, oldest, mypy, ruff) on a patch's PR branch and its base; record them",
    )
    cmd.add_argument("patch", help="patch file name or number, e.g. 0002")
    cmd.add_argument("--onto", type=Path, required=True, help="an upstream Lightning git checkout (left clean)")
    cmd.add_argument(
        "--runs",
        nargs="+",
        choices=list(RUNS),
        default=list(RUNS),
        help="the jobs to run and record (default: all): the tests with the newest torch allowed, under the oldest"
        " requirements, mypy, ruff",
    )
    cmd.add_argument("--base", help="as upstream-pr --base")
    cmd.add_argument(
        "--torch",
        help="newest: the torch release to test with (default: the newest that upstream's requirements allow)",
    )
    cmd.add_argument("--python", help="newest: use this venv's interpreter instead of making one")
    cmd.add_argument(
        "--oldest-python",
        help="oldest: the Python to make its venv from, of the version upstream's oldest job runs (default: on PATH)",
    )
    cmd.add_argument("--select", nargs="+", help="test paths or node ids instead of the patch's default selection")
    cmd.add_argument(
        "--base-runs",
        choices=["all", "failures"],
        default="all",
        help="tests: on the base, rerun the whole selection (default) or only what failed on the branch",
    )
    cmd.add_argument("--author", help="as upstream-pr --author")
    cmd.set_defaults(run=_upstream_tests)

    cmd = sub.add_parser("rebase", help="replay the series onto a new upstream release in .work/tree")
    cmd.add_argument("version", help="the new upstream version, e.g. 2.6.7")
    cmd.add_argument("--sdist", type=Path, help="a local copy of the new sdist (default: pip download)")
    cmd.add_argument("--sha256", help="the new sdist's expected sha256")
    cmd.set_defaults(run=_rebase)

    cmd = sub.add_parser("release", help="tag this commit as the release the pin names, then move to the next label")
    cmd.add_argument("--date", help="the release date for the CHANGELOG (default: today, UTC), as YYYY-MM-DD")
    cmd.set_defaults(run=_release)

    cmd = sub.add_parser("fetch", help="download (or find in the cache) the pinned sdist and print its path")
    cmd.set_defaults(run=_fetch)

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
