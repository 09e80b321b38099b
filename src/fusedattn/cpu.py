"""Attention for CPU tensors: the same semantics, forward/backward split and autograd as
the Triton kernels, in O(B * H * Sq * chunk) memory (never an (Sq, Sk) buffer), computed in float32
whatever the input dtype.

Three ways through, chosen per call:

- ``forward`` / ``backward`` on problems torch's fused CPU attention kernel can express exactly (no
  softcap, bias or mask; sinks are merged in afterwards by their lse): the problem is cut into
  sub-problems by ``fused_parts`` -- key ranges every row of a block sees in full, squares on the
  shifted diagonal that are its top-left causal rule, and blocks of a window band with the keep rule
  as an additive mask -- each handed to the kernel, the partial results combined by lse in float32.
  The backward hands the same sub-problems, with the whole row's lse and output, to the kernel's
  backward.
- the tiled math path (softcap, bias, mask, or no fused kernel): query tiles against the key tiles
  their rows can see, online softmax, the keep rule applied only on tiles the window cuts.
- ``chunked_forward``: the forward by key chunks in plain differentiable torch ops, for the calls
  autograd must differentiate itself (double backward, forward-mode AD, torch.func).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

from . import dropout
from .block_mask import EMPTY, BlockMask
from .merge import merge_into
from .spec import UNBOUNDED, AttentionSpec, alibi_distances, from_bhsd, keep_mask, to_bhsd

KEY_CHUNK = 256  # chunked_forward's key chunk
# The tiled math path's tiles: (B, H, QUERY_TILE, KEY_TILE) float32 scores at a time.
QUERY_TILE = 256
KEY_TILE = 256
# Rows per sub-problem of a window band on the fused path: the band's masked triangles grow with it,
# the kernel's efficiency per row falls below a few hundred rows.
BAND_ROWS = 256


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


def _grouped_alibi(alibi: torch.Tensor | None, heads_kv: int) -> torch.Tensor | None:
    """The (B, Hq) float32 ALiBi slopes as (B, Hkv, G, 1, 1), to scale the grouped scores' distances."""
    if alibi is None:
        return None
    return alibi.float().reshape(alibi.shape[0], heads_kv, alibi.shape[1] // heads_kv, 1, 1)


def _scores(q, k_chunk, spec: AttentionSpec, key_start: int, seqlen_q: int, seqlen_k: int, mask=None, bias=None,
            mask_shift: int = 0, alibi=None):
    """Scores of one key chunk after softcap, bias, ALiBi (``alibi``: grouped slopes) and masking;
    also tanh for the softcap gradient."""
    s = torch.matmul(q, k_chunk.transpose(-1, -2)) * spec.scale
    t = None
    if spec.has_softcap:
        t = torch.tanh(s / spec.softcap)
        s = spec.softcap * t
    if bias is not None:
        s = s + _chunk(bias, key_start, key_start + k_chunk.shape[-2]).float()
    if alibi is not None:
        s = s - alibi * alibi_distances(seqlen_q, seqlen_k, q.device, key_start, key_start + k_chunk.shape[-2])
    keep = keep_mask(
        seqlen_q, seqlen_k, spec.window_left, spec.window_right, q.device, key_start, key_start + k_chunk.shape[-2],
        chunk=spec.chunk,
    )
    if mask is not None:  # the user's mask: its key columns of this chunk
        keep = keep & _chunk(mask, key_start, key_start + k_chunk.shape[-2], mask_shift)
    return s.masked_fill(~keep, float("-inf")), t


def _user_layout(t_grouped: torch.Tensor, layout: str, dtype: torch.dtype) -> torch.Tensor:
    b, hkv, g, s, d = t_grouped.shape
    return from_bhsd(t_grouped.reshape(b, hkv * g, s, d), layout).to(dtype).contiguous()


def forward(q, k, v, spec: AttentionSpec, sinks: torch.Tensor | None = None, mask: BlockMask | None = None,
            bias: torch.Tensor | None = None, alibi: torch.Tensor | None = None,
            dropout_seed: torch.Tensor | None = None, dropout_first_batch: int = 0):
    """(out, lse) of attention for CPU tensors: out in q's layout and dtype, lse (B, Hq, Sq) float32.
    ``alibi``: (B, Hq) float32 ALiBi slopes (with ``spec.alibi``). ``dropout_seed``: the call's
    (1,) int64 seed (with ``spec.dropout_p``; the mask of dropout.py), ``dropout_first_batch`` the
    batch index that mask gives q's first batch."""
    if q.is_cpu and uses_fused_kernel(spec, mask, bias):
        return _fused_forward(q, k, v, spec, sinks)
    return _math_forward(q, k, v, spec, sinks, mask, bias, alibi, dropout_seed, dropout_first_batch)


def chunked_forward(q, k, v, spec: AttentionSpec, sinks: torch.Tensor | None = None, mask: BlockMask | None = None,
                    bias: torch.Tensor | None = None, alibi: torch.Tensor | None = None,
                    dropout_seed: torch.Tensor | None = None, dropout_first_batch: int = 0):
    """The forward by key chunks with an online softmax, in plain differentiable torch ops only
    (matmul, exp, where, ...), on any device: autograd differentiates it to any order and forward-mode
    AD and torch.func transforms go through it. The calls no custom backward can serve use it
    (``interface``: double backward, forward-mode AD, functorch); keep it free of fused kernels."""
    heads_kv = to_bhsd(k, spec.layout).shape[1]
    qg, kg, vg = _grouped(q, spec.layout, heads_kv), _kv(k, spec.layout), _kv(v, spec.layout)
    b, hkv, g, seqlen_q, _ = qg.shape
    mask, mask_shift = _element_rows(mask, seqlen_q)
    mask, bias = _grouped_mask(mask, hkv * g, hkv), _grouped_mask(bias, hkv * g, hkv)
    alibi = _grouped_alibi(None if alibi is None else alibi.detach(), hkv)
    if dropout_seed is not None:  # read on the host once, not once per chunk
        dropout_seed = int(dropout_seed.reshape(-1)[0])
    seqlen_k, head_dim_v = kg.shape[-2], vg.shape[-1]
    if sinks is None:
        row_max = qg.new_full((b, hkv, g, seqlen_q, 1), float("-inf"))
        row_sum = qg.new_zeros((b, hkv, g, seqlen_q, 1))
    else:  # the sink is one more logit of every row: start as if it had been seen
        row_max = sinks.float().view(1, hkv, g, 1, 1).expand(b, hkv, g, seqlen_q, 1)
        row_sum = qg.new_ones((b, hkv, g, seqlen_q, 1))
    acc = qg.new_zeros((b, hkv, g, seqlen_q, head_dim_v))
    for start in range(0, seqlen_k, KEY_CHUNK):
        end = min(start + KEY_CHUNK, seqlen_k)
        s, _ = _scores(qg, kg[..., start:end, :], spec, start, seqlen_q, seqlen_k, mask, bias, mask_shift, alibi)
        new_max = torch.maximum(row_max, s.amax(dim=-1, keepdim=True))
        shift = torch.where(torch.isinf(new_max), torch.zeros_like(new_max), new_max)
        p = torch.exp(s - shift)
        alpha = torch.exp(row_max - shift)
        row_sum = row_sum * alpha + p.sum(dim=-1, keepdim=True)
        if dropout_seed is not None:  # dropped probabilities leave the values' sum, not the normaliser
            kept = dropout.keep_mask(dropout_seed, b, hkv * g, seqlen_q, seqlen_k, spec.dropout_p, q.device,
                                     batch_start=dropout_first_batch, key_start=start,
                                     key_end=end).view(b, hkv, g, seqlen_q, end - start)
            p = torch.where(kept, p, torch.zeros_like(p)) * dropout.keep_scale(spec.dropout_p)
        acc = acc * alpha + torch.matmul(p, vg[..., start:end, :])
        row_max = new_max
    empty = row_sum == 0
    out = acc / torch.where(empty, torch.ones_like(row_sum), row_sum)
    lse = torch.where(empty, torch.full_like(row_sum, float("-inf")), row_max + torch.log(row_sum))
    lse = lse.reshape(b, hkv * g, seqlen_q)
    return _user_layout(out, spec.layout, q.dtype), lse


def backward(dout, dlse, q, k, v, out, lse, spec: AttentionSpec, mask: BlockMask | None = None,
             bias: torch.Tensor | None = None, bias_grad: bool = False, alibi: torch.Tensor | None = None,
             dropout_seed: torch.Tensor | None = None, dropout_first_batch: int = 0):
    """(dq, dk, dv, dbias); dbias (with ``bias_grad``) has the bias's 4-D shape, summed over its
    broadcast dims in a fixed order. ``dlse``: a gradient on lse as well (or None). ``alibi``: as
    for ``forward`` (constants: no gradient)."""
    if q.is_cpu and uses_fused_kernel(spec, mask, bias):
        return (*_fused_backward(dout, dlse, q, k, v, out, lse, spec), None)
    return _math_backward(dout, dlse, q, k, v, out, lse, spec, mask, bias, bias_grad, alibi, dropout_seed,
                          dropout_first_batch)


# ----------------------------------------------------------------------------- the keys a row sees


def rows_with_keys(seqlen_q: int, seqlen_k: int, window_left: int, window_right: int) -> tuple[int, int]:
    """[first, end): the query rows that see at least one key under the causal/window rule;
    the rows outside it see none (out 0, lse -inf). Window sides are >= 0 or UNBOUNDED."""
    if seqlen_k == 0:
        return 0, 0
    diag = seqlen_k - seqlen_q
    first = 0 if window_right == UNBOUNDED else min(seqlen_q, max(0, -(diag + window_right)))
    end = seqlen_q if window_left == UNBOUNDED else min(seqlen_q, seqlen_k - diag + window_left)
    return first, max(first, end)


def visible_keys(query_start: int, query_end: int, seqlen_q: int, seqlen_k: int, window_left: int,
                 window_right: int) -> tuple[int, int, int, int]:
    """(lo, hi, full_lo, full_hi) for the rows [query_start, query_end) (clipped to the keys):
    [lo, hi) holds every key some row of them sees, [full_lo, full_hi) the keys all of them see (empty
    when full_hi <= full_lo). Both ends of a row's range grow with the row, so the block's first and
    last rows bound them."""
    diag = seqlen_k - seqlen_q

    def first(i):
        return 0 if window_left == UNBOUNDED else min(seqlen_k, max(0, i + diag - window_left))

    def end(i):
        return seqlen_k if window_right == UNBOUNDED else max(0, min(seqlen_k, i + diag + window_right + 1))

    return first(query_start), end(query_end - 1), first(query_end - 1), end(query_start)


def chunk_keys(query_start: int, query_end: int, seqlen_q: int, seqlen_k: int, chunk: int, lo: int, hi: int,
               full_lo: int, full_hi: int) -> tuple[int, int, int, int]:
    """``visible_keys``' (lo, hi, full_lo, full_hi) narrowed by the chunk rule (rows at aligned positions
    >= 0: the caller drops the others): the keys from the first row's chunk start to the last row's
    chunk end; the keys all rows see, only the first row's chunk from the last row's chunk start."""
    diag = seqlen_k - seqlen_q
    first, last = query_start + diag, query_end - 1 + diag
    lo = max(lo, first // chunk * chunk)
    hi = max(lo, min(hi, (last // chunk + 1) * chunk))
    full_lo = max(full_lo, last // chunk * chunk)
    full_hi = min(full_hi, (first // chunk + 1) * chunk)
    return lo, hi, full_lo, full_hi


# ----------------------------------------------------------------------------- torch's fused kernel


@dataclass(frozen=True)
class Part:
    """One sub-problem for the fused kernel: query rows [q0, q1) against keys [k0, k1). ``causal``: a
    square whose top-left causal rule (row r sees its keys 0..r) is exactly ours; ``masked``: some
    pairs are outside the window, so the keep rule goes in as an additive 0/-inf mask. Every row of
    a part sees at least one of its keys (the kernel's answer for a row that sees none is not ours)."""

    q0: int
    q1: int
    k0: int
    k1: int
    causal: bool = False
    masked: bool = False


def fused_parts(seqlen_q: int, seqlen_k: int, window_left: int, window_right: int,
                band_rows: int | None = None) -> list[Part]:
    """The sub-problems the fused path computes for a causal/window rule (forward and backward alike):
    together they cover every kept (row, key) pair exactly once and no other; rows in no part see no
    key; two parts' rows are the same or disjoint (their results merge row block by row block). Key
    ranges a block's rows never see are never visited.

    - no window: one part, everything;
    - a bound on the right only (causal, or a window open to the left): row i sees keys [0, i + e],
      e = Sk - Sq + right; the rows whose range ends inside the keys get a square on the shifted
      diagonal (top-left causal, as the kernel's ``is_causal``: equal to ours on a square) and the full
      key range before it; the rows past it see every key;
    - a bound on the left: blocks of ``band_rows`` rows, each against the keys its rows see, masked
      unless every row sees all of them."""
    first_row, end_row = rows_with_keys(seqlen_q, seqlen_k, window_left, window_right)
    if first_row >= end_row:
        return []
    # A side that cuts no row's range (wider than the keys) is no bound: fewer, unmasked parts.
    if window_left >= seqlen_k - 1:
        window_left = UNBOUNDED
    if window_right >= seqlen_q - 1:
        window_right = UNBOUNDED
    if window_left == UNBOUNDED and window_right == UNBOUNDED:
        return [Part(0, seqlen_q, 0, seqlen_k)]
    if window_left == UNBOUNDED:
        shift = seqlen_k - seqlen_q + window_right
        split = min(end_row, seqlen_k - shift)  # rows from here on see every key
        parts = []
        if first_row < split:
            if first_row + shift > 0:
                parts.append(Part(first_row, split, 0, first_row + shift))
            parts.append(Part(first_row, split, first_row + shift, split + shift, causal=True))
        if split < end_row:
            parts.append(Part(max(first_row, split), end_row, 0, seqlen_k))
        return parts
    band_rows = band_rows or BAND_ROWS
    parts = []
    for q0 in range(first_row, end_row, band_rows):
        q1 = min(q0 + band_rows, end_row)
        lo, hi, full_lo, full_hi = visible_keys(q0, q1, seqlen_q, seqlen_k, window_left, window_right)
        parts.append(Part(q0, q1, lo, hi, masked=not (full_lo <= lo and hi <= full_hi)))
    return parts


def uses_fused_kernel(spec: AttentionSpec, mask, bias) -> bool:
    """Whether a call on CPU tensors goes to torch's fused CPU kernel (the "torch" backend asked for on
    GPU tensors takes the math path): the kernel knows no softcap, bias or boolean mask (a bias would
    need its gradient, a mask the kernel's answer for rows it empties; ALiBi would be a bias, chunk a mask;
    its dropout draws its own mask, which no backward could regenerate)."""
    return not spec.has_softcap and not spec.alibi and not spec.has_chunk and not spec.has_dropout and mask is None \
        and bias is None and fused_kernel_available()


@functools.lru_cache(maxsize=None)
def fused_kernel_available() -> bool:
    try:
        return all(hasattr(torch.ops.aten, name) for name in (
            "_scaled_dot_product_flash_attention_for_cpu", "_scaled_dot_product_flash_attention_for_cpu_backward"))
    except Exception:  # noqa: BLE001  an op namespace that cannot be read: take the math path
        return False


@functools.lru_cache(maxsize=None)
def fused_kernel_takes_gqa() -> bool:
    """Whether the kernel pairs query head h with key/value head h // (Hq / Hkv) itself (newer torch);
    else the path expands K/V per query head and sums their gradients back. Probed once on a tiny
    problem against the expanded answer."""
    gen = torch.Generator().manual_seed(0)
    q, k, v, dout = (torch.randn(1, h, 5, 8, generator=gen) for h in (2, 1, 1, 2))
    try:
        out, lse = _flash_forward(q, k, v, False, None, 0.5)
        grads = _flash_backward(dout, q, k, v, out, lse, False, None, 0.5)
        k2, v2 = k.expand(1, 2, 5, 8).contiguous(), v.expand(1, 2, 5, 8).contiguous()
        out2, _ = _flash_forward(q, k2, v2, False, None, 0.5)
        dk2 = _flash_backward(dout, q, k2, v2, out2, lse, False, None, 0.5)[1].sum(1, keepdim=True)
    except Exception:  # noqa: BLE001  any refusal means: not supported
        return False
    return grads[1].shape == k.shape and torch.allclose(out, out2) and torch.allclose(grads[1], dk2, atol=1e-5)


def _flash_forward(q, k, v, causal: bool, mask, scale: float):
    """torch's fused CPU attention: (out, lse) of (B, H, S, D) operands, lse natural log, fp32."""
    return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, causal, attn_mask=mask,
                                                                      scale=scale)


def _flash_backward(dout, q, k, v, out, lse, causal: bool, mask, scale: float):
    """Its backward: (dq, dk, dv) from the rows' lse and out (p = exp(s - lse), delta = sum(dout * out))."""
    return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
        dout, q, k, v, out, lse, 0.0, causal, attn_mask=mask, scale=scale)


def _fp32(t: torch.Tensor, width: int, last=None) -> torch.Tensor:
    """``t`` (B, H, S, X) as float32 with ``width`` head dims: zeros past X (the kernel wants one head
    dim for q, k and v; zero columns change no dot product), ``last`` (a scalar or (B, H, S)) in the
    last column. ``t`` itself where nothing changes."""
    if t.dtype == torch.float32 and t.shape[-1] == width and last is None:
        return t
    padded = t.new_zeros((*t.shape[:-1], width), dtype=torch.float32)
    padded[..., : t.shape[-1]] = t
    if last is not None:
        padded[..., -1] = last
    return padded


def _foldable(t: torch.Tensor) -> bool:
    """(B, H, S, X) whose batch and head dims merge into one without a copy, heads outside rows (the
    (B, H, S, X) memory order)."""
    return (t.shape[0] == 1 or t.stride(0) == t.shape[1] * t.stride(1)) and t.stride(1) >= t.stride(2)


class _Operands:
    """The (B, H, S, X) float32 tensors of one fused call, sliced and shaped as the kernel takes them.

    The kernel writes its outputs (out, dq, dk, dv) as (B, S, H, X) memory. Where every head has its
    own K/V and the tensors are laid out (B, H, S, X), each (batch, head) is passed as a batch of one
    head instead: the same computation, and the outputs come out (B, H, S, X) with no copy on either
    side. Where the kernel cannot pair query heads with fewer K/V heads itself, K/V are expanded
    once and their gradients summed back per group."""

    def __init__(self, heads_q: int, heads_kv: int, row_side: list[torch.Tensor], key_side: list[torch.Tensor]):
        self.heads_q, self.heads_kv = heads_q, heads_kv
        self.fold = heads_q == heads_kv and all(_foldable(t) for t in row_side + key_side)
        self.expand = heads_q != heads_kv and not fused_kernel_takes_gqa()
        if self.expand:
            group = heads_q // heads_kv
            key_side = [t.repeat_interleave(group, dim=1) for t in key_side]
        self.row_side, self.key_side = row_side, key_side

    def _shape(self, t: torch.Tensor) -> torch.Tensor:
        b, h, s, x = t.shape
        return t.view(b * h, 1, s, x) if self.fold else t

    def rows(self, start: int, end: int) -> list[torch.Tensor]:
        return [self._shape(t[:, :, start:end]) for t in self.row_side]

    def keys(self, start: int, end: int) -> list[torch.Tensor]:
        return [self._shape(t[:, :, start:end]) for t in self.key_side]

    def lse(self, lse: torch.Tensor, start: int, end: int) -> torch.Tensor:
        lse = lse[:, :, start:end]
        return lse.reshape(-1, 1, end - start) if self.fold else lse

    def unfold(self, t: torch.Tensor, heads: int) -> torch.Tensor:
        """A kernel output back as (B, H, S, ...) (its key-side gradients summed per group if expanded)."""
        if self.fold:
            return t.view(-1, heads, *t.shape[2:])
        if heads != t.shape[1]:
            b, _, s, x = t.shape
            return t.view(b, heads, -1, s, x).sum(2)
        return t


def _mask_of(part: Part, seqlen_q: int, seqlen_k: int, spec: AttentionSpec, cache: dict) -> torch.Tensor | None:
    """A masked part's keep rule as the additive float32 (rows, keys) mask the kernel takes (0 kept,
    -inf not). The blocks of a band sit alike relative to the diagonal, but for the first ones: the
    last mask is kept for the next part (one, so that the masks never add up to an (Sq, Sk) buffer)."""
    if not part.masked:
        return None
    key = (part.q1 - part.q0, part.k1 - part.k0, part.q0 + seqlen_k - seqlen_q - part.k0)
    if key not in cache:
        keep = keep_mask(seqlen_q, seqlen_k, spec.window_left, spec.window_right, None, part.k0, part.k1, part.q0,
                         part.q1)
        cache.clear()
        cache[key] = torch.zeros(keep.shape).masked_fill_(~keep, float("-inf"))
    return cache[key]


def _in_layout(t: torch.Tensor, layout: str, dtype: torch.dtype, width: int) -> torch.Tensor:
    """A (B, H, S, >= width) result as the caller's contiguous (layout, dtype) tensor of ``width``
    head dims; no copy where it already is one."""
    return from_bhsd(t[..., :width], layout).to(dtype).contiguous()


def _fused_forward(q, k, v, spec: AttentionSpec, sinks: torch.Tensor | None):
    qh, kh, vh = (to_bhsd(t, spec.layout) for t in (q, k, v))
    batch, heads_q, seqlen_q, head_dim = qh.shape
    heads_kv, seqlen_k, head_dim_v = kh.shape[1], kh.shape[2], vh.shape[3]
    width = max(head_dim, head_dim_v)
    parts = fused_parts(seqlen_q, seqlen_k, spec.window_left, spec.window_right) if qh.numel() else []
    out = lse = None
    if parts:
        ops = _Operands(heads_q, heads_kv, [_fp32(qh, width)], [_fp32(kh, width), _fp32(vh, width)])
        masks, filled = {}, set()
        for part in parts:
            (part_q,), (part_k, part_v) = ops.rows(part.q0, part.q1), ops.keys(part.k0, part.k1)
            part_out, part_lse = _flash_forward(part_q, part_k, part_v, part.causal,
                                                _mask_of(part, seqlen_q, seqlen_k, spec, masks), spec.scale)
            part_out, part_lse = ops.unfold(part_out, heads_q), ops.unfold(part_lse.unsqueeze(-1), heads_q)[..., 0]
            rows = slice(part.q0, part.q1)
            if out is None and (part.q0, part.q1) == (0, seqlen_q):  # the first result over every row holds the rest
                out, lse = part_out, part_lse
            elif (part.q0, part.q1) in filled:
                merge_into(out[:, :, rows], lse[:, :, rows], part_out, part_lse)
            else:
                if out is None:
                    out = qh.new_zeros((batch, heads_q, seqlen_q, width), dtype=torch.float32)
                    lse = qh.new_full((batch, heads_q, seqlen_q), float("-inf"), dtype=torch.float32)
                out[:, :, rows], lse[:, :, rows] = part_out, part_lse
            filled.add((part.q0, part.q1))
    if out is None:  # no row sees a key
        out = qh.new_zeros((batch, heads_q, seqlen_q, width), dtype=torch.float32)
        lse = qh.new_full((batch, heads_q, seqlen_q), float("-inf"), dtype=torch.float32)
    if sinks is not None:  # the sink: one more logit, of output 0
        merge_into(out, lse, None, sinks.float().view(1, heads_q, 1).expand_as(lse))
    return _in_layout(out, spec.layout, q.dtype, head_dim_v), lse.contiguous()


def _fused_backward(dout, dlse, q, k, v, out, lse, spec: AttentionSpec):
    """(dq, dk, dv) by the kernel's backward on ``fused_parts``, each given the whole row's lse and out
    (finite: a row with no key is in no part).

    A gradient on lse adds p * dlse to ds = p * (dp - delta): delta - dlse in place of delta. The
    kernel takes delta as sum(dout * out) over the head dims, so one more head column carries it:
    out's is 1, dout's -dlse, q's, k's and v's 0 (no score or dp changes)."""
    qh, kh, vh, doh, oh = (to_bhsd(t, spec.layout) for t in (q, k, v, dout, out))
    heads_q, seqlen_q, head_dim = qh.shape[1:]
    heads_kv, seqlen_k, head_dim_v = kh.shape[1], kh.shape[2], vh.shape[3]
    width = max(head_dim, head_dim_v) + (dlse is not None)
    parts = fused_parts(seqlen_q, seqlen_k, spec.window_left, spec.window_right) if qh.numel() else []
    if not parts:
        return tuple(torch.zeros_like(t, memory_format=torch.contiguous_format) for t in (q, k, v))
    out_last, dout_last = (None, None) if dlse is None else (1.0, -dlse.float())
    ops = _Operands(heads_q, heads_kv, [_fp32(qh, width), _fp32(doh, width, dout_last), _fp32(oh, width, out_last)],
                    [_fp32(kh, width), _fp32(vh, width)])
    dq = dk = dv = None
    masks = {}
    for part in parts:
        (part_q, part_dout, part_out), (part_k, part_v) = ops.rows(part.q0, part.q1), ops.keys(part.k0, part.k1)
        grads = _flash_backward(part_dout, part_q, part_k, part_v, part_out, ops.lse(lse, part.q0, part.q1),
                                part.causal, _mask_of(part, seqlen_q, seqlen_k, spec, masks), spec.scale)
        part_dq, part_dk, part_dv = (ops.unfold(g, h) for g, h in zip(grads, (heads_q, heads_kv, heads_kv)))
        dq = _accumulate(dq, part_dq, part.q0, part.q1, seqlen_q)
        dk = _accumulate(dk, part_dk, part.k0, part.k1, seqlen_k)
        dv = _accumulate(dv, part_dv, part.k0, part.k1, seqlen_k)
    return (_in_layout(dq, spec.layout, q.dtype, head_dim), _in_layout(dk, spec.layout, k.dtype, head_dim),
            _in_layout(dv, spec.layout, v.dtype, head_dim_v))


def _accumulate(total: torch.Tensor | None, part: torch.Tensor, start: int, end: int, length: int) -> torch.Tensor:
    """``total`` (B, H, length, X) plus a part's gradient at positions [start, end); the first part that
    spans every position is the total (no zeroing, no copy)."""
    if total is None:
        if (start, end) == (0, length):
            return part
        total = part.new_zeros((*part.shape[:2], length, part.shape[-1]))
    total[:, :, start:end] += part
    return total


# ----------------------------------------------------------------------------- the tiled math path


class _Tiles:
    """The tiled math path's view of one call: float32 K/V, the user's mask and bias grouped by K/V
    head, and for each query tile the key tiles its rows can see."""

    def __init__(self, q, k, v, spec: AttentionSpec, mask: BlockMask | None, bias: torch.Tensor | None,
                 alibi: torch.Tensor | None = None, dropout_seed: torch.Tensor | None = None,
                 dropout_first_batch: int = 0):
        self.spec = spec
        self.qh, kh, vh = (to_bhsd(t, spec.layout) for t in (q, k, v))
        self.batch, self.heads_q, self.seqlen_q, self.head_dim = self.qh.shape
        self.heads_kv, self.seqlen_k = kh.shape[1], kh.shape[2]
        self.group = self.heads_q // self.heads_kv
        self.k, self.v = kh.float(), vh.float()
        self.mask_states = None if mask is None else (mask.states, mask.cell)
        mask, self.mask_shift = _element_rows(mask, self.seqlen_q)
        self.mask = _grouped_mask(mask, self.heads_q, self.heads_kv)
        self.bias = _grouped_mask(bias, self.heads_q, self.heads_kv)
        self.alibi = _grouped_alibi(alibi, self.heads_kv)
        self.dropout_seed = None if dropout_seed is None else int(dropout_seed.reshape(-1)[0])
        self.dropout_first_batch = dropout_first_batch

    def kept(self, q0: int, q1: int, k0: int, k1: int) -> torch.Tensor | None:
        """Dropout's keep mask of a tile as (B, Hkv, G, rows, keys), or None without dropout."""
        if self.dropout_seed is None:
            return None
        keep = dropout.keep_mask(self.dropout_seed, self.batch, self.heads_q, self.seqlen_q, self.seqlen_k,
                                 self.spec.dropout_p, self.k.device, batch_start=self.dropout_first_batch,
                                 query_start=q0, query_end=q1, key_start=k0, key_end=k1)
        return keep.view(self.batch, self.heads_kv, self.group, q1 - q0, k1 - k0)

    def query_tiles(self):
        """(q0, q1, key tiles [(k0, k1, whole)]) over the rows that see a key; ``whole``: every row of
        the tile sees every key of the key tile (no keep rule to apply). Key tiles the mask empties
        for every batch and head are left out (its tile states, as the kernels skip them)."""
        spec = self.spec
        first_row, end_row = rows_with_keys(self.seqlen_q, self.seqlen_k, spec.window_left, spec.window_right)
        if spec.has_chunk:  # rows at a negative aligned position lie in no key's chunk
            first_row = min(end_row, max(first_row, self.seqlen_q - self.seqlen_k))
        for q0 in range(first_row, end_row, QUERY_TILE):
            q1 = min(q0 + QUERY_TILE, end_row)
            lo, hi, full_lo, full_hi = visible_keys(q0, q1, self.seqlen_q, self.seqlen_k, spec.window_left,
                                                    spec.window_right)
            if spec.has_chunk:
                lo, hi, full_lo, full_hi = chunk_keys(q0, q1, self.seqlen_q, self.seqlen_k, spec.chunk, lo, hi,
                                                      full_lo, full_hi)
            key_tiles = [(k0, min(k0 + KEY_TILE, hi)) for k0 in range(lo, hi, KEY_TILE)]
            yield q0, q1, [(k0, k1, full_lo <= k0 and k1 <= full_hi) for k0, k1 in key_tiles
                           if not self._masked_off(q0, q1, k0, k1)]

    def _masked_off(self, q0: int, q1: int, k0: int, k1: int) -> bool:
        """Whether the mask's tile states say it keeps no entry of the tile, in any batch or head."""
        if self.mask_states is None:
            return False
        states, (cell_q, cell_k) = self.mask_states
        rows = slice(None) if states.shape[2] == 1 else slice(q0 // cell_q, (q1 - 1) // cell_q + 1)
        cols = slice(None) if states.shape[3] == 1 else slice(k0 // cell_k, (k1 - 1) // cell_k + 1)
        return bool((states[:, :, rows, cols] == EMPTY).all())

    def rows(self, t: torch.Tensor, q0: int, q1: int) -> torch.Tensor:
        """Rows [q0, q1) of a (B, Hq, Sq, X) tensor as float32 (B, Hkv, G * rows, X): a group's query
        heads stacked on one K/V head, one matmul for all of them."""
        return t[:, :, q0:q1].float().reshape(self.batch, self.heads_kv, self.group * (q1 - q0), t.shape[-1])

    def scaled(self, q_rows: torch.Tensor) -> torch.Tensor:
        """Query rows times the factor their scores take before softcap's tanh: one pass over the rows
        instead of one over every score tile."""
        spec = self.spec
        return q_rows * (spec.scale / spec.softcap if spec.has_softcap else spec.scale)

    def scores(self, q_scaled: torch.Tensor, q0: int, q1: int, k0: int, k1: int, whole: bool,
               keep_tanh: bool = False):
        """(B, Hkv, G, rows, keys) scores of a tile after softcap, bias, ALiBi and masking (``q_scaled``: from
        ``scaled``), and with ``keep_tanh`` tanh for the softcap gradient (else None)."""
        spec = self.spec
        s = torch.matmul(q_scaled, self.k[:, :, k0:k1].transpose(-1, -2))
        s = s.view(self.batch, self.heads_kv, self.group, q1 - q0, k1 - k0)
        tanh = None
        if spec.has_softcap:
            s = s.tanh_()
            tanh, s = (s, s * spec.softcap) if keep_tanh else (None, s.mul_(spec.softcap))
        if self.bias is not None:
            s.add_(_chunk(_rows_of(self.bias, q0, q1), k0, k1))
        if self.alibi is not None:
            s.sub_(self.alibi * alibi_distances(self.seqlen_q, self.seqlen_k, s.device, k0, k1, q0, q1))
        keep = None if whole else keep_mask(self.seqlen_q, self.seqlen_k, spec.window_left, spec.window_right,
                                            s.device, k0, k1, q0, q1, chunk=spec.chunk)
        if self.mask is not None:
            user = _chunk(_rows_of(self.mask, q0, q1), k0, k1, self.mask_shift)
            keep = user if keep is None else keep & user
        if keep is not None:
            s.masked_fill_(~keep, float("-inf"))
        return s, tanh


def _rows_of(t: torch.Tensor, q0: int, q1: int) -> torch.Tensor:
    """The query rows [q0, q1) of a grouped mask or bias (or its one broadcast row)."""
    return t if t.shape[-2] == 1 else t[..., q0:q1, :]


def _math_forward(q, k, v, spec: AttentionSpec, sinks, mask, bias, alibi=None, dropout_seed=None,
                  dropout_first_batch=0):
    tiles = _Tiles(q, k, v, spec, mask, bias, alibi, dropout_seed, dropout_first_batch)
    b, hkv, g, seqlen_q, head_dim_v = tiles.batch, tiles.heads_kv, tiles.group, tiles.seqlen_q, tiles.v.shape[-1]
    out = tiles.k.new_zeros((b, hkv, g, seqlen_q, head_dim_v))
    if sinks is None:
        lse = tiles.k.new_full((b, hkv, g, seqlen_q), float("-inf"))
    else:  # rows with no key: lse is the sink's logit alone (a new tensor: written below, never the sinks)
        lse = sinks.float().view(1, hkv, g, 1).repeat(b, 1, 1, seqlen_q)
    for q0, q1, key_tiles in tiles.query_tiles():
        q_rows = tiles.scaled(tiles.rows(tiles.qh, q0, q1))
        shape = (b, hkv, g, q1 - q0, 1)
        if sinks is None:
            row_max, row_sum = q_rows.new_full(shape, float("-inf")), q_rows.new_zeros(shape)
        else:  # the sink is one more logit of every row: start as if it had been seen
            row_max, row_sum = lse[..., q0:q1].unsqueeze(-1).clone(), q_rows.new_ones(shape)
        acc = q_rows.new_zeros((*shape[:-1], head_dim_v))
        for k0, k1, whole in key_tiles:
            s, _ = tiles.scores(q_rows, q0, q1, k0, k1, whole)
            new_max = torch.maximum(row_max, s.amax(dim=-1, keepdim=True))
            shift = torch.where(torch.isinf(new_max), torch.zeros_like(new_max), new_max)
            p = s.sub_(shift).exp_()
            alpha = torch.exp(row_max - shift)
            row_sum = row_sum * alpha + p.sum(dim=-1, keepdim=True)
            kept = tiles.kept(q0, q1, k0, k1)
            if kept is not None:  # dropped probabilities leave the values' sum, not the normaliser
                p = p.masked_fill_(~kept, 0.0)
            pv = torch.matmul(p.view(b, hkv, -1, k1 - k0), tiles.v[:, :, k0:k1]).view(acc.shape)
            acc = acc.mul_(alpha).add_(pv)
            row_max = new_max
        empty = row_sum == 0
        if spec.has_dropout:
            acc = acc.mul_(dropout.keep_scale(spec.dropout_p))
        out[..., q0:q1, :] = acc / torch.where(empty, torch.ones_like(row_sum), row_sum)
        lse[..., q0:q1] = torch.where(empty, torch.full_like(row_sum, float("-inf")),
                                      row_max + torch.log(row_sum)).squeeze(-1)
    out = out.view(b, hkv * g, seqlen_q, head_dim_v)
    return _in_layout(out, spec.layout, q.dtype, head_dim_v), lse.view(b, hkv * g, seqlen_q)


def _math_backward(dout, dlse, q, k, v, out, lse, spec: AttentionSpec, mask, bias, bias_grad: bool, alibi=None,
                   dropout_seed=None, dropout_first_batch=0):
    tiles = _Tiles(q, k, v, spec, mask, bias, alibi, dropout_seed, dropout_first_batch)
    b, hkv, g, seqlen_q = tiles.batch, tiles.heads_kv, tiles.group, tiles.seqlen_q
    doh, oh = to_bhsd(dout, spec.layout), to_bhsd(out, spec.layout)
    dq = torch.zeros((b, tiles.heads_q, seqlen_q, tiles.head_dim), dtype=torch.float32, device=q.device)
    dk, dv = torch.zeros_like(tiles.k), torch.zeros_like(tiles.v)
    dbias = torch.zeros(tiles.bias.shape, dtype=torch.float32, device=q.device) if bias_grad else None
    # Rows with no key have lse = -inf and only masked (-inf) scores: exp(-inf - inf) = 0, not NaN.
    lse = torch.where(torch.isneginf(lse), torch.full_like(lse, float("inf")), lse).view(b, hkv, g, seqlen_q)
    for q0, q1, key_tiles in tiles.query_tiles():
        rows = q1 - q0
        q_rows, dout_rows = tiles.rows(tiles.qh, q0, q1), tiles.rows(doh, q0, q1)
        # d lse / d s = p, so a gradient on lse folds into delta: ds = p * (dp - (delta - dlse)).
        delta = (dout_rows * tiles.rows(oh, q0, q1)).sum(dim=-1).view(b, hkv, g, rows, 1)
        if dlse is not None:
            delta = delta - dlse[:, :, q0:q1].float().reshape(b, hkv, g, rows, 1)
        lse_rows = lse[..., q0:q1].unsqueeze(-1)
        q_scaled, dq_rows = tiles.scaled(q_rows), torch.zeros_like(q_rows)
        for k0, k1, whole in key_tiles:
            keys = k1 - k0
            s, tanh = tiles.scores(q_scaled, q0, q1, k0, k1, whole, keep_tanh=True)
            p = s.sub_(lse_rows).exp_()
            kept = tiles.kept(q0, q1, k0, k1)
            # with dropout, what multiplied V: p on kept entries times the keep scale, else 0
            p_used = p if kept is None else p.masked_fill(~kept, 0.0).mul_(dropout.keep_scale(spec.dropout_p))
            p_flat = p_used.view(b, hkv, g * rows, keys)
            dv[:, :, k0:k1] += torch.matmul(p_flat.transpose(-1, -2), dout_rows)
            dp = torch.matmul(dout_rows, tiles.v[:, :, k0:k1].transpose(-1, -2)).view(p.shape)
            if kept is not None:  # d out / d p: the dropped entries' values never reached the output
                dp = dp.masked_fill_(~kept, 0.0).mul_(dropout.keep_scale(spec.dropout_p))
            ds = dp.sub_(delta).mul_(p)
            if dbias is not None:  # the logit's gradient, summed down to the bias's broadcast shape
                target = _chunk(_rows_of(dbias, q0, q1), k0, k1)
                target.add_(_sum_to(ds, target.shape))
            if tanh is not None:
                ds = ds.mul_(tanh.square_().neg_().add_(1.0))
            ds_flat = ds.view(b, hkv, g * rows, keys)
            dq_rows += torch.matmul(ds_flat, tiles.k[:, :, k0:k1])
            dk[:, :, k0:k1] += torch.matmul(ds_flat.transpose(-1, -2), q_rows)
        dq[:, :, q0:q1] = dq_rows.view(b, tiles.heads_q, rows, tiles.head_dim)
    dq, dk = dq.mul_(spec.scale), dk.mul_(spec.scale)
    return (
        _in_layout(dq, spec.layout, q.dtype, dq.shape[-1]),
        _in_layout(dk, spec.layout, k.dtype, dk.shape[-1]),
        _in_layout(dv, spec.layout, v.dtype, dv.shape[-1]),
        dbias.reshape(bias.shape).to(bias.dtype) if dbias is not None else None,
    )


def _sum_to(t: torch.Tensor, shape) -> torch.Tensor:
    """``t`` summed over the dims where ``shape`` has 1 (the last dim only up to the chunk)."""
    dims = tuple(i for i, size in enumerate(shape) if size == 1 and t.shape[i] != 1)
    return t.sum(dim=dims, keepdim=True) if dims else t
