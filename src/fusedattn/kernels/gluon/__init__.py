"""The Gluon kernels: warp-specialised, for Hopper (sm_90) only.

This package's own namespace says which problems they compute, without importing Triton's Gluon
dialect: the planner asks it on any machine. The kernels (``common``, ``fwd``, ``bwd``) are
imported only where they run, never under Triton's interpreter.
"""

from __future__ import annotations

import functools

import torch

from ...spec import UNBOUNDED, AttentionSpec
from ..shared.support import TAKEN, Support, refused

DTYPES = (torch.bfloat16, torch.float16)
HEAD_DIMS = (64, 128)
WG_ROWS = 64  # rows of one consumer warpgroup's tile (one wgmma M)


def dkdv_key_block(config) -> int:
    """Keys one program of the Gluon dK/dV pass owns: WG_ROWS per consumer warpgroup of ``config``."""
    return WG_ROWS * config.hopper_split


def ordered_heaviest_first(config) -> bool:
    """Whether the dK/dV pass summing dQ in a fixed order under a causal bound launches its heaviest
    programs first (every walk from the last query block down, turns ascending) rather than its
    lightest (turns descending, the diagonal's program adding first), where its launch is not
    interleaved (``bwd.fixed_order_launch``, which interleaved always goes heaviest first): with 64-row
    steps (D=128).
    Measured against each other (the dK/dV pass, one H200, two runs at 4k and 16k keys): heaviest first
    1-7% faster at 4k and 6-8% at 16k with 64-row steps, where lightest first ends on its heaviest
    programs with 7-8% of the SMs idle; 3-8% slower with 128-row steps (D=64)."""
    return config.block_m <= 64


def problem_support(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, spec: AttentionSpec) -> Support:
    """Whether the Gluon kernels compute the problem (else the Triton kernels do): sm_90, 16-bit,
    D = Dv in {64, 128}, a right window of none or 0 (causal), any left window; softcap or not."""
    if not q.is_cuda:
        return refused("not a CUDA tensor")
    if major_capability(q.device.index) != 9:
        return refused(f"the GPU is sm_{major_capability(q.device.index)}x; the Gluon kernels are built for sm_90")
    if q.dtype not in DTYPES:
        return refused(f"{q.dtype} inputs; the Gluon kernels take fp16 and bf16")
    head_dim, head_dim_v = q.shape[-1], v.shape[-1]
    if head_dim != head_dim_v or head_dim not in HEAD_DIMS:
        return refused(f"head dims D={head_dim}, Dv={head_dim_v}; the Gluon kernels take D = Dv in {HEAD_DIMS}")
    if spec.window_right not in (UNBOUNDED, 0):
        return refused(f"a right window of {spec.window_right} keys; the Gluon kernels take none or 0 (causal)")
    return TAKEN


@functools.lru_cache(maxsize=None)
def major_capability(device_index: int | None) -> int:  # a driver query: kept, asked several times a step
    return torch.cuda.get_device_capability(device_index)[0]


@functools.lru_cache(maxsize=None)
def multiprocessors(device_index: int | None) -> int:  # a driver query: kept
    return torch.cuda.get_device_properties(device_index).multi_processor_count
