"""The one masking function: the keep rule of SPEC 3.2 applied to a score tile.

Interior tiles (see ``block_range``) never call it. The backward's dK/dV pass holds
tiles transposed -- keys along rows -- and asks for ``TRANSPOSED=True``.
Masked scores become -inf, never a large negative number: a finite stand-in leaks
probability into masked keys on long rows.
"""

import triton
import triton.language as tl


@triton.jit
def apply_mask(
    scores, offs_q, offs_k, seqlen_q, seqlen_k, window_left, window_right,
    HAS_LEFT: tl.constexpr, HAS_RIGHT: tl.constexpr, TRANSPOSED: tl.constexpr,
):
    if TRANSPOSED:
        q_idx = offs_q[None, :]
        k_idx = offs_k[:, None]
    else:
        q_idx = offs_q[:, None]
        k_idx = offs_k[None, :]
    keep = k_idx < seqlen_k
    offset_from_diagonal = k_idx - q_idx - (seqlen_k - seqlen_q)
    if HAS_RIGHT:
        keep = keep & (offset_from_diagonal <= window_right)
    if HAS_LEFT:
        keep = keep & (offset_from_diagonal >= -window_left)
    return tl.where(keep, scores, float("-inf"))
