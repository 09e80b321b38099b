"""Scores and softmax pieces in the log2 domain, shared by forward and backward.

The softmax scale (and softcap) is folded with log2(e) on the host, so a score costs
one multiply and ``exp2`` replaces ``exp``. Row statistics follow the convention for
empty rows: a row with no kept key ends with sum 0, output 0 and lse -inf (with a sink: sum 1,
output 0, lse = the sink).
"""

import triton
import triton.language as tl

from ..shared import constants

LOG2E = tl.constexpr(constants.LOG2E)
LN2 = tl.constexpr(0.6931471805599453)


@triton.jit
def tanh(x):
    # exp2-based, accurate to a few fp32 ulps on the GPU and under the interpreter alike
    # (libdevice has no interpreter implementation); near 0 a short odd series avoids the
    # cancellation in 1 - e^{-2|x|}.
    ax = tl.abs(x)
    e = tl.math.exp2(ax * (-2.0 * LOG2E))
    far = (1.0 - e) / (1.0 + e)
    x2 = ax * ax
    near = ax * (1.0 + x2 * (-0.3333333333333333 + x2 * (0.13333333333333333 + x2 * -0.05396825396825397)))
    magnitude = tl.where(ax < 0.125, near, far)
    return tl.where(x < 0, -magnitude, magnitude)


TANH_APPROX = 2  # HAS_SOFTCAP's value for tanh.approx.f32 (``fwd.softcap_mode``)
SOFTCAP_TANH_APPROX = tl.constexpr(TANH_APPROX)  # the same, as the kernels read it


@triton.jit
def log2_scores(qk, qk_scale, softcap_log2, HAS_SOFTCAP: tl.constexpr):
    """Scores times log2(e), and tanh of the capped argument (for the softcap gradient).

    With softcap: ``qk_scale = scale / softcap`` and ``softcap_log2 = softcap * log2(e)``,
    so the result is ``log2(e) * softcap * tanh(scale * qk / softcap)``. HAS_SOFTCAP =
    SOFTCAP_TANH_APPROX (bf16 on the GPU): tanh by the one-instruction approximation the Gluon
    kernels take for bf16 (``hopper.log2_scores``), so that every pass of a call computes the same
    scores. Without: ``qk_scale = scale * log2(e)``.
    """
    if HAS_SOFTCAP == SOFTCAP_TANH_APPROX:
        t = tl.inline_asm_elementwise("tanh.approx.f32 $0, $1;", "=r,r", [qk * qk_scale], dtype=tl.float32,
                                      is_pure=True, pack=1)
        return t * softcap_log2, t
    elif HAS_SOFTCAP:
        t = tanh(qk * qk_scale)
        return t * softcap_log2, t
    else:
        return qk * qk_scale, qk


@triton.jit
def initial_row_stats(Sinks, head, BLOCK_M: tl.constexpr, HAS_SINKS: tl.constexpr):
    """(row_max, row_sum) before the first key tile. A sink is one more logit in every row of its
    head: the online softmax starts as if it had seen it, max = sink, sum = exp2(0)."""
    if HAS_SINKS:
        sink = tl.load(Sinks + head).to(tl.float32) * LOG2E
        return tl.full([BLOCK_M], 0.0, dtype=tl.float32) + sink, tl.full([BLOCK_M], 1.0, dtype=tl.float32)
    else:
        return tl.full([BLOCK_M], float("-inf"), dtype=tl.float32), tl.zeros([BLOCK_M], dtype=tl.float32)


@triton.jit
def online_softmax_step(scores, row_max, row_sum, IS_MASKED: tl.constexpr, tile_shift=0.0,
                        HAS_TILE_SHIFT: tl.constexpr = False):
    """One key tile of the online softmax: returns (p, alpha, new row_max, new row_sum).

    ``alpha`` rescales what was accumulated so far. Only boundary tiles can leave a row
    at -inf, so only they pay for shifting such rows by 0 instead (exp2(-inf - -inf) is NaN).
    ``tile_shift``: a constant the tile's true scores exceed ``scores`` by (ALiBi's key term split
    into a vector and a per-tile constant, ``HAS_TILE_SHIFT``): added to the maxima, not to every score.
    """
    if HAS_TILE_SHIFT:
        new_max = tl.maximum(row_max, tl.max(scores, 1) + tile_shift)
    else:
        new_max = tl.maximum(row_max, tl.max(scores, 1))
    if IS_MASKED:
        shift = tl.where(new_max == float("-inf"), 0.0, new_max)
    else:
        shift = new_max
    if HAS_TILE_SHIFT:
        p = tl.math.exp2(scores - (shift - tile_shift)[:, None])
    else:
        p = tl.math.exp2(scores - shift[:, None])
    alpha = tl.math.exp2(row_max - shift)
    row_sum = row_sum * alpha + tl.sum(p, 1)
    return p, alpha, new_max, row_sum


@triton.jit
def finalize_rows(acc, row_max, row_sum):
    """Normalised output and natural-log lse; rows with no kept key give 0 and -inf."""
    empty = row_sum == 0.0
    safe_sum = tl.where(empty, 1.0, row_sum)
    out = acc / safe_sum[:, None]
    lse = tl.where(empty, float("-inf"), (row_max + tl.math.log2(safe_sum)) * LN2)
    return out, lse


@triton.jit
def lse_for_backward(lse):
    """lse in the log2 domain; a row with no kept key becomes +inf so p = exp2(-inf - inf) = 0."""
    return tl.where(lse == float("-inf"), float("inf"), lse * LOG2E)
