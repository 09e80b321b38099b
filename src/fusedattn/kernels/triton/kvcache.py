"""KV-cache attention kernels (``fusedattn.kvcache_attention``), forward only.

- ``_append_kernel`` writes ``k_new`` / ``v_new`` into the cache at positions
  ``cache_seqlens[b] + i`` (through the block table when the cache is paged).
- ``_cache_attention_kernel``: one program per (block of packed query rows, batch x KV head,
  split). Its rows are the (query position, query head) pairs of one KV head -- for decoding
  (Sq = 1) the query heads of a GQA group -- so each key tile is read once per KV head, not once per
  query head. A program walks its split's share of the key blocks its rows see
  (``block_range.key_blocks_for_rows``, ``split_key_blocks``), loading cache rows by pointers: a
  paged cache's rows are found through the block table row by row, so any page size works with any
  key tile. Scores go through the same pieces as the other kernels (``softmax``,
  ``masking.adjust_scores``, ``masking.alibi_scores`` with ``HAS_ALIBI``: each packed row has its
  query head's slope).
- ``_combine_splits_kernel``: with more than one split, each split stored its own normalised
  output (fp32) and lse; the combination weighs them by lse (the rule of ``merge_attention``).

Cache lengths are read on the device. The interface checks them (and the pages they use) before
anything runs, except while a CUDA graph is being captured, when their values cannot be read on
the host: then the kernels guard themselves. A batch whose length is out of range (negative, or
past the capacity with the new tokens) gets nothing appended and NaN outputs; a cache row whose
page index lies outside the cache is neither written nor read, and the rows that needed it become
NaN. No access ever leaves the tensors.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from ...spec import AttentionSpec
from ..shared.block_range import key_blocks_for_rows, split_key_blocks
from ..shared.constants import score_constants
from .fwd import dot_precision, padded_dims, softcap_mode
from ..shared.knobs import knobs
from ..shared.launch import cdiv, launch, next_power_of_2
from .masking import adjust_scores, alibi_scores, alibi_slope
from .softmax import finalize_rows, initial_row_stats, log2_scores, online_softmax_step


@triton.jit
def cache_rows(BlockTable, batch, positions, in_range, stride_table, page_size, num_pages, PAGED: tl.constexpr):
    """(page, row, usable) of sequence ``batch``'s ``positions``: the cache's first index (the page;
    the batch itself for a contiguous cache), the row within it (int64 both), and which positions
    may be touched -- ``in_range`` ones whose page lies inside the cache."""
    if PAGED:
        page = tl.load(BlockTable + batch.to(tl.int64) * stride_table + positions // page_size, mask=in_range,
                       other=0)
        usable = in_range & (page >= 0) & (page < num_pages)
        return page.to(tl.int64), (positions % page_size).to(tl.int64), usable
    else:
        return batch.to(tl.int64) + positions.to(tl.int64) * 0, positions.to(tl.int64), in_range


@triton.jit
def _append_kernel(
    KNew, VNew, KCache, VCache, CacheSeqlens, BlockTable,
    stride_nkb, stride_nks, stride_nkh, stride_nvb, stride_nvs, stride_nvh,
    stride_kp, stride_ks, stride_kh, stride_vp, stride_vs, stride_vh,
    stride_table, new_len, heads_kv, page_size, num_pages, capacity,
    HEAD_DIM: tl.constexpr, HEAD_DIM_V: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr,
    BLOCK_S: tl.constexpr, PAGED: tl.constexpr,
):
    """Rows ``[s_block * BLOCK_S, ...)`` of one (batch, KV head) of k_new and v_new into the cache."""
    batch_head = tl.program_id(1)
    batch = batch_head // heads_kv
    head = batch_head % heads_kv
    cached = tl.load(CacheSeqlens + batch)
    fits = (cached >= 0) & (cached + new_len <= capacity)  # else nothing of this batch is written
    offs_s = tl.program_id(0) * BLOCK_S + tl.arange(0, BLOCK_S)
    page, row, usable = cache_rows(BlockTable, batch, cached + offs_s, (offs_s < new_len) & fits, stride_table,
                                   page_size, num_pages, PAGED)
    offs_d = tl.arange(0, BLOCK_D)
    offs_dv = tl.arange(0, BLOCK_DV)
    new_rows = batch.to(tl.int64) * stride_nkb + offs_s.to(tl.int64)[:, None] * stride_nks + head * stride_nkh
    k = tl.load(KNew + new_rows + offs_d[None, :], mask=usable[:, None] & (offs_d < HEAD_DIM)[None, :])
    tl.store(KCache + (page * stride_kp + row * stride_ks + head * stride_kh)[:, None] + offs_d[None, :], k,
             mask=usable[:, None] & (offs_d < HEAD_DIM)[None, :])
    new_rows = batch.to(tl.int64) * stride_nvb + offs_s.to(tl.int64)[:, None] * stride_nvs + head * stride_nvh
    v = tl.load(VNew + new_rows + offs_dv[None, :], mask=usable[:, None] & (offs_dv < HEAD_DIM_V)[None, :])
    tl.store(VCache + (page * stride_vp + row * stride_vs + head * stride_vh)[:, None] + offs_dv[None, :], v,
             mask=usable[:, None] & (offs_dv < HEAD_DIM_V)[None, :])


@triton.jit
def _cache_tiles(
    acc, row_max, row_sum, lost, q, KCache, VCache, BlockTable, batch, head_kv, block_begin, block_end, block_step,
    offs_q, seqlen_q, seqlen_k, window_left, window_right, qk_scale, softcap_log2,
    stride_table, page_size, num_pages, stride_kp, stride_ks, stride_kh, stride_vp, stride_vs, stride_vh,
    HEAD_DIM: tl.constexpr, HEAD_DIM_V: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr,
    BLOCK_N: tl.constexpr, HAS_LEFT: tl.constexpr, HAS_RIGHT: tl.constexpr, HAS_SOFTCAP: tl.constexpr,
    PAGED: tl.constexpr, DOT_PRECISION: tl.constexpr, alibi_slope_log2=0.0, HAS_ALIBI: tl.constexpr = False,
    chunk=1, HAS_CHUNK: tl.constexpr = False,
):
    """Key blocks ``block_begin, block_begin + block_step, ...`` below ``block_end`` of the cache
    (``split_key_blocks``); ``lost`` counts kept keys whose page lay outside the cache (they read as
    zero and their rows are poisoned by the caller). ``HAS_ALIBI``: ALiBi with ``alibi_slope_log2``,
    the (BLOCK_M,) slopes of the rows' query heads in log2 units."""
    offs_tile = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    offs_dv = tl.arange(0, BLOCK_DV)
    for n_block in range(block_begin, block_end, block_step):
        start_n = n_block * BLOCK_N
        offs_n = start_n + offs_tile
        in_range = offs_n < seqlen_k
        page, row, usable = cache_rows(BlockTable, batch, offs_n, in_range, stride_table, page_size, num_pages, PAGED)
        if PAGED:
            lost += tl.sum((in_range & ~usable).to(tl.int32), 0)
        k_rows = page * stride_kp + row * stride_ks + head_kv * stride_kh
        k = tl.load(KCache + k_rows[:, None] + offs_d[None, :], mask=usable[:, None] & (offs_d < HEAD_DIM)[None, :],
                    other=0.0)
        qk = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION)
        scores, _ = log2_scores(qk, qk_scale, softcap_log2, HAS_SOFTCAP)
        if HAS_ALIBI:  # the queries are the last seqlen_q of the seqlen_k keys: bottom-right aligned
            scores = alibi_scores(scores, offs_q, offs_n, seqlen_q, seqlen_k, alibi_slope_log2[:, None], False)
        # No user mask or bias here: their arguments are placeholders the flags turn off.
        scores = adjust_scores(scores, offs_q, offs_n, 0, start_n, seqlen_q, seqlen_k, window_left, window_right,
                               None, None, 0, 0, 0, 0, 0, 0, None, None, 0, 0, 0, 0, HAS_LEFT, HAS_RIGHT, False,
                               False, False, False, True, False, chunk=chunk, HAS_CHUNK=HAS_CHUNK)
        p, alpha, row_max, row_sum = online_softmax_step(scores, row_max, row_sum, True)
        v_rows = page * stride_vp + row * stride_vs + head_kv * stride_vh
        v = tl.load(VCache + v_rows[:, None] + offs_dv[None, :],
                    mask=usable[:, None] & (offs_dv < HEAD_DIM_V)[None, :], other=0.0)
        acc = acc * alpha[:, None]
        acc = tl.dot(p.to(v.dtype), v, acc, input_precision=DOT_PRECISION)
    return acc, row_max, row_sum, lost


