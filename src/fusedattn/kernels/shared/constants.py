"""Constants every kernel family and the host share, and the score scaling they all take."""

from __future__ import annotations

from ...spec import AttentionSpec

LOG2E = 1.4426950408889634  # log2(e): the kernels keep scores in log2 units, so exp2 replaces exp


def score_constants(spec: AttentionSpec) -> tuple[float, float]:
    """(qk_scale, softcap_log2) as every kernel's ``log2_scores`` expects them."""
    if spec.has_softcap:
        return spec.scale / spec.softcap, spec.softcap * LOG2E
    return spec.scale * LOG2E, 0.0


# dQ's register order (the Gluon dK/dV pass's staging, undone by the Triton conversion): a 64 x 64
# fp32 tile as one run of 4096 floats whose offset bit i holds the tile's (row, column) bit
# REGISTER_ORDER_BASES[i] -- the order of the Hopper wgmma accumulator's registers, so that each
# thread stores 16-byte vectors and a warp's lanes 0-7 fall on 8 different 16-byte chunks (no bank
# conflict). Run r of a head covers rows [64 (r // (D / 64)), + 64) x columns [64 (r % (D / 64)), + 64).
REGISTER_ORDER_BASES = ((0, 1), (8, 0), (0, 2), (0, 4), (1, 0), (0, 8), (0, 16), (0, 32), (2, 0), (4, 0), (16, 0),
                        (32, 0))


def register_order_permutation() -> tuple[int, ...]:
    """How a (tiles, 4096) block of runs, reshaped to (tiles, 2, ..., 2) (dim 12 - i: offset bit i),
    is permuted into (row bits 5..0, tile, column bits 5..0) order, i.e. rows x (tile, column)."""
    def dim(axis: int, bit: int) -> int:
        offset_bit = next(i for i, b in enumerate(REGISTER_ORDER_BASES) if b[axis] == 1 << bit)
        return 12 - offset_bit
    return (*(dim(0, b) for b in range(5, -1, -1)), 0, *(dim(1, b) for b in range(5, -1, -1)))
