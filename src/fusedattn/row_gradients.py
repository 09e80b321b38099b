"""Gradients that have a closed form in the row statistics (lse, delta = rowsum(dout * out) - dlse):
the sinks', and that of a bias constant along the keys. Plain torch ops, the same on every backend."""

from __future__ import annotations

import torch

from .kernels.shared.constants import LOG2E
from .spec import to_bhsd


def sink_gradient(sinks: torch.Tensor, lse2: torch.Tensor, delta: torch.Tensor, heads_q: int) -> torch.Tensor:
    """dsink[h] = -sum_{b,i} p_sink[b,h,i] * delta[b,h,i], p_sink = exp(sink[h] - lse) (docs/SEMANTICS.md,
    "`sinks`"), over the pre-pass's row statistics (``_preprocess_kernel``: lse2 = lse * log2 e, delta =
    rowsum(dO * O) - dlse, d lse / d sink = p_sink bringing the lse gradient in; (B*Hq, rows) with padding
    rows of lse2 +inf and delta 0, which add 0). O(B * H * Sq) work; recomputing delta from dO and O read
    both (B, S, H, D) tensors again, a large part of the sinks' backward. Float32, summed in a fixed order."""
    rows = lse2.shape[1]
    p_sink = torch.exp2(sinks.detach().float().view(1, heads_q, 1) * LOG2E - lse2.view(-1, heads_q, rows))
    return -(p_sink * delta.view(-1, heads_q, rows)).sum((0, 2))


def sink_gradient_from_outputs(sinks, out, dout, lse, dlse, layout: str) -> torch.Tensor:
    """The same gradient from the call's tensors (the "torch" backend, and problems where no kernel
    runs: no row, or no key for any row): delta = rowsum(dout * out) - dlse in float32. ``lse`` (B,
    Hq, Sq), or (Hq, total) for packed sequences (their (1, total, H, D) tensors give (1, H, total))."""
    delta = (to_bhsd(dout, layout).float() * to_bhsd(out, layout).float()).sum(-1)
    if dlse is not None:
        delta = delta - dlse
    p_sink = torch.exp(sinks.detach().float().view(-1, 1) - lse)
    terms = p_sink * delta  # (..., Hq, rows)
    return -terms.movedim(-2, 0).reshape(terms.shape[-2], -1).sum(1)


def row_bias_gradient(bias, out, dout, lse, dlse, sinks, layout: str) -> torch.Tensor:
    """The gradient of a bias constant along the keys (its Sk dim 1), from row statistics, in fp32,
    rounded once to the bias's dtype and summed over the dims it broadcasts.

    Summing the softmax gradient ds_ij = p_ij (dp_ij - delta_i) over a whole row cancels: with
    A_i = sum_j p_ij dp_ij = dout_i . out_i (exact out) and B_i = sum_j p_ij (1 - p_sink, 0 for a row
    with no key), the sum is A_i (1 - B_i) + dlse_i B_i -- exactly dlse_i B_i without sinks. Summed
    tile by tile, the kernels' delta (from the output rounded to its dtype) leaves dout . (out - out
    rounded) per row instead of that zero: noise as large as the whole gradient. Here A_i only meets
    p_sink, which is what a softmax-invariant bias's gradient is made of."""
    batch, heads_q, seqlen_q = lse.shape[-3:] if lse.dim() == 3 else (1, *lse.shape)
    finite = torch.isfinite(lse)
    if sinks is None:
        kept = finite.float()  # B_i: the keys' share of the row's softmax
        row = kept * dlse if dlse is not None else torch.zeros_like(lse)
    else:
        p_sink = torch.exp(sinks.detach().float().view(-1, 1) - lse)  # lse includes the sink: never -inf
        kept = 1.0 - p_sink
        dot = (to_bhsd(dout, layout).float() * to_bhsd(out, layout).float()).sum(-1)  # A_i, from the output
        row = dot * p_sink + (kept * dlse if dlse is not None else 0.0)
    row = row.reshape(batch, heads_q, seqlen_q)
    b, h, sq = bias.shape[:3]
    if h != heads_q:  # one value per KV group (h = Hkv) or per call (h = 1): sum the query heads onto it
        row = row.reshape(batch, h, heads_q // h, seqlen_q).sum(2)
    broadcast = [axis for axis, size, full in ((0, b, batch), (2, sq, seqlen_q)) if size == 1 and full != 1]
    row = row.sum(dim=broadcast, keepdim=True) if broadcast else row
    return row.reshape(bias.shape).to(bias.dtype)
