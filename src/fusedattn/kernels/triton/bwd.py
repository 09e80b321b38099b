"""The Triton backward kernels: a delta pre-pass, then dK/dV and dQ.

The planner (``dispatch.py``, ``plan_backward``) decides when they run. The pre-pass always
does; on Hopper, where the Gluon kernels take the problem, they run the dK/dV pass and, where
they can, dQ (``gluon/bwd.py``, ``gluon/fwd.py``); ``run_passes`` launches the passes they leave.

dQ is summed here one of two ways, as the plan says (from the launch config, tuning/configs.py):
- a separate pass of dQ programs (7 matmuls per tile pair, no atomics, bitwise
  reproducible): every default, and what ``deterministic=True`` always runs;
- fp32 atomics from the dK/dV programs (5 matmuls): TMA bulk reduce-adds on Hopper, or
  pointer atomics; an option.

- ``_preprocess_kernel``: the two row statistics the passes read, one float per query row
  each, in buffers whose rows are padded to a multiple of every tile height (so the loops load
  them without masks, in vectors): ``lse2`` = lse * log2(e), +inf for a row with no key and for
  padding (so p = 0 there), and delta = rowsum(dO * O) - dlse (0 in padding). A gradient on lse
  enters only here: d lse / d s = p, so ds = p * (dp - delta).
- ``_backward_kernel``, launched once with both kinds of program or twice, one kind each:
  - ``_dkdv_program``s: one per (key block, batch * kv head). Each keeps dK, dV in
    registers and walks the query blocks of every query head of its KV group (one flat
    loop), so the GQA sum over the group is a plain in-register reduction in a fixed order;
  - ``_dq_program``s: one per (query block, batch * query head), the same key-block walk
    as the forward; dQ stays in registers, so the result is bitwise reproducible.

With a user mask both passes walk host-made tile lists instead of block ranges
(``tile_lists.py``): full tiles without the mask, then partial ones; emptied tiles are skipped.
(``_bias_grad_kernel``, the deterministic broadcast-bias pass, still walks the rule's range and
applies the mask per tile.)

Tiles in the dK/dV pass are held transposed (keys along rows). Inside the loops, Q/dO
(dK/dV pass) and K/V (dQ pass) come through TMA descriptors where the config and the
tensors' alignment allow (``memory.load_block``).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ...block_mask import EMPTY, BlockMask
from ...spec import AttentionSpec, Packing, bhsd_shape, bhsd_stride, gradient_like
from ..shared.config import AttentionConfigs, KernelConfig
from ..shared.block_range import key_blocks_for_query_block, query_blocks_for_key_block
from ..shared import tile_lists
from .dropout import dropout_keep
from .fwd import (bhs_strides, broadcast_args, chunk_arg, dot_precision, dropout_args, mask_args, mask_descriptor, padded_dim, padded_dims,
                  row_list_args, sequence_args, softcap_mode)
from ..shared.constants import register_order_permutation, score_constants
from ..shared.launch import SLOT, Launcher, cdiv, per_problem
from .masking import (ALIBI_KEY_TERM, adjust_scores, alibi_distance, alibi_in_scores, alibi_mode, alibi_slope,
                      broadcast_tile_offsets, slice_indices)
from .memory import (Descriptor, all_or_placeholders, head_base, load_block, load_tile, loop_descriptors, lse_offset,
                     score_tile_descriptor, sequence_pair, sequence_rows, store_tile, tile_ptrs)
from .softmax import log2_scores, lse_for_backward

TILE_EMPTY: tl.constexpr = tl.constexpr(EMPTY)  # a tile state (block_mask.py): no kept pair


@triton.jit
def _probabilities(
    qk, lse2, offs_q, offs_k, start_q, start_k, seqlen_q, seqlen_k, window_left, window_right, qk_scale,
    softcap_log2, mask_desc, mask_base, mask_batch, mask_head, stride_mq, stride_mk, MASK_SHIFT_Q: tl.constexpr,
    MASK_SHIFT_K: tl.constexpr, bias_desc, bias_base, bias_batch, bias_head, stride_bq, stride_bk,
    HAS_LEFT: tl.constexpr, HAS_RIGHT: tl.constexpr, HAS_SOFTCAP: tl.constexpr, HAS_MASK: tl.constexpr,
    HAS_BIAS: tl.constexpr, BIAS_TMA: tl.constexpr, MASK_TMA: tl.constexpr, IS_MASKED: tl.constexpr,
    TRANSPOSED: tl.constexpr, alibi_slope_log2=0.0, HAS_ALIBI: tl.constexpr = False, chunk=1,
    HAS_CHUNK: tl.constexpr = False, key_part=0.0, KEY_PART: tl.constexpr = False,
):
    """Recomputed softmax probabilities of a tile from the forward's lse (log2 domain). ``HAS_ALIBI``:
    the distance form only (``alibi_in_scores``, ``alibi_distance``). ``KEY_PART``: ``key_part``, a
    vector over the tile's keys, is added to the scores (ALiBi's key term, whose rest the caller
    took out of ``lse2``)."""
    scores, tanh_arg = log2_scores(qk, qk_scale, softcap_log2, HAS_SOFTCAP)
    scores = adjust_scores(scores, offs_q, offs_k, start_q, start_k, seqlen_q, seqlen_k, window_left, window_right,
                           mask_desc, mask_base, mask_batch, mask_head, stride_mq, stride_mk, MASK_SHIFT_Q,
                           MASK_SHIFT_K, bias_desc, bias_base, bias_batch, bias_head, stride_bq, stride_bk, HAS_LEFT,
                           HAS_RIGHT, HAS_MASK, HAS_BIAS, BIAS_TMA, MASK_TMA, IS_MASKED, TRANSPOSED,
                           alibi_slope_log2=alibi_slope_log2, HAS_ALIBI=HAS_ALIBI,
            chunk=chunk, HAS_CHUNK=HAS_CHUNK)
    if KEY_PART:
        if TRANSPOSED:
            scores = scores + key_part[:, None]
        else:
            scores = scores + key_part[None, :]
    if TRANSPOSED:
        p = tl.math.exp2(scores - lse2[None, :])
    else:
        p = tl.math.exp2(scores - lse2[:, None])
    return p, tanh_arg


@triton.jit
def _score_grads(p, dp, delta, tanh_arg, HAS_SOFTCAP: tl.constexpr, TRANSPOSED: tl.constexpr):
    """(dL/d logit, dL/d(scale * qk)): the softmax gradient -- which is also the bias gradient,
    the bias being added to the logit -- then the softcap chain rule (docs/SEMANTICS.md, "`scale` and
    `softcap`")."""
    if TRANSPOSED:
        ds_logit = p * (dp - delta[None, :])
    else:
        ds_logit = p * (dp - delta[:, None])
    if HAS_SOFTCAP:
        return ds_logit, ds_logit * (1.0 - tanh_arg * tanh_arg)
    else:
        return ds_logit, ds_logit


# How the dK/dV pass writes the bias gradient (DBIAS constexpr); DBIAS_PASS: it writes none, the
# deterministic ``_bias_grad_kernel`` does (host side only).
DBIAS_OFF, DBIAS_STORE, DBIAS_ATOMIC, DBIAS_PASS = 0, 1, 2, 3


@triton.jit
def _write_bias_grad(ds_logit, desc, base, bias_batch, bias_head, start_q, start_k, offs_q, offs_k, seqlen_q,
                     seqlen_k, stride_q, stride_k, MODE: tl.constexpr, SUM_Q: tl.constexpr, SUM_K: tl.constexpr,
                     USE_DESC: tl.constexpr, TRANSPOSED: tl.constexpr):
    """A tile's bias gradient into one (batch, head) of the (B|1, H|1, Sq|1, Sk|1) gradient at
    ``base``: summed over the tile's rows (``SUM_Q``: the bias has one query row) and/or keys
    (``SUM_K``), then stored (``MODE == DBIAS_STORE``: the caller owns these entries) or added
    with fp32 atomics (``DBIAS_ATOMIC``: other programs add to them too). ``USE_DESC`` (no sums): a
    TMA descriptor over the gradient's own shape, written at (``bias_batch``, ``bias_head``), as
    ``masking.load_bias_tile`` reads the bias."""
    if SUM_Q and SUM_K:
        total = tl.sum(tl.sum(ds_logit, axis=1), axis=0)
        if MODE == 1:  # DBIAS_STORE
            tl.store(base, total)
        else:
            tl.atomic_add(base, total, sem="relaxed")
    elif SUM_Q or SUM_K:
        if SUM_Q:
            values = tl.sum(ds_logit, axis=1 if TRANSPOSED else 0)
            ptrs, inside = base + offs_k.to(tl.int64) * stride_k, offs_k < seqlen_k
        else:
            values = tl.sum(ds_logit, axis=0 if TRANSPOSED else 1)
            ptrs, inside = base + offs_q.to(tl.int64) * stride_q, offs_q < seqlen_q
        if MODE == 1:
            tl.store(ptrs, values, mask=inside)
        else:
            tl.atomic_add(ptrs, values, mask=inside, sem="relaxed")
    elif USE_DESC:  # the copy engine drops the entries past Sq and Sk
        tile = tl.trans(ds_logit) if TRANSPOSED else ds_logit
        tile = tile.reshape(1, 1, desc.block_shape[2], desc.block_shape[3]).to(desc.dtype)
        if MODE == 1:
            desc.store([bias_batch, bias_head, start_q, start_k], tile)
        else:
            desc.atomic_add([bias_batch, bias_head, start_q, start_k], tile)
    else:
        offsets, inside = broadcast_tile_offsets(offs_q, offs_k, seqlen_q, seqlen_k, stride_q, stride_k, TRANSPOSED)
        if MODE == 1:
            tl.store(base + offsets, ds_logit, mask=inside)
        else:
            tl.atomic_add(base + offsets, ds_logit, mask=inside, sem="relaxed")


@triton.jit(do_not_specialize=["seqlen_q", "stride_lse_head"])
def _preprocess_kernel(
    Out, DOut, Lse, DLse, Lse2, Delta, DQAccum, CuSeqlensQ,
    stride_ob, stride_oh, stride_os, stride_dob, stride_doh, stride_dos,
    seqlen_q, heads_q, stride_stats, dq_cols, stride_lse_head,
    HEAD_DIM_V: tl.constexpr, BLOCK_DV: tl.constexpr, BLOCK_M: tl.constexpr, HAS_DLSE: tl.constexpr,
    ZERO_DQ: tl.constexpr, BLOCK_DQ: tl.constexpr, VARLEN: tl.constexpr,
):
    """Row statistics of the backward: lse in base 2 and delta = rowsum(dO * O) (- dlse), rows padded
    to ``stride_stats`` (rows past a sequence's length: lse2 of -inf, delta 0). ``ZERO_DQ``: also
    zero this program's rows of the contiguous fp32 (B, Hq, Sq, dq_cols) dQ accumulator (packed: (1,
    Hq, total_q, dq_cols)) that the dK/dV pass then sums into (a memset launch less a step).
    ``VARLEN``: packed sequences (``memory.sequence_rows``), lse (Hq, total_q)."""
    batch_head = tl.program_id(1)
    batch = batch_head // heads_q
    head = batch_head % heads_q
    q_index, seqlen_q = sequence_rows(CuSeqlensQ, batch, seqlen_q, VARLEN)
    start_m = tl.program_id(0) * BLOCK_M
    offs_tile = tl.arange(0, BLOCK_M)
    offs_m = start_m + offs_tile
    offs_dv = tl.arange(0, BLOCK_DV)
    o = load_tile(tile_ptrs(head_base(Out, q_index, head, stride_ob, stride_oh), start_m, stride_os, offs_tile,
                            offs_dv), offs_m, seqlen_q, offs_dv, HEAD_DIM_V, True, HEAD_DIM_V != BLOCK_DV)
    do = load_tile(tile_ptrs(head_base(DOut, q_index, head, stride_dob, stride_doh), start_m, stride_dos, offs_tile,
                             offs_dv), offs_m, seqlen_q, offs_dv, HEAD_DIM_V, True, HEAD_DIM_V != BLOCK_DV)
    delta = tl.sum(o.to(tl.float32) * do.to(tl.float32), axis=1)
    row_offset = lse_offset(batch, head, heads_q, seqlen_q, q_index, stride_lse_head, VARLEN)
    if HAS_DLSE:
        delta -= tl.load(DLse + row_offset + offs_m, mask=offs_m < seqlen_q, other=0.0)
    lse2 = lse_for_backward(tl.load(Lse + row_offset + offs_m, mask=offs_m < seqlen_q, other=float("-inf")))
    stats_offset = batch_head.to(tl.int64) * stride_stats
    tl.store(Lse2 + stats_offset + offs_m, lse2, mask=offs_m < stride_stats)
    tl.store(Delta + stats_offset + offs_m, delta, mask=offs_m < stride_stats)
    if ZERO_DQ:
        offs_dq = tl.arange(0, BLOCK_DQ)
        rows = DQAccum + (row_offset + offs_m.to(tl.int64))[:, None] * dq_cols + offs_dq[None, :]
        tl.store(rows, tl.zeros([BLOCK_M, BLOCK_DQ], dtype=tl.float32),
                 mask=(offs_m[:, None] < seqlen_q) & (offs_dq[None, :] < dq_cols))


@triton.jit
def _dkdv_tiles(
    dk, dv, k, v, Q, DOut, q_desc, do_desc, DQAccum, dq_desc, Lse2, Delta, batch, q_index, head_kv, group_size, heads_q,
    stride_qb, stride_qh, stride_qs, stride_dob, stride_doh, stride_dos, stride_dqb, stride_dqh, stride_dqs,
    stride_stats, block_begin, block_end, skip_begin, skip_end, offs_n, seqlen_q, seqlen_k, window_left, window_right,
    qk_scale, softcap_log2, scale, Mask, stride_mb, stride_mh, stride_mq, stride_mk, mask_head_div,
    Bias, stride_bb, stride_bh, stride_bq, stride_bk, bias_head_div, DBias, stride_dbb, stride_dbh,
    stride_dbq, stride_dbk, bias_desc, dbias_desc, mask_desc, start_n, tile_list, query_blocks,
    HEAD_DIM: tl.constexpr, HEAD_DIM_V: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr,
    BLOCK_M: tl.constexpr, HAS_LEFT: tl.constexpr, HAS_RIGHT: tl.constexpr, HAS_SOFTCAP: tl.constexpr,
    HAS_MASK: tl.constexpr, HAS_BIAS: tl.constexpr, BIAS_TMA: tl.constexpr, DBIAS: tl.constexpr, DBIAS_SUM_Q: tl.constexpr,
    DBIAS_SUM_K: tl.constexpr, IS_MASKED: tl.constexpr, FROM_LIST: tl.constexpr, ATOMIC_DQ: tl.constexpr,
    DQ_TMA: tl.constexpr, DOT_PRECISION: tl.constexpr, STAGES: tl.constexpr, TMA_LOADS: tl.constexpr,
    MASK_SHIFT_Q: tl.constexpr, MASK_SHIFT_K: tl.constexpr, MASK_TMA: tl.constexpr,
    Alibi=0, HAS_ALIBI: tl.constexpr = False, chunk=1,
    HAS_CHUNK: tl.constexpr = False, BLOCK_N: tl.constexpr = 16, dropout_seed=0, dropout_threshold=0, dropout_scale=1.0,
    HAS_DROPOUT: tl.constexpr = False,
):
    """Query blocks ``[block_begin, block_end)`` of every query head of the KV group, as one flat
    loop (head-major): one software pipeline runs across the heads, and no loop nest holds dK, dV.
    A masked walk skips the blocks ``[skip_begin, skip_end)`` (the interior, walked separately), so
    both boundary stretches share one loop. ``FROM_LIST``: the steps are instead the entries at
    positions ``[block_begin, block_end)`` of ``tile_list``, ``member * query_blocks + block``
    (tile_lists.column_lists)."""
    offs_tile = tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    query_unit = offs_tile.to(tl.float32)  # ALiBi's key-term form: i' - c of a step's rows
    skipped = skip_end - skip_begin
    blocks = block_end - block_begin - skipped
    steps = block_end - block_begin if FROM_LIST else blocks * group_size
    for step in tl.range(0, steps, num_stages=STAGES):
        if FROM_LIST:
            entry = tl.load(tile_list + block_begin + step)
            member = tl.where(group_size == 1, 0, entry // query_blocks)
            block = entry - member * query_blocks
        else:
            # A group of one (MHA) is specialised to the constant 1 at launch: no division per step then.
            member = tl.where(group_size == 1, 0, step // blocks)
            block = block_begin + step - member * blocks
            if IS_MASKED:
                block = tl.where(block >= skip_begin, block + skipped, block)
        head = head_kv * group_size + member
        start_m = block * BLOCK_M
        offs_m = start_m + offs_tile
        q = load_block(q_desc, head_base(Q, q_index, head, stride_qb, stride_qh), batch, head, start_m, stride_qs,
                       seqlen_q, HEAD_DIM, BLOCK_M, BLOCK_D, IS_MASKED, TMA_LOADS)
        do = load_block(do_desc, head_base(DOut, q_index, head, stride_dob, stride_doh), batch, head, start_m,
                        stride_dos, seqlen_q, HEAD_DIM_V, BLOCK_M, BLOCK_DV, IS_MASKED, TMA_LOADS)
        dq_row = batch * heads_q + head
        stats_offset = dq_row.to(tl.int64) * stride_stats  # padded rows: no mask (rows past seqlen_q give p = 0)
        lse2 = tl.load(Lse2 + stats_offset + offs_m)
        delta = tl.load(Delta + stats_offset + offs_m)
        qk_t = tl.dot(k, tl.trans(q), input_precision=DOT_PRECISION)
        mask_base = head_base(Mask, batch, head // mask_head_div, stride_mb, stride_mh)
        bias_base = head_base(Bias, batch, head // bias_head_div, stride_bb, stride_bh)
        mask_batch, mask_head = slice_indices(batch, head, stride_mb, stride_mh, mask_head_div)
        bias_batch, bias_head = slice_indices(batch, head, stride_bb, stride_bh, bias_head_div)
        if HAS_ALIBI:  # each step's query head has its own slope
            slope = alibi_slope(Alibi, batch, head, heads_q)
        else:
            slope = 0.0
        if HAS_ALIBI == ALIBI_KEY_TERM:
            # -slope * (i' - j) = slope * (j - c) - slope * (i' - c), c = start_m + Sk - Sq: a vector over
            # the keys (the tile's rows here, a few values a thread) and the row term taken out of lse
            # as slope times a loop-invariant vector (the queries are the tile's columns, many a thread)
            key_part = slope * (offs_n - (start_m + seqlen_k - seqlen_q)).to(tl.float32)
            lse2 = lse2 + slope * query_unit
        else:
            key_part = 0.0
        p_t, tanh_t = _probabilities(qk_t, lse2, offs_m, offs_n, start_m, start_n, seqlen_q, seqlen_k, window_left,
                                     window_right, qk_scale, softcap_log2, mask_desc, mask_base, mask_batch,
                                     mask_head, stride_mq, stride_mk, MASK_SHIFT_Q, MASK_SHIFT_K, bias_desc, bias_base,
                                     bias_batch, bias_head, stride_bq, stride_bk, HAS_LEFT, HAS_RIGHT, HAS_SOFTCAP,
                                     HAS_MASK, HAS_BIAS, BIAS_TMA, MASK_TMA, IS_MASKED, True,
                                     alibi_slope_log2=slope, HAS_ALIBI=alibi_in_scores(HAS_ALIBI),
            chunk=chunk, HAS_CHUNK=HAS_CHUNK, key_part=key_part, KEY_PART=HAS_ALIBI == ALIBI_KEY_TERM)
        if HAS_DROPOUT:  # what multiplied V: the kept probabilities, scaled
            keep_t = dropout_keep(dropout_seed, dq_row, offs_m, start_n, dropout_threshold, BLOCK_N, True)
            dv = tl.dot(tl.where(keep_t, p_t * dropout_scale, 0.0).to(do.dtype), do, dv,
                        input_precision=DOT_PRECISION)
        else:
            dv = tl.dot(p_t.to(do.dtype), do, dv, input_precision=DOT_PRECISION)
        dp_t = tl.dot(v, tl.trans(do), input_precision=DOT_PRECISION)
        if HAS_DROPOUT:  # a dropped probability's value never reached the output
            dp_t = tl.where(keep_t, dp_t * dropout_scale, 0.0)
        dlogit_t, ds_t = _score_grads(p_t, dp_t, delta, tanh_t, HAS_SOFTCAP, True)
        if DBIAS != 0:
            # the gradient has the bias's shape: the same slice indices
            _write_bias_grad(dlogit_t, dbias_desc, head_base(DBias, batch, head // bias_head_div, stride_dbb,
                                                             stride_dbh), bias_batch, bias_head, start_m, start_n,
                             offs_m, offs_n, seqlen_q, seqlen_k, stride_dbq, stride_dbk, DBIAS, DBIAS_SUM_Q,
                             DBIAS_SUM_K, BIAS_TMA, True)
        ds_t = ds_t.to(q.dtype)
        dk = tl.dot(ds_t, q, dk, input_precision=DOT_PRECISION)
        if ATOMIC_DQ:
            dq = tl.dot(tl.trans(ds_t), k, input_precision=DOT_PRECISION) * scale
            if DQ_TMA:  # one bulk reduce-add per tile; the descriptor drops rows past seqlen_q
                dq_desc.atomic_add([dq_row, start_m, 0], dq.reshape(1, BLOCK_M, BLOCK_D))
            else:
                dq_ptrs = tile_ptrs(head_base(DQAccum, q_index, head, stride_dqb, stride_dqh), start_m, stride_dqs,
                                    offs_tile, offs_d)
                tl.atomic_add(dq_ptrs, dq, mask=(offs_m[:, None] < seqlen_q) & (offs_d[None, :] < HEAD_DIM),
                              sem="relaxed")
    return dk, dv


@triton.jit
def _dkdv_program(
    n_block, batch, head_kv, q_index, k_index,
    Q, K, V, DOut, Lse2, Delta, DK, DV, DQAccum, Mask, Bias, DBias, TileLists, q_desc, do_desc, dq_desc, bias_desc,
    dbias_desc, mask_desc,
    stride_qb, stride_qh, stride_qs,
    stride_kb, stride_kh, stride_ks,
    stride_vb, stride_vh, stride_vs,
    stride_dob, stride_doh, stride_dos,
    stride_dkb, stride_dkh, stride_dks,
    stride_dvb, stride_dvh, stride_dvs,
    stride_dqb, stride_dqh, stride_dqs,
    stride_mb, stride_mh, stride_mq, stride_mk, mask_head_div, MASK_SHIFT_Q: tl.constexpr, MASK_SHIFT_K: tl.constexpr,
    stride_lb, stride_lh, stride_lr,
    stride_bb, stride_bh, stride_bq, stride_bk, bias_head_div, stride_dbb, stride_dbh, stride_dbq, stride_dbk,
    seqlen_q, seqlen_k, heads_q, group_size, window_left, window_right, stride_stats,
    qk_scale, softcap_log2, scale,
    HEAD_DIM: tl.constexpr, HEAD_DIM_V: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    HAS_LEFT: tl.constexpr, HAS_RIGHT: tl.constexpr, HAS_SOFTCAP: tl.constexpr, HAS_MASK: tl.constexpr,
    HAS_BIAS: tl.constexpr, BIAS_TMA: tl.constexpr, DBIAS: tl.constexpr, DBIAS_SUM_Q: tl.constexpr,
    DBIAS_SUM_K: tl.constexpr, ATOMIC_DQ: tl.constexpr, DQ_TMA: tl.constexpr, DOT_PRECISION: tl.constexpr,
    INTERIOR_STAGES: tl.constexpr, MASKED_STAGES: tl.constexpr, TMA_LOADS: tl.constexpr, MASK_TMA: tl.constexpr,
    Alibi=0, HAS_ALIBI: tl.constexpr = False, chunk=1,
    HAS_CHUNK: tl.constexpr = False, dropout_seed=0, dropout_threshold=0, dropout_scale=1.0,
    HAS_DROPOUT: tl.constexpr = False,
):
    """dK, dV of one key block of one KV head, summed over the query heads of its group. ``batch``:
    the batch (or packed sequence) index; ``q_index``, ``k_index``: what addresses its rows of the
    query-side and key-side tensors (``memory.sequence_rows``)."""
    start_n = n_block * BLOCK_N
    offs_tile = tl.arange(0, BLOCK_N)
    offs_n = start_n + offs_tile
    offs_d = tl.arange(0, BLOCK_D)
    offs_dv = tl.arange(0, BLOCK_DV)
    k = load_tile(tile_ptrs(head_base(K, k_index, head_kv, stride_kb, stride_kh), start_n, stride_ks, offs_tile,
                            offs_d), offs_n, seqlen_k, offs_d, HEAD_DIM, True, HEAD_DIM != BLOCK_D)
    v = load_tile(tile_ptrs(head_base(V, k_index, head_kv, stride_vb, stride_vh), start_n, stride_vs, offs_tile,
                            offs_dv), offs_n, seqlen_k, offs_dv, HEAD_DIM_V, True, HEAD_DIM_V != BLOCK_DV)
    dk = tl.zeros([BLOCK_N, BLOCK_D], dtype=tl.float32)
    dv = tl.zeros([BLOCK_N, BLOCK_DV], dtype=tl.float32)
    operands = (k, v, Q, DOut, q_desc, do_desc, DQAccum, dq_desc, Lse2, Delta, batch, q_index, head_kv, group_size,
                heads_q,
                stride_qb, stride_qh, stride_qs, stride_dob, stride_doh, stride_dos, stride_dqb, stride_dqh,
                stride_dqs, stride_stats)
    scores_args = (offs_n, seqlen_q, seqlen_k, window_left, window_right, qk_scale, softcap_log2, scale, Mask,
                   stride_mb, stride_mh, stride_mq, stride_mk, mask_head_div, Bias,
                   stride_bb, stride_bh, stride_bq, stride_bk, bias_head_div, DBias, stride_dbb, stride_dbh,
                   stride_dbq, stride_dbk, bias_desc, dbias_desc, mask_desc, start_n)
    # (Tuples carry runtime values only: a constexpr packed into one inside a jit function loses
    # its constness in Triton 3.6.)
    # Full tiles first (the interior stretch, or the list's full tiles), then the masked ones, each
    # over the whole group in a fixed order (dK, dV are bitwise reproducible). A masked loop *before*
    # the pipelined one made ptxas serialise every wgmma of the kernel (C7515, "non wgmma
    # instructions defining accumulator registers").
    if HAS_MASK:  # the tiles the mask leaves, listed on the host (tile_lists.column_lists)
        tile_list = head_base(TileLists, batch, head_kv, stride_lb, stride_lh) + n_block * stride_lr
        full_tiles = tl.load(tile_list)
        partial_tiles = tl.load(tile_list + 1)
        query_blocks = tl.cdiv(seqlen_q, BLOCK_M)
        dk, dv = _dkdv_tiles(
            dk, dv, *operands, 0, full_tiles, 0, 0, *scores_args, tile_list + 2, query_blocks, HEAD_DIM, HEAD_DIM_V,
            BLOCK_D, BLOCK_DV, BLOCK_M, HAS_LEFT, HAS_RIGHT, HAS_SOFTCAP, False, HAS_BIAS, BIAS_TMA, DBIAS,
            DBIAS_SUM_Q, DBIAS_SUM_K, HAS_BIAS,  # a -inf bias can empty a row on any tile
            True, ATOMIC_DQ, DQ_TMA, DOT_PRECISION, INTERIOR_STAGES, TMA_LOADS,
            MASK_SHIFT_Q=MASK_SHIFT_Q, MASK_SHIFT_K=MASK_SHIFT_K, MASK_TMA=MASK_TMA, Alibi=Alibi, HAS_ALIBI=HAS_ALIBI,
            chunk=chunk, HAS_CHUNK=HAS_CHUNK, BLOCK_N=BLOCK_N, dropout_seed=dropout_seed,
            dropout_threshold=dropout_threshold, dropout_scale=dropout_scale, HAS_DROPOUT=HAS_DROPOUT)
        dk, dv = _dkdv_tiles(
            dk, dv, *operands, full_tiles, full_tiles + partial_tiles, 0, 0, *scores_args, tile_list + 2,
            query_blocks, HEAD_DIM, HEAD_DIM_V, BLOCK_D, BLOCK_DV, BLOCK_M, HAS_LEFT, HAS_RIGHT, HAS_SOFTCAP, True,
            HAS_BIAS, BIAS_TMA, DBIAS, DBIAS_SUM_Q, DBIAS_SUM_K, True, True, ATOMIC_DQ, DQ_TMA, DOT_PRECISION,
            MASKED_STAGES, TMA_LOADS, MASK_SHIFT_Q=MASK_SHIFT_Q, MASK_SHIFT_K=MASK_SHIFT_K, MASK_TMA=MASK_TMA, Alibi=Alibi, HAS_ALIBI=HAS_ALIBI,
            chunk=chunk, HAS_CHUNK=HAS_CHUNK, BLOCK_N=BLOCK_N, dropout_seed=dropout_seed,
            dropout_threshold=dropout_threshold, dropout_scale=dropout_scale, HAS_DROPOUT=HAS_DROPOUT)
    else:
        begin, interior_begin, interior_end, end = query_blocks_for_key_block(
            n_block, seqlen_q, seqlen_k, window_left, window_right, BLOCK_M, BLOCK_N, HAS_LEFT, HAS_RIGHT,
            chunk, HAS_CHUNK)
        dk, dv = _dkdv_tiles(
            dk, dv, *operands, interior_begin, interior_end, interior_end, interior_end, *scores_args, TileLists, 0,
            HEAD_DIM, HEAD_DIM_V, BLOCK_D, BLOCK_DV, BLOCK_M, HAS_LEFT, HAS_RIGHT, HAS_SOFTCAP, False, HAS_BIAS,
            BIAS_TMA, DBIAS, DBIAS_SUM_Q, DBIAS_SUM_K,
            HAS_BIAS,  # a -inf bias can empty a row on any tile: guard it too
            False, ATOMIC_DQ, DQ_TMA, DOT_PRECISION, INTERIOR_STAGES, TMA_LOADS,
            MASK_SHIFT_Q=MASK_SHIFT_Q, MASK_SHIFT_K=MASK_SHIFT_K, MASK_TMA=MASK_TMA, Alibi=Alibi, HAS_ALIBI=HAS_ALIBI,
            chunk=chunk, HAS_CHUNK=HAS_CHUNK, BLOCK_N=BLOCK_N, dropout_seed=dropout_seed,
            dropout_threshold=dropout_threshold, dropout_scale=dropout_scale, HAS_DROPOUT=HAS_DROPOUT)
        # both boundary stretches in one masked walk
        dk, dv = _dkdv_tiles(
            dk, dv, *operands, begin, end, interior_begin, interior_end, *scores_args, TileLists, 0, HEAD_DIM,
            HEAD_DIM_V, BLOCK_D, BLOCK_DV, BLOCK_M, HAS_LEFT, HAS_RIGHT, HAS_SOFTCAP, False, HAS_BIAS, BIAS_TMA, DBIAS,
            DBIAS_SUM_Q, DBIAS_SUM_K, True, False, ATOMIC_DQ, DQ_TMA, DOT_PRECISION, MASKED_STAGES, TMA_LOADS,
            MASK_SHIFT_Q=MASK_SHIFT_Q, MASK_SHIFT_K=MASK_SHIFT_K, MASK_TMA=MASK_TMA, Alibi=Alibi, HAS_ALIBI=HAS_ALIBI,
            chunk=chunk, HAS_CHUNK=HAS_CHUNK, BLOCK_N=BLOCK_N, dropout_seed=dropout_seed,
            dropout_threshold=dropout_threshold, dropout_scale=dropout_scale, HAS_DROPOUT=HAS_DROPOUT)

    store_tile(tile_ptrs(head_base(DK, k_index, head_kv, stride_dkb, stride_dkh), start_n, stride_dks, offs_tile,
                         offs_d), dk * scale, offs_n, seqlen_k, offs_d, HEAD_DIM)
    store_tile(tile_ptrs(head_base(DV, k_index, head_kv, stride_dvb, stride_dvh), start_n, stride_dvs, offs_tile,
                         offs_dv), dv, offs_n, seqlen_k, offs_dv, HEAD_DIM_V)


@triton.jit
def _dq_tiles(
    dq, q, do, lse2, delta, k_desc, v_desc, k_base, v_base, batch, head_kv, stride_ks, stride_vs,
    block_begin, block_end, tile_list, start_m, offs_m, seqlen_q, seqlen_k, window_left, window_right, qk_scale,
    softcap_log2, mask_desc, mask_base, mask_batch, mask_head, stride_mq, stride_mk, bias_desc, bias_base, bias_batch,
    bias_head, stride_bq, stride_bk,
    HEAD_DIM: tl.constexpr, HEAD_DIM_V: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr,
    BLOCK_N: tl.constexpr, HAS_LEFT: tl.constexpr, HAS_RIGHT: tl.constexpr, HAS_SOFTCAP: tl.constexpr,
    HAS_MASK: tl.constexpr, HAS_BIAS: tl.constexpr, BIAS_TMA: tl.constexpr, IS_MASKED: tl.constexpr,
    FROM_LIST: tl.constexpr, DOT_PRECISION: tl.constexpr, TMA_LOADS: tl.constexpr,
    MASK_SHIFT_Q: tl.constexpr, MASK_SHIFT_K: tl.constexpr, MASK_TMA: tl.constexpr,
    alibi_slope_log2=0.0, HAS_ALIBI: tl.constexpr = False, chunk=1,
    HAS_CHUNK: tl.constexpr = False, batch_head=0, dropout_seed=0, dropout_threshold=0, dropout_scale=1.0,
    HAS_DROPOUT: tl.constexpr = False,
):
    """Key blocks ``[block_begin, block_end)``, or with ``FROM_LIST`` the entries at those
    positions of ``tile_list`` (tile_lists.py), as the forward walks them."""
    offs_tile = tl.arange(0, BLOCK_N)
    if HAS_ALIBI == ALIBI_KEY_TERM:
        # -slope * (i' - j) = slope * (j - start_n) - slope * (i' - start_n): a loop-invariant vector
        # over a tile's keys, and a row term taken out of lse per tile (as in the forward: a vector
        # over the keys made per tile inside the pipelined loop made ptxas serialise the kernel's
        # wgmmas). i' - start_n is formed in integers: small near the diagonal, where p is not.
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
        v = load_block(v_desc, v_base, batch, head_kv, start_n, stride_vs, seqlen_k, HEAD_DIM_V, BLOCK_N, BLOCK_DV,
                       IS_MASKED, TMA_LOADS)
        qk = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION)
        if HAS_ALIBI == ALIBI_KEY_TERM:
            lse2_tile = lse2 + alibi_slope_log2 * (offs_m + (seqlen_k - seqlen_q) - start_n).to(tl.float32)
        else:
            lse2_tile = lse2
        p, tanh_arg = _probabilities(qk, lse2_tile, offs_m, offs_n, start_m, start_n, seqlen_q, seqlen_k, window_left,
                                     window_right, qk_scale, softcap_log2, mask_desc, mask_base, mask_batch,
                                     mask_head, stride_mq, stride_mk, MASK_SHIFT_Q, MASK_SHIFT_K, bias_desc, bias_base,
                                     bias_batch, bias_head, stride_bq, stride_bk, HAS_LEFT, HAS_RIGHT, HAS_SOFTCAP,
                                     HAS_MASK, HAS_BIAS, BIAS_TMA, MASK_TMA, IS_MASKED, False,
                                     alibi_slope_log2=alibi_slope_log2, HAS_ALIBI=alibi_in_scores(HAS_ALIBI),
            chunk=chunk, HAS_CHUNK=HAS_CHUNK, key_part=key_part, KEY_PART=HAS_ALIBI == ALIBI_KEY_TERM)
        dp = tl.dot(do, tl.trans(v), input_precision=DOT_PRECISION)
        if HAS_DROPOUT:  # a dropped probability's value never reached the output
            keep = dropout_keep(dropout_seed, batch_head, offs_m, start_n, dropout_threshold, BLOCK_N, False)
            dp = tl.where(keep, dp * dropout_scale, 0.0)
        _, ds = _score_grads(p, dp, delta, tanh_arg, HAS_SOFTCAP, False)
        dq = tl.dot(ds.to(k.dtype), k, dq, input_precision=DOT_PRECISION)
    return dq


@triton.jit
def _dq_program(
    m_block, batch, head, q_index, k_index,
    Q, K, V, DOut, Lse2, Delta, DQ, Mask, Bias, TileLists, k_desc, v_desc, bias_desc, mask_desc,
    stride_qb, stride_qh, stride_qs,
    stride_kb, stride_kh, stride_ks,
    stride_vb, stride_vh, stride_vs,
    stride_dob, stride_doh, stride_dos,
    stride_dqb, stride_dqh, stride_dqs,
    stride_mb, stride_mh, stride_mq, stride_mk, mask_head_div, MASK_SHIFT_Q: tl.constexpr, MASK_SHIFT_K: tl.constexpr,
    stride_lb, stride_lh, stride_lr, lists_head_div,
    stride_bb, stride_bh, stride_bq, stride_bk, bias_head_div,
    seqlen_q, seqlen_k, heads_q, group_size, window_left, window_right, stride_stats,
    qk_scale, softcap_log2, scale,
    HEAD_DIM: tl.constexpr, HEAD_DIM_V: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    HAS_LEFT: tl.constexpr, HAS_RIGHT: tl.constexpr, HAS_SOFTCAP: tl.constexpr, HAS_MASK: tl.constexpr,
    HAS_BIAS: tl.constexpr, BIAS_TMA: tl.constexpr, DOT_PRECISION: tl.constexpr, TMA_LOADS: tl.constexpr,
    MASK_TMA: tl.constexpr, Alibi=0, HAS_ALIBI: tl.constexpr = False, chunk=1,
    HAS_CHUNK: tl.constexpr = False, dropout_seed=0, dropout_threshold=0, dropout_scale=1.0,
    HAS_DROPOUT: tl.constexpr = False,
):
    """dQ of one query block of one query head, in registers: a fixed summation order. ``q_index``,
    ``k_index``: as for ``_dkdv_program``."""
    mask_base = head_base(Mask, batch, head // mask_head_div, stride_mb, stride_mh)
    mask_batch, mask_head = slice_indices(batch, head, stride_mb, stride_mh, mask_head_div)
    bias_base = head_base(Bias, batch, head // bias_head_div, stride_bb, stride_bh)
    bias_batch, bias_head = slice_indices(batch, head, stride_bb, stride_bh, bias_head_div)
    batch_head = batch * heads_q + head
    head_kv = head // group_size
    if HAS_ALIBI:
        slope = alibi_slope(Alibi, batch, head, heads_q)
    else:
        slope = 0.0
    start_m = m_block * BLOCK_M
    offs_tile = tl.arange(0, BLOCK_M)
    offs_m = start_m + offs_tile
    offs_d = tl.arange(0, BLOCK_D)
    offs_dv = tl.arange(0, BLOCK_DV)
    q = load_tile(tile_ptrs(head_base(Q, q_index, head, stride_qb, stride_qh), start_m, stride_qs, offs_tile, offs_d),
                  offs_m, seqlen_q, offs_d, HEAD_DIM, True, HEAD_DIM != BLOCK_D)
    do = load_tile(tile_ptrs(head_base(DOut, q_index, head, stride_dob, stride_doh), start_m, stride_dos, offs_tile,
                             offs_dv), offs_m, seqlen_q, offs_dv, HEAD_DIM_V, True, HEAD_DIM_V != BLOCK_DV)
    stats_offset = batch_head.to(tl.int64) * stride_stats
    lse2 = tl.load(Lse2 + stats_offset + offs_m)
    delta = tl.load(Delta + stats_offset + offs_m)
    k_base = head_base(K, k_index, head_kv, stride_kb, stride_kh)
    v_base = head_base(V, k_index, head_kv, stride_vb, stride_vh)

    dq = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    operands = (q, do, lse2, delta, k_desc, v_desc, k_base, v_base, batch, head_kv, stride_ks, stride_vs)
    scores_args = (start_m, offs_m, seqlen_q, seqlen_k, window_left, window_right, qk_scale, softcap_log2, mask_desc,
                   mask_base, mask_batch, mask_head, stride_mq, stride_mk, bias_desc, bias_base, bias_batch, bias_head,
                   stride_bq, stride_bk)
    if HAS_MASK:  # the tiles the mask leaves, as the forward walks them (tile_lists.row_lists)
        tile_list = head_base(TileLists, batch, head // lists_head_div, stride_lb, stride_lh) + m_block * stride_lr
        full_tiles = tl.load(tile_list)
        partial_tiles = tl.load(tile_list + 1)
        dq = _dq_tiles(dq, *operands, 0, full_tiles, tile_list + 2, *scores_args, HEAD_DIM, HEAD_DIM_V, BLOCK_D,
                       BLOCK_DV, BLOCK_N, HAS_LEFT, HAS_RIGHT, HAS_SOFTCAP, False, HAS_BIAS, BIAS_TMA,
                       HAS_BIAS,  # a -inf bias can empty a row on any tile
                       True, DOT_PRECISION, TMA_LOADS,
                       MASK_SHIFT_Q=MASK_SHIFT_Q, MASK_SHIFT_K=MASK_SHIFT_K, MASK_TMA=MASK_TMA, alibi_slope_log2=slope, HAS_ALIBI=HAS_ALIBI,
            chunk=chunk, HAS_CHUNK=HAS_CHUNK, batch_head=batch_head, dropout_seed=dropout_seed,
            dropout_threshold=dropout_threshold, dropout_scale=dropout_scale, HAS_DROPOUT=HAS_DROPOUT)
        dq = _dq_tiles(dq, *operands, full_tiles, full_tiles + partial_tiles, tile_list + 2, *scores_args, HEAD_DIM,
                       HEAD_DIM_V, BLOCK_D, BLOCK_DV, BLOCK_N, HAS_LEFT, HAS_RIGHT, HAS_SOFTCAP, True, HAS_BIAS,
                       BIAS_TMA, True, True, DOT_PRECISION, TMA_LOADS,
                       MASK_SHIFT_Q=MASK_SHIFT_Q, MASK_SHIFT_K=MASK_SHIFT_K, MASK_TMA=MASK_TMA, alibi_slope_log2=slope, HAS_ALIBI=HAS_ALIBI,
            chunk=chunk, HAS_CHUNK=HAS_CHUNK, batch_head=batch_head, dropout_seed=dropout_seed,
            dropout_threshold=dropout_threshold, dropout_scale=dropout_scale, HAS_DROPOUT=HAS_DROPOUT)
    else:
        begin, interior_begin, interior_end, end = key_blocks_for_query_block(
            m_block, seqlen_q, seqlen_k, window_left, window_right, BLOCK_M, BLOCK_N, HAS_LEFT, HAS_RIGHT,
            chunk, HAS_CHUNK)
        dq = _dq_tiles(dq, *operands, interior_begin, interior_end, TileLists, *scores_args, HEAD_DIM, HEAD_DIM_V,
                       BLOCK_D, BLOCK_DV, BLOCK_N, HAS_LEFT, HAS_RIGHT, HAS_SOFTCAP, False, HAS_BIAS, BIAS_TMA,
                       HAS_BIAS,  # a -inf bias can empty a row on any tile: guard every tile
                       False, DOT_PRECISION, TMA_LOADS,
                       MASK_SHIFT_Q=MASK_SHIFT_Q, MASK_SHIFT_K=MASK_SHIFT_K, MASK_TMA=MASK_TMA, alibi_slope_log2=slope, HAS_ALIBI=HAS_ALIBI,
            chunk=chunk, HAS_CHUNK=HAS_CHUNK, batch_head=batch_head, dropout_seed=dropout_seed,
            dropout_threshold=dropout_threshold, dropout_scale=dropout_scale, HAS_DROPOUT=HAS_DROPOUT)
        if HAS_LEFT or HAS_CHUNK:  # boundary blocks before the interior
            dq = _dq_tiles(dq, *operands, begin, interior_begin, TileLists, *scores_args, HEAD_DIM, HEAD_DIM_V,
                           BLOCK_D, BLOCK_DV, BLOCK_N, HAS_LEFT, HAS_RIGHT, HAS_SOFTCAP, False, HAS_BIAS, BIAS_TMA,
                           True, False, DOT_PRECISION, TMA_LOADS,
                       MASK_SHIFT_Q=MASK_SHIFT_Q, MASK_SHIFT_K=MASK_SHIFT_K, MASK_TMA=MASK_TMA, alibi_slope_log2=slope, HAS_ALIBI=HAS_ALIBI,
            chunk=chunk, HAS_CHUNK=HAS_CHUNK, batch_head=batch_head, dropout_seed=dropout_seed,
            dropout_threshold=dropout_threshold, dropout_scale=dropout_scale, HAS_DROPOUT=HAS_DROPOUT)
        dq = _dq_tiles(dq, *operands, interior_end, end, TileLists, *scores_args, HEAD_DIM, HEAD_DIM_V, BLOCK_D,
                       BLOCK_DV, BLOCK_N, HAS_LEFT, HAS_RIGHT, HAS_SOFTCAP, False, HAS_BIAS, BIAS_TMA, True, False,
                       DOT_PRECISION, TMA_LOADS,
                       MASK_SHIFT_Q=MASK_SHIFT_Q, MASK_SHIFT_K=MASK_SHIFT_K, MASK_TMA=MASK_TMA, alibi_slope_log2=slope, HAS_ALIBI=HAS_ALIBI,
            chunk=chunk, HAS_CHUNK=HAS_CHUNK, batch_head=batch_head, dropout_seed=dropout_seed,
            dropout_threshold=dropout_threshold, dropout_scale=dropout_scale, HAS_DROPOUT=HAS_DROPOUT)
    store_tile(tile_ptrs(head_base(DQ, q_index, head, stride_dqb, stride_dqh), start_m, stride_dqs, offs_tile, offs_d),
               dq * scale, offs_m, seqlen_q, offs_d, HEAD_DIM)


# Lengths stay runtime values: Triton would otherwise compile a separate kernel for a length of 1
# (decoding), and Triton 3.6's ptxas (12.8) crashed on the backward specialised so.
# ... and so do the program counts: packed sequences' longest length changes from call to call, and
# a new set of lengths must not compile a new kernel.
@triton.jit(do_not_specialize=["seqlen_q", "seqlen_k", "key_blocks", "query_blocks", "dkdv_programs"])
def _backward_kernel(
    Q, K, V, DOut, Lse2, Delta, DK, DV, DQ, Mask, Bias, DBias, ColumnLists, RowLists, CuSeqlensQ, CuSeqlensK, Alibi,
    DropoutSeed, q_desc, do_desc, k_desc, v_desc, dq_desc, bias_dkdv_desc, bias_dq_desc, dbias_desc, mask_dkdv_desc, mask_dq_desc,
    stride_qb, stride_qh, stride_qs,
    stride_kb, stride_kh, stride_ks,
    stride_vb, stride_vh, stride_vs,
    stride_dob, stride_doh, stride_dos,
    stride_dkb, stride_dkh, stride_dks,
    stride_dvb, stride_dvh, stride_dvs,
    stride_dqb, stride_dqh, stride_dqs,
    stride_mb, stride_mh, stride_mq, stride_mk, mask_head_div, MASK_SHIFT_Q: tl.constexpr, MASK_SHIFT_K: tl.constexpr,
    stride_clb, stride_clh, stride_clr, stride_rlb, stride_rlh, stride_rlr, rows_head_div,
    stride_bb, stride_bh, stride_bq, stride_bk, bias_head_div, stride_dbb, stride_dbh, stride_dbq, stride_dbk,
    seqlen_q, seqlen_k, heads_q, heads_kv, group_size, window_left, window_right, stride_stats,
    qk_scale, softcap_log2, scale, chunk, dropout_threshold, dropout_scale, key_blocks, query_blocks, dkdv_programs,
    dkdv_block_major,
    HEAD_DIM: tl.constexpr, HEAD_DIM_V: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr,
    DKDV_BLOCK_M: tl.constexpr, DKDV_BLOCK_N: tl.constexpr, DQ_BLOCK_M: tl.constexpr, DQ_BLOCK_N: tl.constexpr,
    HAS_LEFT: tl.constexpr, HAS_RIGHT: tl.constexpr, HAS_SOFTCAP: tl.constexpr, HAS_MASK: tl.constexpr,
    HAS_BIAS: tl.constexpr, BIAS_TMA: tl.constexpr, DBIAS: tl.constexpr, DBIAS_SUM_Q: tl.constexpr,
    DBIAS_SUM_K: tl.constexpr, ATOMIC_DQ: tl.constexpr, DQ_TMA: tl.constexpr, DOT_PRECISION: tl.constexpr,
    INTERIOR_STAGES: tl.constexpr, MASKED_STAGES: tl.constexpr,
    RUN_DKDV: tl.constexpr, RUN_DQ: tl.constexpr, DKDV_TMA_LOADS: tl.constexpr, DQ_TMA_LOADS: tl.constexpr,
    MASK_TMA: tl.constexpr, VARLEN: tl.constexpr, HAS_ALIBI: tl.constexpr, HAS_CHUNK: tl.constexpr,
    HAS_DROPOUT: tl.constexpr,
):
    """The backward after the pre-pass. Programs ``[0, dkdv_programs)`` compute dK/dV (the heavier
    work, so it starts first), the rest compute dQ. Launched once with both kinds (they fill each
    other's tail) or twice, one kind each (each with its own warps and pipelining depth), as the
    launch config says. Consecutive programs walk the blocks of one head, which stays in L2.

    A split launch compiles one pass only: the outer ``if``s test the constexprs themselves and a
    disabled flag short-circuits the runtime test. (A local assigned from a constexpr is *not*
    one in Triton, so ``is_dkdv = RUN_DKDV; if is_dkdv:`` would compile both passes.)

    ``VARLEN``: packed sequences; the grid covers the longest (``seqlen_q``, ``seqlen_k``, the block
    counts are its), a shorter sequence's extra blocks do nothing (``memory.sequence_rows``).
    """
    pid = tl.program_id(0)
    if HAS_DROPOUT:
        dropout_seed = tl.load(DropoutSeed)
    else:
        dropout_seed = 0
    if RUN_DKDV:
        if not RUN_DQ or pid < dkdv_programs:
            if dkdv_block_major:  # every head's first key block, then every head's second, ...
                heads_total = dkdv_programs // key_blocks
                n_block = pid // heads_total
                batch_head_kv = pid % heads_total
            else:  # the key blocks of one head after another
                n_block = pid % key_blocks
                batch_head_kv = pid // key_blocks
            batch = batch_head_kv // heads_kv
            q_index, seq_q, k_index, seq_k = sequence_pair(CuSeqlensQ, CuSeqlensK, batch, seqlen_q, seqlen_k, VARLEN)
            if not VARLEN or n_block * DKDV_BLOCK_N < seq_k:
                _dkdv_program(
                    n_block, batch, batch_head_kv % heads_kv, q_index, k_index,
                    Q, K, V, DOut, Lse2, Delta, DK, DV, DQ, Mask, Bias, DBias, ColumnLists, q_desc, do_desc, dq_desc,
                    bias_dkdv_desc, dbias_desc, mask_dkdv_desc,
                    stride_qb, stride_qh, stride_qs, stride_kb, stride_kh, stride_ks, stride_vb, stride_vh, stride_vs,
                    stride_dob, stride_doh, stride_dos, stride_dkb, stride_dkh, stride_dks, stride_dvb, stride_dvh,
                    stride_dvs, stride_dqb, stride_dqh, stride_dqs, stride_mb, stride_mh, stride_mq, stride_mk, mask_head_div,
                    MASK_SHIFT_Q, MASK_SHIFT_K, stride_clb, stride_clh, stride_clr,
                    stride_bb, stride_bh, stride_bq, stride_bk, bias_head_div, stride_dbb, stride_dbh, stride_dbq, stride_dbk,
                    seq_q, seq_k, heads_q, group_size, window_left, window_right, stride_stats,
                    qk_scale, softcap_log2, scale,
                    HEAD_DIM, HEAD_DIM_V, BLOCK_D, BLOCK_DV, DKDV_BLOCK_M, DKDV_BLOCK_N, HAS_LEFT, HAS_RIGHT, HAS_SOFTCAP,
                    HAS_MASK, HAS_BIAS, BIAS_TMA, DBIAS, DBIAS_SUM_Q, DBIAS_SUM_K, ATOMIC_DQ, DQ_TMA, DOT_PRECISION,
                    INTERIOR_STAGES, MASKED_STAGES, DKDV_TMA_LOADS, MASK_TMA, Alibi=Alibi, HAS_ALIBI=HAS_ALIBI,
            chunk=chunk, HAS_CHUNK=HAS_CHUNK, dropout_seed=dropout_seed,
            dropout_threshold=dropout_threshold, dropout_scale=dropout_scale, HAS_DROPOUT=HAS_DROPOUT)
    if RUN_DQ:
        if not RUN_DKDV or pid >= dkdv_programs:
            dq_pid = pid - dkdv_programs
            batch_head = dq_pid // query_blocks
            m_block = dq_pid % query_blocks
            if HAS_RIGHT:  # with a right window bound the last query blocks see the most keys: run them first
                m_block = query_blocks - 1 - m_block
            batch = batch_head // heads_q
            q_index, seq_q, k_index, seq_k = sequence_pair(CuSeqlensQ, CuSeqlensK, batch, seqlen_q, seqlen_k, VARLEN)
            if not VARLEN or m_block * DQ_BLOCK_M < seq_q:
                _dq_program(
                    m_block, batch, batch_head % heads_q, q_index, k_index,
                    Q, K, V, DOut, Lse2, Delta, DQ, Mask, Bias, RowLists, k_desc, v_desc, bias_dq_desc, mask_dq_desc,
                    stride_qb, stride_qh, stride_qs, stride_kb, stride_kh, stride_ks, stride_vb, stride_vh, stride_vs,
                    stride_dob, stride_doh, stride_dos, stride_dqb, stride_dqh, stride_dqs,
                    stride_mb, stride_mh, stride_mq, stride_mk, mask_head_div, MASK_SHIFT_Q, MASK_SHIFT_K,
                    stride_rlb, stride_rlh, stride_rlr, rows_head_div,
                    stride_bb, stride_bh, stride_bq, stride_bk, bias_head_div,
                    seq_q, seq_k, heads_q, group_size, window_left, window_right, stride_stats,
                    qk_scale, softcap_log2, scale,
                    HEAD_DIM, HEAD_DIM_V, BLOCK_D, BLOCK_DV, DQ_BLOCK_M, DQ_BLOCK_N, HAS_LEFT, HAS_RIGHT, HAS_SOFTCAP,
                    HAS_MASK, HAS_BIAS, BIAS_TMA, DOT_PRECISION, DQ_TMA_LOADS, MASK_TMA, Alibi=Alibi,
                    HAS_ALIBI=HAS_ALIBI,
            chunk=chunk, HAS_CHUNK=HAS_CHUNK, dropout_seed=dropout_seed,
            dropout_threshold=dropout_threshold, dropout_scale=dropout_scale, HAS_DROPOUT=HAS_DROPOUT)


@triton.jit(do_not_specialize=["seqlen_q", "seqlen_k"])
def _bias_grad_kernel(
    Q, K, V, DOut, Lse2, Delta, Mask, Bias, DBias, Alibi, DropoutSeed,
    stride_qb, stride_qh, stride_qs,
    stride_kb, stride_kh, stride_ks,
    stride_vb, stride_vh, stride_vs,
    stride_dob, stride_doh, stride_dos,
    stride_mb, stride_mh, stride_mq, stride_mk, mask_head_div, MASK_SHIFT_Q: tl.constexpr, MASK_SHIFT_K: tl.constexpr,
    TileStates, stride_tb, stride_th, stride_tq, tiles_head_div,
    stride_bb, stride_bh, stride_bq, stride_bk, bias_head_div, stride_dbb, stride_dbh, stride_dbq, stride_dbk,
    seqlen_q, seqlen_k, batch_size, heads_q, group_size, window_left, window_right, stride_stats,
    qk_scale, softcap_log2, chunk, dropout_threshold, dropout_scale, bias_batches, bias_heads, q_tiles, k_tiles,
    HEAD_DIM: tl.constexpr, HEAD_DIM_V: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    HAS_LEFT: tl.constexpr, HAS_RIGHT: tl.constexpr, HAS_SOFTCAP: tl.constexpr, HAS_MASK: tl.constexpr,
    HAS_BIAS: tl.constexpr, DBIAS_SUM_Q: tl.constexpr, DBIAS_SUM_K: tl.constexpr, DOT_PRECISION: tl.constexpr,
    HAS_ALIBI: tl.constexpr, HAS_CHUNK: tl.constexpr, HAS_DROPOUT: tl.constexpr,
):
    """The bias gradient of a broadcast bias, bitwise reproducible (``deterministic=True``): one
    program per output tile -- (bias batch, bias head, query block, key block), a broadcast query
    or key dim counting as one block -- sums, in a fixed order, the softmax gradient of every tile
    that maps onto it: each batch (bias batch dim 1), each query head of the bias head, each query
    block (bias Sq = 1) and each key block (bias Sk = 1). It recomputes p and dp (2 matmuls per
    tile), which is the price of not summing with atomics in the dK/dV pass. Tiles outside the
    window, and with a mask those it empties (``TileStates``: tile_lists.tile_states at this pass's
    tiles), are skipped, as every other pass skips them."""
    pid = tl.program_id(0)
    out_n = pid % k_tiles
    out_m = (pid // k_tiles) % q_tiles
    bias_head = (pid // (k_tiles * q_tiles)) % bias_heads
    bias_batch = pid // (k_tiles * q_tiles * bias_heads)
    batches = batch_size // bias_batches  # 1, or every batch for a bias shared by the batch
    heads_per_bias_head = heads_q // bias_heads
    m_count = tl.cdiv(seqlen_q, BLOCK_M) if DBIAS_SUM_Q else 1
    n_count = tl.cdiv(seqlen_k, BLOCK_N) if DBIAS_SUM_K else 1
    offs_m_tile = tl.arange(0, BLOCK_M)
    offs_n_tile = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    offs_dv = tl.arange(0, BLOCK_DV)
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for step in range(batches * heads_per_bias_head * m_count * n_count):
        n_block = out_n + step % n_count
        m_block = out_m + (step // n_count) % m_count
        member = step // (n_count * m_count)
        head = bias_head * heads_per_bias_head + member % heads_per_bias_head
        batch = bias_batch + member // heads_per_bias_head
        begin, interior_begin, interior_end, end = key_blocks_for_query_block(
            m_block, seqlen_q, seqlen_k, window_left, window_right, BLOCK_M, BLOCK_N, HAS_LEFT, HAS_RIGHT,
            chunk, HAS_CHUNK)
        visited = (n_block >= begin) & (n_block < end)  # a tile with a kept pair
        if HAS_MASK:  # and one the mask does not empty
            state = tl.load(TileStates + batch * stride_tb + (head // tiles_head_div) * stride_th + m_block * stride_tq
                            + n_block)
            visited &= state != TILE_EMPTY
        if visited:
            head_kv = head // group_size
            start_m = m_block * BLOCK_M
            start_n = n_block * BLOCK_N
            offs_m = start_m + offs_m_tile
            offs_n = start_n + offs_n_tile
            q = load_tile(tile_ptrs(head_base(Q, batch, head, stride_qb, stride_qh), start_m, stride_qs, offs_m_tile,
                                    offs_d), offs_m, seqlen_q, offs_d, HEAD_DIM, True, HEAD_DIM != BLOCK_D)
            do = load_tile(tile_ptrs(head_base(DOut, batch, head, stride_dob, stride_doh), start_m, stride_dos,
                                     offs_m_tile, offs_dv), offs_m, seqlen_q, offs_dv, HEAD_DIM_V, True,
                           HEAD_DIM_V != BLOCK_DV)
            k = load_tile(tile_ptrs(head_base(K, batch, head_kv, stride_kb, stride_kh), start_n, stride_ks,
                                    offs_n_tile, offs_d), offs_n, seqlen_k, offs_d, HEAD_DIM, True, HEAD_DIM != BLOCK_D)
            v = load_tile(tile_ptrs(head_base(V, batch, head_kv, stride_vb, stride_vh), start_n, stride_vs,
                                    offs_n_tile, offs_dv), offs_n, seqlen_k, offs_dv, HEAD_DIM_V, True,
                          HEAD_DIM_V != BLOCK_DV)
            stats_offset = (batch * heads_q + head).to(tl.int64) * stride_stats
            lse2 = tl.load(Lse2 + stats_offset + offs_m, mask=offs_m < stride_stats, other=float("inf"))
            delta = tl.load(Delta + stats_offset + offs_m, mask=offs_m < stride_stats, other=0.0)
            qk = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION)
            if HAS_ALIBI:
                slope = alibi_slope(Alibi, batch, head, heads_q)
            else:
                slope = 0.0
            p, tanh_arg = _probabilities(
                qk, lse2, offs_m, offs_n, start_m, start_n, seqlen_q, seqlen_k, window_left, window_right, qk_scale,
                softcap_log2, Mask, head_base(Mask, batch, head // mask_head_div, stride_mb, stride_mh), 0, 0,
                stride_mq, stride_mk, MASK_SHIFT_Q, MASK_SHIFT_K, Bias,
                head_base(Bias, batch, head // bias_head_div, stride_bb, stride_bh), 0, 0, stride_bq, stride_bk,
                HAS_LEFT, HAS_RIGHT, HAS_SOFTCAP, HAS_MASK, HAS_BIAS, False, False, True, False,
                alibi_slope_log2=slope, HAS_ALIBI=alibi_distance(HAS_ALIBI),
            chunk=chunk, HAS_CHUNK=HAS_CHUNK)
            dp = tl.dot(do, tl.trans(v), input_precision=DOT_PRECISION)
            if HAS_DROPOUT:
                keep = dropout_keep(tl.load(DropoutSeed), batch * heads_q + head, offs_m, start_n, dropout_threshold,
                                    BLOCK_N, False)
                dp = tl.where(keep, dp * dropout_scale, 0.0)
            dlogit, _ = _score_grads(p, dp, delta, tanh_arg, HAS_SOFTCAP, False)
            acc += dlogit
    _write_bias_grad(acc, DBias, head_base(DBias, bias_batch, bias_head, stride_dbb, stride_dbh), 0, 0, 0, 0,
                     out_m * BLOCK_M + offs_m_tile, out_n * BLOCK_N + offs_n_tile, seqlen_q, seqlen_k,
                     stride_dbq, stride_dbk, 1, DBIAS_SUM_Q, DBIAS_SUM_K, False, False)  # 1: DBIAS_STORE, pointers


# ----------------------------------------------------------------------------- launcher


def dq_from_sums(sums: torch.Tensor, q: torch.Tensor, layout: str, register_order: bool = False) -> torch.Tensor:
    """dQ in q's dtype from the fp32 (B, Hq, Sq, padded D) sums -- ``register_order``: summed as the
    Gluon pass's register-order runs (``constants.REGISTER_ORDER_BASES``) --, in q's strides like dK and dV
    (``attention_backward``): the strides the custom op's fake declares, and those AccumulateGrad
    keeps without a copy (a dQ with the sums' (B, H, S, D) strides was cloned every step where q's
    differ: bshd layout). By ``_convert_dq_kernel``: torch's copy into bshd strides measured much
    slower than into bhsd."""
    dq = gradient_like(q)
    _dq_conversion(tuple(sums.shape), bhsd_stride(dq, layout), q.shape[-1], q.device.index, register_order)(sums, dq)
    return dq


@per_problem
def _dq_conversion(sums_shape: tuple, dq_strides: tuple, head_dim: int, device_index, register_order: bool) -> Launcher:
    """``_convert_dq_kernel``'s launch for one problem (``dq_strides``: dQ's in (B, H, S, D) order);
    each call passes the sums and dQ."""
    batch, heads, seqlen, sums_cols = sums_shape
    assert dq_strides[3] == 1
    if register_order:  # a program per 64-row tile: its runs (one per 64 columns)
        assert seqlen % 64 == 0 and head_dim in (64, 128) and sums_cols == head_dim
        rows, permutation = 64, register_order_permutation()
    else:
        rows, permutation = DQ_CONVERT_ROWS, None
    return Launcher(_convert_dq_kernel, (cdiv(seqlen, rows), batch * heads),
                    (SLOT, SLOT, seqlen, heads, sums_cols, *dq_strides[:3]), HEAD_DIM=head_dim,
                    BLOCK_D=padded_dim(head_dim), BLOCK_M=rows, RUN_PERMUTATION=permutation, num_warps=4)


DQ_CONVERT_ROWS = 32  # rows of a conversion program: a (32, 128) fp32 tile, 16 KB in flight


@triton.jit(do_not_specialize=["seqlen_q", "stride_b", "stride_h", "stride_s"])
def _convert_dq_kernel(Sums, DQ, seqlen_q, heads_q, sums_cols, stride_b, stride_h, stride_s,
                       HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr,
                       RUN_PERMUTATION: tl.constexpr = None):
    """dQ rows [BLOCK_M * pid0, + BLOCK_M) of head row pid1 (= batch * Hq + head) in DQ's dtype and
    (batch, head, row) strides, unit stride along D, from the contiguous fp32 (B * Hq, Sq, sums_cols)
    sums: one read of the sums and one write of dQ, in either layout. ``RUN_PERMUTATION``
    (``constants.register_order_permutation``; BLOCK_M = 64, Sq a multiple of 64): the sums are the
    Gluon pass's register-order runs, read whole and permuted back into rows and columns."""
    head_row = tl.program_id(1)
    batch = head_row // heads_q
    head = head_row - batch * heads_q
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.arange(0, BLOCK_D)
    inside = (rows[:, None] < seqlen_q) & (cols[None, :] < HEAD_DIM)
    if RUN_PERMUTATION is not None:
        runs = tl.arange(0, BLOCK_D * 64)  # this row tile's BLOCK_D / 64 runs, contiguous
        sums = tl.load(Sums + (head_row.to(tl.int64) * seqlen_q + tl.program_id(0) * 64) * sums_cols + runs)
        sums = tl.reshape(sums, [BLOCK_D // 64, 2, 2, 2, 2, 2, 2, 2, 2, 2, 2, 2, 2])
        P: tl.constexpr = RUN_PERMUTATION
        sums = tl.permute(sums, (P[0], P[1], P[2], P[3], P[4], P[5], P[6], P[7], P[8], P[9], P[10], P[11], P[12]))
        sums = tl.reshape(sums, [BLOCK_M, BLOCK_D])
    else:
        sums = tl.load(Sums + (head_row.to(tl.int64) * seqlen_q + rows[:, None]) * sums_cols + cols[None, :],
                       mask=inside)
    out = DQ + batch.to(tl.int64) * stride_b + head.to(tl.int64) * stride_h + rows[:, None].to(tl.int64) * stride_s
    tl.store(out + cols[None, :], sums.to(DQ.dtype.element_ty), mask=inside)


def _kernel_flags(q, v, spec: AttentionSpec, mask, bias) -> dict:
    """The backward kernels' feature constexprs: head dims and their padded widths, the window
    bounds, softcap, mask, bias, the matmuls' precision."""
    head_dim, head_dim_v = q.shape[-1], v.shape[-1]
    block_d, block_dv = padded_dims(head_dim, head_dim_v)
    return dict(
        HEAD_DIM=head_dim, HEAD_DIM_V=head_dim_v, BLOCK_D=block_d, BLOCK_DV=block_dv,
        HAS_LEFT=spec.has_window_left, HAS_RIGHT=spec.has_window_right,
        HAS_SOFTCAP=softcap_mode(spec, q.dtype, q.device), HAS_MASK=mask is not None, HAS_BIAS=bias is not None,
        DOT_PRECISION=dot_precision(q.dtype), HAS_ALIBI=alibi_mode(spec), HAS_CHUNK=spec.has_chunk,
        HAS_DROPOUT=spec.has_dropout,
    )


def _triton_passes(q, k, v, dout, dk, dv, dq_buffer, spec: AttentionSpec, configs: AttentionConfigs,
                   plan, dkdv_cfg: KernelConfig, dq_tma: bool, gluon_dkdv: bool, mask, bias,
                   dbias_mode: int, packing: Packing | None, user_mask, column_lists, row_lists, bias_args,
                   dbias_args, bias_tma: bool, mask_tma: bool, dkdv_loads: bool, dq_loads: bool,
                   call_arguments) -> list:
    """The Triton backward's launches for one call: [(launcher, runs dK/dV, runs dQ)], each
    ``Launcher`` taking the call's tensors and descriptors (``call_arguments``) and fixing the rest:
    strides, lengths, scalars, the constexprs. dK, dV from the Gluon pass: the dQ pass alone; else
    one launch of both (dQ by atomics, or the fused dQ programs) or two. ``dkdv_loads``,
    ``dq_loads``: the passes' tiles come through TMA (their descriptors could be made)."""
    layout = spec.layout
    dq_cfg, atomic_dq = configs.dq, plan.atomic_dq
    batch, heads_q, seqlen_q, head_dim = bhsd_shape(q, layout)
    heads_kv, seqlen_k, head_dim_v = bhsd_shape(v, layout)[1:]
    if packing is not None:
        batch, seqlen_q, seqlen_k = packing.sequences, packing.max_seqlen_q, packing.max_seqlen_k
    qk_scale, softcap_log2 = score_constants(spec)
    flags = _kernel_flags(q, v, spec, mask, bias)
    dq_strides = bhs_strides(dq_buffer, "bhsd" if atomic_dq else layout, packing)
    key_blocks = cdiv(seqlen_k, dkdv_cfg.block_n)
    query_blocks = cdiv(seqlen_q, dq_cfg.block_m)
    dkdv_programs = key_blocks * batch * heads_kv
    dq_programs = 0 if atomic_dq else query_blocks * batch * heads_q
    scalars = (*(stride for t in (q, k, v, dout, dk, dv) for stride in bhs_strides(t, layout, packing)),
               *dq_strides, *user_mask[1:], *column_lists[1:],
               *row_lists[1:], *bias_args[1:],
               *dbias_args[1:5],
               # group_size is passed, not derived in the kernel: Triton specialises an int argument
               # equal to 1, which removes the group walk's index arithmetic for MHA.
               seqlen_q, seqlen_k, heads_q, heads_kv, heads_q // heads_kv, spec.window_left, spec.window_right,
               plan.padded_rows,
               qk_scale, softcap_log2, spec.scale, chunk_arg(spec, seqlen_k), *dropout_args(spec), key_blocks,
               query_blocks)
    constexprs = dict(
        DKDV_BLOCK_M=dkdv_cfg.block_m, DKDV_BLOCK_N=dkdv_cfg.block_n, DQ_BLOCK_M=dq_cfg.block_m,
        DQ_BLOCK_N=dq_cfg.block_n, ATOMIC_DQ=atomic_dq, DQ_TMA=dq_tma, VARLEN=packing is not None,
        DBIAS=dbias_mode if dbias_mode != DBIAS_PASS else DBIAS_OFF, **bias_grad_sums(bias), BIAS_TMA=bias_tma,
        MASK_TMA=mask_tma,
        # Boundary stretches of the dK/dV pass run a few tiles per program: pipelining them buys
        # little, and its extra live registers made the whole kernel spill.
        INTERIOR_STAGES=dkdv_cfg.num_stages, MASKED_STAGES=1, **flags)

    def one_launch(programs, first_dq_program, run_dkdv, run_dq, cfg):
        leading = len(call_arguments(run_dkdv, run_dq))
        launcher = Launcher(_backward_kernel, (programs,),
                            (SLOT,) * leading + (*scalars, first_dq_program, int(plan.block_major)),
                            RUN_DKDV=run_dkdv, RUN_DQ=run_dq, DKDV_TMA_LOADS=run_dkdv and dkdv_loads,
                            DQ_TMA_LOADS=run_dq and dq_loads,
                            num_warps=cfg.num_warps, num_stages=cfg.num_stages, **constexprs)
        return launcher, run_dkdv, run_dq

    if gluon_dkdv:  # dK, dV came from the Gluon pass: the dQ pass alone
        return [one_launch(dq_programs, 0, False, True, dq_cfg)]
    if configs.fuse_dq_pass or atomic_dq:  # one launch; the dQ programs take the dK/dV warps and stages
        return [one_launch(dkdv_programs + dq_programs, dkdv_programs, True, not atomic_dq, dkdv_cfg)]
    return [one_launch(dkdv_programs, dkdv_programs, True, False, dkdv_cfg),
            one_launch(dq_programs, 0, False, True, dq_cfg)]


def column_list_args(mask: BlockMask | None, spec: AttentionSpec, seqlen_q: int, seqlen_k: int, cfg: KernelConfig,
                     heads_q: int, heads_kv: int, placeholder: torch.Tensor) -> tuple:
    """(lists, stride_b, stride_h, stride_key_block) of the dK/dV programs' tile lists (indexed by KV head)."""
    if mask is None:
        return (placeholder, 0, 0, 0)
    lists = tile_lists.column_lists(mask, spec, seqlen_q, seqlen_k, cfg.block_m, cfg.block_n, heads_q, heads_kv)
    return broadcast_args(lists, heads_kv, heads_kv, placeholder)[:4]


def bias_grad_sums(bias: torch.Tensor | None) -> dict:
    """The constexprs that say over which of a tile's axes the bias gradient sums (the bias has
    one query row / one key column)."""
    return dict(DBIAS_SUM_Q=bias is not None and bias.shape[2] == 1,
                DBIAS_SUM_K=bias is not None and bias.shape[3] == 1)


def _bias_grad_pass(q, k, v, dout, lse2, delta, mask, user_mask, bias_args, dbias_args, spec: AttentionSpec,
                    cfg: KernelConfig, flags: dict, alibi: torch.Tensor | None = None,
                    dropout_seed: torch.Tensor | None = None):
    """Launch ``_bias_grad_kernel``: one program per output tile of the (broadcast) bias gradient."""
    layout = spec.layout
    batch, heads_q, seqlen_q, _ = bhsd_shape(q, layout)
    heads_kv, seqlen_k = bhsd_shape(k, layout)[1:3]
    bias = bias_args[0]
    sums = bias_grad_sums(bias)
    q_tiles = 1 if sums["DBIAS_SUM_Q"] else cdiv(seqlen_q, cfg.block_m)
    k_tiles = 1 if sums["DBIAS_SUM_K"] else cdiv(seqlen_k, cfg.block_n)
    bias_batches, bias_heads = bias.shape[0], bias.shape[1]
    states = None if mask is None else tile_lists.tile_states(mask, spec, seqlen_q, seqlen_k, cfg.block_m,
                                                              cfg.block_n)
    state_args = broadcast_args(states, heads_q, heads_kv, lse2)
    _bias_grad_kernel[(bias_batches * bias_heads * q_tiles * k_tiles,)](
        q, k, v, dout, lse2, delta, user_mask[0], bias, dbias_args[0], alibi if alibi is not None else lse2,
        dropout_seed if dropout_seed is not None else lse2,
        *bhs_strides(q, layout), *bhs_strides(k, layout), *bhs_strides(v, layout), *bhs_strides(dout, layout),
        *user_mask[1:], state_args[0], *state_args[1:4], state_args[5], *bias_args[1:], *dbias_args[1:5],
        seqlen_q, seqlen_k, batch, heads_q, heads_q // heads_kv, spec.window_left, spec.window_right, lse2.shape[1],
        *score_constants(spec), chunk_arg(spec, seqlen_k), *dropout_args(spec), bias_batches, bias_heads, q_tiles,
        k_tiles,
        BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, **sums, **flags, num_warps=cfg.num_warps, num_stages=1)


def _dq_descriptor(dq_accum: torch.Tensor, padded_d: int, block_m: int):
    """A (B*Hq, Sq, D) TMA descriptor over the dQ accumulator: a reduce-add of a (1, BLOCK_M, BLOCK_D)
    tile drops the rows past seqlen_q and the columns past D, so no tile spills into the next head."""
    batch, heads, seqlen_q, _ = dq_accum.shape
    return Descriptor(dq_accum.view(batch * heads, seqlen_q, padded_d), (1, block_m, padded_dim(padded_d)))


def preprocess_launcher(out, dout, dlse, spec: AttentionSpec, head_dim: int, head_dim_v: int, batch: int, heads_q: int,
                        seqlen_q: int, total_q: int, block_m: int, padded_rows: int, padded_d: int, zero_dq: bool,
                        packing: Packing | None) -> Launcher:
    """``_preprocess_kernel``'s launch for one problem; each call passes out, dout, lse, dlse (or
    lse), lse2, delta, the dQ accumulator it zeroes (or lse) and cu_seqlens_q (or lse)."""
    layout = spec.layout
    return Launcher(
        _preprocess_kernel, (padded_rows // block_m, batch * heads_q),
        ((SLOT,) * 8 + (*bhs_strides(out, layout, packing), *bhs_strides(dout, layout, packing), seqlen_q, heads_q,
                        padded_rows, padded_d if zero_dq else 0, total_q if packing is not None else 0)),
        HEAD_DIM_V=head_dim_v, BLOCK_DV=padded_dims(head_dim, head_dim_v)[1], BLOCK_M=block_m,
        HAS_DLSE=dlse is not None, ZERO_DQ=zero_dq, BLOCK_DQ=padded_dim(padded_d) if zero_dq else 16,
        VARLEN=packing is not None)


def run_passes(q, k, v, dout, lse2, delta, dk, dv, dq_buffer, dbias, spec: AttentionSpec, configs: AttentionConfigs,
               plan, dkdv_cfg: KernelConfig, gluon_dkdv: bool, mask, bias, dbias_mode: int,
               packing: Packing | None, alibi: torch.Tensor | None = None, dropout_seed: torch.Tensor | None = None):
    """The Triton passes of a backward the planner sent here (``dispatch.plan_backward``): dK and dV
    (unless the Gluon pass computed them: ``gluon_dkdv``), dQ -- summed by atomics into the fp32
    ``dq_buffer`` by the dK/dV programs where ``plan.atomic_dq``, else by the dQ programs -- and the
    bias gradient into ``dbias`` as ``dbias_mode`` says. ``alibi`` (with ``spec.alibi``): the
    contiguous float32 (B, Hq) ALiBi slopes. ``dropout_seed`` (with ``spec.dropout_p``): the forward's
    (1,) int64 seed. Returns (dq, dbias) in their final dtypes."""
    assert spec.alibi == (alibi is not None), "spec.alibi and the slopes go together"
    assert spec.has_dropout == (dropout_seed is not None), "spec.dropout_p and the seed go together"
    layout = spec.layout
    _, heads_q, seqlen_q, head_dim = bhsd_shape(q, layout)
    heads_kv, seqlen_k, head_dim_v = bhsd_shape(v, layout)[1:]
    if packing is not None:
        seqlen_q, seqlen_k = packing.max_seqlen_q, packing.max_seqlen_k
    dq_cfg, atomic_dq, padded_d = configs.dq, plan.atomic_dq, plan.padded_d
    dq_tma = atomic_dq and configs.dq_tma and packing is None
    if atomic_dq:
        dq_target = _dq_descriptor(dq_buffer, padded_d, dkdv_cfg.block_m) if dq_tma else dq_buffer
    else:
        dq_buffer = gradient_like(q)
        dq_target = dq_buffer
    block_d, block_dv = padded_dims(head_dim, head_dim_v)
    # TMA descriptors for the tiles each pass walks: Q, dO (dK/dV pass, unless the Gluon pass ran it),
    # K, V (dQ pass, unless the dK/dV programs sum dQ by atomics).
    dkdv_descs = loop_descriptors(((q, block_d), (dout, block_dv)), layout, dkdv_cfg.block_m,
                                  dkdv_cfg.tma_loads and packing is None and not gluon_dkdv)
    dq_descs = loop_descriptors(((k, block_d), (v, block_dv)), layout, dq_cfg.block_n,
                                dq_cfg.tma_loads and packing is None and not atomic_dq)
    user_mask = mask_args(mask, heads_q, heads_kv, lse2)
    # With a mask, the tiles each program visits (tile_lists.py): per key block for dK/dV, per
    # query block for dQ, at each pass's own tile sizes.
    column_lists = column_list_args(None if gluon_dkdv else mask, spec, seqlen_q, seqlen_k, dkdv_cfg, heads_q,
                                    heads_kv, lse2)
    row_lists = row_list_args(None if atomic_dq else mask, spec, seqlen_q, seqlen_k, dq_cfg.block_m,
                              dq_cfg.block_n, heads_q, heads_kv, lse2)
    bias_args = broadcast_args(bias, heads_q, heads_kv, lse2)
    dbias_args = broadcast_args(dbias, heads_q, heads_kv, lse2)
    # The bias (and its gradient) through TMA where all three descriptors can be made; else pointers.
    writes_dbias = dbias_mode in (DBIAS_STORE, DBIAS_ATOMIC)
    bias_descs, bias_tma = all_or_placeholders(
        [score_tile_descriptor(bias, dkdv_cfg.block_m, dkdv_cfg.block_n),
         score_tile_descriptor(bias, dq_cfg.block_m, dq_cfg.block_n),
         score_tile_descriptor(dbias, dkdv_cfg.block_m, dkdv_cfg.block_n) if writes_dbias else lse2], lse2)
    # The mask's bytes through TMA likewise, at each pass's tiles (fwd.mask_descriptor).
    mask_descs, mask_tma = all_or_placeholders(
        [mask_descriptor(mask, dkdv_cfg.block_m, dkdv_cfg.block_n),
         mask_descriptor(mask, dq_cfg.block_m, dq_cfg.block_n)], lse2)
    tensors = (q, k, v, dout, lse2, delta, dk, dv, dq_buffer, user_mask[0], bias_args[0], dbias_args[0],
               column_lists[0], row_lists[0], *sequence_args(packing, lse2), alibi if alibi is not None else lse2,
               dropout_seed if dropout_seed is not None else lse2)

    def call_arguments(run_dkdv: bool, run_dq: bool) -> tuple:
        """The kernel's leading arguments, the call's tensors and descriptors (its others follow)."""
        dkdv_loads = run_dkdv and dkdv_descs is not None
        dq_loads = run_dq and dq_descs is not None
        return (*tensors, *(dkdv_descs if dkdv_loads else (q, dout)), *(dq_descs if dq_loads else (k, v)), dq_target,
                *bias_descs, *mask_descs)

    # The launches depend on the call's tensors only through these where no mask, bias or packing
    # takes part: kept with the plan (building them is most of a short step's host time otherwise).
    plain = mask is None and bias is None and packing is None
    if plain:
        passes_key = (q.stride(), k.stride(), v.stride(), gluon_dkdv, dkdv_descs is None, dq_descs is None)
    passes = plan.triton_passes.get(passes_key) if plain else None
    if passes is None:
        passes = _triton_passes(q, k, v, dout, dk, dv, dq_buffer, spec, configs, plan, dkdv_cfg, dq_tma, gluon_dkdv,
                                mask, bias, dbias_mode, packing, user_mask, column_lists, row_lists, bias_args,
                                dbias_args, bias_tma, mask_tma, dkdv_descs is not None, dq_descs is not None,
                                call_arguments)
        if plain:
            if len(plan.triton_passes) >= 8:
                plan.triton_passes.clear()
            plan.triton_passes[passes_key] = passes
    for launcher, run_dkdv, run_dq in passes:
        launcher(*call_arguments(run_dkdv, run_dq))
    if dbias_mode == DBIAS_PASS:
        _bias_grad_pass(q, k, v, dout, lse2, delta, mask, user_mask, bias_args, dbias_args, spec, dq_cfg,
                        _kernel_flags(q, v, spec, mask, bias), alibi, dropout_seed)
    elif dbias_mode == DBIAS_ATOMIC:
        dbias = dbias.to(bias.dtype)
    if atomic_dq:
        dq_buffer = dq_from_sums(dq_buffer, q, layout)
    return dq_buffer, dbias
