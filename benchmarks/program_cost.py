"""Split each kernel's time into a per-program fixed cost and a per-step cost, fusedattn beside
FlashAttention-4 (or alone), from per-kernel times (torch.profiler, CUPTI) at several sequence
lengths whose launches have the same number of programs.

    python benchmarks/program_cost.py [--systems fusedattn,fa4] [--head-dims 64,128] \\
        [--seqlens 512,1024,2048,4096,8192] [--out program-cost.json]
    python benchmarks/program_cost.py --masks causal,window --window-widths 512,768,1024,1536,2048

The standard shapes hold tokens (B * S = 16k) and B * H * D fixed, so a backward launch has
B * H * S / 128 = the same number of 128-key programs at every S, and a program's steps grow
with S: a kernel's time is waves * (fixed + steps * per_step). A least-squares line of the
kernel's time against the keys a query row sees on average (``keys_per_row``: S full, (S + 1) / 2
causal), per system, D and mask, gives the intercept (the fixed cost of all the programs an SM
runs, in microseconds) and the slope. Two kernels with the same slope and different intercepts
differ per program (prologue, first loads, epilogue), not per step.

``window``: a causal sliding window of W keys at one length (``--window-seqlen``, 4096 by default: at
D=128 the same 2048 key-block programs as the causal lengths), its x (S W - W (W - 1) / 2) / S (its
first W rows see fewer), so that the slopes of the three masks are the same step cost and compare: a window's programs' steps grow with W, its masked steps (the left edge and the
diagonal) do not. Its intercept less the causal one is the cost of the left edge's masked steps;
what the two share is the fixed part. (Keep W at or above the width where the forward's config
changes: ``configs.WIDE_LEFT_WINDOW``.)
Timing only: outputs are not compared here (``python -m fusedattn.bench`` checks each system's).
"""

from __future__ import annotations

import argparse
import collections
import json
import re

import torch

import fusedattn
from fusedattn.bench.systems import fa4_attn_func, fa4_call, stored_as
from fusedattn.dispatch import configs_for
from fusedattn.spec import UNBOUNDED, AttentionSpec

ROLES = [  # kernel name pattern -> role, first match wins
    ("pre", r"_preprocess_kernel|BackwardPreprocess"),
    ("post", r"_convert_dq|BackwardPostprocess"),
    ("forward", r"_attn_fwd|_forward|ForwardSm90"),
    ("dkdv", r"_dkdv|_backward_kernel|BackwardSm90"),
]


def role(name: str) -> str:
    for r, pattern in ROLES:
        if re.search(pattern, name):
            return r
    return "other"


def bhsd_inputs(batch: int, heads: int, heads_kv: int, seqlen: int, head_dim: int):
    """Seeded random bf16 q, k, v of (B, H, S, D) shapes (k and v with ``heads_kv`` heads)."""
    gen = torch.Generator(device="cuda").manual_seed(0)
    q = torch.randn(batch, heads, seqlen, head_dim, device="cuda", dtype=torch.bfloat16, generator=gen)
    k, v = (torch.randn(batch, heads_kv, seqlen, head_dim, device="cuda", dtype=torch.bfloat16, generator=gen)
            for _ in range(2))
    return q, k, v


def call_masking(window: int | None, causal: bool = True) -> dict:
    """``fusedattn.attention``'s mask options: a causal sliding window of ``window`` keys (the query
    itself included), else ``causal``."""
    return dict(window=(window - 1, 0)) if window else dict(causal=causal)


def heuristic_configs(q, v, seqlen_k: int, window: int | None, causal: bool = True, softcap: float = 0.0):
    """The configs fusedattn picks for such a call (``dispatch.configs_for``: a tuned entry, else the
    heuristics, with a window's band class), for the forms' scripts to pin variations of."""
    spec = AttentionSpec("bhsd", window - 1 if window else UNBOUNDED, 0 if window or causal else UNBOUNDED,
                         q.shape[-1] ** -0.5, softcap, False)
    return configs_for(q, v, spec, seqlen_k)


def kernel_times(fn, iters: int) -> dict[str, float]:
    """Mean microseconds per call of each kernel ``fn`` launches (the profiler's device times)."""
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(iters):
            fn()
        torch.cuda.synchronize()
    totals: dict[str, float] = collections.defaultdict(float)
    for event in prof.events():
        if event.device_type == torch.autograd.DeviceType.CUDA:
            totals[event.name] += event.time_range.elapsed_us()
    return {name: t / iters for name, t in totals.items()}


