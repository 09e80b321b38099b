"""Print the standard-shape tables (markdown) of docs/PERFORMANCE.md from a `python -m fusedattn.bench` JSON.

    python benchmarks/readme_table.py benchmarks/results/full-v51-NVIDIA-H100-80GB-HBM3-2026-11-26.json

First table: forward / forward+backward / backward-alone TFLOP/s of every system (backward alone
is the fwd+bwd time less the forward time of the same run). Second table: fusedattn's ratios,
all from times of the same run (> 1 means fusedattn is faster; "graph": both steps replayed from
CUDA graphs, the GPU's time without the host's), and the cost of
``deterministic=True`` (its fwd+bwd time over the default's). Where FlagGems was not measured
in the run, its column compares our forward with the forward figures FlagGems reached on an H200
on 2026-11-21 (same shapes and convention, measured outside this repository), copied below and
marked *.
"""

from __future__ import annotations

import json
import sys

# Forward TFLOP/s of FlagGems on an H200 (2026-11-21, the standard shapes): (D, S, causal) -> fwd.
FLAGGEMS_FWD = {
    (128, 1024, False): 380, (128, 1024, True): 309, (128, 4096, False): 397, (128, 4096, True): 364,
    (128, 16384, False): 442, (128, 16384, True): 435,
    (64, 1024, False): 327, (64, 1024, True): 216, (64, 4096, False): 345, (64, 4096, True): 273,
    (64, 16384, False): 351, (64, 16384, True): 292,
}
COLUMNS = [("fusedattn", "**fusedattn**"), ("sdpa-cudnn", "SDPA cuDNN"), ("sdpa-flash", "SDPA flash (FA2)"),
           ("flex", "FlexAttention"), ("flaggems", "FlagGems"), ("flash-sparse-attn", "flash-sparse-attn dense"),
           ("sdpa-efficient", "SDPA efficient")]


def _cases(rows: list[dict]) -> list[dict[str, dict]]:
    by_case: dict[str, dict[str, dict]] = {}
    for r in rows:
        if "fwd_ms" in r:
            by_case.setdefault(r["case"], {})[r["system"]] = r
    cases = [c for c in by_case.values() if "fusedattn" in c]
    return sorted(cases, key=lambda c: (c["fusedattn"].get("Hkv", c["fusedattn"]["H"]) != c["fusedattn"]["H"],
                                        c["fusedattn"]["D"], c["fusedattn"]["Sq"], c["fusedattn"]["causal"]))


def _shape_cells(r: dict) -> list[str]:
    grouped = r.get("Hkv", r["H"]) != r["H"]
    return [str(r["D"]) + (f", GQA {r['H']}/{r['Hkv']}" if grouped else ""), str(r["Sq"]),
            "yes" if r["causal"] else "no"]


def _markdown(header: list[str], body: list[list[str]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    return "\n".join(lines + ["| " + " | ".join(cells) + " |" for cells in body])


def tflops_table(rows: list[dict]) -> str:
    cases = _cases(rows)
    columns = [(system, title) for system, title in COLUMNS if any(system in c for c in cases)]
    body = []
    for case in cases:
        cells = _shape_cells(case["fusedattn"])
        for system, _ in columns:
            r = case.get(system)
            cell = f"{r['fwd_tflops']:.0f} / {r['fwdbwd_tflops']:.0f} / {r['bwd_tflops']:.0f}" if r else "—"
            cells.append(f"**{cell}**" if system == "fusedattn" else cell)
        body.append(cells)
    return _markdown(["D", "S", "causal"] + [title for _, title in columns], body)


def ratio_table(rows: list[dict]) -> str:
    def ratio(peer: dict | None, ours: dict, key: str) -> str:
        return f"{peer[key] / ours[key]:.2f}x" if peer else "—"

    body = []
    for case in _cases(rows):
        ours, cudnn = case["fusedattn"], case.get("sdpa-cudnn")
        cells = _shape_cells(ours)
        graph = cudnn if cudnn and "graph_fwdbwd_ms" in cudnn and "graph_fwdbwd_ms" in ours else None
        cells += [ratio(cudnn, ours, "fwd_ms"), ratio(cudnn, ours, "bwd_ms"), ratio(cudnn, ours, "fwdbwd_ms"),
                  ratio(graph, ours, "graph_fwdbwd_ms"),
                  ratio(case.get("sdpa-flash"), ours, "fwdbwd_ms"), ratio(case.get("flex"), ours, "fwdbwd_ms")]
        if "flaggems" in case:
            cells += [ratio(case["flaggems"], ours, "fwd_ms"), ratio(case["flaggems"], ours, "fwdbwd_ms")]
        else:
            published = FLAGGEMS_FWD.get((ours["D"], ours["Sq"], ours["causal"]))
            grouped = ours.get("Hkv", ours["H"]) != ours["H"]
            cells += [f"{ours['fwd_tflops'] / published:.2f}x*" if published and not grouped else "—", "—"]
        det = case.get("fusedattn-deterministic")
        cells.append(f"{det['fwdbwd_ms'] / ours['fwdbwd_ms']:.2f}" if det else "—")
        body.append(cells)
    header = ["D", "S", "causal", "fwd vs cuDNN", "bwd vs cuDNN", "f+b vs cuDNN", "f+b vs cuDNN (graph)", "f+b vs FA2",
              "f+b vs Flex",
              "fwd vs FlagGems", "f+b vs FlagGems", "deterministic / default (time)"]
    return _markdown(header, body)


if __name__ == "__main__":
    with open(sys.argv[1]) as f:
        data = json.load(f)
    print(tflops_table(data["rows"]))
    print()
    print(ratio_table(data["rows"]))
