"""Merge the JSONs of several `python -m fusedattn.bench` runs of one session (one device call
holds at most ~10 minutes, a full run with rounds takes longer) into one, and plot it.

    python benchmarks/merge_results.py benchmarks/results/full-<gpu>-<date>.json part1.json part2.json

Rows are taken as they are; a (system, shape) measured in two parts is refused, so that no row is
silently replaced. The environment is the first part's, with every part's device, date and rounds
listed under ``parts``; the PNG beside the output is drawn by the bench's own ``plot``.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from fusedattn.bench.__main__ import plot


def merge(parts: list[dict]) -> dict:
    rows, seen = [], set()
    for part in parts:
        for row in part["rows"]:
            key = (row["system"], row["case"])
            if key in seen:
                raise ValueError(f"{key} is measured in two parts")
            seen.add(key)
            rows.append(row)
    environment = dict(parts[0]["environment"])
    environment["parts"] = [{k: p["environment"].get(k) for k in ("device", "date", "rounds")} for p in parts]
    systems = {}
    for part in parts:
        systems.update(part.get("systems", {}))
    return dict(environment=environment, systems=systems, rows=rows)


def main(argv: list[str]) -> None:
    if len(argv) < 2:
        sys.exit(__doc__)
    out, parts = Path(argv[0]), [json.loads(Path(p).read_text()) for p in argv[1:]]
    merged = merge(parts)
    out.write_text(json.dumps(merged, indent=1))
    title = f"{merged['environment']['device']}: forward+backward, bf16, 16k tokens"
    drawn = plot(merged["rows"], out.with_suffix(".png"), title)
    print(f"wrote {out}" + (f" and {out.with_suffix('.png')}" if drawn else ""))


if __name__ == "__main__":
    main(sys.argv[1:])
