"""Rebuild a bench result JSON from the table a run printed, when the run's JSON did not come back.

    python benchmarks/rows_from_log.py standard full64.log OUT.json --device "NVIDIA H100 80GB HBM3" \
        --date 2026-11-26 --rounds 3 [--note TEXT]
    python benchmarks/rows_from_log.py variants variants.log OUT.json --device ... --date ... [--note TEXT]

The printed table holds every time the README's tables use (eager fwd and fwd+bwd ms, the graph's
fwd+bwd ms; variant rows: fwd and fwd+bwd ms, peak GB) at 3 decimals, so a rate rebuilt from it is
within ~0.2% of the saved one at the shortest rows. What the table does not print stays out (the
graph's forward, the rounds, the GPU state, a peer's max |diff|). Every row is marked
``"from_printed_table": true`` and the environment says so too; ``readme_table.py`` reads the file
as it reads a saved one. (v51: an x4 call's file limit kept two JSONs from coming back.)
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

from fusedattn.bench import variants  # noqa: E402
from fusedattn.bench.__main__ import HIDDEN, TOKENS, _rates  # noqa: E402

CASE = re.compile(r"D(\d+)-S(\d+)(?:-gqa(\d+)/(\d+))?-(full|causal)$")


def standard_rows(lines: list[str]) -> list[dict]:
    rows = []
    for line in lines:
        words = line.split()
        if len(words) < 3 or not CASE.match(words[0]):
            continue
        d, s, hq, hkv, mask = CASE.match(words[0]).groups()
        d, s = int(d), int(s)
        heads = int(hq) if hq else HIDDEN // d
        row = dict(system=words[1], case=words[0], B=TOKENS // s, H=heads, Hkv=int(hkv) if hkv else heads, Sq=s,
                   Sk=s, D=d, causal=mask == "causal", dtype="bfloat16", from_printed_table=True)
        if words[2] in ("fails:", "skipped:"):
            row["note"] = " ".join(words[2:])
        else:
            row.update(fwd_ms=float(words[2]), fwdbwd_ms=float(words[4]), graph_fwdbwd_ms=float(words[7]))
            row.update(_rates(row))
            row["sm_clock_cell"] = words[-1]
        rows.append(row)
    return rows


def variant_rows(lines: list[str]) -> list[dict]:
    names = sorted((v.name for v in variants.VARIANTS), key=len, reverse=True)
    systems = sorted(variants.SYSTEMS, key=len, reverse=True)
    by_name = {v.name: v for v in variants.VARIANTS}
    rows = []
    for line in lines:
        name = next((n for n in names if line.startswith(n)), None)
        if name is None:
            continue
        rest = line[len(name):].lstrip()
        system = next((s for s in systems if rest.startswith(s + " ") or rest == s), None)
        if system is None:
            continue
        words = rest[len(system):].split()
        v = by_name[name]
        row = dict(variant=name, system=system, B=variants.B, H=variants.H, Hkv=v.heads_kv, S=variants.S, D=variants.D,
                   causal=v.causal, from_printed_table=True)
        if words and words[0] in ("fails:", "skipped:"):
            row["note"] = " ".join(words)
        else:
            row.update(fwd_ms=float(words[0]), fwdbwd_ms=float(words[1]), fwdbwd_tflops=float(words[2]),
                       step_peak_gb=float(words[3]), sm_clock_cell=words[-1])
        rows.append(row)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("kind", choices=("standard", "variants"))
    parser.add_argument("log")
    parser.add_argument("out")
    parser.add_argument("--device", required=True, help="the GPU the run printed it ran on")
    parser.add_argument("--date", required=True)
    parser.add_argument("--rounds", type=int, default=None, help="the run's --rounds")
    parser.add_argument("--note", default="")
    args = parser.parse_args()
    lines = Path(args.log).read_text().splitlines()
    rows = (standard_rows if args.kind == "standard" else variant_rows)(lines)
    header = next((line for line in lines if line.startswith("fusedattn benchmark on")), "")
    env = dict(device=args.device, date=args.date, rounds=args.rounds, from_printed_table=True,
               source_log=Path(args.log).name, printed_header=header, note=args.note)
    Path(args.out).write_text(json.dumps(dict(environment=env, rows=rows), indent=1))
    print(f"{len(rows)} rows -> {args.out}")


if __name__ == "__main__":
    main()
