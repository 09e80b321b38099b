"""FlashAttention 2's public functions on fusedattn: switching is one import line,

    from fusedattn.flash_attn import flash_attn_func, flash_attn_varlen_func, flash_attn_with_kvcache

with FlashAttention's signatures, defaults and conventions: (B, S, H, D) tensors; ``causal``
bottom-right aligned; ``window_size=(left, right)``, -1 unbounded, ``causal`` forcing right to 0;
``softmax_scale`` None for 1/sqrt(D); ``softcap`` 0 for none; ``softmax_lse`` (B, H, Sq), or (H,
total_q) for the varlen functions; ``return_attn_probs`` giving (out, softmax_lse, None) -- the
probabilities FlashAttention returns for testing with dropout are not formed
(``fusedattn.dropout.keep_mask`` gives a call's dropout mask). ``flash_attn_with_kvcache`` takes
``cache_batch_idx`` (which cache row each sequence uses) and ``cache_leftpad`` (where each
sequence's cache starts), ``flash_attn_varlen_func`` a paged ``block_table``, with FlashAttention's
rules (neither ``cache_batch_idx`` nor ``cache_leftpad`` together with a paged cache).
``alibi_slopes``: float32 (nheads,) or (batch, nheads) -- batch the number of sequences for the
varlen functions -- adding ``-alibi_slope * |i + seqlen_k - seqlen_q - j|`` to the scores after
softcap (bottom-right aligned, per sequence for varlen; for ``flash_attn_with_kvcache`` seqlen_k is
cache_seqlens + the new tokens, counted from ``cache_leftpad``); no gradient for the slopes.
``dropout_p``: attention dropout as FlashAttention applies it, whenever it is > 0 (pass 0.0 in
evaluation): probabilities dropped at p rounded to a multiple of 1/256, as FlashAttention's 8-bit draw,
and the kept ones scaled by the inverse of the kept fraction drawn (docs/SEMANTICS.md 3.11); the
mask is fusedattn's own (a Philox stream seeded from torch's generator), not FlashAttention's.
fusedattn also takes fp32 inputs, which FlashAttention refuses.
"""

from __future__ import annotations

import torch

from .interface import attention
from .kvcache import kvcache_attention
from .varlen import varlen_attention

__all__ = ["flash_attn_func", "flash_attn_qkvpacked_func", "flash_attn_kvpacked_func", "flash_attn_varlen_func",
           "flash_attn_varlen_qkvpacked_func", "flash_attn_varlen_kvpacked_func", "flash_attn_with_kvcache"]


def _options(caller: str, dropout_p, softmax_scale, causal, window_size, softcap, alibi_slopes=None) -> dict:
    """FlashAttention's arguments as fusedattn's options (``alibi_slopes`` and ``dropout_p`` only where
    given: ``kvcache_attention`` takes no dropout)."""
    left, right = (int(window_size[0]), int(window_size[1]))
    window = None if (left, right) == (-1, -1) else (left, right)
    options = dict(causal=bool(causal), window=window, scale=softmax_scale, softcap=softcap if softcap else None)
    if alibi_slopes is not None:  # FlashAttention's (nheads,) or (batch, nheads) float32 slopes
        options["alibi_slopes"] = alibi_slopes
    if dropout_p:
        options["dropout_p"] = dropout_p
    return options


def _returned(out, lse, return_attn_probs: bool):
    # FlashAttention's third value is the dropout-encoded probabilities, returned only with dropout
    return (out, lse, None) if return_attn_probs else out


def flash_attn_func(q, k, v, dropout_p=0.0, softmax_scale=None, causal=False, window_size=(-1, -1), softcap=0.0,
                    alibi_slopes=None, deterministic=False, return_attn_probs=False):
    """q: (B, Sq, Hq, D), k: (B, Sk, Hkv, D), v: (B, Sk, Hkv, Dv). Returns out (B, Sq, Hq, Dv); with
    ``return_attn_probs`` (out, softmax_lse (B, Hq, Sq) float32, None)."""
    options = _options("flash_attn_func", dropout_p, softmax_scale, causal, window_size, softcap, alibi_slopes)
    out, lse = attention(q, k, v, **options, deterministic=deterministic, return_lse=True)
    return _returned(out, lse, return_attn_probs)


