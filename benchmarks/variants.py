"""Time launch-config variants of fusedattn side by side with its peers, in one process.

    PYTHONPATH=src python benchmarks/variants.py [--head-dims 64,128] [--seqlens 1024,4096,16384]
        [--variants base,tma,...] [--peers flex,sdpa-cudnn] [--json out.json]

A variant is a change to the heuristic ``AttentionConfigs`` (tuning/configs.py), pinned for
both the forward and the backward of a measurement. Use it to test a prediction in
``benchmarks/NOTES.md`` before changing the heuristic; the standard comparison stays
``python -m fusedattn.bench``. Prints forward, backward and fwd+bwd per shape and the
fwd+bwd ratio of each variant to the first peer.
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import replace

import torch

from fusedattn.bench.__main__ import environment, measure, standard_shapes
from fusedattn.bench.systems import SYSTEMS
from fusedattn.tuning.configs import AttentionConfigs, KernelConfig, pinned_configs, select_configs


def _tma(configs: AttentionConfigs) -> AttentionConfigs:
    return replace(configs, forward=replace(configs.forward, tma_loads=True),
                   dkdv=replace(configs.dkdv, tma_loads=True), dq=replace(configs.dq, tma_loads=True))


def _no_tma(configs: AttentionConfigs) -> AttentionConfigs:
    return replace(configs, forward=replace(configs.forward, tma_loads=False),
                   dkdv=replace(configs.dkdv, tma_loads=False), dq=replace(configs.dq, tma_loads=False))


VARIANTS = {
    "heuristic": lambda c: c,
    "pointers": _no_tma,
    "tma": _tma,
    "tma-fused": lambda c: replace(_tma(c), fuse_dq_pass=True, atomic_dq=False),
    "tma-split": lambda c: replace(_tma(c), fuse_dq_pass=False, atomic_dq=False),
    "tma-atomic": lambda c: replace(_tma(c), atomic_dq=True, dq_tma=True),
    "deterministic": lambda c: replace(c, atomic_dq=False),  # what deterministic=True runs
    "dkdv-pointers": lambda c: replace(c, dkdv=replace(c.dkdv, tma_loads=False)),
    "fused-pointers": lambda c: replace(_no_tma(c), fuse_dq_pass=True, atomic_dq=False),
    "dkdv-2cta": lambda c: replace(c, dkdv=KernelConfig(64, 64, 4, 2, tma_loads=True)),
    "dkdv-128": lambda c: replace(c, dkdv=KernelConfig(64, 128, 8, 3, tma_loads=True)),
    "dkdv-2cta-pointers": lambda c: replace(c, dkdv=KernelConfig(64, 64, 4, 2)),
    "split-dq64": lambda c: replace(_tma(c), atomic_dq=False, fuse_dq_pass=False, dq=KernelConfig(64, 64, 4, 3, True)),
    "fused-dq64": lambda c: replace(_tma(c), atomic_dq=False, fuse_dq_pass=True, dq=KernelConfig(64, 64, 4, 3, True)),
    "dkdv-2cta-s3": lambda c: replace(c, dkdv=KernelConfig(64, 64, 4, 3, tma_loads=True)),
    "dq-pointers": lambda c: replace(c, dq=replace(c.dq, tma_loads=False)),
    "tma-fwd64": lambda c: replace(_tma(c), forward=KernelConfig(64, 64, 4, 3, tma_loads=True)),
    "tma-fwd128x64": lambda c: replace(_tma(c), forward=KernelConfig(128, 64, 8, 3, tma_loads=True)),
}


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--head-dims", default="64,128")
    p.add_argument("--seqlens", default="1024,4096,16384")
    p.add_argument("--variants", default="pointers,tma")
    p.add_argument("--peers", default="flex,sdpa-cudnn")
    p.add_argument("--json", default=None)
    args = p.parse_args()
    shapes = standard_shapes(head_dims=[int(d) for d in args.head_dims.split(",")],
                             seqlens=[int(s) for s in args.seqlens.split(",")])
    fused = next(s for s in SYSTEMS if s.name == "fusedattn")
    peers = [s for s in SYSTEMS if s.name in args.peers.split(",")]
    names = args.variants.split(",")
    rows = []
    for shape in shapes:
        base = select_configs(torch.device("cuda"), shape.dtype, shape.head_dim, shape.head_dim, shape.seqlen)
        reference = None
        for name in names:
            with pinned_configs(VARIANTS[name](base)):
                row, out = measure(fused, shape, "cuda", reference)
            reference = out if reference is None else reference
            rows.append(dict(row, system=name))
        for peer in peers:
            row, _ = measure(peer, shape, "cuda", reference)
            rows.append(row)
        print(_table([r for r in rows if r["case"] == shape.name], peers[0].name if peers else None), flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(environment=environment(), rows=rows), f, indent=1)


def _table(rows, against) -> str:
    peer = next((r for r in rows if r["system"] == against and "fwd_ms" in r), None)
    lines = [f"{rows[0]['case']}:  {'fwd ms':>8} {'bwd ms':>8} {'f+b ms':>8} {'f+b TF/s':>9} {'vs ' + (against or '-'):>10}"]
    for r in rows:
        if "fwd_ms" not in r:
            lines.append(f"  {r['system']:<16} {r.get('note', '')}")
            continue
        ratio = f"{peer['fwdbwd_ms'] / r['fwdbwd_ms']:.3f}x" if peer else ""
        flag = "" if r.get("output_agrees", True) else "  OUTPUT DISAGREES"
        lines.append(f"  {r['system']:<16} {r['fwd_ms']:8.3f} {r['bwd_ms']:8.3f} {r['fwdbwd_ms']:8.3f} "
                     f"{r['fwdbwd_tflops']:9.1f} {ratio:>10}{flag}")
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
