"""Sweep launch configs of each kernel on the GPU and print the best per head dim.

    PYTHONPATH=src python benchmarks/tune.py [--head-dims 64,128] [--seqlen 4096] [--causal]

Times each kernel alone (forward; backward with atomic dQ = preprocess + dK/dV;
deterministic backward = the same + the dQ pass) with configs pinned, on the SPEC 5
shape for that head dim. The winners feed ``tuning/configs.py``'s heuristic; the
results are a table, not a test. For the tuning cache that launches use, run
``python -m fusedattn.tune`` instead; this script also times the atomic-dQ schedules.
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import replace

import torch
import triton.testing

from fusedattn.dispatch import attention_backward, attention_forward
from fusedattn.spec import resolve_spec
from fusedattn.tuning.configs import select_configs
from fusedattn.tuning.search import DKDV_CANDIDATES, DQ_CANDIDATES, FORWARD_CANDIDATES, candidate_config

# The candidate grids of the opt-in tuning run (python -m fusedattn.tune).
FWD, DKDV, DQ = FORWARD_CANDIDATES, DKDV_CANDIDATES, DQ_CANDIDATES


def bench(fn):
    try:
        return triton.testing.do_bench(fn, warmup=10, rep=40, return_mode="median")
    except Exception as e:  # out of shared memory / registers: not a candidate
        return f"{type(e).__name__}: {str(e).splitlines()[0][:80]}"


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--head-dims", default="64,128")
    p.add_argument("--seqlen", type=int, default=4096)
    p.add_argument("--causal", action="store_true")
    p.add_argument("--only", default="fwd,bwd-tma,bwd-atomic,bwd-det-dkdv,bwd-det-dq")
    p.add_argument("--json", default=None)
    p.add_argument("--tma-loads", choices=("on", "off"), default="on")
    args = p.parse_args()
    tma = args.tma_loads == "on"

    def config(cfg):
        return candidate_config(cfg, tma)

    results = {}
    for d in map(int, args.head_dims.split(",")):
        s, h = args.seqlen, 2048 // d
        b = max(1, 16384 // s)
        gen = torch.Generator(device="cuda").manual_seed(0)
        q, k, v, dout = (torch.randn(b, h, s, d, device="cuda", dtype=torch.bfloat16, generator=gen) for _ in range(4))
        spec = resolve_spec(d, layout="bhsd", causal=args.causal, window=None, scale=None, softcap=None,
                            deterministic=False)
        flops = 4 * b * h * s * s * d / (2 if args.causal else 1)
        base = select_configs(q.device, q.dtype, d, d)
        out, lse = attention_forward(q, k, v, spec, base.forward)
        rows = []
        only = args.only.split(",")
        for cfg in FWD if "fwd" in only else []:
            t = bench(lambda: attention_forward(q, k, v, spec, config(cfg)))
            rows.append(("fwd", cfg, t, flops / t * 1e-9 if isinstance(t, float) else None))
        for dq_tma, kind in ((True, "bwd-tma"), (False, "bwd-atomic")):  # dQ by atomics from the dK/dV pass
            for cfg in DKDV if kind in only else []:
                configs = replace(base, dkdv=config(cfg), atomic_dq=True, dq_tma=dq_tma)
                t = bench(lambda: attention_backward(dout, None, q, k, v, out, lse, spec, configs))
                rows.append((kind, cfg, t, 2.5 * flops / t * 1e-9 if isinstance(t, float) else None))
        det = replace(spec, deterministic=True)
        for cfg in DKDV if "bwd-det-dkdv" in only else []:  # the default schedule: dK/dV without atomics, then the dQ pass
            configs = replace(base, dkdv=config(cfg), dq=config(DQ[0]), atomic_dq=False)
            t = bench(lambda: attention_backward(dout, None, q, k, v, out, lse, det, configs))
            rows.append(("bwd-det-dkdv", cfg, t, 2.5 * flops / t * 1e-9 if isinstance(t, float) else None))
        for cfg in DQ if "bwd-det-dq" in only else []:
            configs = replace(base, dq=config(cfg), atomic_dq=False)
            t = bench(lambda: attention_backward(dout, None, q, k, v, out, lse, det, configs))
            rows.append(("bwd-det-dq", cfg, t, 2.5 * flops / t * 1e-9 if isinstance(t, float) else None))
        print(f"\n== D={d} S={s} B={b} H={h} causal={args.causal}  (default {base})")
        for kind, cfg, t, tf in rows:
            shown = f"{t:8.3f} ms {tf:6.1f} TFLOP/s" if tf else str(t)
            gluon = f" gluon={cfg[4]}" if len(cfg) > 4 else ""
            print(f"  {kind:<18} BM={cfg[0]:<4} BN={cfg[1]:<4} warps={cfg[2]} stages={cfg[3]}{gluon}  {shown}")
        for kind in ("fwd", "bwd-tma", "bwd-atomic", "bwd-det-dkdv", "bwd-det-dq"):
            timed = [(t, cfg) for k_, cfg, t, _ in rows if k_ == kind and isinstance(t, float)]
            if timed:
                print(f"  best {kind}: {min(timed)[1]} {min(timed)[0]:.3f} ms")
        results[d] = [dict(kind=k_, config=cfg, ms=t if isinstance(t, float) else None, error=None if isinstance(t, float) else t)
                      for k_, cfg, t, _ in rows]
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    sys.exit(main())
