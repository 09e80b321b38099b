"""Attention dropout's keep bits for a tile, as ``fusedattn/dropout.py`` defines them.

One Philox4x32 call per 16 keys of a row: counter (key // 16, row, batch * Hq + head, 0) keyed by
the call's seed; its sixteen bytes, word after word and little-endian within a word, belong to the
sixteen keys in order, and a probability is kept when its byte is at least the threshold. The words
are spread over the keys by interleaving (``_spread4``), which keeps each row's bytes in one thread.
"""

import triton
import triton.language as tl

DROPOUT_ROUNDS: tl.constexpr = tl.constexpr(7)  # dropout.ROUNDS


@triton.jit
def _spread4(x0, x1, x2, x3):
    """(M, G) x 4 -> (M, 4G) with column 4c + t = x_t[:, c]."""
    return tl.interleave(tl.interleave(x0, x2), tl.interleave(x1, x3))


@triton.jit
def dropout_keep(seed, batch_head, offs_q, start_k, threshold, BLOCK_K: tl.constexpr, TRANSPOSED: tl.constexpr):
    """Bool tile, True where the probability of (query offs_q, key start_k + c) is kept: (rows =
    queries, BLOCK_K keys), or its transpose with ``TRANSPOSED`` (keys along rows, as the dK/dV pass
    holds its tiles). ``start_k``: a multiple of 16; ``seed``: the call's int64 seed."""
    groups = start_k // 16 + tl.arange(0, BLOCK_K // 16)
    c0 = (groups[None, :] + offs_q[:, None] * 0).to(tl.uint32)
    c1 = (offs_q[:, None] + groups[None, :] * 0).to(tl.uint32)
    c2 = (batch_head + c0 * 0).to(tl.uint32)
    c3 = c0 * 0
    w0, w1, w2, w3 = tl.philox(seed, c0, c1, c2, c3, DROPOUT_ROUNDS)
    words = _spread4(w0, w1, w2, w3)  # (M, 4G): column 4c + w = word w of group c
    b0 = words & 0xFF
    b1 = (words >> 8) & 0xFF
    b2 = (words >> 16) & 0xFF
    b3 = words >> 24
    random_bytes = _spread4(b0, b1, b2, b3)  # (M, 16G): column 16c + 4w + byte
    keep = random_bytes >= threshold.to(tl.uint32)
    if TRANSPOSED:
        keep = tl.trans(keep)
    return keep
