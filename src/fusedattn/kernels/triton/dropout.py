"""Attention dropout's keep bits for a tile, as ``fusedattn/dropout.py`` defines them.

One Philox4x32 call per 16 keys of a row: counter (key // 16, row, batch * Hq + head, 0) keyed by
the call's seed; its sixteen bytes, word after word and little-endian within a word, belong to the
sixteen keys in order, and a probability is kept when its byte is at least the threshold.

The words are spread over the keys in two steps: interleaved once into one word per four keys
(``_spread4``), then each word broadcast over its four keys, which shift out their own byte. The
tile the dK/dV pass takes (keys along rows) is made in that orientation from the start. Spreading
the bytes by a second interleave, or transposing a finished tile, each became a round trip through
shared memory with a barrier, several per tile, which cost more than the Philox rounds themselves.
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
    M: tl.constexpr = offs_q.shape[0]
    GROUPS: tl.constexpr = BLOCK_K // 16
    groups = start_k // 16 + tl.arange(0, GROUPS)
    byte_shift = ((tl.arange(0, BLOCK_K) % 4) * 8).to(tl.uint32)  # each key's byte within its word
    if TRANSPOSED:
        c0 = (groups[:, None] + offs_q[None, :] * 0).to(tl.uint32)
        c1 = (offs_q[None, :] + groups[:, None] * 0).to(tl.uint32)
        w0, w1, w2, w3 = tl.philox(seed, c0, c1, (batch_head + c0 * 0).to(tl.uint32), c0 * 0, DROPOUT_ROUNDS)
        # (GROUPS, M, 2, 2) [g, m, t, s] = word 2t + s -> (4 GROUPS, M): row 4g + w = word w of group g
        words = tl.reshape(tl.permute(tl.join(tl.join(w0, w2), tl.join(w1, w3)), (0, 2, 3, 1)), (4 * GROUPS, M))
        words = tl.reshape(tl.broadcast_to(words[:, None, :], (4 * GROUPS, 4, M)), (BLOCK_K, M))
        random_bytes = (words >> byte_shift[:, None]) & 0xFF
    else:
        c0 = (groups[None, :] + offs_q[:, None] * 0).to(tl.uint32)
        c1 = (offs_q[:, None] + groups[None, :] * 0).to(tl.uint32)
        w0, w1, w2, w3 = tl.philox(seed, c0, c1, (batch_head + c0 * 0).to(tl.uint32), c0 * 0, DROPOUT_ROUNDS)
        words = _spread4(w0, w1, w2, w3)  # (M, 4 GROUPS): column 4g + w = word w of group g
        words = tl.reshape(tl.broadcast_to(words[:, :, None], (M, 4 * GROUPS, 4)), (M, BLOCK_K))
        random_bytes = (words >> byte_shift[None, :]) & 0xFF
    return random_bytes >= threshold.to(tl.uint32)
