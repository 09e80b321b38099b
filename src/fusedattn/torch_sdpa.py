"""``fusedattn.sdpa`` and ``fusedattn.routed_sdpa``: torch's ``scaled_dot_product_attention`` semantics on fusedattn's kernels.

Layout (B, H, S, D), or any (N, ..., S, D) with at most two leading dims; ``is_causal`` top-left
aligned (query i sees keys j <= i, whatever Sq and Sk); a bool ``attn_mask`` keeps True entries, a
float one is added to the scores (and gets its gradient); masks and key/value batch and head dims
broadcast as torch broadcasts them; ``enable_gqa`` lets Hq be a multiple of Hkv. A row that keeps
no key gives zeros, as torch's math backend, CPU kernel and memory-efficient kernel do (its cuDNN
backend gives other values there). ``dropout_p``: attention dropout whenever it is > 0, as torch
applies it (pass 0.0 in evaluation), with fusedattn's mask (docs/SEMANTICS.md 3.11: p rounded to a
multiple of 1/256, the kept probabilities scaled by the inverse of the kept fraction drawn).

``routed_sdpa()`` routes ``torch.nn.functional.scaled_dot_product_attention`` to it inside a
``with`` block and restores torch's afterwards: code that looks the function up at call time (as
Hugging Face transformers does) runs on fusedattn; a reference taken before the block does not.
"""

from __future__ import annotations

import contextlib

import torch
import torch.nn.functional as F

from .interface import attention

_NAME = "fusedattn.sdpa"


def _as_4d(t: torch.Tensor, name: str) -> torch.Tensor:
    if t.dim() == 4:
        return t
    if t.dim() == 3:
        return t.unsqueeze(1)
    raise ValueError(f"{_NAME}: `{name}` must be 3-D (N, S, E) or 4-D (N, H, S, E), got {tuple(t.shape)}")


def sdpa(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False):
    """torch.nn.functional.scaled_dot_product_attention, computed by ``fusedattn.attention``."""
    if is_causal and attn_mask is not None:
        raise RuntimeError(f"{_NAME}: an explicit attn_mask should not be set when is_causal=True (as in torch)")
    three_d = query.dim() == 3
    q, k, v = _as_4d(query, "query"), _as_4d(key, "key"), _as_4d(value, "value")
    batch, heads_q, seqlen_q = q.shape[:3]
    heads_kv, seqlen_k = k.shape[1], k.shape[2]
    if heads_kv != heads_q and heads_kv != 1:
        if not enable_gqa or heads_q % heads_kv:
            raise RuntimeError(f"{_NAME}: query has {heads_q} heads and key/value {heads_kv}: that needs "
                               f"enable_gqa=True and a head count dividing the query's")
    if heads_kv == 1 and heads_q > 1:  # broadcast over heads, as torch does (MQA)
        k, v = k.expand(-1, heads_q, -1, -1), v.expand(-1, heads_q, -1, -1)
    if k.shape[0] != batch:  # broadcast over the batch
        k, v = k.expand(batch, -1, -1, -1), v.expand(batch, -1, -1, -1)
    mask = bias = window = None
    if is_causal:
        if seqlen_q >= seqlen_k:  # top-left j <= i is the bottom-right window's right bound Sq - Sk
            window = (-1, seqlen_q - seqlen_k)
        else:  # a negative right bound, which no window has: a mask of the keys each row keeps
            mask = torch.ones(seqlen_q, seqlen_k, dtype=torch.bool, device=q.device).tril()
    elif attn_mask is not None:
        full = attn_mask.reshape((1,) * (4 - attn_mask.dim()) + tuple(attn_mask.shape))
        if full.dtype == torch.bool:
            mask = full
        else:
            bias = full
    if mask is not None and mask.dim() == 2:
        mask = mask.reshape(1, 1, *mask.shape)
    out = attention(q, k, v, layout="bhsd", window=window, scale=scale, mask=mask, bias=bias, dropout_p=dropout_p)
    return out.squeeze(1) if three_d else out


@contextlib.contextmanager
def routed_sdpa():
    """Route ``torch.nn.functional.scaled_dot_product_attention`` to ``sdpa`` inside the block."""
    original = F.scaled_dot_product_attention
    F.scaled_dot_product_attention = sdpa
    try:
        yield
    finally:
        F.scaled_dot_product_attention = original
