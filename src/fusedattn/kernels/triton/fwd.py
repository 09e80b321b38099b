"""Forward kernel: one program per (query block, batch * query head).

The key loop runs in up to three stretches given by ``block_range``: boundary tiles
left of the interior (sliding window only), interior tiles with no mask math, and
boundary tiles on the right (causal diagonal, window edge, ragged key tail). All
three call ``_forward_tiles`` with ``IS_MASKED`` as a constexpr. With a user mask the
program walks its host-made tile list instead (``tile_lists.py``): full tiles, then
partial ones; the tiles the mask empties are not in it.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ... import dropout
from ...block_mask import BlockMask
from ...spec import AttentionSpec, Packing, bhsd_shape, bhsd_stride
from ..shared.config import KernelConfig
from ..shared.block_range import key_blocks_for_query_block
from ..shared.constants import score_constants
from ..shared.launch import cdiv, launch, next_power_of_2
from .dropout import dropout_keep
from .masking import ALIBI_KEY_TERM, ONE_ROW, adjust_scores, alibi_in_scores, alibi_mode, alibi_row_term, alibi_slope, slice_indices
from .memory import (head_base, load_block, load_tile, loop_descriptors, lse_offset, score_tile_descriptor,
                     sequence_pair, store_tile, tile_ptrs)
from .softmax import LN2, TANH_APPROX, finalize_rows, initial_row_stats, log2_scores, online_softmax_step
from ..shared.tile_lists import row_lists


@triton.jit
def _forward_tiles(
    acc, row_max, row_sum, q, k_desc, v_desc, k_base, v_base, batch, head_kv, stride_ks, stride_vs,
    block_begin, block_end, tile_list, start_m, offs_m, seqlen_q, seqlen_k, window_left, window_right,
    qk_scale, softcap_log2, mask_desc, mask_base, mask_batch, mask_head, stride_mq, stride_mk, bias_desc, bias_base,
    bias_batch, bias_head, stride_bq, stride_bk,
    HEAD_DIM: tl.constexpr, HEAD_DIM_V: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr,
    BLOCK_N: tl.constexpr, HAS_LEFT: tl.constexpr, HAS_RIGHT: tl.constexpr, HAS_SOFTCAP: tl.constexpr,
    HAS_MASK: tl.constexpr, HAS_BIAS: tl.constexpr, BIAS_TMA: tl.constexpr, IS_MASKED: tl.constexpr,
    FROM_LIST: tl.constexpr, DOT_PRECISION: tl.constexpr, TMA_LOADS: tl.constexpr,
    MASK_SHIFT_Q: tl.constexpr, MASK_SHIFT_K: tl.constexpr, MASK_TMA: tl.constexpr,
    alibi_slope_log2=0.0, HAS_ALIBI: tl.constexpr = False, chunk=1,
    HAS_CHUNK: tl.constexpr = False, dropout_seed=0, batch_head=0, dropout_threshold=0,
    HAS_DROPOUT: tl.constexpr = False,
):
    """Key blocks ``[block_begin, block_end)``, or with ``FROM_LIST`` the entries at those
    positions of ``tile_list`` (tile_lists.py). ``HAS_ALIBI``: ALiBi with the program's slope.
    ``HAS_DROPOUT``: the dropped probabilities leave the sum over values but not the row's
    normaliser (the caller scales the kept ones once, at the end)."""
    offs_tile = tl.arange(0, BLOCK_N)
    if HAS_ALIBI == ALIBI_KEY_TERM:
        # The key term slope * (j - c), c the program's first aligned row, as a loop-invariant vector
        # slope * (j - start_n) and the tile's constant slope * (start_n - c), which the online
        # softmax takes as a shift of its row maxima (a vector made per tile defined registers inside
        # the pipelined wgmma's stage: ptxas then serialised every wgmma of the kernel).
        key_part = offs_tile.to(tl.float32) * alibi_slope_log2
    else:
        key_part = 0.0
    for position in range(block_begin, block_end):
        if FROM_LIST:
            n_block = tl.load(tile_list + position)
        else:
            n_block = position
        start_n = n_block * BLOCK_N
        offs_n = start_n + offs_tile
        k = load_block(k_desc, k_base, batch, head_kv, start_n, stride_ks, seqlen_k, HEAD_DIM, BLOCK_N, BLOCK_D,
                       IS_MASKED, TMA_LOADS)
        qk = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION)
        scores, _ = log2_scores(qk, qk_scale, softcap_log2, HAS_SOFTCAP)
        scores = adjust_scores(scores, offs_m, offs_n, start_m, start_n, seqlen_q, seqlen_k, window_left, window_right,
                               mask_desc, mask_base, mask_batch, mask_head, stride_mq, stride_mk, MASK_SHIFT_Q,
                               MASK_SHIFT_K, bias_desc, bias_base, bias_batch, bias_head, stride_bq, stride_bk, HAS_LEFT,
                               HAS_RIGHT, HAS_MASK, HAS_BIAS, BIAS_TMA, MASK_TMA, IS_MASKED, False,
                               alibi_slope_log2=alibi_slope_log2, HAS_ALIBI=alibi_in_scores(HAS_ALIBI),
            chunk=chunk, HAS_CHUNK=HAS_CHUNK)
        if HAS_ALIBI == ALIBI_KEY_TERM:
            tile_shift = alibi_slope_log2 * (start_n - (start_m + seqlen_k - seqlen_q)).to(tl.float32)
            p, alpha, row_max, row_sum = online_softmax_step(scores + key_part[None, :], row_max, row_sum, IS_MASKED,
                                                             tile_shift, True)
        else:
            p, alpha, row_max, row_sum = online_softmax_step(scores, row_max, row_sum, IS_MASKED)
        if HAS_DROPOUT:
            p = tl.where(dropout_keep(dropout_seed, batch_head, offs_m, start_n, dropout_threshold, BLOCK_N, False),
                         p, 0.0)
        v = load_block(v_desc, v_base, batch, head_kv, start_n, stride_vs, seqlen_k, HEAD_DIM_V, BLOCK_N, BLOCK_DV,
                       IS_MASKED, TMA_LOADS)
        acc = acc * alpha[:, None]
        acc = tl.dot(p.to(v.dtype), v, acc, input_precision=DOT_PRECISION)
    return acc, row_max, row_sum


# Lengths stay runtime values: Triton would otherwise compile a separate kernel for a length of 1
# (decoding), and Triton 3.6's ptxas (12.8) crashed on the backward specialised so.
@triton.jit(do_not_specialize=["seqlen_q", "seqlen_k", "stride_lse_head"])
def _forward_kernel(
    Q, K, V, Out, Lse, Sinks, Mask, Bias, TileLists, CuSeqlensQ, CuSeqlensK, Alibi, DropoutSeed, k_desc, v_desc, bias_desc,
    mask_desc,
    stride_qb, stride_qh, stride_qs,
    stride_kb, stride_kh, stride_ks,
    stride_vb, stride_vh, stride_vs,
    stride_ob, stride_oh, stride_os,
    stride_mb, stride_mh, stride_mq, stride_mk, mask_head_div, MASK_SHIFT_Q: tl.constexpr, MASK_SHIFT_K: tl.constexpr,
    stride_lb, stride_lh, stride_lr, lists_head_div,
    stride_bb, stride_bh, stride_bq, stride_bk, bias_head_div,
    seqlen_q, seqlen_k, heads_q, group_size, window_left, window_right, stride_lse_head,
    qk_scale, softcap_log2, chunk, dropout_threshold, dropout_scale,
    HEAD_DIM: tl.constexpr, HEAD_DIM_V: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    HAS_LEFT: tl.constexpr, HAS_RIGHT: tl.constexpr, HAS_SOFTCAP: tl.constexpr, HAS_SINKS: tl.constexpr,
    HAS_MASK: tl.constexpr, HAS_BIAS: tl.constexpr, BIAS_TMA: tl.constexpr, MASK_TMA: tl.constexpr,
    DOT_PRECISION: tl.constexpr, TMA_LOADS: tl.constexpr, VARLEN: tl.constexpr, HAS_ALIBI: tl.constexpr,
    HAS_CHUNK: tl.constexpr, HAS_DROPOUT: tl.constexpr,
):
    # With a right window bound the last query blocks see the most keys: run them first.
    if HAS_RIGHT:
        m_block = tl.num_programs(0) - 1 - tl.program_id(0)
    else:
        m_block = tl.program_id(0)
    batch_head = tl.program_id(1)
    batch = batch_head // heads_q
    head = batch_head % heads_q
    head_kv = head // group_size
    if HAS_ALIBI:  # the (batch, head)'s ALiBi slope, in log2 units
        slope = alibi_slope(Alibi, batch, head, heads_q)
    else:
        slope = 0.0
    if HAS_DROPOUT:
        seed = tl.load(DropoutSeed)
    else:
        seed = 0
    # Packed sequences: the grid covers the longest; a shorter one's extra query blocks stop here.
    q_index, seqlen_q, k_index, seqlen_k = sequence_pair(CuSeqlensQ, CuSeqlensK, batch, seqlen_q, seqlen_k, VARLEN)
    start_m = m_block * BLOCK_M
    if VARLEN:
        if start_m >= seqlen_q:
            return
    offs_tile = tl.arange(0, BLOCK_M)
    offs_m = start_m + offs_tile
    offs_d = tl.arange(0, BLOCK_D)
    offs_dv = tl.arange(0, BLOCK_DV)
    q_base = head_base(Q, q_index, head, stride_qb, stride_qh)
    k_base = head_base(K, k_index, head_kv, stride_kb, stride_kh)
    v_base = head_base(V, k_index, head_kv, stride_vb, stride_vh)
    mask_base = head_base(Mask, batch, head // mask_head_div, stride_mb, stride_mh)
    bias_base = head_base(Bias, batch, head // bias_head_div, stride_bb, stride_bh)
    mask_batch, mask_head = slice_indices(batch, head, stride_mb, stride_mh, mask_head_div)
    bias_batch, bias_head = slice_indices(batch, head, stride_bb, stride_bh, bias_head_div)
    q = load_tile(tile_ptrs(q_base, start_m, stride_qs, offs_tile, offs_d), offs_m, seqlen_q,
                  offs_d, HEAD_DIM, True, HEAD_DIM != BLOCK_D)

    row_max, row_sum = initial_row_stats(Sinks, head, BLOCK_M, HAS_SINKS)
    if HAS_ALIBI == ALIBI_KEY_TERM:  # the sink's logit against scores without their row term
        row_max = row_max - alibi_row_term(offs_m, start_m, slope)
    acc = tl.zeros([BLOCK_M, BLOCK_DV], dtype=tl.float32)
    common = (q, k_desc, v_desc, k_base, v_base, batch, head_kv, stride_ks, stride_vs)
    scores_args = (start_m, offs_m, seqlen_q, seqlen_k, window_left, window_right, qk_scale, softcap_log2, mask_desc,
                   mask_base, mask_batch, mask_head, stride_mq, stride_mk, bias_desc, bias_base, bias_batch, bias_head,
                   stride_bq, stride_bk)
    if HAS_MASK:  # the tiles the mask leaves, listed on the host (tile_lists.py): full ones, then partial
        tile_list = head_base(TileLists, batch, head // lists_head_div, stride_lb, stride_lh) + m_block * stride_lr
        full_tiles = tl.load(tile_list)
        partial_tiles = tl.load(tile_list + 1)
        acc, row_max, row_sum = _forward_tiles(
            acc, row_max, row_sum, *common, 0, full_tiles, tile_list + 2, *scores_args, HEAD_DIM, HEAD_DIM_V,
            BLOCK_D, BLOCK_DV, BLOCK_N, HAS_LEFT, HAS_RIGHT, HAS_SOFTCAP, False, HAS_BIAS, BIAS_TMA,
            HAS_BIAS,  # a -inf bias can empty a row on any tile
            True, DOT_PRECISION, TMA_LOADS,
            MASK_SHIFT_Q=MASK_SHIFT_Q, MASK_SHIFT_K=MASK_SHIFT_K, MASK_TMA=MASK_TMA, alibi_slope_log2=slope, HAS_ALIBI=HAS_ALIBI,
            chunk=chunk, HAS_CHUNK=HAS_CHUNK, dropout_seed=seed, batch_head=batch_head, dropout_threshold=dropout_threshold,
            HAS_DROPOUT=HAS_DROPOUT)
        acc, row_max, row_sum = _forward_tiles(
            acc, row_max, row_sum, *common, full_tiles, full_tiles + partial_tiles, tile_list + 2, *scores_args,
            HEAD_DIM, HEAD_DIM_V, BLOCK_D, BLOCK_DV, BLOCK_N, HAS_LEFT, HAS_RIGHT, HAS_SOFTCAP, True, HAS_BIAS,
            BIAS_TMA, True, True, DOT_PRECISION, TMA_LOADS,
            MASK_SHIFT_Q=MASK_SHIFT_Q, MASK_SHIFT_K=MASK_SHIFT_K, MASK_TMA=MASK_TMA, alibi_slope_log2=slope, HAS_ALIBI=HAS_ALIBI,
            chunk=chunk, HAS_CHUNK=HAS_CHUNK, dropout_seed=seed, batch_head=batch_head, dropout_threshold=dropout_threshold,
            HAS_DROPOUT=HAS_DROPOUT)
    else:
        begin, interior_begin, interior_end, end = key_blocks_for_query_block(
            m_block, seqlen_q, seqlen_k, window_left, window_right, BLOCK_M, BLOCK_N, HAS_LEFT, HAS_RIGHT,
            chunk, HAS_CHUNK)
        acc, row_max, row_sum = _forward_tiles(
            acc, row_max, row_sum, *common, interior_begin, interior_end, TileLists, *scores_args, HEAD_DIM,
            HEAD_DIM_V, BLOCK_D, BLOCK_DV, BLOCK_N, HAS_LEFT, HAS_RIGHT, HAS_SOFTCAP, False, HAS_BIAS, BIAS_TMA,
            HAS_BIAS,  # a -inf bias can empty a row on any tile: guard every tile
            False, DOT_PRECISION, TMA_LOADS,
            MASK_SHIFT_Q=MASK_SHIFT_Q, MASK_SHIFT_K=MASK_SHIFT_K, MASK_TMA=MASK_TMA, alibi_slope_log2=slope, HAS_ALIBI=HAS_ALIBI,
            chunk=chunk, HAS_CHUNK=HAS_CHUNK, dropout_seed=seed, batch_head=batch_head, dropout_threshold=dropout_threshold,
            HAS_DROPOUT=HAS_DROPOUT)
        if HAS_LEFT or HAS_CHUNK:  # boundary blocks before the interior
            acc, row_max, row_sum = _forward_tiles(
                acc, row_max, row_sum, *common, begin, interior_begin, TileLists, *scores_args, HEAD_DIM, HEAD_DIM_V,
                BLOCK_D, BLOCK_DV, BLOCK_N, HAS_LEFT, HAS_RIGHT, HAS_SOFTCAP, False, HAS_BIAS, BIAS_TMA, True, False,
                DOT_PRECISION, TMA_LOADS,
            MASK_SHIFT_Q=MASK_SHIFT_Q, MASK_SHIFT_K=MASK_SHIFT_K, MASK_TMA=MASK_TMA, alibi_slope_log2=slope, HAS_ALIBI=HAS_ALIBI,
            chunk=chunk, HAS_CHUNK=HAS_CHUNK, dropout_seed=seed, batch_head=batch_head, dropout_threshold=dropout_threshold,
            HAS_DROPOUT=HAS_DROPOUT)
        acc, row_max, row_sum = _forward_tiles(
            acc, row_max, row_sum, *common, interior_end, end, TileLists, *scores_args, HEAD_DIM, HEAD_DIM_V,
            BLOCK_D, BLOCK_DV, BLOCK_N, HAS_LEFT, HAS_RIGHT, HAS_SOFTCAP, False, HAS_BIAS, BIAS_TMA, True, False,
            DOT_PRECISION, TMA_LOADS,
            MASK_SHIFT_Q=MASK_SHIFT_Q, MASK_SHIFT_K=MASK_SHIFT_K, MASK_TMA=MASK_TMA, alibi_slope_log2=slope, HAS_ALIBI=HAS_ALIBI,
            chunk=chunk, HAS_CHUNK=HAS_CHUNK, dropout_seed=seed, batch_head=batch_head, dropout_threshold=dropout_threshold,
            HAS_DROPOUT=HAS_DROPOUT)

    if HAS_DROPOUT:  # the kept probabilities, scaled by the inverse of the kept fraction
        acc = acc * dropout_scale
    out, lse = finalize_rows(acc, row_max, row_sum)
    if HAS_ALIBI == ALIBI_KEY_TERM:  # the row term the scores left out
        lse = lse + alibi_row_term(offs_m, start_m, slope) * LN2
    o_base = head_base(Out, q_index, head, stride_ob, stride_oh)
    store_tile(tile_ptrs(o_base, start_m, stride_os, offs_tile, offs_dv), out, offs_m, seqlen_q, offs_dv, HEAD_DIM_V)
    lse_rows = Lse + lse_offset(batch, head, heads_q, seqlen_q, q_index, stride_lse_head, VARLEN)
    tl.store(lse_rows + offs_m, lse, mask=offs_m < seqlen_q)


# ----------------------------------------------------------------------------- launcher

def chunk_arg(spec: AttentionSpec, seqlen_k: int) -> int:
    """The kernels' ``chunk`` (an int32): the spec's, at most Sk -- a chunk of Sk or more keeps the
    same pairs (every key in chunk 0, every row at aligned position 0..Sk-1 too) -- or 1 when off."""
    return min(spec.chunk, max(seqlen_k, 1)) if spec.has_chunk else 1


def dropout_args(spec: AttentionSpec) -> tuple[int, float]:
    """The kernels' (dropout_threshold, dropout_scale): the byte below which a probability is
    dropped and the kept ones' scale (dropout.py); (0, 1.0) when off."""
    if not spec.has_dropout:
        return 0, 1.0
    return dropout.threshold(spec.dropout_p), dropout.keep_scale(spec.dropout_p)


