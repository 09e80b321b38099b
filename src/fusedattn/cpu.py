"""Chunked pure-PyTorch attention for CPU tensors (SPEC 3.8).

Same semantics and the same forward/backward split as the Triton kernels: the
forward walks key chunks with an online softmax and returns (out, lse); the
backward recomputes probabilities from lse chunk by chunk. Memory is
O(B * H * Sq * chunk), never (Sq, Sk). Computes in float32 whatever the input dtype.
"""

from __future__ import annotations

import torch

from .block_mask import BlockMask
from .spec import AttentionSpec, from_bhsd, keep_mask, to_bhsd

KEY_CHUNK = 256


def _grouped(t: torch.Tensor, layout: str, heads_kv: int) -> torch.Tensor:
    """(B, Hq, S, D) float32 view grouped as (B, Hkv, G, S, D) so K/V broadcast over G."""
    t = to_bhsd(t, layout).float()
    b, h, s, d = t.shape
    return t.reshape(b, heads_kv, h // heads_kv, s, d)


def _kv(t: torch.Tensor, layout: str) -> torch.Tensor:
    return to_bhsd(t, layout).float().unsqueeze(2)  # (B, Hkv, 1, Sk, D)


def _grouped_mask(mask: torch.Tensor | None, heads_q: int, heads_kv: int) -> torch.Tensor | None:
    """The 4-D (B|1, Hq|Hkv|1, Sq|1, Sk|1) mask or bias as (B|1, Hkv|1, G|1, Sq|1, Sk|1), to
    broadcast against the grouped (B, Hkv, G, Sq, chunk) scores."""
    if mask is None:
        return None
    b, h, sq, sk = mask.shape
    if h == heads_q and heads_q != heads_kv:
        return mask.reshape(b, heads_kv, heads_q // heads_kv, sq, sk)
    return mask.unsqueeze(2)  # one per KV group (h = Hkv) or shared (h = 1)


def _element_rows(mask: BlockMask | None, seqlen_q: int) -> tuple[torch.Tensor | None, int]:
    """(the mask as a 4-D bool tensor with one row per query, its key shift): a mask by elements
    as it is; a keep map of whole blocks with its block rows repeated, its columns still blocks
    (``_chunk`` expands them per key chunk, so no (Sq, Sk) tensor is made)."""
    if mask is None:
        return None, 0
    source = mask.source
    shift_q, shift_k = mask.source_shift
    if shift_q and source.shape[2] > 1:
        source = source.repeat_interleave(1 << shift_q, dim=2)[:, :, :seqlen_q]
    return source, shift_k


def _chunk(t: torch.Tensor, key_start: int, key_end: int, shift: int = 0) -> torch.Tensor:
    """The key columns [key_start, key_end) of a grouped mask or bias (or its one broadcast column);
    ``shift``: columns of whole key blocks, key j in column j >> shift."""
    if t.shape[-1] == 1:
        return t
    if shift:
        return t[..., torch.arange(key_start, key_end, device=t.device) >> shift]
    return t[..., key_start:key_end]


def _scores(q, k_chunk, spec: AttentionSpec, key_start: int, seqlen_q: int, seqlen_k: int, mask=None, bias=None,
            mask_shift: int = 0):
    """Scores of one key chunk after softcap, bias and masking; also tanh for the softcap gradient."""
    s = torch.matmul(q, k_chunk.transpose(-1, -2)) * spec.scale
    t = None
    if spec.has_softcap:
        t = torch.tanh(s / spec.softcap)
        s = spec.softcap * t
    if bias is not None:
        s = s + _chunk(bias, key_start, key_start + k_chunk.shape[-2]).float()
    keep = keep_mask(
        seqlen_q, seqlen_k, spec.window_left, spec.window_right, q.device, key_start, key_start + k_chunk.shape[-2]
    )
    if mask is not None:  # the user's mask: its key columns of this chunk
        keep = keep & _chunk(mask, key_start, key_start + k_chunk.shape[-2], mask_shift)
    return s.masked_fill(~keep, float("-inf")), t


def _user_layout(t_grouped: torch.Tensor, layout: str, dtype: torch.dtype) -> torch.Tensor:
    b, hkv, g, s, d = t_grouped.shape
    return from_bhsd(t_grouped.reshape(b, hkv * g, s, d), layout).to(dtype).contiguous()


def forward(q, k, v, spec: AttentionSpec, sinks: torch.Tensor | None = None, mask: BlockMask | None = None,
            bias: torch.Tensor | None = None):
    """(out, lse) of SPEC 3 for CPU tensors."""
    return chunked_forward(q, k, v, spec, sinks, mask, bias)


def chunked_forward(q, k, v, spec: AttentionSpec, sinks: torch.Tensor | None = None, mask: BlockMask | None = None,
                    bias: torch.Tensor | None = None):
    """The forward by key chunks with an online softmax, in plain differentiable torch ops only
    (matmul, exp, where, ...), on any device: autograd differentiates it to any order and forward-mode
    AD and torch.func transforms go through it. The calls no custom backward can serve use it
    (``interface``: double backward, forward-mode AD, functorch); keep it free of fused kernels."""
    heads_kv = to_bhsd(k, spec.layout).shape[1]
    qg, kg, vg = _grouped(q, spec.layout, heads_kv), _kv(k, spec.layout), _kv(v, spec.layout)
    b, hkv, g, seqlen_q, _ = qg.shape
    mask, mask_shift = _element_rows(mask, seqlen_q)
    mask, bias = _grouped_mask(mask, hkv * g, hkv), _grouped_mask(bias, hkv * g, hkv)
    seqlen_k, head_dim_v = kg.shape[-2], vg.shape[-1]
    if sinks is None:
        row_max = qg.new_full((b, hkv, g, seqlen_q, 1), float("-inf"))
        row_sum = qg.new_zeros((b, hkv, g, seqlen_q, 1))
    else:  # the sink is one more logit of every row (SPEC 3.5): start as if it had been seen
        row_max = sinks.float().view(1, hkv, g, 1, 1).expand(b, hkv, g, seqlen_q, 1)
        row_sum = qg.new_ones((b, hkv, g, seqlen_q, 1))
    acc = qg.new_zeros((b, hkv, g, seqlen_q, head_dim_v))
    for start in range(0, seqlen_k, KEY_CHUNK):
        end = min(start + KEY_CHUNK, seqlen_k)
        s, _ = _scores(qg, kg[..., start:end, :], spec, start, seqlen_q, seqlen_k, mask, bias, mask_shift)
        new_max = torch.maximum(row_max, s.amax(dim=-1, keepdim=True))
        shift = torch.where(torch.isinf(new_max), torch.zeros_like(new_max), new_max)
        p = torch.exp(s - shift)
        alpha = torch.exp(row_max - shift)
        row_sum = row_sum * alpha + p.sum(dim=-1, keepdim=True)
        acc = acc * alpha + torch.matmul(p, vg[..., start:end, :])
        row_max = new_max
    empty = row_sum == 0
    out = acc / torch.where(empty, torch.ones_like(row_sum), row_sum)
    lse = torch.where(empty, torch.full_like(row_sum, float("-inf")), row_max + torch.log(row_sum))
    lse = lse.reshape(b, hkv * g, seqlen_q)
    return _user_layout(out, spec.layout, q.dtype), lse


def backward(dout, dlse, q, k, v, out, lse, spec: AttentionSpec, mask: BlockMask | None = None,
             bias: torch.Tensor | None = None, bias_grad: bool = False):
    """(dq, dk, dv, dbias); dbias (with ``bias_grad``) has the bias's 4-D shape, summed over its
    broadcast dims in a fixed order."""
    heads_kv = to_bhsd(k, spec.layout).shape[1]
    qg, kg, vg = _grouped(q, spec.layout, heads_kv), _kv(k, spec.layout), _kv(v, spec.layout)
    dog, og = _grouped(dout, spec.layout, heads_kv), _grouped(out, spec.layout, heads_kv)
    b, hkv, g, seqlen_q, _ = qg.shape
    mask, mask_shift = _element_rows(mask, seqlen_q)
    mask, bias_g = _grouped_mask(mask, hkv * g, hkv), _grouped_mask(bias, hkv * g, hkv)
    dbias = torch.zeros(bias_g.shape, dtype=torch.float32, device=q.device) if bias_grad else None
    seqlen_k = kg.shape[-2]
    # d lse / d s = p, so a gradient on lse folds into delta: ds = p * (dp - (delta - dlse)).
    delta = (dog * og).sum(dim=-1, keepdim=True)
    if dlse is not None:
        delta = delta - dlse.float().reshape(b, hkv, g, seqlen_q, 1)
    lse_g = lse.reshape(b, hkv, g, seqlen_q, 1)
    # Rows with no key have lse = -inf and only masked (-inf) scores: exp(-inf - inf) = 0, not NaN.
    lse_g = torch.where(torch.isneginf(lse_g), torch.full_like(lse_g, float("inf")), lse_g)
    dq = torch.zeros_like(qg)
    dk = torch.zeros_like(kg.squeeze(2))
    dv = torch.zeros_like(vg.squeeze(2))
    for start in range(0, seqlen_k, KEY_CHUNK):
        end = min(start + KEY_CHUNK, seqlen_k)
        k_chunk, v_chunk = kg[..., start:end, :], vg[..., start:end, :]
        s, tanh_s = _scores(qg, k_chunk, spec, start, seqlen_q, seqlen_k, mask, bias_g, mask_shift)
        p = torch.exp(s - lse_g)
        dv[..., start:end, :] = torch.matmul(p.transpose(-1, -2), dog).sum(dim=2)
        dp = torch.matmul(dog, v_chunk.transpose(-1, -2))
        ds = p * (dp - delta)
        if dbias is not None:  # the logit's gradient, summed down to the bias's broadcast shape
            _chunk(dbias, start, end).add_(_sum_to(ds, dbias.shape))
        if tanh_s is not None:
            ds = ds * (1.0 - tanh_s * tanh_s)
        dq += torch.matmul(ds, k_chunk) * spec.scale
        dk[..., start:end, :] = torch.matmul(ds.transpose(-1, -2), qg).sum(dim=2) * spec.scale
    return (
        _user_layout(dq, spec.layout, q.dtype),
        from_bhsd(dk, spec.layout).to(k.dtype).contiguous(),
        from_bhsd(dv, spec.layout).to(v.dtype).contiguous(),
        dbias.reshape(bias.shape).to(bias.dtype) if dbias is not None else None,
    )


def _sum_to(t: torch.Tensor, shape) -> torch.Tensor:
    """``t`` summed over the dims where ``shape`` has 1 (the last dim only up to the chunk)."""
    dims = tuple(i for i, size in enumerate(shape) if size == 1 and t.shape[i] != 1)
    return t.sum(dim=dims, keepdim=True) if dims else t
