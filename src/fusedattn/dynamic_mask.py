"""Dynamic masks in the spirit of Flash Dynamic Mask Attention (docs/SEMANTICS.md, "Top-k masks").

``topk_mask`` keeps, per query row, the k allowed keys with the largest score::

    mask = fusedattn.topk_mask(b.detach(), 1024, causal=True)
    out = fusedattn.attention(q, k, v, bias=b, mask=mask, causal=True)   # b trains through kept entries

``topk_block_mask`` is the block-sparse form: per query block it keeps the k key blocks with
the largest pooled score, as a ``BlockMask`` of whole blocks, so the kernels skip every other
tile without reading any mask.

"Allowed" is the keep rule (``causal`` / ``window``, bottom-right aligned), the
same one ``attention`` applies. Scores of -inf or NaN are never kept; a row (or query block)
with fewer than k allowed, finite candidates keeps all of them. Ties are broken by
``torch.topk`` (unspecified order). Both work on row chunks, so temporaries stay small next to
the (.., Sq, Sk) scores.
"""

from __future__ import annotations

import torch

from .block_mask import BlockMask, block_sizes, reduce_chunks
from .checks import check_bool, check_window, is_integer
from .spec import fold_window, keep_mask

CHUNK_ELEMENTS = 1 << 26  # scores handled at once (a few hundred MB of temporaries at most)


def _check_scores(name: str, scores, k) -> None:
    if not isinstance(scores, torch.Tensor) or not scores.is_floating_point():
        raise TypeError(f"fusedattn.{name}: `scores` must be a floating-point tensor (.., Sq, Sk), got "
                        + (str(scores.dtype) if isinstance(scores, torch.Tensor) else type(scores).__name__))
    if not 2 <= scores.dim() <= 4:
        raise ValueError(f"fusedattn.{name}: `scores` must have 2 to 4 dims (.., Sq, Sk), got {tuple(scores.shape)}")
    if not is_integer(k) or k < 1:
        raise ValueError(f"fusedattn.{name}: `k` must be an int >= 1, got {k!r}")


def _check_rule(name: str, causal, window) -> None:
    """``causal`` and ``window`` checked exactly as ``attention`` checks them."""
    check_bool("causal", causal, f"fusedattn.{name}")
    check_window(window, f"fusedattn.{name}")


def _candidates(chunk: torch.Tensor, allowed: torch.Tensor) -> torch.Tensor:
    """The chunk's scores with every entry that may not be kept (not allowed, -inf, NaN) at -inf."""
    return chunk.masked_fill(~allowed | torch.isnan(chunk), float("-inf"))


def topk_mask(scores: torch.Tensor, k: int, *, causal: bool = False,
              window: tuple[int, int] | None = None) -> torch.Tensor:
    """A bool mask of ``scores``' shape (2-4 dims, last two (Sq, Sk)): True at the ``k`` allowed
    keys of each query row with the largest score (see the module doc)."""
    _check_scores("topk_mask", scores, k)
    _check_rule("topk_mask", causal, window)
    k = int(k)
    seqlen_q, seqlen_k = scores.shape[-2:]
    left, right = fold_window(causal, window)
    mask = torch.zeros(scores.shape, dtype=torch.bool, device=scores.device)
    rows_per_chunk = max(1, CHUNK_ELEMENTS // max(1, scores[..., 0, :].numel()))
    for start in range(0, seqlen_q, rows_per_chunk):
        end = min(start + rows_per_chunk, seqlen_q)
        allowed = keep_mask(seqlen_q, seqlen_k, left, right, scores.device, query_start=start, query_end=end)
        candidates = _candidates(scores[..., start:end, :], allowed)
        top = candidates.topk(min(k, seqlen_k), dim=-1).indices
        chunk = mask[..., start:end, :]
        chunk.scatter_(-1, top, True)
        chunk &= candidates != float("-inf")  # a row with fewer than k candidates picked some -inf
    return mask


def _pool_keys(t: torch.Tensor, block_k: int, reduce) -> torch.Tensor:
    """``reduce(view, dim)`` over consecutive key blocks of the last dim (the last may be short)."""
    return reduce_chunks(t, t.dim() - 1, block_k, reduce)


def topk_block_mask(scores: torch.Tensor, k: int, *, block_size: int | tuple[int, int] = (128, 128),
                    causal: bool = False, window: tuple[int, int] | None = None, pool: str = "mean") -> BlockMask:
    """A ``BlockMask`` keeping, per (block_size[0])-row query block, the ``k`` key blocks with the
    largest pooled score: the ``pool`` ("mean" or "max") of the allowed, finite scores of the tile.
    Tiles with no such score are never kept. Pass it as ``attention(..., mask=...)`` with the same
    ``causal`` / ``window``: the kernels then skip every dropped tile, and apply the keep rule on the
    diagonal ones. ``block_size``: an int (square blocks) or (block_q, block_k), powers of two, at least 16."""
    _check_scores("topk_block_mask", scores, k)
    _check_rule("topk_block_mask", causal, window)
    k = int(k)
    if pool not in ("mean", "max"):
        raise ValueError(f"fusedattn.topk_block_mask: `pool` must be 'mean' or 'max', got {pool!r}")
    block_q, block_k = block_sizes(block_size, "fusedattn.topk_block_mask")
    seqlen_q, seqlen_k = scores.shape[-2:]
    left, right = fold_window(causal, window)
    pooled_rows = []
    for start in range(0, seqlen_q, block_q):
        end = min(start + block_q, seqlen_q)
        allowed = keep_mask(seqlen_q, seqlen_k, left, right, scores.device, query_start=start, query_end=end)
        candidates = _candidates(scores[..., start:end, :], allowed).float()
        valid = candidates != float("-inf")
        if pool == "max":
            per_key = candidates.amax(dim=-2)
            pooled = _pool_keys(per_key, block_k, lambda t, d: t.amax(dim=d))
        else:
            sums = _pool_keys(torch.where(valid, candidates, 0.0).sum(dim=-2), block_k, lambda t, d: t.sum(dim=d))
            counts = _pool_keys(valid.sum(dim=-2), block_k, lambda t, d: t.sum(dim=d))
            pooled = torch.where(counts > 0, sums / counts.clamp(min=1), float("-inf"))
        pooled_rows.append(pooled)
    pooled = torch.stack(pooled_rows, dim=-2)  # (.., query blocks, key blocks)
    top = pooled.topk(min(k, pooled.shape[-1]), dim=-1).indices
    keep = torch.zeros(pooled.shape, dtype=torch.bool, device=scores.device).scatter_(-1, top, True)
    keep &= pooled != float("-inf")
    return BlockMask.from_blocks(keep, (block_q, block_k), seqlen_q, seqlen_k)