def keys_per_row(seqlen: int, window: int | None, causal: bool) -> float:
    """The keys a query row sees on average (the fit's x): full S, causal (S + 1) / 2, a causal window
    of W keys (the row itself included) (S W - W (W - 1) / 2) / S."""
    if window:
        w = min(window, seqlen)
        return (seqlen * w - w * (w - 1) / 2) / seqlen
    return (seqlen + 1) / 2 if causal else float(seqlen)


def fit(xs: list[float], ys: list[float]) -> tuple[float, float]:
    n = len(xs)
    mx, my = sum(xs) / n, sum(ys) / n
    sxx = sum((x - mx) ** 2 for x in xs)
    slope = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sxx
    return my - slope * mx, slope


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--systems", default="fusedattn,fa4")
    p.add_argument("--head-dims", default="64,128")
    p.add_argument("--seqlens", default="512,1024,2048,4096,8192")
    p.add_argument("--masks", default="causal,full", help="causal, full, window (a sliding window of each width)")
    p.add_argument("--window-widths", default="512,768,1024,1536,2048")
    p.add_argument("--window-seqlen", type=int, default=4096)
    p.add_argument("--iters", type=int, default=10)
    p.add_argument("--out", default="program-cost.json")
    args = p.parse_args()
    seqlens = [int(s) for s in args.seqlens.split(",")]
    widths = [int(w) for w in args.window_widths.split(",")]
    rows = []
    for d in (int(x) for x in args.head_dims.split(",")):
        for mask in args.masks.split(","):
            causal = mask == "causal"
            # (S, window keys or None) of each point; the fit's x is the window's width or S
            points = [(args.window_seqlen, w) for w in widths] if mask == "window" else [(s, None) for s in seqlens]
            for system in args.systems.split(","):
                fa4 = fa4_attn_func() if system == "fa4" else None
                per_role: dict[str, list[float]] = collections.defaultdict(list)
                for s, width in points:
                    window = (width - 1, 0) if width else None
                    gen = torch.Generator(device="cuda").manual_seed(0)
                    size = (16384 // s, 2048 // d, s, d)
                    q, k, v, dout = (torch.randn(size, device="cuda", dtype=torch.bfloat16, generator=gen)
                                     for _ in range(4))
                    if fa4 is not None:
                        leaves = [stored_as(t, "bshd").requires_grad_() for t in (q, k, v)]
                        grad = stored_as(dout, "bshd")
                        call = lambda: fa4_call(fa4, *leaves, causal=causal or window is not None,  # noqa: E731
                                                window_size=window or (None, None))
                    else:
                        leaves = [t.requires_grad_() for t in (q, k, v)]
                        grad = dout
                        options = call_masking(width, causal)
                        call = lambda: fusedattn.attention(*leaves, layout="bhsd", **options)  # noqa: E731

                    def step():
                        for t in leaves:
                            t.grad = None
                        call().backward(grad)

                    times = kernel_times(step, args.iters)
                    by_role: dict[str, float] = collections.defaultdict(float)
                    for name, t in times.items():
                        by_role[role(name)] += t
                    for r, t in by_role.items():
                        per_role[r].append(t)
                    row = {"system": system, "head_dim": d, "causal": causal, "window": width, "seqlen": s,
                           "roles_us": dict(by_role), "kernels_us": times}
                    rows.append(row)
                    print(f"{system:10s} D={d} {mask:6s} S={s:5d} " + (f"W={width:5d} " if width else "") +
                          " ".join(f"{r}={t:8.1f}" for r, t in sorted(by_role.items())), flush=True)
                for r, ts in per_role.items():
                    if len(ts) == len(points) and r in ("forward", "dkdv"):
                        a, b = fit([keys_per_row(s, width, causal) for s, width in points], ts)
                        print(f"  fit {system} D={d} {mask} {r}: {a:8.1f} us + {b * 1024:8.1f} us per 1k keys a "
                              "row sees", flush=True)
                        rows.append({"system": system, "head_dim": d, "causal": causal, "mask": mask, "role": r,
                                     "intercept_us": a, "slope_us_per_1k": b * 1024, "x": "keys a row sees"})
    device = torch.cuda.get_device_name()
    with open(args.out, "w") as f:
        json.dump({"device": device, "torch": torch.__version__, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
