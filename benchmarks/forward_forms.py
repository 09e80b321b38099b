"""The Hopper forward's forms side by side, in one process, rounds alternating (CUDA events,
``triton.testing.do_bench``): the forward alone, each form's output compared with the first
form's before it is timed.

    python benchmarks/forward_forms.py --out DIR
    python benchmarks/forward_forms.py --head-dims 64 --shapes 4096:causal --forms heuristic,ws2

Forms (pinned forward configs; everything else the heuristic's):
- ``heuristic``: the heuristic's forward;
- ``ws2``, ``ws3``: the warp-specialised kernel on 2 or 3 consumer warpgroups (128- or 192-row
  tiles, 128-key blocks), taking turns.
Shapes: ``S:causal|full|window[N]`` (B x S = 16k tokens, 2048 / D query heads, bf16, bhsd; window:
causal with an N-key sliding window, 1024 by default, FLOP/s counted over the pairs it keeps). Writes
``<out>/forward-forms-<gpu>.json`` and prints the medians.
"""

import argparse
import json
from dataclasses import replace
from pathlib import Path

import torch
import triton

import fusedattn
from fusedattn.tuning.configs import KernelConfig, pinned_configs
from program_cost import call_masking, heuristic_configs


WINDOW = 1024  # keys a query sees in the window shapes, itself included


def ws(split: int) -> KernelConfig:
    return KernelConfig(64 * split, 128, 4, 2, tma_loads=True, hopper_overlap=0, hopper_split=split, hopper_pingpong=1)


FORMS = {"ws2": ws(2), "ws3": ws(3)}


def window_keys(mask: str) -> int | None:
    """Keys a query sees for ``window`` (WINDOW) or ``windowN`` (N), else None."""
    return (int(mask[6:] or WINDOW)) if mask.startswith("window") else None


def kept_pairs(seqlen: int, mask: str) -> int:
    if mask == "full":
        return seqlen * seqlen
    if mask == "causal":
        return seqlen * (seqlen + 1) // 2
    return sum(min(i + 1, window_keys(mask)) for i in range(seqlen))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--forms", default="heuristic,ws2,ws3")
    p.add_argument("--head-dims", default="64,128")
    p.add_argument("--shapes", default="4096:full,4096:causal,16384:causal")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--out", default="benchmarks/results")
    args = p.parse_args()
    forms = args.forms.split(",")
    rows = []
    for head_dim in map(int, args.head_dims.split(",")):
        for shape in args.shapes.split(","):
            seqlen, mask = shape.split(":")
            seqlen, causal = int(seqlen), mask != "full"
            window = window_keys(mask)
            batch, heads = max(1, 16384 // seqlen), 2048 // head_dim
            q, k, v = (torch.randn(batch, heads, seqlen, head_dim, device="cuda", dtype=torch.bfloat16)
                       for _ in range(3))
            base = heuristic_configs(q, v, seqlen, window, causal)
            first, times = None, {name: [] for name in forms}
            for _ in range(args.rounds):
                for name in forms:
                    configs = base if name == "heuristic" else replace(base, forward=FORMS[name])
                    with pinned_configs(configs):
                        def call():
                            return fusedattn.attention(q, k, v, layout="bhsd", **call_masking(window, causal))
                        out = call()
                        if first is None:
                            first = out
                        diff = (out.float() - first.float()).abs().max().item()
                        assert diff < 2e-2, f"{name}: output differs from the first form's by {diff}"
                        times[name].append(triton.testing.do_bench(call, warmup=50, rep=300))
            for name in forms:
                ms = sorted(times[name])[len(times[name]) // 2]
                flops = 4 * batch * heads * kept_pairs(seqlen, mask) * head_dim
                rows.append(dict(form=name, head_dim=head_dim, seqlen=seqlen, mask=mask, fwd_ms=ms,
                                 fwd_ms_rounds=times[name], fwd_tflops=flops / ms / 1e9))
                print(f"D={head_dim} {seqlen} {mask:6s} {name:14s} fwd {ms:.3f} ms  {flops / ms / 1e9:.0f} TFLOP/s")
    gpu = torch.cuda.get_device_name().replace(" ", "-")
    out = Path(args.out) / f"forward-forms-{gpu}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(dict(gpu=torch.cuda.get_device_name(), rows=rows), indent=1))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
