"""Compile-only checks (no GPU) of what Gluon takes, for the notes' account of FA4's Hopper tiles.

FA4's D=128 non-causal backward steps 80 query rows at a time (wgmma N = 80). A Gluon register
tensor or shared-memory tile must have power-of-two dimensions, so a 64 x 80 tile does not compile;
this script shows it for N = 64, 80, 128 (sm_90 target, Triton's own compiler, no device needed).

    python benchmarks/gluon_limits.py
"""

from __future__ import annotations

import triton
from triton.backends.compiler import GPUTarget
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon._runtime import GluonASTSource


@gluon.jit
def _scores_tile(X, N: gl.constexpr):
    """A 64 x N fp32 wgmma accumulator (S^T of one warpgroup's 64 keys against N queries), staged."""
    layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, N, 16])
    s = gl.zeros([64, N], gl.float32, layout=layout)
    smem = gl.allocate_shared_memory(gl.float32, [64, N], gl.NVMMASharedLayout.get_default_for([64, N], gl.float32))
    smem.store(s)


def compiles(n: int) -> str:
    try:
        triton.compile(GluonASTSource(_scores_tile, {"X": "*fp32"}, {"N": n}), target=GPUTarget("cuda", 90, 32))
        return "compiles"
    except Exception as error:  # the innermost cause carries the compiler's message
        while error.__cause__ is not None:
            error = error.__cause__
        return f"fails: {error}"


if __name__ == "__main__":
    for n in (64, 80, 128):
        print(f"64 x {n} scores tile: {compiles(n)}")
