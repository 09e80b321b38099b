"""``kvcache_attention``: attention of new queries over a KV cache (FlashAttention's
``flash_attn_with_kvcache``), forward only.

The cache is contiguous, (B, S_cache, Hkv, D), or paged, (pages, page_size, Hkv, D) with a block
table (B, pages per sequence) of page indices: sequence b's token t lives in page
``block_table[b, t // page_size]``, row ``t % page_size``. ``cache_seqlens[b]`` tokens of sequence
b are valid. ``k_new`` / ``v_new`` (B, S_new, Hkv, D) are first written into the cache at positions
``cache_seqlens[b] ...`` (in place), then the queries attend over ``cache_seqlens[b] + S_new`` keys,
with causal / window -- and ALiBi's distances ``|i + Sk - Sq - j|``, Sk = ``cache_seqlens[b] + S_new`` --
aligned bottom-right (the queries are the sequence's last Sq tokens). ``cache_seqlens`` itself is
not advanced: the caller owns it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from .checks import check_alibi, check_chunk, check_heads_and_dims, check_options, check_sinks, check_tensors, is_integer
from .dispatch import resolve_backend
from .interface import attention, beyond_first_order
from .kernels.triton.kvcache import kvcache_forward
from .spec import AttentionSpec, resolve_spec

_NAME = "fusedattn.kvcache_attention"


@dataclass(frozen=True)
class CacheShape:
    """What the checks learned from the shapes: ``capacity`` is the most tokens a sequence's cache
    holds (S_cache, or pages per sequence x page size)."""

    batch: int
    heads_q: int
    new_len: int
    paged: bool
    page_size: int
    num_pages: int
    capacity: int


def _check_int32(name: str, t, rank: int, dims: str, q: torch.Tensor) -> None:
    if not isinstance(t, torch.Tensor) or t.dtype != torch.int32:
        got = t.dtype if isinstance(t, torch.Tensor) else type(t).__name__
        raise TypeError(f"{_NAME}: `{name}` must be an int32 torch.Tensor {dims}, got {got}")
    if t.dim() != rank:
        raise ValueError(f"{_NAME}: `{name}` must be {rank}-D {dims}, got shape {tuple(t.shape)}")
    if t.device != q.device:
        raise ValueError(f"{_NAME}: `{name}` is on {t.device} but q is on {q.device}")


def check_shapes(q, k_cache, v_cache, cache_seqlens, block_table, k_new, v_new) -> CacheShape:
    """Every rule that the shapes, dtypes and devices decide (no value is read here)."""
    paged = block_table is not None
    cache_dims = "(pages, page_size, Hkv, D)" if paged else "(B, S_cache, Hkv, D)"
    check_tensors(_NAME, (("q", q),), 4, "(B, Sq, Hq, D)")
    check_tensors(_NAME, (("k_cache", k_cache), ("v_cache", v_cache)), 4, cache_dims)
    if k_cache.dtype != q.dtype:
        raise TypeError(f"{_NAME}: the caches are {k_cache.dtype}; expected q's dtype {q.dtype}")
    if k_cache.device != q.device:
        raise ValueError(f"{_NAME}: the caches are on {k_cache.device} but q is on {q.device}")
    batch, _, heads_q, head_dim = q.shape
    if k_cache.shape[:3] != v_cache.shape[:3]:
        raise ValueError(f"{_NAME}: `k_cache` {tuple(k_cache.shape)} and `v_cache` {tuple(v_cache.shape)} must agree "
                         f"on all but the head dim {cache_dims}")
    slots, rows, heads_kv, head_dim_k = k_cache.shape
    if head_dim_k != head_dim:
        raise ValueError(f"{_NAME}: `k_cache` head dim {head_dim_k} must equal `q` head dim {head_dim}")
    check_heads_and_dims(_NAME, heads_q, heads_kv, head_dim, v_cache.shape[3], lambda: f"(caches {cache_dims})")
    for name, t in (("k_cache", k_cache), ("v_cache", v_cache)):
        if t.stride(-1) != 1:
            raise ValueError(f"{_NAME}: `{name}` must have unit stride on its head dim (it is written in place), "
                             f"got strides {t.stride()}")
    if paged:
        _check_int32("block_table", block_table, 2, "(B, pages per sequence)", q)
        if block_table.shape[0] != batch:
            raise ValueError(f"{_NAME}: `block_table` has {block_table.shape[0]} rows; expected one per sequence "
                             f"(B = {batch})")
        if rows % 16 != 0:
            raise ValueError(f"{_NAME}: the page size of a paged cache (dim 1 of the caches, the rows each "
                             f"`block_table` entry points to) must be a multiple of 16, got {rows}")
        capacity = block_table.shape[1] * rows
    else:
        if slots != batch:
            raise ValueError(f"{_NAME}: `k_cache` holds {slots} sequences but q has batch {batch}; a cache of pages "
                             f"needs a `block_table`")
        capacity = rows
    if isinstance(cache_seqlens, torch.Tensor):
        _check_int32("cache_seqlens", cache_seqlens, 1, "(B,)", q)
        if cache_seqlens.shape[0] != batch:
            raise ValueError(f"{_NAME}: `cache_seqlens` has {cache_seqlens.shape[0]} entries; expected B = {batch}")
    elif not is_integer(cache_seqlens):
        raise TypeError(f"{_NAME}: `cache_seqlens` must be an int32 tensor (B,) or an int, got "
                        f"{type(cache_seqlens).__name__}")
    new_len = 0
    if (k_new is None) != (v_new is None):
        raise ValueError(f"{_NAME}: `k_new` and `v_new` go together: give both or neither")
    if k_new is not None:
        check_tensors(_NAME, (("k_new", k_new), ("v_new", v_new)), 4, "(B, S_new, Hkv, D)")
        expected = [(batch, k_new.shape[1], heads_kv, head_dim), (batch, k_new.shape[1], heads_kv, v_cache.shape[3])]
        for name, t, shape in zip(("k_new", "v_new"), (k_new, v_new), expected):
            if tuple(t.shape) != shape:
                raise ValueError(f"{_NAME}: `{name}` has shape {tuple(t.shape)}; expected {shape} (B, S_new, Hkv, "
                                 f"head dim of the cache)")
            if t.dtype != k_cache.dtype:
                raise TypeError(f"{_NAME}: `{name}` is {t.dtype}; expected the cache's dtype {k_cache.dtype}")
            if t.device != k_cache.device:
                raise ValueError(f"{_NAME}: `{name}` is on {t.device} but the cache is on {k_cache.device}")
        new_len = k_new.shape[1]
    return CacheShape(batch, heads_q, new_len, paged, rows if paged else 0, slots if paged else 0, capacity)


def check_aliasing(k_cache, v_cache, k_new, v_new) -> None:
    """New tokens that are views of the cache they are copied into would be overwritten while read.
    (Addresses, so not where torch.compile traces: ``_kvcache_impl`` runs it.)"""
    if k_new is None:
        return
    for new_name, new in (("k_new", k_new), ("v_new", v_new)):
        for cache_name, cache in (("k_cache", k_cache), ("v_cache", v_cache)):
            if _overlap(new, cache):
                raise ValueError(f"{_NAME}: `{new_name}` overlaps `{cache_name}` in memory (a view of the cache?); "
                                 f"the new tokens are copied into the cache in place, so they must live outside "
                                 f"it: pass a copy")


def _overlap(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether the memory spans of ``a`` and ``b`` (first to last element) intersect: a conservative
    test, exact for the views of a cache one would pass by mistake."""
    if a.numel() == 0 or b.numel() == 0 or a.untyped_storage().data_ptr() != b.untyped_storage().data_ptr():
        return False

    def span(t):
        start = t.data_ptr()
        return start, start + (sum((n - 1) * abs(st) for n, st in zip(t.shape, t.stride())) + 1) * t.element_size()

    (a0, a1), (b0, b1) = span(a), span(b)
    return a0 < b1 and b0 < a1


