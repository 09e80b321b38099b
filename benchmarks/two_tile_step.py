"""Can a two-tile step (64 + 16 query rows) bring FA4's 80-row D=128 backward step into Gluon?
Timing only, on one GPU, every form in one process, rounds alternating; dK/dV pass kernel times
from the profiler (``program_cost.kernel_times``).

    python benchmarks/two_tile_step.py [--shapes 4096:full:16:16,...] [--rounds 3] [--out F.json]

Forms:
- ``fusedattn``: the shipped D=128 dK/dV+dQ pass (64-row steps, two warpgroups of 64 keys);
- ``mock16``: the same pass with ``Knobs.mock_extra_rows = 16``: every step also runs the
  matmuls (S^T, dP^T with N = 16; dV, dK with K = 16; dQ^T = K^T dS^T with N = 16), exponentials
  and dS / dQ stores of 16 more query rows (its tile's first rows again; dK, dV, dQ wrong). A
  two-tile 80-row step does at least this work, in 64/80 as many steps; the mock leaves out the
  extra rows' loads and dQ reduce-adds, so 0.8 x its time is a lower bound for that form;
- ``fa4``: FlashAttention-4 as shipped (80-row steps at D=128 without a causal bound);
- ``fa4-m64``: FA4 with its causal tile choice (64-row steps, dQ not swapped) on every row:
  our step's shape in FA4's kernel.
"""

from __future__ import annotations

import argparse
import collections
import json
import statistics

import torch

import fusedattn
from fusedattn.bench.systems import fa4_attn_func, fa4_call, stored_as
from fusedattn.kernels.shared import knobs

from program_cost import kernel_times, role


def _fa4_tiles(m64: bool):
    """Force FA4's SM90 backward to its causal tiles (m64) or restore its own choice."""
    from flash_attn.cute import interface

    original = getattr(interface, "_fusedattn_original_tiles", interface._tile_size_bwd_sm90)
    interface._fusedattn_original_tiles = original
    if m64:
        interface._tile_size_bwd_sm90 = lambda hd, hdv, causal, local, *a, **k: original(hd, hdv, True, local, *a, **k)
    else:
        interface._tile_size_bwd_sm90 = original


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--forms", default="fusedattn,mock16,fa4,fa4-m64")
    p.add_argument("--shapes", default="1024:full:16:16,4096:full:16:16,16384:full:16:16,4096:full:16:2,"
                                       "4096:causal:16:16")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--iters", type=int, default=10)
    p.add_argument("--out", default="two-tile-step.json")
    args = p.parse_args()
    forms = args.forms.split(",")
    rows = []
    for shape in args.shapes.split(","):
        seqlen, kind, heads_q, heads_kv = shape.split(":")
        seqlen, heads_q, heads_kv, causal = int(seqlen), int(heads_q), int(heads_kv), kind == "causal"
        batch = max(16384 // seqlen, 1)
        gen = torch.Generator(device="cuda").manual_seed(0)
        q, dout = (torch.randn(batch, heads_q, seqlen, 128, device="cuda", dtype=torch.bfloat16, generator=gen)
                   for _ in range(2))
        k, v = (torch.randn(batch, heads_kv, seqlen, 128, device="cuda", dtype=torch.bfloat16, generator=gen)
                for _ in range(2))
        times = collections.defaultdict(list)
        grads = {}
        for rnd in range(args.rounds):
            for form in forms:
                if form.startswith("fa4"):
                    _fa4_tiles(form == "fa4-m64")
                    fn = fa4_attn_func()
                    leaves = [stored_as(t, "bshd").clone().requires_grad_() for t in (q, k, v)]
                    grad = stored_as(dout, "bshd")
                    call = lambda: fa4_call(fn, *leaves, causal=causal)  # noqa: E731
                    extra = 0
                else:
                    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
                    grad = dout
                    call = lambda: fusedattn.attention(*leaves, layout="bhsd", causal=causal)  # noqa: E731
                    extra = 16 if form == "mock16" else 0

                def step():
                    for t in leaves:
                        t.grad = None
                    call().backward(grad)

                with knobs.overridden(mock_extra_rows=extra):
                    per_kernel = kernel_times(step, args.iters)
                    if rnd == 0 and form != "mock16":
                        step()
                        grads[form] = [t.grad.float() for t in leaves]
                dkdv = sum(t for name, t in per_kernel.items() if role(name) == "dkdv")
                times[form].append(dkdv)
                rows.append(dict(S=seqlen, B=batch, Hq=heads_q, Hkv=heads_kv, causal=causal, form=form, round=rnd,
                                 dkdv_us=dkdv, kernels_us=per_kernel))
        _fa4_tiles(False)
        ref = grads.get("fusedattn")
        diffs = {f: max((a - b).abs().max().item() for a, b in zip(g, ref)) for f, g in grads.items()} if ref else {}
        med = {f: statistics.median(ts) for f, ts in times.items()}
        line = " ".join(f"{f}={med[f]:8.1f}" for f in forms)
        if "mock16" in med:
            line += f"  0.8*mock16={0.8 * med['mock16']:8.1f}"
        print(f"D=128 S={seqlen} {kind} {heads_q}/{heads_kv} dK/dV kernel us: {line}  "
              f"max |grad - ours|: {diffs}", flush=True)
        rows.append(dict(S=seqlen, B=batch, Hq=heads_q, Hkv=heads_kv, causal=causal, medians_us=med,
                         max_grad_diff_vs_fusedattn=diffs))
    with open(args.out, "w") as f:
        json.dump({"device": torch.cuda.get_device_name(), "torch": torch.__version__, "rows": rows}, f, indent=1)
    print("wrote", args.out)


if __name__ == "__main__":
    main()