def flash_attn_qkvpacked_func(qkv, dropout_p=0.0, softmax_scale=None, causal=False, window_size=(-1, -1),
                              softcap=0.0, alibi_slopes=None, deterministic=False, return_attn_probs=False):
    """qkv: (B, S, 3, H, D); the three are views of it, and the gradient lands in qkv."""
    return flash_attn_func(qkv[:, :, 0], qkv[:, :, 1], qkv[:, :, 2], dropout_p, softmax_scale, causal, window_size,
                           softcap, alibi_slopes, deterministic, return_attn_probs)


def flash_attn_kvpacked_func(q, kv, dropout_p=0.0, softmax_scale=None, causal=False, window_size=(-1, -1),
                             softcap=0.0, alibi_slopes=None, deterministic=False, return_attn_probs=False):
    """q: (B, Sq, Hq, D), kv: (B, Sk, 2, Hkv, D)."""
    return flash_attn_func(q, kv[:, :, 0], kv[:, :, 1], dropout_p, softmax_scale, causal, window_size, softcap,
                           alibi_slopes, deterministic, return_attn_probs)


def flash_attn_varlen_func(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p=0.0,
                           softmax_scale=None, causal=False, window_size=(-1, -1), softcap=0.0, alibi_slopes=None,
                           deterministic=False, return_attn_probs=False, block_table=None):
    """q: (total_q, Hq, D), k, v: (total_k, Hkv, D); ``cu_seqlens_*`` int32 (B + 1,) offsets. Returns
    out (total_q, Hq, Dv); with ``return_attn_probs`` (out, softmax_lse (Hq, total_q) float32, None).

    With ``block_table`` int32 (B, max_num_blocks_per_seq), k and v are paged caches (num_blocks,
    page_block_size, Hkv, D) and, as in FlashAttention, sequence i's keys are its first
    ``cu_seqlens_k[i + 1] - cu_seqlens_k[i]`` tokens, token t in page ``block_table[i, t //
    page_block_size]``, row ``t % page_block_size`` (only the differences of ``cu_seqlens_k`` count:
    they are lengths, not offsets into k). Those keys are gathered into packed tensors (one indexing
    op; gradients, if asked for, flow back into the pages) and attended as above; ``cu_seqlens_k`` is
    read on the host for that (not under CUDA-graph capture). fusedattn takes any page size;
    FlashAttention wants a multiple of 256."""
    options = _options("flash_attn_varlen_func", dropout_p, softmax_scale, causal, window_size, softcap, alibi_slopes)
    if block_table is not None:
        k, v, cu_seqlens_k = _gather_pages(k, v, cu_seqlens_q, cu_seqlens_k, block_table)
    out, lse = varlen_attention(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, **options,
                                deterministic=deterministic, return_lse=True)
    return _returned(out, lse, return_attn_probs)


_VARLEN = "fusedattn.flash_attn.flash_attn_varlen_func"


def _check_int32(caller: str, name: str, t, dims: str, rank: int) -> None:
    if not isinstance(t, torch.Tensor) or t.dtype != torch.int32:
        got = t.dtype if isinstance(t, torch.Tensor) else type(t).__name__
        raise TypeError(f"{caller}: `{name}` must be an int32 torch.Tensor {dims}, got {got}")
    if t.dim() != rank:
        raise ValueError(f"{caller}: `{name}` must be {rank}-D {dims}, got shape {tuple(t.shape)}")


