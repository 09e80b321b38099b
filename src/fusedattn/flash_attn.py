"""FlashAttention 2's public functions on fusedattn: switching is one import line,

    from fusedattn.flash_attn import flash_attn_func, flash_attn_varlen_func, flash_attn_with_kvcache

with FlashAttention's signatures, defaults and conventions: (B, S, H, D) tensors; ``causal``
bottom-right aligned; ``window_size=(left, right)``, -1 unbounded, ``causal`` forcing right to 0;
``softmax_scale`` None for 1/sqrt(D); ``softcap`` 0 for none; ``softmax_lse`` (B, H, Sq), or (H,
total_q) for the varlen functions; ``return_attn_probs`` giving (out, softmax_lse, None) -- the
probabilities FlashAttention returns only with dropout. Not yet available, and raising
``NotImplementedError`` naming them: ``alibi_slopes``, ``dropout_p > 0``, and in
``flash_attn_with_kvcache`` ``cache_batch_idx`` and ``cache_leftpad``; ``block_table`` in the varlen
functions. fusedattn also takes fp32 inputs, which FlashAttention refuses.
"""

from __future__ import annotations

import torch

from .interface import attention
from .kvcache import kvcache_attention
from .varlen import varlen_attention

__all__ = ["flash_attn_func", "flash_attn_qkvpacked_func", "flash_attn_kvpacked_func", "flash_attn_varlen_func",
           "flash_attn_varlen_qkvpacked_func", "flash_attn_varlen_kvpacked_func", "flash_attn_with_kvcache"]


def _options(caller: str, dropout_p, softmax_scale, causal, window_size, softcap, alibi_slopes) -> dict:
    """FlashAttention's arguments as fusedattn's options."""
    if alibi_slopes is not None:
        raise NotImplementedError(f"fusedattn.flash_attn.{caller}: alibi_slopes is not supported yet")
    if dropout_p:
        raise NotImplementedError(f"fusedattn.flash_attn.{caller}: dropout_p > 0 is not supported yet "
                                  f"(got {dropout_p}); use dropout_p=0.0")
    left, right = (int(window_size[0]), int(window_size[1]))
    window = None if (left, right) == (-1, -1) else (left, right)
    return dict(causal=bool(causal), window=window, scale=softmax_scale, softcap=softcap if softcap else None)


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
    out (total_q, Hq, Dv); with ``return_attn_probs`` (out, softmax_lse (Hq, total_q) float32, None)."""
    if block_table is not None:
        raise NotImplementedError("fusedattn.flash_attn.flash_attn_varlen_func: a paged block_table is not supported "
                                  "yet; use flash_attn_with_kvcache for paged caches")
    options = _options("flash_attn_varlen_func", dropout_p, softmax_scale, causal, window_size, softcap, alibi_slopes)
    out, lse = varlen_attention(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, **options,
                                deterministic=deterministic, return_lse=True)
    return _returned(out, lse, return_attn_probs)


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


def flash_attn_with_kvcache(q, k_cache, v_cache, k=None, v=None, rotary_cos=None, rotary_sin=None, cache_seqlens=None,
                            cache_batch_idx=None, cache_leftpad=None, block_table=None, softmax_scale=None,
                            causal=False, window_size=(-1, -1), softcap=0.0, rotary_interleaved=True,
                            alibi_slopes=None, num_splits=0, return_softmax_lse=False):
    """Attention of q (B, Sq, Hq, D) over a KV cache (B, S_cache, Hkv, D) -- or paged (pages,
    page_size, Hkv, D) with ``block_table`` (B, pages per sequence) -- after writing ``k``, ``v``
    (B, S_new, Hkv, D) into it in place at ``cache_seqlens`` (int32 (B,) or an int; None: the whole
    cache is valid, and nothing may be appended). With ``rotary_cos`` / ``rotary_sin`` (S_max, rotary_dim / 2), q and the new k are
    rotated first: the new k at positions cache_seqlens + i; q the same where causal or a window is
    set, else all of q at position cache_seqlens. Forward only. ``num_splits`` 0 chooses.
    Returns out, and with ``return_softmax_lse`` (out, softmax_lse (B, Hq, Sq) float32)."""
    for name, value in (("cache_batch_idx", cache_batch_idx), ("cache_leftpad", cache_leftpad)):
        if value is not None:
            raise NotImplementedError(f"fusedattn.flash_attn.flash_attn_with_kvcache: {name} is not supported yet")
    options = _options("flash_attn_with_kvcache", 0.0, softmax_scale, causal, window_size, softcap, alibi_slopes)
    batch, seqlen_q = q.shape[:2]
    if cache_seqlens is None:  # the whole cache holds valid tokens; new ones would have nowhere to go
        if k is not None:
            raise ValueError("fusedattn.flash_attn.flash_attn_with_kvcache: appending k, v needs cache_seqlens "
                             "(where each sequence's new tokens go)")
        cache_seqlens = k_cache.shape[1] if block_table is None else block_table.shape[1] * k_cache.shape[1]
    if rotary_cos is not None:
        lengths = torch.as_tensor(cache_seqlens, device=q.device).expand(batch).to(torch.long)
        if k is not None:
            positions_k = lengths[:, None] + torch.arange(k.shape[1], device=q.device)
            k = apply_rotary(k, rotary_cos, rotary_sin, positions_k, rotary_interleaved)
        if options["causal"] or options["window"] is not None:
            positions_q = lengths[:, None] + torch.arange(seqlen_q, device=q.device)
        else:
            positions_q = lengths[:, None].expand(batch, seqlen_q)
        q = apply_rotary(q, rotary_cos, rotary_sin, positions_q, rotary_interleaved)
    out, lse = kvcache_attention(q, k_cache, v_cache, cache_seqlens, block_table=block_table, k_new=k, v_new=v,
                                 **options, return_lse=True, num_splits=num_splits or None)
    return (out, lse) if return_softmax_lse else out