def padded_dim(d: int) -> int:
    """Tile width for a head dim: a power of two, at least 16 (the smallest tl.dot K)."""
    return max(16, next_power_of_2(d))


def padded_dims(head_dim: int, head_dim_v: int) -> tuple[int, int]:
    """(BLOCK_D, BLOCK_DV): each dim's tile width, except that a V tile narrower than a padded Q/K
    tile is widened to it. Triton 3.6 miscompiles the forward with D=40 and Dv=24 on 64-key tiles
    (tiles 64 and 32 wide, both column-masked): the P @ V dot touches shared memory past the
    kernel's allocation (compute-sanitizer) and the output is wrong, with TMA or pointer loads
    alike; D=64 / Dv=24 and D=40 / Dv=40 are right."""
    block_d, block_dv = padded_dim(head_dim), padded_dim(head_dim_v)
    if head_dim != block_d and block_dv < block_d:
        block_dv = block_d
    return block_d, block_dv


def dot_precision(dtype: torch.dtype) -> str:
    # fp32 inputs are computed at fp32 accuracy: no silent tf32 (docs/SEMANTICS.md, "Layouts, shapes and dtypes").
    return "ieee" if dtype == torch.float32 else "tf32"


def softcap_mode(spec: AttentionSpec, dtype: torch.dtype, device: torch.device) -> int:
    """The Triton kernels' HAS_SOFTCAP: 0 none; 1 tanh to a few fp32 ulps; for bf16 on the GPU
    ``softmax.TANH_APPROX`` (tanh.approx.f32), the form the Gluon kernels take for bf16
    (``gluon.common.log2_scores``): a call's passes may mix the two kinds of kernel, and its backward
    must recompute the scores its forward normalised."""
    if not spec.has_softcap:
        return 0
    return TANH_APPROX if dtype == torch.bfloat16 and device.type == "cuda" else 1


