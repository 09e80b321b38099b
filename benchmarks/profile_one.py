"""One forward + backward of fusedattn and of FlexAttention on one shape, for a profiler.

    ncu --clock-control none -k regex:"_forward_kernel|_backward_kernel|triton_tem" \
        --section SpeedOfLight --section WarpStateStats python benchmarks/profile_one.py --head-dim 128

Each system runs twice (the first run compiles); with ``--variant`` the fusedattn configs
come from ``benchmarks/variants.py``.
"""

from __future__ import annotations

import argparse

import torch

import fusedattn
from fusedattn.bench.systems import Shape, _flex
from fusedattn.tuning.configs import pinned_configs, select_configs

from variants import VARIANTS


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--seqlen", type=int, default=4096)
    p.add_argument("--causal", action="store_true")
    p.add_argument("--variant", default="heuristic")
    p.add_argument("--systems", default="fusedattn,flex")
    args = p.parse_args()
    d, s = args.head_dim, args.seqlen
    shape = Shape(16384 // s, 2048 // d, s, d, args.causal)
    gen = torch.Generator(device="cuda").manual_seed(0)
    size = (shape.batch, shape.heads, s, d)
    q, k, v, dout = (torch.randn(size, device="cuda", dtype=torch.bfloat16, generator=gen) for _ in range(4))
    leaves = [t.requires_grad_() for t in (q, k, v)]
    configs = VARIANTS[args.variant](select_configs(q.device, q.dtype, d, d))
    systems = {"fusedattn": lambda *t: fusedattn.attention(*t, layout="bhsd", causal=args.causal),
               "flex": _flex(shape)}
    for name in args.systems.split(","):
        for _ in range(2):
            with pinned_configs(configs):
                systems[name](*leaves).backward(dout)
            torch.cuda.synchronize()
    print("done", configs)


if __name__ == "__main__":
    main()
