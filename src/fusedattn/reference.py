"""The semantics of docs/SEMANTICS.md in plain PyTorch: the specification in code.

Materialises the (B, H, Sq, Sk) score matrix, so it is for tests and small inputs.
Run it in float64 for the ground truth, or in the input dtype for the "eager
low-precision" error that sets the test tolerance (docs/SEMANTICS.md, "Correctness rule"). Differentiable through
autograd, including ``lse``.
"""

from __future__ import annotations

import math

import torch

from .dropout import keep_scale
from .spec import alibi_distances, fold_window, from_bhsd, keep_mask, to_bhsd


def reference_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    layout: str = "bshd",
    causal: bool = False,
    window: tuple[int, int] | None = None,
    scale: float | None = None,
    softcap: float | None = None,
    bias: torch.Tensor | None = None,
    mask: torch.Tensor | None = None,
    sinks: torch.Tensor | None = None,
    alibi_slopes: torch.Tensor | None = None,
    chunk: int | None = None,
    dropout_keep: torch.Tensor | None = None,
    dropout_p: float = 0.0,
    return_lse: bool = False,
):
    """``dropout_keep``: with ``dropout_p``, a bool (B, Hq, Sq, Sk) mask of the probabilities kept
    (``dropout.keep_mask``); the kept ones are scaled by ``dropout.keep_scale(dropout_p)``, the
    others dropped; lse is the undropped one."""
    qh, kh, vh = to_bhsd(q, layout), to_bhsd(k, layout), to_bhsd(v, layout)
    batch, heads_q, seqlen_q, head_dim = qh.shape
    heads_kv, seqlen_k = kh.shape[1], kh.shape[2]
    group = heads_q // heads_kv
    kh = kh.repeat_interleave(group, dim=1)
    vh = vh.repeat_interleave(group, dim=1)
    scale = 1.0 / math.sqrt(head_dim) if scale is None else scale

    s = torch.matmul(qh, kh.transpose(-1, -2)) * scale
    if softcap is not None:
        s = softcap * torch.tanh(s / softcap)
    if bias is not None:
        s = s + _expand_heads(bias, heads_q).to(s.dtype)
    if alibi_slopes is not None:  # (Hq,) or (B, Hq): -slope * |i + Sk - Sq - j|, after softcap (FlashAttention 2's order)
        slopes = alibi_slopes.to(s.dtype).reshape(-1 if alibi_slopes.dim() == 2 else 1, heads_q, 1, 1)
        s = s - slopes * alibi_distances(seqlen_q, seqlen_k, device=q.device).to(s.dtype)
    left, right = fold_window(causal, window)
    keep = keep_mask(seqlen_q, seqlen_k, left, right, device=q.device, chunk=chunk or 0)
    if mask is not None:
        keep = keep & _expand_heads(mask, heads_q)
    s = s.masked_fill(~keep, float("-inf"))

    row_max = s.amax(dim=-1, keepdim=True)
    if sinks is not None:
        sink = sinks.to(s.dtype).view(1, heads_q, 1, 1)
        row_max = torch.maximum(row_max, sink)
    # A row with no kept key has max -inf: shift by 0 instead so exp gives 0, not NaN.
    row_max = torch.where(torch.isinf(row_max), torch.zeros_like(row_max), row_max).detach()
    e = torch.exp(s - row_max)
    denom = e.sum(dim=-1, keepdim=True)
    if sinks is not None:
        denom = denom + torch.exp(sink - row_max)
    empty = denom == 0
    # Divide and take logs of 1 on empty rows: a NaN there would leak through torch.where's backward.
    safe_denom = torch.where(empty, torch.ones_like(denom), denom)
    p = e / safe_denom
    if dropout_keep is not None:
        p = torch.where(dropout_keep, p * keep_scale(dropout_p), torch.zeros_like(p))
    out = torch.matmul(p.to(vh.dtype), vh)
    out = from_bhsd(out, layout)
    if not return_lse:
        return out
    lse = torch.where(empty, torch.full_like(denom, float("-inf")), torch.log(safe_denom) + row_max)
    return out, lse.squeeze(-1)


def _expand_heads(t: torch.Tensor, heads_q: int) -> torch.Tensor:
    """Broadcast a (B|1, H|Hkv|1, Sq|1, Sk|1) tensor's head dim to Hq."""
    heads = t.shape[1]
    if heads not in (1, heads_q):
        t = t.repeat_interleave(heads_q // heads, dim=1)
    return t
