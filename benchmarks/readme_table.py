"""Print the README's performance table (markdown) from a `python -m fusedattn.bench` JSON.

    python benchmarks/readme_table.py benchmarks/results/NVIDIA-H200-2026-11-21.json

Each cell is forward / forward+backward TFLOP/s; ratios are fwd+bwd times of the same run.
FlagGems was not in the GPU image, so its column compares our forward with the H200 forward
figures of ../shared/BENCHMARKS.md (same shapes and convention), copied below.
"""

from __future__ import annotations

import json
import sys

# Forward TFLOP/s of FlagGems on an H200, BENCHMARKS.md "Plain attention": (D, S, causal) -> fwd.
FLAGGEMS_FWD = {
    (128, 1024, False): 380, (128, 1024, True): 309, (128, 4096, False): 397, (128, 4096, True): 364,
    (128, 16384, False): 442, (128, 16384, True): 435,
    (64, 1024, False): 327, (64, 1024, True): 216, (64, 4096, False): 345, (64, 4096, True): 273,
    (64, 16384, False): 351, (64, 16384, True): 292,
}
COLUMNS = [("fusedattn", "**fusedattn**"), ("sdpa-cudnn", "SDPA cuDNN"), ("sdpa-flash", "SDPA flash (FA2)"),
           ("flex", "FlexAttention"), ("sdpa-efficient", "SDPA efficient")]


def table(rows: list[dict]) -> str:
    by_case: dict[str, dict[str, dict]] = {}
    for r in rows:
        if "fwd_ms" in r:
            by_case.setdefault(r["case"], {})[r["system"]] = r
    header = (["D", "S", "causal"] + [title for _, title in COLUMNS]
              + ["f+b vs Flex", "f+b vs cuDNN", "fwd vs FlagGems*"])
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    cases = sorted(by_case.values(),
                   key=lambda c: (c["fusedattn"]["D"], c["fusedattn"]["Sq"], c["fusedattn"]["causal"]))
    for case in cases:
        ours = case["fusedattn"]
        cells = [str(ours["D"]), str(ours["Sq"]), "yes" if ours["causal"] else "no"]
        for system, _ in COLUMNS:
            r = case.get(system)
            cell = f"{r['fwd_tflops']:.0f} / {r['fwdbwd_tflops']:.0f}" if r else "—"
            cells.append(f"**{cell}**" if system == "fusedattn" else cell)
        for peer in ("flex", "sdpa-cudnn"):
            r = case.get(peer)
            cells.append(f"{r['fwdbwd_ms'] / ours['fwdbwd_ms']:.2f}x" if r else "—")
        flaggems = FLAGGEMS_FWD.get((ours["D"], ours["Sq"], ours["causal"]))
        cells.append(f"{ours['fwd_tflops'] / flaggems:.2f}x" if flaggems else "—")
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


if __name__ == "__main__":
    with open(sys.argv[1]) as f:
        print(table(json.load(f)["rows"]))