def bhs_strides(t: torch.Tensor, layout: str, packing: Packing | None = None) -> tuple[int, int, int]:
    """(batch, head, row) strides; for packed sequences the row stride stands for the batch's
    (``memory.sequence_rows``: the kernels' batch index is then a sequence's first row)."""
    sb, sh, ss, sd = bhsd_stride(t, layout)
    assert sd == 1, "head dim must have unit stride (the interface copies otherwise)"
    return (sb if packing is None else ss), sh, ss


def sequence_args(packing: Packing | None, placeholder: torch.Tensor) -> tuple:
    """(cu_seqlens_q, cu_seqlens_k) as the kernels take them: placeholders without packing."""
    if packing is None:
        return placeholder, placeholder
    return packing.cu_seqlens_q, packing.cu_seqlens_k


def broadcast_args(t: torch.Tensor | None, heads_q: int, heads_kv: int, placeholder: torch.Tensor) -> tuple:
    """(tensor, stride_b, stride_h, stride_q, stride_k, head_div) of a (B|1, Hq|Hkv|1, Sq|1, Sk|1)
    mask or bias as the kernels address it: size-1 dims get stride 0 (broadcast), and query head
    h reads head h // head_div (head_div = Hq / Hkv for one entry per KV group). None: a
    placeholder the kernels never read."""
    if t is None:
        return (placeholder, 0, 0, 0, 0, 1)
    strides = [0 if size == 1 else stride for size, stride in zip(t.shape, t.stride())]
    head_div = heads_q // heads_kv if t.shape[1] == heads_kv and heads_kv != heads_q else 1
    return (t, *strides, head_div)


