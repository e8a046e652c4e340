"""The torch matrix's table in docs/torch-matrix.md, from the results the ``tests``/``oldest`` nox sessions write.

python .ci/torch_matrix.py render DIR   the table from the JSON files under DIR (each session's $TORCH_MATRIX_RESULTS)
python .ci/torch_matrix.py check        every row passed, all rows name one commit, and the sources are unchanged since
                                        (but for the pin's label, which a release moves)
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PAGE = ROOT / "docs" / "torch-matrix.md"
BEGIN = "<!-- the table: `python .ci/torch_matrix.py render DIR` writes it -->"
END = "<!-- end of the table -->"
COLUMNS = ["torch", "session", "python", "platform", "passed", "failed", "skipped", "seconds", "commit"]
SOURCES = ["patches", "src", "tests", "tools", "noxfile.py", "pyproject.toml"]  # what a result describes
PIN = "patches/upstream.pin"  # its label moves after a release (`release`), which changes no code


def _version(text: str) -> list[int]:
    return [int(n) for n in re.findall(r"\d+", text.split("+")[0])]


def render(folder: Path) -> int:
    """Write the table of the results under ``folder`` into the page."""
    cells = [json.loads(path.read_text(encoding="utf-8")) for path in sorted(folder.rglob("*.json"))]
    if not cells:
        print(f"no result (*.json) under {folder}", file=sys.stderr)
        return 1
    cells.sort(key=lambda c: (_version(c["torch"]), c["session"], _version(c["python"]), c["platform"]))
    rows = ["| " + " | ".join(COLUMNS) + " |", "|" + "---|" * 4 + "--:|" * 4 + "---|"]
    for cell in cells:
        commit = re.sub(r"^([0-9a-f]{10})[0-9a-f]+", r"\1", cell["commit"])  # a short hash, "+dirty" kept
        values = {**cell, "session": f"`{cell['session']}`", "commit": f"`{commit}`"}
        rows.append("| " + " | ".join(str(values[column]) for column in COLUMNS) + " |")
    text = PAGE.read_text(encoding="utf-8")
    head, _, rest = text.partition(BEGIN)
    _, _, tail = rest.partition(END)
    if not rest or not tail:
        print(f"{PAGE}: the markers {BEGIN!r} and {END!r} are missing", file=sys.stderr)
        return 1
    PAGE.write_text(f"{head}{BEGIN}\n\n" + "\n".join(rows) + f"\n\n{END}{tail}", encoding="utf-8")
    return 0


def _pin(commit: str) -> str:
    """The upstream pin at ``commit`` without its ``local-version`` label."""
    text = subprocess.run(["git", "-C", str(ROOT), "show", f"{commit}:{PIN}"], capture_output=True, text=True).stdout
    return re.sub(r"(?m)^local-version\s*=.*$", "", text)


def _changed(commit: str) -> bool:
    """Whether a source differs between ``commit`` and ``HEAD`` (or ``commit`` is none)."""
    diff = ["git", "-C", str(ROOT), "diff", "--quiet", commit, "HEAD", "--", *SOURCES, f":(exclude){PIN}"]
    return bool(subprocess.run(diff, stderr=subprocess.DEVNULL).returncode) or _pin(commit) != _pin("HEAD")


def check() -> int:
    """Whether the page's table describes this checkout: every row passed, at one commit, no source changed since."""
    table = PAGE.read_text(encoding="utf-8").partition(BEGIN)[2].partition(END)[0]
    lines = [line.strip().strip("|").split("|") for line in table.splitlines() if line.startswith("|")]
    rows = [dict(zip(COLUMNS, (v.strip().strip("`") for v in line), strict=True)) for line in lines[2:]]
    problems = [f"{r['session']} ({r['python']}, {r['platform']}): {r['failed']} failed" for r in rows
                if r["failed"] != "0" or r["passed"] == "0"]  # fmt: skip
    commits = sorted({row["commit"] for row in rows})
    if len(commits) != 1:
        problems.append(f"the rows name {len(commits)} commits: {', '.join(commits) or 'none'}")
    elif _changed(commits[0]):
        problems.append(f"{', '.join(SOURCES)} changed since {commits[0]} (or it is no commit): run the matrix again")
    print("\n".join(problems) or f"torch matrix: {len(rows)} rows passed at {commits[0]}, the sources unchanged since")
    return 1 if problems else 0


def main(argv: list[str]) -> int:
    """Run ``render DIR`` or ``check``; the exit code."""
    if argv[:1] == ["render"] and len(argv) == 2:
        return render(Path(argv[1]))
    if argv == ["check"]:
        return check()
    print(__doc__, file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