# Lengths and split counts are runtime values: a new one compiles nothing (decoding calls this
# with a new cache length every step).
@triton.jit(do_not_specialize=["seqlen_q", "new_len", "page_size", "num_pages", "capacity"])
def _cache_attention_kernel(
    Q, KCache, VCache, Out, Lse, Sinks, CacheSeqlens, BlockTable, Alibi,
    stride_qb, stride_qs, stride_qh,
    stride_kp, stride_ks, stride_kh, stride_vp, stride_vs, stride_vh,
    stride_o_split, stride_ob, stride_os, stride_oh,
    stride_l_split, stride_lb, stride_lh, stride_ls,
    stride_table, seqlen_q, new_len, group_size, heads_kv, page_size, num_pages, capacity,
    window_left, window_right, qk_scale, softcap_log2, chunk,
    HEAD_DIM: tl.constexpr, HEAD_DIM_V: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    HAS_LEFT: tl.constexpr, HAS_RIGHT: tl.constexpr, HAS_SOFTCAP: tl.constexpr, HAS_SINKS: tl.constexpr,
    PAGED: tl.constexpr, DOT_PRECISION: tl.constexpr, PDL: tl.constexpr, WAIT_PRIOR: tl.constexpr,
    HAS_ALIBI: tl.constexpr = False, HAS_CHUNK: tl.constexpr = False,
):
    if WAIT_PRIOR:  # launched early (programmatic dependent launch): the previous kernel's writes first
        tl.extra.cuda.gdc_wait()
    if PDL:  # the combination kernel may start now: it waits for this grid before reading (``_combine_splits_kernel``)
        tl.extra.cuda.gdc_launch_dependents()
    m_block = tl.program_id(0)
    batch_head = tl.program_id(1)
    split = tl.program_id(2)
    batch = batch_head // heads_kv
    head_kv = batch_head % heads_kv
    cached = tl.load(CacheSeqlens + batch)
    seqlen_k = cached + new_len
    bad_length = (cached < 0) | (seqlen_k > capacity)  # only unchecked under graph capture (module docstring)
    seqlen_k = tl.where(bad_length, 0, seqlen_k)

    # Packed rows: row r is query position r // group_size of query head head_kv * group_size + r % group_size.
    packed_rows = seqlen_q * group_size
    first_row = m_block * BLOCK_M
    rows = first_row + tl.arange(0, BLOCK_M)
    row_ok = rows < packed_rows
    offs_q = rows // group_size
    head = head_kv * group_size + rows % group_size
    offs_d = tl.arange(0, BLOCK_D)
    offs_dv = tl.arange(0, BLOCK_DV)
    q_rows = batch.to(tl.int64) * stride_qb + offs_q.to(tl.int64) * stride_qs + head.to(tl.int64) * stride_qh
    q = tl.load(Q + q_rows[:, None] + offs_d[None, :], mask=row_ok[:, None] & (offs_d < HEAD_DIM)[None, :], other=0.0)
    if HAS_ALIBI:  # each row's query head's slope (``head`` < Hq on every row, padded ones included)
        slopes = alibi_slope(Alibi, batch, head, heads_kv * group_size)
    else:
        slopes = 0.0

    last_row = tl.minimum(first_row + BLOCK_M, packed_rows) - 1
    begin, _, _, end = key_blocks_for_rows(first_row // group_size, last_row // group_size, seqlen_q, seqlen_k,
                                           window_left, window_right, BLOCK_N, HAS_LEFT, HAS_RIGHT, chunk, HAS_CHUNK)
    begin, end, step = split_key_blocks(begin, end, split, tl.num_programs(2))

    row_max, row_sum = initial_row_stats(Sinks, head, BLOCK_M, HAS_SINKS)
    if HAS_SINKS:  # a sink is one logit of the whole row: split 0 counts it, the others start empty
        row_max = tl.where(split == 0, row_max, float("-inf"))
        row_sum = tl.where(split == 0, row_sum, 0.0)
    acc = tl.zeros([BLOCK_M, BLOCK_DV], dtype=tl.float32)
    lost = tl.zeros([], dtype=tl.int32)
    common = (q, KCache, VCache, BlockTable, batch, head_kv)
    scores_args = (offs_q, seqlen_q, seqlen_k, window_left, window_right, qk_scale, softcap_log2, stride_table,
                   page_size, num_pages, stride_kp, stride_ks, stride_kh, stride_vp, stride_vs, stride_vh)
    # One loop over the split's blocks, every tile masked: the mask math is nothing beside the loads,
    # and each loop costs a pipeline prologue (three loops, interior tiles unmasked, measured slower
    # at B=1, and much slower paged). Constexprs spelled out: packed in a
    # tuple they would arrive as plain values.
    acc, row_max, row_sum, lost = _cache_tiles(
        acc, row_max, row_sum, lost, *common, begin, end, step, *scores_args, HEAD_DIM, HEAD_DIM_V, BLOCK_D,
        BLOCK_DV, BLOCK_N, HAS_LEFT, HAS_RIGHT, HAS_SOFTCAP, PAGED, DOT_PRECISION, alibi_slope_log2=slopes,
        HAS_ALIBI=HAS_ALIBI, chunk=chunk, HAS_CHUNK=HAS_CHUNK)

    out, lse = finalize_rows(acc, row_max, row_sum)
    poisoned = bad_length | (lost > 0)
    out = tl.where(poisoned, float("nan"), out)
    lse = tl.where(poisoned, float("nan"), lse)
    out_rows = (split.to(tl.int64) * stride_o_split + batch.to(tl.int64) * stride_ob + offs_q.to(tl.int64) * stride_os
                + head.to(tl.int64) * stride_oh)
    tl.store(Out + out_rows[:, None] + offs_dv[None, :], out.to(Out.dtype.element_ty),
             mask=row_ok[:, None] & (offs_dv < HEAD_DIM_V)[None, :])
    lse_rows = (split.to(tl.int64) * stride_l_split + batch.to(tl.int64) * stride_lb + head.to(tl.int64) * stride_lh
                + offs_q.to(tl.int64) * stride_ls)
    tl.store(Lse + lse_rows, lse, mask=row_ok)


