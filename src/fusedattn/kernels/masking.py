"""The masking functions: the keep rule of SPEC 3.2 applied to a score tile, and the user's
boolean mask (SPEC 3.3) on top of it.

Interior tiles (see ``block_range``) never call it. The backward's dK/dV pass holds
tiles transposed -- keys along rows -- and asks for ``TRANSPOSED=True``.
Masked scores become -inf, never a large negative number: a finite stand-in leaks
probability into masked keys on long rows.

The rule is turned into an inclusive key range per query row,
``[i + diag - window_left, min(i + diag + window_right, seqlen_k - 1)]``, so each
element costs two compares against per-row bounds rather than index arithmetic on
the whole tile (boundary tiles are register-bound in the backward).
"""

import triton
import triton.language as tl


@triton.jit
def apply_mask(
    scores, offs_q, offs_k, seqlen_q, seqlen_k, window_left, window_right,
    HAS_LEFT: tl.constexpr, HAS_RIGHT: tl.constexpr, TRANSPOSED: tl.constexpr,
):
    diag = seqlen_k - seqlen_q
    last_key = seqlen_k - 1 + offs_q * 0
    if HAS_RIGHT:
        last_key = tl.minimum(last_key, offs_q + (diag + window_right))
    if TRANSPOSED:
        keep = offs_k[:, None] <= last_key[None, :]
        if HAS_LEFT:
            keep = keep & (offs_k[:, None] >= (offs_q + (diag - window_left))[None, :])
    else:
        keep = offs_k[None, :] <= last_key[:, None]
        if HAS_LEFT:
            keep = keep & (offs_k[None, :] >= (offs_q + (diag - window_left))[:, None])
    return tl.where(keep, scores, float("-inf"))


@triton.jit
def apply_user_mask(scores, mask_base, offs_q, offs_k, seqlen_q, seqlen_k, stride_mq, stride_mk,
                    TRANSPOSED: tl.constexpr):
    """The user's boolean mask (True = attend) on a score tile. ``mask_base`` points at this
    (batch, head) of the mask viewed as (B, H, Sq, Sk) bytes; broadcast dims have stride 0.
    Entries past Sq or Sk read as False, so padding rows and keys stay masked."""
    if TRANSPOSED:
        offsets = offs_k[:, None].to(tl.int64) * stride_mk + offs_q[None, :].to(tl.int64) * stride_mq
        inside = (offs_k[:, None] < seqlen_k) & (offs_q[None, :] < seqlen_q)
    else:
        offsets = offs_q[:, None].to(tl.int64) * stride_mq + offs_k[None, :].to(tl.int64) * stride_mk
        inside = (offs_q[:, None] < seqlen_q) & (offs_k[None, :] < seqlen_k)
    keep = tl.load(mask_base + offsets, mask=inside, other=0) != 0
    return tl.where(keep, scores, float("-inf"))
