"""One forward + backward of fusedattn and of FlexAttention (or FlashAttention-4: ``--systems
fusedattn,fa4``, its wheels installed as benchmarks/NOTES.md v62 says) on one shape, for a profiler.

    ncu --clock-control none -k regex:"_forward_kernel|_backward_kernel|triton_tem" \
        --section SpeedOfLight --section WarpStateStats python benchmarks/profile_one.py --head-dim 128

(FA4's kernels are CuTe DSL functions: profile without ``-k`` and tell them apart by name.)

Each system runs twice (the first run compiles); with ``--variant`` the fusedattn configs
come from ``benchmarks/variants.py``.
"""

from __future__ import annotations

import argparse

import torch

import fusedattn
from fusedattn.bench.systems import Shape, _flex, fa4_attn_func, fa4_call, stored_as
from fusedattn.tuning.configs import pinned_configs, select_configs

from variants import VARIANTS


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--seqlen", type=int, default=4096)
    p.add_argument("--causal", action="store_true")
    p.add_argument("--variant", default="heuristic")
    p.add_argument("--systems", default="fusedattn,flex", help="comma-separated: fusedattn, flex, fa4")
    args = p.parse_args()
    d, s = args.head_dim, args.seqlen
    shape = Shape(16384 // s, 2048 // d, s, d, args.causal)
    gen = torch.Generator(device="cuda").manual_seed(0)
    size = (shape.batch, shape.heads, s, d)
    q, k, v, dout = (torch.randn(size, device="cuda", dtype=torch.bfloat16, generator=gen) for _ in range(4))
    leaves = [t.requires_grad_() for t in (q, k, v)]
    configs = VARIANTS[args.variant](select_configs(q.device, q.dtype, d, d))
    systems = {"fusedattn": lambda *t: fusedattn.attention(*t, layout="bhsd", causal=args.causal),
               "flex": _flex(shape),
               # FlashAttention-4 on (B, S, H, D) storage, as the bench times it (systems.fa4_call)
               "fa4": lambda *t: fa4_call(fa4_attn_func(), *t, causal=args.causal)}
    for name in args.systems.split(","):
        inputs = leaves
        if name == "fa4":
            inputs = [stored_as(t.detach(), "bshd").requires_grad_() for t in leaves]
        for _ in range(2):
            with pinned_configs(configs):
                systems[name](*inputs).backward(stored_as(dout, "bshd") if name == "fa4" else dout)
            torch.cuda.synchronize()
    print("done", configs)


if __name__ == "__main__":
    main()