def check_values(cache_seqlens: torch.Tensor, block_table, shape: CacheShape) -> None:
    """The lengths and the pages they use, read on the host (one small device-to-host copy): a length
    out of range or a page outside the cache is an error before anything is written."""
    ends = cache_seqlens.long() + shape.new_len
    stats = [cache_seqlens.min(), ends.max()]
    if shape.paged:
        used = torch.arange(block_table.shape[1], device=block_table.device) < \
            ((ends + shape.page_size - 1) // shape.page_size).clamp(min=0)[:, None]
        stats += [torch.where(used, block_table, 0).min(), torch.where(used, block_table, 0).max()]
    values = torch.stack(stats).tolist()
    if values[0] < 0:
        raise ValueError(f"{_NAME}: `cache_seqlens` must be >= 0, got {cache_seqlens.tolist()}")
    if values[1] > shape.capacity:
        where = "the `block_table`'s pages per sequence x page size" if shape.paged else "S_cache"
        raise ValueError(f"{_NAME}: a sequence needs {values[1]} cache rows (cache_seqlens + {shape.new_len} new) "
                         f"but the cache holds {shape.capacity} ({where}); nothing was written")
    if shape.paged and (values[2] < 0 or values[3] >= shape.num_pages):
        raise ValueError(f"{_NAME}: `block_table` points outside the cache: the pages in use run from {values[2]} "
                         f"to {values[3]} but the cache has {shape.num_pages} pages; nothing was written")


def _capturing(device: torch.device) -> bool:
    """Whether a CUDA graph is being captured on the current stream: values cannot be read then."""
    return device.type == "cuda" and torch.cuda.is_current_stream_capturing()


def _gather(cache: torch.Tensor, block_table, batch: int, length: int) -> torch.Tensor:
    """Sequence ``batch``'s first ``length`` cache rows as (length, Hkv, D)."""
    if block_table is None:
        return cache[batch, :length]
    positions = torch.arange(length, device=cache.device)
    return cache[block_table[batch, positions // cache.shape[1]].long(), positions % cache.shape[1]]


def _scatter(cache: torch.Tensor, block_table, batch: int, start: int, rows: torch.Tensor) -> None:
    positions = torch.arange(start, start + rows.shape[0], device=cache.device)
    if block_table is None:
        cache[batch, positions] = rows
    else:
        cache[block_table[batch, positions // cache.shape[1]].long(), positions % cache.shape[1]] = rows


def _per_sequence(q, k_cache, v_cache, cache_seqlens, block_table, k_new, v_new, options: dict, sinks, alibi=None):
    """The "torch" backend: append with indexing, then ``attention`` on each sequence's keys
    (``alibi``: the (B, Hq) slopes, a row to each sequence)."""
    outs, lses = [], []
    for b, cached in enumerate(cache_seqlens.tolist()):
        if k_new is not None:
            _scatter(k_cache, block_table, b, cached, k_new[b])
            _scatter(v_cache, block_table, b, cached, v_new[b])
        length = cached + (0 if k_new is None else k_new.shape[1])
        out, lse = attention(q[b:b + 1], _gather(k_cache, block_table, b, length)[None],
                             _gather(v_cache, block_table, b, length)[None], sinks=sinks,
                             alibi_slopes=None if alibi is None else alibi[b:b + 1], return_lse=True, **options)
        outs.append(out)
        lses.append(lse)
    return torch.cat(outs), torch.cat(lses)


def _kvcache_impl(q, k_cache, v_cache, cache_seqlens, block_table, k_new, v_new, sinks, alibi, window_left: int,
                  window_right: int, scale: float, softcap: float, chunk: int, num_splits: int | None, backend: str,
                  shape: CacheShape | None = None):
    """The call once its arguments are checked by shape (``shape``, or checked again here): the checks
    that read values or addresses, then the append and the attention, (out, lse). Both the eager call
    and the custom op run it."""
    check_aliasing(k_cache, v_cache, k_new, v_new)
    shape = shape or check_shapes(q, k_cache, v_cache, cache_seqlens, block_table, k_new, v_new)
    if not _capturing(q.device):
        check_values(cache_seqlens, block_table, shape)
    spec = AttentionSpec("bshd", window_left, window_right, scale, softcap, False, alibi is not None, chunk)
    if backend == "torch":
        options = dict(window=(window_left, window_right), scale=scale, softcap=softcap if softcap else None,
                       chunk=chunk or None)
        return _per_sequence(q, k_cache, v_cache, cache_seqlens, block_table, k_new, v_new, options, sinks, alibi)
    kernel_sinks = sinks.float().contiguous() if sinks is not None else None
    table = block_table.contiguous() if block_table is not None else None  # the kernels step pages by 1
    return kvcache_forward(q, k_cache, v_cache, cache_seqlens.contiguous(), table, k_new, v_new, spec, kernel_sinks,
                           num_splits, shape.capacity, alibi)


@torch.library.custom_op("fusedattn::kvcache_attention", mutates_args=("k_cache", "v_cache"))
def _kvcache_op(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, cache_seqlens: torch.Tensor,
                block_table: Optional[torch.Tensor], k_new: Optional[torch.Tensor], v_new: Optional[torch.Tensor],
                sinks: Optional[torch.Tensor], alibi: Optional[torch.Tensor], window_left: int, window_right: int,
                scale: float, softcap: float, chunk: int, num_splits: Optional[int],
                backend: str) -> tuple[torch.Tensor, torch.Tensor]:
    """torch.compile traces this op, not the checks that read values: ``kvcache_attention`` compiles
    with fullgraph=True and, under CUDA-graph capture (mode="reduce-overhead"), the kernels guard
    themselves as in an eager capture."""
    return _kvcache_impl(q, k_cache, v_cache, cache_seqlens, block_table, k_new, v_new, sinks, alibi, window_left,
                         window_right, scale, softcap, chunk, num_splits, backend)


@_kvcache_op.register_fake
def _kvcache_fake(q, k_cache, v_cache, cache_seqlens, block_table, k_new, v_new, sinks, alibi, *options):
    batch, seqlen_q, heads_q, _ = q.shape
    return q.new_empty((batch, seqlen_q, heads_q, v_cache.shape[-1])), \
        q.new_empty((batch, heads_q, seqlen_q), dtype=torch.float32)


@torch.no_grad()
def kvcache_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    cache_seqlens: torch.Tensor | int,
    *,
    block_table: torch.Tensor | None = None,
    k_new: torch.Tensor | None = None,
    v_new: torch.Tensor | None = None,
    causal: bool = False,
    window: tuple[int, int] | None = None,
    scale: float | None = None,
    softcap: float | None = None,
    sinks: torch.Tensor | None = None,
    alibi_slopes: torch.Tensor | None = None,
    chunk: int | None = None,
    return_lse: bool = False,
    num_splits: int | None = None,
):
    """Attention of ``q`` (B, Sq, Hq, D) over a KV cache, after appending ``k_new`` / ``v_new`` in
    place (module docstring). Forward only: the outputs carry no gradient.

    ``cache_seqlens``: int32 (B,) (or one int for all) valid tokens per sequence before the append.
    ``block_table``: int32 (B, pages per sequence) for a paged cache (page size a multiple of 16).
    ``num_splits``: how many parts the keys are split into for parallelism when the queries are few
    (decoding); None chooses from the shapes, 1 turns splitting off (at most 64 are used, and at most
    one per 64-key tile of the cache's capacity). Options as in
    ``fusedattn.attention``; ``alibi_slopes`` float32 (Hq,) or (B, Hq), with distances aligned as
    causal is (module docstring); ``chunk``: chunked local attention, ``(i + Sk - Sq) // chunk == j //
    chunk`` with Sk = ``cache_seqlens[b]`` + the new tokens (Llama 4's chunked layers decoding over a
    cache holding the whole sequence; the kernel walks only the key blocks of its rows' chunks). Returns out (B, Sq, Hq, Dv), and with ``return_lse=True`` lse (B, Hq,
    Sq) float32.

    Bad lengths or pages raise before anything is written; this reads ``cache_seqlens`` (and the
    block table) on the host once a call. Under CUDA-graph capture the values cannot be read: the
    kernels then guard themselves (nothing written or read outside the cache; the rows of an
    out-of-range sequence come out NaN)."""
    check_options(layout="bshd", causal=causal, window=window, scale=scale, softcap=softcap, deterministic=False,
                  return_lse=return_lse, caller=_NAME)
    compiling = torch.compiler.is_compiling()
    if not compiling and beyond_first_order(q, k_cache, v_cache, k_new, v_new, sinks):
        raise NotImplementedError(f"{_NAME} is forward-only (inference over a cache it writes in place): it takes "
                                  f"no forward-mode AD tangent and runs under no torch.func transform (grad, vmap, "
                                  f"jvp, ...); use fusedattn.attention for differentiable attention")
    shape = check_shapes(q, k_cache, v_cache, cache_seqlens, block_table, k_new, v_new)
    check_sinks(sinks, q, shape.heads_q)
    alibi = check_alibi(alibi_slopes, q, shape, caller=_NAME)
    check_chunk(chunk, caller=_NAME)
    if num_splits is not None and (not is_integer(num_splits) or num_splits < 1):
        raise ValueError(f"{_NAME}: `num_splits` must be an int >= 1 or None (automatic), got {num_splits!r}")
    if not isinstance(cache_seqlens, torch.Tensor):
        cache_seqlens = torch.full((shape.batch,), int(cache_seqlens), dtype=torch.int32, device=q.device)
    q = q if q.stride(-1) == 1 else q.contiguous()
    if k_new is not None:
        k_new, v_new = (t if t.stride(-1) == 1 else t.contiguous() for t in (k_new, v_new))
    spec = resolve_spec(q.shape[-1], layout="bshd", causal=causal, window=window, scale=scale, softcap=softcap,
                        deterministic=False, alibi=alibi is not None, chunk=chunk)
    args = (q, k_cache, v_cache, cache_seqlens, block_table, k_new, v_new, sinks, alibi, *spec.op_args()[1:5], spec.chunk,
            None if num_splits is None else int(num_splits), resolve_backend(q.device))
    out, lse = _kvcache_op(*args) if compiling else _kvcache_impl(*args, shape=shape)
    return (out, lse) if return_lse else out