def mask_args(mask: BlockMask | None, heads_q: int, heads_kv: int, placeholder: torch.Tensor) -> tuple:
    """``broadcast_args`` of what a mask's partial tiles read, then its index shifts
    (``masking.adjust_scores``)."""
    if mask is None:
        return (*broadcast_args(None, heads_q, heads_kv, placeholder), 0, 0)
    source = mask.source.view(torch.uint8)  # the same bytes: 1 = attend
    shift_q, shift_k = mask.source_shift
    if source.shape[-2] == 1:  # one row for every query: read as a key vector
        shift_q = ONE_ROW.value
    return (*broadcast_args(source, heads_q, heads_kv, placeholder), shift_q, shift_k)


def mask_descriptor(mask: BlockMask | None, block_q: int, block_k: int):
    """A TMA descriptor over the bytes a mask's partial tiles read (``memory.score_tile_descriptor``),
    or None: no mask, a keep map of whole blocks (read by shifted indices), or a tensor TMA cannot
    address."""
    if mask is None or any(mask.source_shift):
        return None
    return score_tile_descriptor(mask.source.view(torch.uint8), block_q, block_k)


def row_list_args(mask: BlockMask | None, spec: AttentionSpec, seqlen_q: int, seqlen_k: int, block_m: int,
                  block_n: int, heads_q: int, heads_kv: int, placeholder: torch.Tensor) -> tuple:
    """(lists, stride_b, stride_h, stride_row, head_div) of the forward / dQ programs' tile lists."""
    if mask is None:
        return (placeholder, 0, 0, 0, 1)
    lists = row_lists(mask, spec, seqlen_q, seqlen_k, block_m, block_n)
    lists, batch_stride, head_stride, row_stride, _, head_div = broadcast_args(lists, heads_q, heads_kv, placeholder)
    return (lists, batch_stride, head_stride, row_stride, head_div)




