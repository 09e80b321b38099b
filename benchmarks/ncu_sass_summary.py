"""Summarise ncu's per-instruction page for kernels side by side: stall reasons, executed
instructions by opcode, shared-memory wavefronts (and the excess over ideal: bank conflicts) by
opcode, and the hottest SASS lines.

    ncu --clock-control none -k regex:_dkdv_ws_kernel -c 1 --launch-skip 1 --section WarpStateStats \\
        --section SourceCounters -o ours python benchmarks/profile_one.py --head-dim 64
    ncu -i ours.ncu-rep --page source --print-source sass --csv > ours-sass.csv
    python benchmarks/ncu_sass_summary.py ours-sass.csv fa4-sass.csv --kernel 'dkdv|bwd_sm90'

A report with several launches of one kernel lists it once per launch; only the first is read.
"""

from __future__ import annotations

import argparse
import collections
import csv
import re

SAMPLES = "Warp Stall Sampling (All Samples)"


def kernels(path: str) -> dict[str, list[dict]]:
    """Kernel name -> its instruction rows (the first launch of each name)."""
    out: dict[str, list[dict]] = {}
    header = None
    rows: list[dict] | None = None
    with open(path) as f:
        for record in csv.reader(f):
            if not record:
                continue
            if record[0] == "Kernel Name":
                rows = None if record[1] in out else out.setdefault(record[1], [])
            elif record[0] == "Address":
                header = record
            elif rows is not None and record[0].startswith("0x"):
                rows.append(dict(zip(header, record)))
    return out


def full_opcode(row: dict) -> str:
    """The instruction's opcode with its modifiers, past a predicate."""
    words = row["Source"].split()
    return words[1] if words[0].startswith("@") else words[0]


def opcode(row: dict) -> str:
    """The opcode grouped: its first part, or two for MUFU, WARPGROUP, SYNCS and BAR."""
    op = full_opcode(row)
    keep = 2 if op.startswith(("MUFU", "WARPGROUP", "SYNCS", "BAR")) else 1
    return ".".join(op.split(".")[:keep])


def number(row: dict, key: str) -> int:
    return int(row.get(key) or 0)


def summary(name: str, rows: list[dict], top: int) -> str:
    total = sum(number(r, SAMPLES) for r in rows) or 1
    reasons = [k for k in rows[0] if k.startswith("stall_") and "Not Issued" not in k]
    by_reason = collections.Counter({k[6:]: sum(number(r, k) for r in rows) for k in reasons})
    executed = collections.Counter()
    wavefronts = collections.defaultdict(lambda: [0, 0])
    for r in rows:
        executed[opcode(r)] += number(r, "Instructions Executed")
        w = wavefronts[full_opcode(r)]
        w[0] += number(r, "L1 Wavefronts Shared")
        w[1] += number(r, "L1 Wavefronts Shared Excessive")
    lines = [f"== {name[:100]}",
             f"  samples {total}; by reason: " + ", ".join(f"{k} {100 * v / total:.1f}%" for k, v in by_reason.most_common(10)),
             f"  executed {sum(executed.values()) / 1e6:.1f}M warp instructions: "
             + ", ".join(f"{k} {v / 1e6:.1f}M" for k, v in executed.most_common(24)),
             "  shared wavefronts (excess): " + ", ".join(
                 f"{k} {w / 1e6:.1f}M ({x / 1e6:.1f}M)" for k, (w, x) in sorted(wavefronts.items(), key=lambda kv: -kv[1][0])
                 if w)]
    for r in sorted(rows, key=lambda r: -number(r, SAMPLES))[:top]:
        main = sorted(((number(r, k), k[6:]) for k in reasons), reverse=True)[:2]
        lines.append(f"  {100 * number(r, SAMPLES) / total:5.1f}% {r['Source'].strip()[:64]:64s} "
                     + " ".join(f"{k}:{v}" for v, k in main if v))
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("csv", nargs="+", help="ncu --page source --print-source sass --csv outputs")
    parser.add_argument("--kernel", default=".", help="regex on the kernel name")
    parser.add_argument("--top", type=int, default=15, help="hottest lines to list")
    args = parser.parse_args()
    for path in args.csv:
        print(f"# {path}")
        for name, rows in kernels(path).items():
            if rows and re.search(args.kernel, name):
                print(summary(name, rows, args.top))


if __name__ == "__main__":
    main()
