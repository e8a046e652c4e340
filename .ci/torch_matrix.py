"""The torch matrix's records, ``docs/records/torch-matrix.json``, which the ``tests``/``oldest`` nox sessions write.

python .ci/torch_matrix.py check             every cell passed, all from one commit with this checkout's sources
python .ci/torch_matrix.py merge FILE ...    add the cells of other copies of the records (CI: one per job)
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tools"))
from patchset import records  # noqa: E402 - the tool, from this checkout


def main(argv: list[str]) -> int:
    """Run ``check`` or ``merge``; the exit code."""
    command, *files = argv or ["help"]
    if command == "check" and not files:
        problems = records.stale_matrix(ROOT)
        print("\n".join(problems) or "torch matrix: every cell passed, from one commit with this checkout's sources")
        return 1 if problems else 0
    if command == "merge" and files:
        found = records.load(ROOT, "torch-matrix")
        for cell in (c for f in files for c in json.loads(Path(f).read_text(encoding="utf-8")).values()):
            if cell["key"] not in found or cell["date"] >= found[cell["key"]]["date"]:
                found[cell["key"]] = cell
        records.store(ROOT, "torch-matrix", found)
        return 0
    print(__doc__, file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