def forward(q, k, v, out, lse, spec: AttentionSpec, config: KernelConfig, sinks: torch.Tensor | None = None,
            mask: BlockMask | None = None, bias: torch.Tensor | None = None, packing: Packing | None = None,
            alibi: torch.Tensor | None = None, dropout_seed: torch.Tensor | None = None) -> None:
    """``_forward_kernel`` into ``out`` (the user layout) and ``lse`` ((B, Hq, Sq) float32; packed
    sequences: (Hq, total_q)) with ``config``'s tiles (the planner's: ``dispatch.plan_forward``).
    ``sinks`` (Hq,) float32: one extra logit per head in every row's denominator. ``mask``: the
    user's boolean mask with its tile states (block_mask.BlockMask): empty tiles are skipped, full
    ones run without the mask (tile_lists.py). ``bias``: the user's additive bias, 4-D and broadcast
    the same way, any float dtype. ``packing``: q, k, v are (1, total, H, D) "bshd" views of packed
    sequences (spec.Packing; no mask or bias), read by pointers. ``alibi`` (with ``spec.alibi``): the
    contiguous float32 (B, Hq) ALiBi slopes (B: sequences when packed). ``dropout_seed`` (with
    ``spec.dropout_p``): the call's (1,) int64 seed (dropout.py)."""
    assert spec.alibi == (alibi is not None), "spec.alibi and the slopes go together"
    assert spec.has_dropout == (dropout_seed is not None), "spec.dropout_p and the seed go together"
    batch, heads_q, seqlen_q, head_dim = bhsd_shape(q, spec.layout)
    heads_kv, seqlen_k, head_dim_v = bhsd_shape(v, spec.layout)[1:]
    if packing is not None:
        batch, seqlen_q, seqlen_k = packing.sequences, packing.max_seqlen_q, packing.max_seqlen_k
    bias_desc = score_tile_descriptor(bias, config.block_m, config.block_n)
    mask_desc = mask_descriptor(mask, config.block_m, config.block_n)
    qk_scale, softcap_log2 = score_constants(spec)
    block_d, block_dv = padded_dims(head_dim, head_dim_v)
    descs = loop_descriptors(((k, block_d), (v, block_dv)), spec.layout, config.block_n,
                             config.tma_loads and packing is None)
    grid = (cdiv(seqlen_q, config.block_m), batch * heads_q)
    user_mask = mask_args(mask, heads_q, heads_kv, lse)
    tile_lists = row_list_args(mask, spec, seqlen_q, seqlen_k, config.block_m, config.block_n, heads_q, heads_kv, lse)
    launch(
        _forward_kernel, grid, (
            q, k, v, out, lse, sinks if sinks is not None else lse, user_mask[0], bias if bias is not None else lse,
            tile_lists[0], *sequence_args(packing, lse), alibi if alibi is not None else lse,
            dropout_seed if dropout_seed is not None else lse, *(descs or (k, v)),
            bias_desc if bias_desc is not None else lse, mask_desc if mask_desc is not None else lse,
            *bhs_strides(q, spec.layout, packing), *bhs_strides(k, spec.layout, packing),
            *bhs_strides(v, spec.layout, packing), *bhs_strides(out, spec.layout, packing), *user_mask[1:],
            *tile_lists[1:], *broadcast_args(bias, heads_q, heads_kv, lse)[1:],
            seqlen_q, seqlen_k, heads_q, heads_q // heads_kv, spec.window_left, spec.window_right,
            lse.shape[-1] if packing is not None else 0, qk_scale, softcap_log2, chunk_arg(spec, seqlen_k),
            *dropout_args(spec),
        ),
        HEAD_DIM=head_dim, HEAD_DIM_V=head_dim_v, BLOCK_D=block_d, BLOCK_DV=block_dv,
        BLOCK_M=config.block_m, BLOCK_N=config.block_n, TMA_LOADS=descs is not None,
        HAS_LEFT=spec.has_window_left, HAS_RIGHT=spec.has_window_right,
        HAS_SOFTCAP=softcap_mode(spec, q.dtype, q.device), HAS_SINKS=sinks is not None, HAS_MASK=mask is not None,
        HAS_BIAS=bias is not None, BIAS_TMA=bias_desc is not None, MASK_TMA=mask_desc is not None,
        DOT_PRECISION=dot_precision(q.dtype), VARLEN=packing is not None, HAS_ALIBI=alibi_mode(spec),
        HAS_CHUNK=spec.has_chunk, HAS_DROPOUT=spec.has_dropout,
        num_warps=config.num_warps, num_stages=config.num_stages,
    )