def _gather_pages(k, v, cu_seqlens_q, cu_seqlens_k, block_table):
    """The keys and values of each sequence out of the paged caches ``k``, ``v`` (num_blocks,
    page_block_size, Hkv, D), packed: (k (total_k, Hkv, D), v (total_k, Hkv, Dv), cu_seqlens_k of that
    packing). One advanced index for each (differentiable: autograd scatters the gradients back into
    the pages, summing where sequences share a page). Bad shapes, lengths or pages raise here."""
    paged_dims = "(num_blocks, page_block_size, Hkv, D)"
    for name, t in (("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor) or t.dim() != 4:
            got = tuple(t.shape) if isinstance(t, torch.Tensor) else type(t).__name__
            raise ValueError(f"{_VARLEN}: with a `block_table`, `{name}` must be a paged cache {paged_dims}, "
                             f"got {got}")
    if k.shape[:3] != v.shape[:3]:
        raise ValueError(f"{_VARLEN}: the paged `k` {tuple(k.shape)} and `v` {tuple(v.shape)} must agree on all but "
                         f"the head dim {paged_dims}")
    _check_int32(_VARLEN, "cu_seqlens_q", cu_seqlens_q, "(B + 1,)", 1)
    _check_int32(_VARLEN, "cu_seqlens_k", cu_seqlens_k, "(B + 1,)", 1)
    _check_int32(_VARLEN, "block_table", block_table, "(B, max_num_blocks_per_seq)", 2)
    batch = cu_seqlens_q.numel() - 1
    if batch < 1 or cu_seqlens_k.numel() != batch + 1:
        raise ValueError(f"{_VARLEN}: `cu_seqlens_q` ({cu_seqlens_q.numel()} entries) and `cu_seqlens_k` "
                         f"({cu_seqlens_k.numel()}) must both have B + 1 >= 2 entries")
    if block_table.shape[0] != batch:
        raise ValueError(f"{_VARLEN}: `block_table` has {block_table.shape[0]} rows; expected one per sequence "
                         f"(B = {batch}, from cu_seqlens_q)")
    if block_table.device != k.device:
        raise ValueError(f"{_VARLEN}: `block_table` is on {block_table.device} but the paged k, v are on {k.device}")
    num_blocks, page_size = k.shape[:2]
    if page_size < 1:
        raise ValueError(f"{_VARLEN}: the paged caches have page_block_size 0 (dim 1 of k, v)")
    lengths = (cu_seqlens_k[1:] - cu_seqlens_k[:-1]).to(k.device, torch.long)
    pages_used = (lengths + page_size - 1) // page_size
    in_use = torch.arange(block_table.shape[1], device=k.device) < pages_used[:, None]
    zero = torch.zeros((), dtype=torch.long, device=k.device)
    used = torch.where(in_use, block_table.long(), zero)
    shortest, longest, total, first_page, last_page = torch.stack(
        (lengths.min(), lengths.max(), lengths.sum(), used.min(), used.max())).tolist()
    if shortest < 0:
        raise ValueError(f"{_VARLEN}: `cu_seqlens_k` must never decrease (its differences are the sequences' key "
                         f"counts), got {cu_seqlens_k.tolist()}")
    capacity = block_table.shape[1] * page_size
    if longest > capacity:
        raise ValueError(f"{_VARLEN}: a sequence has {longest} keys but its `block_table` row addresses "
                         f"{capacity} (max_num_blocks_per_seq {block_table.shape[1]} x page_block_size {page_size})")
    if first_page < 0 or last_page >= num_blocks:
        raise ValueError(f"{_VARLEN}: `block_table` points outside the paged cache: the pages in use run from "
                         f"{first_page} to {last_page} but k, v have {num_blocks} pages")
    sequence = torch.repeat_interleave(torch.arange(batch, device=k.device), lengths, output_size=total)
    token = torch.arange(total, device=k.device) - (lengths.cumsum(0) - lengths)[sequence]
    page, row = block_table[sequence, token // page_size].long(), token % page_size
    offsets = torch.zeros(batch + 1, dtype=torch.int32, device=cu_seqlens_k.device)
    offsets[1:] = lengths.cumsum(0).to(offsets.device, torch.int32)
    return k[page, row], v[page, row], offsets


def flash_attn_varlen_qkvpacked_func(qkv, cu_seqlens, max_seqlen, dropout_p=0.0, softmax_scale=None, causal=False,
                                     window_size=(-1, -1), softcap=0.0, alibi_slopes=None, deterministic=False,
                                     return_attn_probs=False):
    """qkv: (total, 3, H, D); one set of offsets for queries and keys."""
    return flash_attn_varlen_func(qkv[:, 0], qkv[:, 1], qkv[:, 2], cu_seqlens, cu_seqlens, max_seqlen, max_seqlen,
                                  dropout_p, softmax_scale, causal, window_size, softcap, alibi_slopes, deterministic,
                                  return_attn_probs)


def flash_attn_varlen_kvpacked_func(q, kv, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p=0.0,
                                    softmax_scale=None, causal=False, window_size=(-1, -1), softcap=0.0,
                                    alibi_slopes=None, deterministic=False, return_attn_probs=False):
    """q: (total_q, Hq, D), kv: (total_k, 2, Hkv, D)."""
    return flash_attn_varlen_func(q, kv[:, 0], kv[:, 1], cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                                  dropout_p, softmax_scale, causal, window_size, softcap, alibi_slopes, deterministic,
                                  return_attn_probs)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, positions: torch.Tensor,
                 interleaved: bool) -> torch.Tensor:
    """FlashAttention's rotary embedding of ``x`` (B, S, H, D) at ``positions`` (B, S): the first
    ``2 * cos.shape[1]`` dims rotate, pairs (2i, 2i+1) when ``interleaved``, else (i, i + half), by
    the angles whose cos / sin are the rows of ``cos``, ``sin`` (max positions, rotary_dim / 2);
    the other dims pass through. Computed in fp32, rounded once to x's dtype."""
    rotary_dim = 2 * cos.shape[1]
    c = cos[positions].unsqueeze(2).float()  # (B, S, 1, rotary_dim / 2)
    s = sin[positions].unsqueeze(2).float()
    part = x[..., :rotary_dim].float()
    if interleaved:
        even, odd = part[..., 0::2], part[..., 1::2]
        rotated = torch.stack((even * c - odd * s, even * s + odd * c), dim=-1).flatten(-2)
    else:
        first, second = part.chunk(2, dim=-1)
        rotated = torch.cat((first * c - second * s, first * s + second * c), dim=-1)
    return torch.cat((rotated.to(x.dtype), x[..., rotary_dim:]), dim=-1)


_KVCACHE = "fusedattn.flash_attn.flash_attn_with_kvcache"


def flash_attn_with_kvcache(q, k_cache, v_cache, k=None, v=None, rotary_cos=None, rotary_sin=None, cache_seqlens=None,
                            cache_batch_idx=None, cache_leftpad=None, block_table=None, softmax_scale=None,
                            causal=False, window_size=(-1, -1), softcap=0.0, rotary_interleaved=True,
                            alibi_slopes=None, num_splits=0, return_softmax_lse=False):
    """Attention of q (B, Sq, Hq, D) over a KV cache (B, S_cache, Hkv, D) -- or paged (pages,
    page_size, Hkv, D) with ``block_table`` (B, pages per sequence) -- after writing ``k``, ``v``
    (B, S_new, Hkv, D) into it in place at ``cache_seqlens`` (int32 (B,) or an int; None: the whole
    cache is valid, and nothing may be appended). With ``rotary_cos`` / ``rotary_sin`` (S_max,
    rotary_dim / 2), q and the new k are rotated first: the new k at positions cache_seqlens + i; q
    the same where causal or a window is set (FlashAttention's reading: a window side of S_cache or
    more is none), else all of q at position cache_seqlens. Forward only. ``num_splits`` 0 chooses.

    ``cache_batch_idx`` int32 (B,): sequence b uses cache row ``cache_batch_idx[b]`` (the caches may
    then have any number of rows); the new k, v are written into that row, in place. Duplicate
    indices are allowed as in FlashAttention, but with new k, v which sequence's tokens end up in
    the shared row is not specified. ``cache_leftpad`` int32 (B,): sequence b's cache starts at
    row ``cache_leftpad[b]`` (0 <= cache_leftpad[b] <= cache_seqlens[b]); its keys are rows
    [cache_leftpad[b], cache_seqlens[b]) and the new tokens, causal / window aligned bottom-right
    over those keys; the rotary positions stay the cache rows (FlashAttention's kernel and tests
    rotate at cache_seqlens + i whatever the padding). Neither goes with a paged ``block_table``
    (FlashAttention refuses both).

    How: ``cache_batch_idx`` with S_cache a multiple of 16 (and no nonzero padding) runs the cache as
    a paged one -- each row a page, ``cache_batch_idx[:, None]`` the block table: one call, nothing
    copied, ``cache_batch_idx`` read on the host only to check its range (not under CUDA-graph
    capture, where the kernels guard themselves). Otherwise -- a nonzero ``cache_leftpad``, or
    ``cache_batch_idx`` with another S_cache -- one call per sequence, on the view of its cache row
    from its padding on; this reads ``cache_leftpad``, ``cache_batch_idx`` and ``cache_seqlens`` on
    the host (so it cannot be captured in a CUDA graph) and checks every sequence before anything is
    written.

    ``alibi_slopes`` float32 (Hq,) or (B, Hq): the queries are each sequence's last Sq keys
    (``kvcache_attention``); row b of (B, Hq) slopes goes with sequence b of q, whatever cache row
    ``cache_batch_idx`` gives it.

    Returns out, and with ``return_softmax_lse`` (out, softmax_lse (B, Hq, Sq) float32)."""
    paged = block_table is not None
    for name, value in (("cache_batch_idx", cache_batch_idx), ("cache_leftpad", cache_leftpad)):
        if paged and value is not None:
            raise ValueError(f"{_KVCACHE}: `{name}` does not go with a paged cache (`block_table`), as in "
                             f"FlashAttention 2, which refuses the pair; give the pages of each sequence in its "
                             f"`block_table` row instead")
    batch, seqlen_q = q.shape[:2]
    capacity = block_table.shape[1] * k_cache.shape[1] if paged else k_cache.shape[1]
    window_size, rotate_per_position = _cache_window(causal, window_size, capacity)
    options = _options("flash_attn_with_kvcache", 0.0, softmax_scale, causal, window_size, softcap, alibi_slopes)
    if cache_seqlens is None:  # the whole cache holds valid tokens; new ones would have nowhere to go
        if k is not None:
            raise ValueError("fusedattn.flash_attn.flash_attn_with_kvcache: appending k, v needs cache_seqlens "
                             "(where each sequence's new tokens go)")
        cache_seqlens = capacity
    if rotary_cos is not None:
        lengths = torch.as_tensor(cache_seqlens, device=q.device).expand(batch).to(torch.long)
        if k is not None:
            positions_k = lengths[:, None] + torch.arange(k.shape[1], device=q.device)
            k = apply_rotary(k, rotary_cos, rotary_sin, positions_k, rotary_interleaved)
        if rotate_per_position:
            positions_q = lengths[:, None] + torch.arange(seqlen_q, device=q.device)
        else:
            positions_q = lengths[:, None].expand(batch, seqlen_q)
        q = apply_rotary(q, rotary_cos, rotary_sin, positions_q, rotary_interleaved)
    call = dict(**options, return_lse=True, num_splits=num_splits or None)
    for name, value in (("cache_batch_idx", cache_batch_idx), ("cache_leftpad", cache_leftpad)):
        if value is not None:
            _check_int32(_KVCACHE, name, value, f"(B,) = ({batch},)", 1)
            if value.shape[0] != batch or value.device != q.device:
                raise ValueError(f"{_KVCACHE}: `{name}` must have one entry per sequence of q, on q's device "
                                 f"({q.device}): expected ({batch},), got {tuple(value.shape)} on {value.device}")
    # the paged path takes pages of a multiple of 16 rows (kvcache.check_shapes)
    rows_as_pages = cache_batch_idx is not None and k_cache.shape[1] % 16 == 0
    if cache_leftpad is not None or (cache_batch_idx is not None and not rows_as_pages):
        layout = _cache_layout(q, k_cache, k, v, cache_seqlens, cache_batch_idx, cache_leftpad)
        if any(layout[1]) or (cache_batch_idx is not None and not rows_as_pages):
            out, lse = _per_sequence(q, k_cache, v_cache, k, v, *layout, call)
            return (out, lse) if return_softmax_lse else out
    if cache_batch_idx is not None:  # the cache rows as pages, one per sequence
        if not _capturing(q.device):
            _check_rows(cache_batch_idx, k_cache.shape[0])
        block_table = cache_batch_idx[:, None]
    out, lse = kvcache_attention(q, k_cache, v_cache, cache_seqlens, block_table=block_table, k_new=k, v_new=v,
                                 **call)
    return (out, lse) if return_softmax_lse else out


def _cache_window(causal, window_size, capacity: int):
    """FlashAttention's window over a cache of ``capacity`` rows (mha_fwd_kvcache): a side of
    ``capacity`` or more is unbounded; and whether the queries are rotated at consecutive positions --
    causal, or a window side still bounded (the kernel's ``Is_causal || Is_local``)."""
    left, right = (int(window_size[0]), int(window_size[1]))
    left, right = (-1 if side >= capacity else side for side in (left, right))
    return (left, right), bool(causal) or left >= 0 or right >= 0


def _capturing(device: torch.device) -> bool:
    """Whether a CUDA graph is being captured on the current stream: values cannot be read then."""
    return device.type == "cuda" and torch.cuda.is_current_stream_capturing()


def _check_rows(cache_batch_idx: torch.Tensor, rows: int) -> None:
    low, high = torch.stack((cache_batch_idx.min(), cache_batch_idx.max())).tolist()
    if low < 0 or high >= rows:
        raise ValueError(f"{_KVCACHE}: `cache_batch_idx` must index the caches' {rows} rows (0 to {rows - 1}), got "
                         f"{cache_batch_idx.tolist()}; nothing was written")


def _cache_layout(q, k_cache, k, v, cache_seqlens, cache_batch_idx, cache_leftpad):
    """(cache_seqlens, cache_leftpad, cache rows) as lists, read on the host in one copy and checked
    for every sequence before any is written."""
    batch = q.shape[0]
    if _capturing(q.device):
        raise ValueError(f"{_KVCACHE}: `cache_leftpad` (or `cache_batch_idx` with S_cache not a multiple of 16) "
                         f"is read on the host, which cannot happen while a CUDA graph is being captured")
    if isinstance(cache_seqlens, torch.Tensor):
        _check_int32(_KVCACHE, "cache_seqlens", cache_seqlens, f"(B,) = ({batch},)", 1)
        if cache_seqlens.shape[0] != batch:
            raise ValueError(f"{_KVCACHE}: `cache_seqlens` has {cache_seqlens.shape[0]} entries; expected B = {batch}")
    for name, t in (("k", k), ("v", v)):
        if t is not None and (not isinstance(t, torch.Tensor) or t.dim() != 4 or t.shape[0] != batch):
            got = tuple(t.shape) if isinstance(t, torch.Tensor) else type(t).__name__
            raise ValueError(f"{_KVCACHE}: `{name}` must be (B, S_new, Hkv, D) with B = {batch}, got {got}")
    columns = [torch.as_tensor(cache_seqlens, device=q.device).long().expand(batch),
               cache_leftpad.long() if cache_leftpad is not None else torch.zeros(batch, dtype=torch.long,
                                                                                   device=q.device),
               cache_batch_idx.long() if cache_batch_idx is not None else torch.arange(batch, device=q.device)]
    lengths, pads, rows = torch.stack(columns).tolist()
    if any(not 0 <= row < k_cache.shape[0] for row in rows):
        _check_rows(cache_batch_idx, k_cache.shape[0])
    if min(lengths) < 0:
        raise ValueError(f"{_KVCACHE}: `cache_seqlens` must be >= 0, got {lengths}; nothing was written")
    if any(not 0 <= pad <= n for pad, n in zip(pads, lengths)):
        raise ValueError(f"{_KVCACHE}: each `cache_leftpad` must lie in [0, cache_seqlens] (the cache of a "
                         f"sequence starts there), got cache_leftpad {pads} for cache_seqlens {lengths}; nothing "
                         f"was written")
    new = 0 if k is None else k.shape[1]
    if max(lengths) + new > k_cache.shape[1]:
        raise ValueError(f"{_KVCACHE}: a sequence needs {max(lengths) + new} cache rows (cache_seqlens + {new} new) "
                         f"but the cache holds {k_cache.shape[1]} (S_cache); nothing was written")
    return lengths, pads, rows


def _per_sequence(q, k_cache, v_cache, k, v, lengths, pads, rows, call: dict):
    """One ``kvcache_attention`` per sequence, on the view of its cache row from its left padding on
    (so the append lands in place, and the causal / window alignment counts from the padding)."""
    outs, lses = [], []
    slopes = call.get("alibi_slopes")
    for b, (length, pad, row) in enumerate(zip(lengths, pads, rows)):
        if slopes is not None and slopes.dim() == 2:  # sequence b's row of (B, Hq) slopes
            call = dict(call, alibi_slopes=slopes[b:b + 1])
        out, lse = kvcache_attention(q[b:b + 1], k_cache[row:row + 1, pad:], v_cache[row:row + 1, pad:], length - pad,
                                     k_new=None if k is None else k[b:b + 1], v_new=None if v is None else v[b:b + 1],
                                     **call)
        outs.append(out)
        lses.append(lse)
    return torch.cat(outs), torch.cat(lses)
