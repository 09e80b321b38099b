"""Attention dropout: which probabilities are dropped, written once for every path.

A call with ``dropout_p = p > 0`` draws one 64-bit seed on q's device from torch's generator
(``draw_seed``: a ``torch.randint`` there, as inductor draws its seeds). ``torch.manual_seed``
therefore reproduces a call's mask, a CUDA graph's replay re-runs the draw and gets a new mask, and
the forward keeps the seed tensor for its backward, which regenerates the same mask.

The mask is a function of (seed, b * Hq + h, i, j) alone -- b the batch index (the sequence's, when
packed), h the query head, i and j the query and key positions inside the sequence -- so it does
not depend on tile sizes, the kernel family or the backend. Philox4x32 with ``ROUNDS`` rounds,
keyed by the seed, maps the counter (j // 16, i, b * Hq + h, 0) to four 32-bit words; their sixteen
bytes, little-endian, word after word, are the random bytes of keys 16 (j // 16) ... 16 (j // 16) + 15.
A probability is kept when its byte is at least ``threshold(p) = round(256 p)``, at most 255: one
Philox call covers sixteen probabilities, as FlashAttention 2 draws bytes. The drop rate is therefore
p rounded to a multiple of 1/256 (0.1 drops 26/256 = 0.1016, as FlashAttention's 0.1 does), and a p
of 511/512 or more drops 255/256 (a byte can always be kept: the scale stays finite); kept probabilities
are scaled by 256 / (256 - threshold), the inverse of the kept fraction actually drawn, so the
output's expectation is the undropped output exactly.

``keep_mask`` is the mask in PyTorch (the PyTorch backend and the reference use it);
``kernels/triton/dropout.py`` computes the same bits per tile in the kernels.
"""

from __future__ import annotations

import torch

ROUNDS = 7  # Philox4x32-7: the fewest rounds Random123 reports as passing BigCrush
LEVELS = 256  # one random byte per probability
KEYS_PER_CALL = 16  # four 32-bit words of one Philox call

_PHILOX_MUL_A, _PHILOX_MUL_B = 0xD2511F53, 0xCD9E8D57
_PHILOX_KEY_A, _PHILOX_KEY_B = 0x9E3779B9, 0xBB67AE85
_U32 = 0xFFFFFFFF


def threshold(p: float) -> int:
    """The byte value below which a probability is dropped: round(256 p), at most 255 (a p just
    under 1 would otherwise round to 256, drop everything and leave no scale)."""
    return min(int(round(float(p) * LEVELS)), LEVELS - 1)


def keep_scale(p: float) -> float:
    """1 / (kept fraction actually drawn): what kept probabilities are multiplied by."""
    return LEVELS / (LEVELS - threshold(p))


def draw_seed(device: torch.device) -> torch.Tensor:
    """A fresh seed, (1,) int64 on ``device``, from torch's default generator there."""
    return torch.randint(0, 2**62, (1,), dtype=torch.int64, device=device)


def _philox(seed: int, c0: torch.Tensor, c1: torch.Tensor, c2: torch.Tensor, c3: torch.Tensor,
            rounds: int = ROUNDS) -> tuple[torch.Tensor, ...]:
    """Philox4x32 on int64 tensors holding uint32 values (broadcast together), key = the seed's low
    and high 32 bits. int64 products wrap modulo 2**64, whose high half is still the exact
    ``umulhi`` of two uint32 values."""
    k0, k1 = seed & _U32, (seed >> 32) & _U32
    for _ in range(rounds):
        p0, p2 = _PHILOX_MUL_B * c2, _PHILOX_MUL_A * c0
        c0, c2 = ((p0 >> 32) & _U32) ^ c1 ^ k0, ((p2 >> 32) & _U32) ^ c3 ^ k1
        c1, c3 = p0 & _U32, p2 & _U32
        k0, k1 = (k0 + _PHILOX_KEY_A) & _U32, (k1 + _PHILOX_KEY_B) & _U32
    return c0, c1, c2, c3


def random_bytes(seed: int, batch_heads: torch.Tensor, rows: torch.Tensor, cols: torch.Tensor) -> torch.Tensor:
    """The random byte (int64 0..255) of each (batch_head, row, col), the three index tensors
    broadcast together (non-negative integers)."""
    batch_heads, rows, cols = torch.broadcast_tensors(batch_heads.long(), rows.long(), cols.long())
    words = _philox(int(seed), cols // KEYS_PER_CALL, rows, batch_heads, torch.zeros_like(rows))
    within = cols % KEYS_PER_CALL
    word = torch.stack(words, -1).gather(-1, (within // 4).unsqueeze(-1)).squeeze(-1)
    return (word >> (8 * (within % 4))) & 0xFF


def keep_mask(seed, batch: int, heads_q: int, seqlen_q: int, seqlen_k: int, p: float,
              device: torch.device | str = "cpu", *, batch_start: int = 0, query_start: int = 0,
              query_end: int | None = None, key_start: int = 0, key_end: int | None = None) -> torch.Tensor:
    """Bool (batch, heads_q, queries, keys): True where the probability is kept, for the batches
    (or packed sequences) ``batch_start ... batch_start + batch - 1``, queries ``[query_start,
    query_end)`` and keys ``[key_start, key_end)`` (default: all). ``seed``: an int or the call's (1,)
    seed tensor. With ``torch.manual_seed(s)`` run before a call and again before ``draw_seed``, this
    is that call's mask."""
    if isinstance(seed, torch.Tensor):
        seed = int(seed.reshape(-1)[0].item())
    query_end = seqlen_q if query_end is None else query_end
    key_end = seqlen_k if key_end is None else key_end
    b = torch.arange(batch_start, batch_start + batch, device=device)
    h = torch.arange(heads_q, device=device)
    batch_heads = (b[:, None] * heads_q + h[None, :])[:, :, None, None]
    rows = torch.arange(query_start, query_end, device=device)[:, None]
    cols = torch.arange(key_start, key_end, device=device)[None, :]
    return random_bytes(seed, batch_heads, rows, cols) >= threshold(p)


def check_dropout(dropout_p) -> float:
    """``dropout_p`` as a float in [0, 1), or an error naming it."""
    if isinstance(dropout_p, bool) or not isinstance(dropout_p, (int, float)):
        raise TypeError(f"dropout_p must be a float in [0, 1), got {type(dropout_p).__name__}")
    p = float(dropout_p)
    if not 0.0 <= p < 1.0:
        raise ValueError(f"dropout_p must be in [0, 1), got {dropout_p}")
    return p