@triton.jit
def _combine_splits_kernel(
    PartOut, PartLse, Out, Lse, heads_q, seqlen_q, num_splits, stride_o_split, stride_l_split,
    HEAD_DIM_V: tl.constexpr, BLOCK_DV: tl.constexpr, BLOCK_SPLITS: tl.constexpr, PDL: tl.constexpr,
):
    """out = sum_s exp(lse_s - lse) * out_s with lse = log sum_s exp(lse_s) (merge_attention's rule,
    docs/SEMANTICS.md, "The computation", for a row no split saw), a chunk of BLOCK_DV of one row
    per program (axis 1: the chunk; the first chunk's program stores lse): row r runs over (batch,
    query, head) as in the (B, Sq, Hq, Dv) outputs; lse is (B, Hq, Sq). Every split's part is loaded
    at once (one round trip to memory, not one per split). A NaN part (a poisoned batch) makes the row NaN.
    PDL (programmatic dependent launch, Hopper): launched while the decoding grid still runs (it
    calls ``gdc_launch_dependents`` first thing), the programs wait here until that grid has
    finished and its stores are visible, so the gap between the two kernels is gone."""
    if PDL:
        tl.extra.cuda.gdc_wait()
    r = tl.program_id(0)
    head = r % heads_q
    batch_query = r // heads_q
    lse_index = ((batch_query // seqlen_q) * heads_q + head).to(tl.int64) * seqlen_q + batch_query % seqlen_q
    splits = tl.arange(0, BLOCK_SPLITS)
    offs_dv = tl.program_id(1) * BLOCK_DV + tl.arange(0, BLOCK_DV)
    lse_parts = tl.load(PartLse + splits * stride_l_split + lse_index, mask=splits < num_splits,
                        other=float("-inf"))
    parts = tl.load(PartOut + splits.to(tl.int64)[:, None] * stride_o_split + r.to(tl.int64) * HEAD_DIM_V
                    + offs_dv[None, :], mask=(splits < num_splits)[:, None] & (offs_dv < HEAD_DIM_V)[None, :],
                    other=0.0)
    poisoned = tl.max((lse_parts != lse_parts).to(tl.int32), 0) > 0
    shift = tl.max(tl.where(lse_parts == lse_parts, lse_parts, float("-inf")), 0)
    shift = tl.where(shift == float("-inf"), 0.0, shift)
    weights = tl.exp(lse_parts - shift)
    weights = tl.where(weights == weights, weights, 0.0)
    total = tl.sum(weights, 0)
    seen = total > 0.0
    safe_total = tl.where(seen, total, 1.0)
    out = tl.sum(weights[:, None] * parts, 0) / safe_total
    lse = tl.where(seen, shift + tl.log(safe_total), float("-inf"))
    out = tl.where(poisoned, float("nan"), out)
    lse = tl.where(poisoned, float("nan"), lse)
    tl.store(Out + r.to(tl.int64) * HEAD_DIM_V + offs_dv, out.to(Out.dtype.element_ty), mask=offs_dv < HEAD_DIM_V)
    if tl.program_id(1) == 0:
        tl.store(Lse + lse_index, lse)


# ----------------------------------------------------------------------------- launcher

KEY_TILE = 64  # keys per tile: decoding is bound by reading K/V; deeper pipelines, not wider tiles
STAGE_BYTES_BUDGET = 128 * 1024  # shared memory for the K/V pipeline stages
MAX_STAGES = 4
NUM_WARPS = 4
# Split-KV: as many programs as fit on the GPU at once, never a second, partial wave; at least a few
# key tiles a split; at most MAX_SPLITS (the combination loads them all). (programs per SM, least
# key tiles a split), contiguous: two of the decoding kernel's ~100 KB of pipeline stages fit an
# SM's shared memory; paged: a split runs half the stages, three fit, and shorter splits paid
# (more splits of 2-3 tiles measured faster than fewer of 4 at B=1, 8k keys).
SPLIT_RULE = {False: (2, 4), True: (3, 2)}  # by paged
MAX_SPLITS = 64
# The combination: a program for each Dv chunk of COMBINE_DV of a row, one warp (a B=1 / 8k step
# measured faster, contiguous and paged, than with one 4-warp program a row).
COMBINE_DV = 64
COMBINE_WARPS = 1
INTERPRETER_SMS = 8  # the "SM count" the auto split assumes under Triton's interpreter (tests split too)


@functools.lru_cache(maxsize=None)
def processor_count(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return INTERPRETER_SMS


def row_tile(rows: int) -> int:
    """Packed query rows per program: the fewest power of two >= 16 (tl.dot's least M) holding them, at most 64."""
    return min(64, max(16, next_power_of_2(rows)))


def pipeline_stages(block_d: int, block_dv: int, element_size: int, paged: bool, split: bool) -> int:
    """Triton's num_stages for the decoding kernel: K/V tiles in flight within the shared-memory budget.
    Paged, the K/V addresses depend on block-table loads, which the pipeliner gives stages of their
    own (at 4 stages it kept one K/V tile in flight, at 8 three): a split, which walks a few tiles,
    takes half the stages (a short prologue: best of 1, 2, 4, 8 at B=1), a whole cache twice them
    (at B=64, 2 stages ran markedly slower than 8)."""
    stages = max(1, min(MAX_STAGES, STAGE_BYTES_BUDGET // (KEY_TILE * (block_d + block_dv) * element_size)))
    if not paged:
        return stages
    return max(1, stages // 2) if split else 2 * stages


def auto_splits(programs: int, key_blocks: int, device: torch.device, paged: bool = False) -> int:
    """Splits over the keys so the grid fills the GPU (``SPLIT_RULE``), none where the other dims
    already do or the keys are too few to share. From shapes only (capacity, not the lengths), so a
    CUDA graph captured once stays right as the cache grows."""
    per_sm, least_blocks = SPLIT_RULE[paged]
    wanted = per_sm * processor_count(device) // programs
    return max(1, min(wanted, key_blocks // least_blocks, MAX_SPLITS))




def dependent_launch(device: torch.device) -> bool:
    """Whether the split combination is launched with programmatic dependent launch (sm_90 and
    later, never under the interpreter)."""
    if device.type != "cuda":
        return False
    forced = knobs().pdl
    return _sm90_or_later(device.index) if forced is None else forced


@functools.lru_cache(maxsize=None)
def _sm90_or_later(device_index: int | None) -> bool:
    return torch.cuda.get_device_capability(device_index)[0] >= 9


def key_reach(spec: AttentionSpec, seqlen_q: int, capacity: int) -> int:
    """The most keys one program's rows can see: the capacity, the window's span, or the chunks its
    rows lie in."""
    reach = capacity
    if spec.has_window_left:
        reach = min(reach, spec.window_left + seqlen_q + max(spec.window_right, 0) + KEY_TILE)
    if spec.has_chunk:
        reach = min(reach, spec.chunk + seqlen_q + KEY_TILE)
    return reach


def kvcache_forward(q, k_cache, v_cache, cache_seqlens, block_table, k_new, v_new, spec: AttentionSpec, sinks,
                    num_splits: int | None, capacity: int, alibi: torch.Tensor | None = None):
    """Append (when ``k_new`` is given), then attend. ``q`` (B, Sq, Hq, D); caches (B, S, Hkv, D) or,
    with ``block_table`` (B, pages per sequence), (pages, page size, Hkv, D); ``cache_seqlens`` int32
    (B,); ``alibi`` (with ``spec.alibi``): contiguous float32 (B, Hq) ALiBi slopes. Returns out (B, Sq,
    Hq, Dv) and lse (B, Hq, Sq) float32."""
    assert spec.alibi == (alibi is not None), "spec.alibi and the slopes go together"
    batch, seqlen_q, heads_q, head_dim = q.shape
    heads_kv, head_dim_v = k_cache.shape[2], v_cache.shape[3]
    group = heads_q // heads_kv
    paged = block_table is not None
    page_size = k_cache.shape[1] if paged else 1
    num_pages = k_cache.shape[0] if paged else 0
    table = block_table if paged else cache_seqlens
    stride_table = block_table.stride(0) if paged else 0
    block_d, block_dv = padded_dims(head_dim, head_dim_v)
    cache_strides = (*k_cache.stride()[:3], *v_cache.stride()[:3])
    new_len = 0 if k_new is None else k_new.shape[1]
    if new_len:
        block_s = 16
        launch(_append_kernel, (cdiv(new_len, block_s), batch * heads_kv), (
            k_new, v_new, k_cache, v_cache, cache_seqlens, table, *k_new.stride()[:3], *v_new.stride()[:3],
            *cache_strides, stride_table, new_len, heads_kv, page_size, num_pages, capacity,
        ), HEAD_DIM=head_dim, HEAD_DIM_V=head_dim_v, BLOCK_D=block_d, BLOCK_DV=block_dv, BLOCK_S=block_s,
            PAGED=paged, num_warps=4)

    out = torch.empty((batch, seqlen_q, heads_q, head_dim_v), dtype=q.dtype, device=q.device)
    lse = torch.empty((batch, heads_q, seqlen_q), dtype=torch.float32, device=q.device)
    if out.numel() == 0:
        return out, lse
    block_m = row_tile(seqlen_q * group)
    m_blocks = cdiv(seqlen_q * group, block_m)
    key_blocks = cdiv(key_reach(spec, seqlen_q, capacity), KEY_TILE)
    if num_splits is None:
        num_splits = auto_splits(batch * heads_kv * m_blocks, key_blocks, q.device, paged)
    # a split beyond one per key tile would be empty
    num_splits = max(1, min(num_splits, key_blocks, MAX_SPLITS))
    if num_splits == 1:
        part_out, part_lse, split_strides = out, lse, (0, 0)
    else:
        part_out = torch.empty((num_splits, *out.shape), dtype=torch.float32, device=q.device)
        part_lse = torch.empty((num_splits, *lse.shape), dtype=torch.float32, device=q.device)
        split_strides = (part_out.stride(0), part_lse.stride(0))
    qk_scale, softcap_log2 = score_constants(spec)
    pdl = dependent_launch(q.device)
    early = pdl if knobs().early_start is None else knobs().early_start and pdl
    launch(_cache_attention_kernel, (m_blocks, batch * heads_kv, num_splits), (
        q, k_cache, v_cache, part_out, part_lse, sinks if sinks is not None else lse, cache_seqlens, table,
        alibi if alibi is not None else lse, *q.stride()[:3], *cache_strides, split_strides[0], *part_out.stride()[-4:-1], split_strides[1],
        *part_lse.stride()[-3:], stride_table, seqlen_q, new_len, group, heads_kv, page_size, num_pages, capacity,
        spec.window_left, spec.window_right, qk_scale, softcap_log2,
        min(spec.chunk, max(capacity, 1)) if spec.has_chunk else 1,  # a chunk of every key: any C >= capacity
    ), HEAD_DIM=head_dim, HEAD_DIM_V=head_dim_v, BLOCK_D=block_d, BLOCK_DV=block_dv, BLOCK_M=block_m,
        BLOCK_N=KEY_TILE, HAS_LEFT=spec.has_window_left, HAS_RIGHT=spec.has_window_right,
        HAS_SOFTCAP=softcap_mode(spec, q.dtype, q.device), HAS_SINKS=sinks is not None, PAGED=paged,
        DOT_PRECISION=dot_precision(q.dtype),
        PDL=pdl and num_splits > 1, WAIT_PRIOR=early, HAS_ALIBI=spec.alibi, HAS_CHUNK=spec.has_chunk,
        num_warps=NUM_WARPS,
        num_stages=pipeline_stages(block_d, block_dv, q.element_size(), paged, num_splits > 1),
        **({"launch_pdl": True} if early else {}))
    if num_splits > 1:
        combine_dv = min(COMBINE_DV, next_power_of_2(head_dim_v))
        launch(_combine_splits_kernel, (batch * seqlen_q * heads_q, cdiv(head_dim_v, combine_dv)), (
            part_out, part_lse, out, lse, heads_q, seqlen_q, num_splits, split_strides[0], split_strides[1],
        ), HEAD_DIM_V=head_dim_v, BLOCK_DV=combine_dv, BLOCK_SPLITS=next_power_of_2(num_splits),
            PDL=pdl, num_warps=COMBINE_WARPS, **({"launch_pdl": True} if pdl else {}))
    return out, lse
