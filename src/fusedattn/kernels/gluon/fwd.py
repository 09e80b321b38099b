"""Hopper (sm_90) forwards in Triton's Gluon dialect: the softmax overlaps the tensor cores.

Two kernels: ``_attn_fwd_kernel`` (8 warps, no warp specialisation; the overlap happens inside
each warpgroup, below) and ``_attn_fwd_ws_kernel`` (warp-specialised: a TMA producer warp and 2
or 3 consumer warpgroups that may take turns; the overlap happens between warpgroups; described
above it). The launch config picks one (``KernelConfig.hopper_split``); both share the masking,
online-softmax and epilogue helpers.

Why a second forward: in plain Triton 3.6 the wgmma of Q K^T is always waited on right after it
is issued, so within a warpgroup the exponentials never run under a matmul, and there is no warp
specialisation on sm_90. Gluon exposes async warpgroup MMAs, their
waits, mbarriers and TMA, so FlashAttention-3's intra-warpgroup overlap can be written.

One program = BLOCK_M=128 query rows of one (batch, query head), num_warps=8 = two warpgroups
of 64 rows (wgmma layout warps_per_cta=[8, 1]). Q arrives once by TMA; K and V stream through a
NUM_STAGES ring of shared memory filled by TMA, one mbarrier per slot and tensor. No warp
specialisation: the program refills a slot once both warpgroups retired the wgmmas reading it.
Descriptors are 4-D over the (B, H, S, D) view of any layout (block (1, 1, rows, D)), so rows
past a head's length are zero-filled on load and clipped on store.

OVERLAP (constexpr) picks the schedule inside each warpgroup:
  0  plain: S_j = Q K_j^T, softmax, O += P_j V_j, each wgmma waited on at once.
  1  FA3's intra-warpgroup overlap: iteration j retires PV_{j-1}, rescales O, issues S_{j+1} and
     PV_j asynchronously, waits for S_{j+1} only and runs the softmax of S_{j+1} under PV_j.
  2  as 1, with S_{j+1} issued right after PV_{j-1} retires (the refill, the O rescale and the
     P conversion then also run under a wgmma).
The loop is rotated on purpose (the PV wait opens the body): in FA3's own order (the wait closing
the body) ptxas hoists the wait to just after the previous one and nothing overlaps (seen in
SASS). Issuing S_{j+1} before PV_{j-1} retired makes ptxas serialise every wgmma (C7515).

Masking follows the causal / window rule (docs/SEMANTICS.md, "`causal` and `window`: bottom-right
alignment") for the windows these kernels take: on the right none or causal, on the left any (LEFT:
a sliding window). A tile visits the key blocks
``block_range.key_blocks_for_query_block`` gives it -- the Triton kernels' own rule: the interior
ones do no mask math, those on the left window's edge, the causal diagonal and a ragged last block
apply it. Other right windows, head dims other than 64/128 and 32-bit inputs take the Triton
kernel (``gluon.problem_support``). Softcap (SOFTCAP) caps the scores before the mask and the row max
(``common.log2_scores``).

The warp-specialised kernel is also the backward's dQ pass (GRAD_Q, ``dq_pass``): the same tiles,
walk, masks, producer ring and turns, with dO loaded beside Q, a step of S = Q K^T and dP = dO V^T
issued together, dS = P (dP - delta) from the pre-pass's row statistics, and dQ += dS K in place
of the online softmax and P V.
"""

from __future__ import annotations

import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (
    fence_async_shared,
    mbarrier,
    tma,
    warpgroup_mma,
    warpgroup_mma_init,
    warpgroup_mma_wait,
)

from ...spec import AttentionSpec, to_bhsd
from ..shared.config import SHORT_KEYS, KernelConfig
from ..shared.block_range import key_blocks_for_query_block
from . import common as hopper
from ..shared.constants import score_constants
from .common import (LOG2E, WG_ROWS, Descriptor, bias_slice_args, chunk_grid, chunk_head_rows, descriptor,
                     dropout_zero, grid_tile, keep_scores, l2_section_rows, launch_order, log2_scores, packed_tile,
                     sm_count, snake_tile, store_sequence_rows, turn_pass, turn_wait, ws_registers)
from ..shared.launch import SLOT, Launcher, cdiv, per_problem
from ..shared import packed_tiles, rounds
from ..shared.knobs import knobs


# --------------------------------------------------------------------------- helpers


@gluon.jit
def _issue_kv(desc, ring, bars, kv_at, j, n_blocks, BLOCK_N: gl.constexpr, NUM_STAGES: gl.constexpr):
    """TMA the program's j-th key block of K (or V) into its ring slot, if the block exists.
    ``kv_at`` = (batch, KV head, first key of the program's range)."""
    batch, head_kv, key0 = kv_at
    slot = j % NUM_STAGES
    pred = j < n_blocks
    bar = bars.index(slot)
    mbarrier.expect(bar, desc.block_type.nbytes, pred=pred)
    tma.async_copy_global_to_shared(desc, [batch, head_kv, key0 + j * BLOCK_N, 0], bar, ring.index(slot), pred=pred)


@gluon.jit
def _kv_tile(ring, bars, j, BLOCK_N: gl.constexpr, HEAD_D: gl.constexpr, NUM_STAGES: gl.constexpr):
    """Wait for block j and return its [BLOCK_N, HEAD_D] shared-memory view."""
    slot = j % NUM_STAGES
    mbarrier.wait(bars.index(slot), (j // NUM_STAGES) & 1)
    return ring.index(slot).reshape([BLOCK_N, HEAD_D])


@gluon.jit
def _softmax_update(s, m_i, l_i, key_start, rows, seq_k, rule, qk_scale, softcap_log2, bias, BLOCK_N: gl.constexpr,
                    s_layout: gl.constexpr, CAUSAL: gl.constexpr, LEFT: gl.constexpr, MASK: gl.constexpr,
                    SOFTCAP: gl.constexpr, BIAS: gl.constexpr, INPUT_DTYPE: gl.constexpr, ALIBI: gl.constexpr = False,
                    alibi_slope=0.0, alibi_shift=0.0, BITS: gl.constexpr = False):
    """Online-softmax step on raw scores s (fp32, s_layout) of keys [key_start, + BLOCK_N). Returns p
    (fp32), m, l, alpha. INPUT_DTYPE: the kernel's inputs' (it picks the cap's tanh: ``log2_scores``).

    m is kept in log2 units of the scaled scores. MASK=False: the block is fully visible
    to every row, no mask math and m_new is finite. Without softcap the scale is applied to the
    row max and inside exp2's argument (one FMA); the cap is not linear, so with it the scores
    are brought to log2 units first. BIAS: ``bias`` (the tile's bias, fp32, s_layout) is added
    after scale and softcap, in log2 units; its -inf entries mask, so every tile then
    guards rows with no visible key, as masked ones do. ALIBI (causal only: the key-term form of
    kernels/triton/masking.alibi_mode): ``alibi_slope * (j - key_start)`` (log2 units; the vector over
    the tile's keys made here: a loop-invariant one spilled registers) is added to the scores and
    ``alibi_shift`` (slope * (key_start - c), the tile's constant) to the row maxima; the caller
    folds the row term into lse. BITS: the mask in ``keep_scores``' bit mask form (the
    warp-specialised kernel's steps)."""
    if SOFTCAP:
        s, _ = log2_scores(s, qk_scale, softcap_log2, True, False, INPUT_DTYPE)
        qk_scale = 1.0
    if BIAS:
        s = s * qk_scale + bias * LOG2E
        qk_scale = 1.0
    if ALIBI:
        keys = gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, s_layout)).to(gl.float32)
        s = s * qk_scale + gl.expand_dims(keys * alibi_slope, 0)
        qk_scale = 1.0
    if MASK:
        # keys past Sk dropped (RAGGED): the forward's tiles run to the next block boundary
        s = keep_scores(s, rows, key_start, seq_k, rule, CAUSAL, LEFT, True, False, BITS)
    if ALIBI:
        m_new = gl.maximum(m_i, gl.max(s, axis=1) + alibi_shift)
    else:
        m_new = gl.maximum(m_i, gl.max(s, axis=1) * qk_scale)
    if MASK or BIAS:
        # A row with no visible key so far keeps m = -inf; shift by 0 so exp2 gives 0, not NaN.
        m_use = gl.where(m_new == -float("inf"), 0.0, m_new)
    else:
        m_use = m_new
    if ALIBI:
        p = gl.exp2(s - gl.expand_dims(m_use - alibi_shift, 1))
    else:
        p = gl.exp2(s * qk_scale - gl.expand_dims(m_use, 1))
    alpha = gl.exp2(m_i - m_use)
    l_new = l_i * alpha + gl.sum(p, axis=1)
    return p, m_new, l_new, alpha


@gluon.jit
def _rescale(acc, alpha, o_layout: gl.constexpr):
    alpha = gl.convert_layout(alpha, gl.SliceLayout(1, o_layout))
    return acc * gl.expand_dims(alpha, 1)


@gluon.jit
def _with_sink(acc, m_i, l_i, sink, row_o: gl.constexpr):
    """The row state with one more logit, ``sink`` (natural log units; no value: it adds to the
    denominator only): the running maximum m_i and sum l_i are in log2 units, so the sink enters as
    sink * log2 e; acc is rescaled to the new maximum. A row that saw no key (m_i = -inf, l_i = 0)
    gets l = 1 at m = the sink: output 0, lse = the sink."""
    sink2 = sink * LOG2E
    m_new = gl.maximum(m_i, sink2)
    alpha = gl.exp2(m_i - m_new)
    l_new = l_i * alpha + gl.exp2(sink2 - m_new)
    acc = acc * gl.expand_dims(gl.convert_layout(alpha, row_o), 1)
    return acc, m_new, l_new


@gluon.jit
def _epilogue(acc, m_i, l_i, rows, Lse, lse_base, seq_q, q, q_buf, o_desc, batch, head, m0, row_o: gl.constexpr,
              packed_out, o_layout: gl.constexpr, VARLEN: gl.constexpr):
    """Normalise, lse (natural log; -inf and out 0 for a row with no visible key; row r at ``Lse +
    lse_base + r``), and O out through the (retired) Q buffer by TMA, which clips rows past the
    head's length. VARLEN (packed sequences): rows past the sequence's length belong to the next
    sequence, which TMA would not clip: O goes out by pointer stores masked to the sequence's rows
    (``packed_out`` = (O, its row and head strides, the sequence's first row))."""
    empty_row = l_i == 0.0
    l_safe = gl.where(empty_row, 1.0, l_i)
    lse = gl.where(empty_row, -float("inf"), (m_i + gl.log2(l_safe)) * 0.6931471805599453)
    inv_l = gl.convert_layout(1.0 / l_safe, row_o)
    out = (acc * gl.expand_dims(inv_l, 1)).to(q.dtype)
    gl.store(Lse + lse_base + rows, lse, mask=rows < seq_q)
    if VARLEN:
        out_ptr, stride_row, stride_head, q_start = packed_out
        store_sequence_rows(out_ptr + head.to(gl.int64) * stride_head, out, m0, q_start, seq_q, stride_row, o_layout)
    else:
        q.store(out)
        fence_async_shared()
        gl.thread_barrier()  # in a warp-specialised partition: a named barrier over its own warps
        tma.async_copy_shared_to_global(o_desc, [batch, head, m0, 0], q_buf)
        tma.store_wait(pendings=0)


@gluon.jit
def _dq_epilogue(acc, qk_scale, softcap_log2, q, q_buf, dq_desc, batch, head, m0, SOFTCAP: gl.constexpr):
    """The dQ pass's output: dQ = scale * sum dS K in q's dtype, out through the (retired) Q buffer
    by TMA, which clips rows past the head's length. The scale from ``constants.score_constants``: qk_scale
    / log2 e, or with SOFTCAP qk_scale * softcap (= qk_scale * softcap_log2 / log2 e)."""
    if SOFTCAP:
        scale = qk_scale * softcap_log2 * 0.6931471805599453
    else:
        scale = qk_scale * 0.6931471805599453
    q.store((acc * scale).to(q.dtype))
    fence_async_shared()
    gl.thread_barrier()
    tma.async_copy_shared_to_global(dq_desc, [batch, head, m0, 0], q_buf)
    tma.store_wait(pendings=0)


@gluon.jit
def _step_simple(q, k_ring, v_ring, k_bars, v_bars, acc, m_i, l_i, s_zero, j, n_blocks, kv_at, rows, seq_k,
                 rule, qk_scale, softcap_log2, k_desc, v_desc, BLOCK_N: gl.constexpr, HEAD_D: gl.constexpr,
                 NUM_STAGES: gl.constexpr, s_layout: gl.constexpr, o_layout: gl.constexpr, p_layout: gl.constexpr,
                 CAUSAL: gl.constexpr, LEFT: gl.constexpr, MASK: gl.constexpr, SOFTCAP: gl.constexpr):
    k = _kv_tile(k_ring, k_bars, j, BLOCK_N, HEAD_D, NUM_STAGES)
    s = warpgroup_mma(q, k.permute((1, 0)), s_zero, use_acc=False)
    p, m_i, l_i, alpha = _softmax_update(s, m_i, l_i, kv_at[2] + j * BLOCK_N, rows, seq_k, rule, qk_scale,
                                         softcap_log2, s, BLOCK_N, s_layout, CAUSAL, LEFT, MASK, SOFTCAP, False,
                                         k.dtype)
    acc = _rescale(acc, alpha, o_layout)
    p = gl.convert_layout(p.to(k.dtype), p_layout)
    v = _kv_tile(v_ring, v_bars, j, BLOCK_N, HEAD_D, NUM_STAGES)
    acc = warpgroup_mma(p, v, acc)
    # Both warpgroups are done with slot j of K and V: refill it with block j + NUM_STAGES.
    gl.thread_barrier()
    _issue_kv(k_desc, k_ring, k_bars, kv_at, j + NUM_STAGES, n_blocks, BLOCK_N, NUM_STAGES)
    _issue_kv(v_desc, v_ring, v_bars, kv_at, j + NUM_STAGES, n_blocks, BLOCK_N, NUM_STAGES)
    return acc, m_i, l_i


@gluon.jit
def _refill_overlap(k_desc, v_desc, k_ring, v_ring, k_bars, v_bars, kv_at, j, n_blocks, BLOCK_N: gl.constexpr,
                    NUM_STAGES: gl.constexpr):
    # Every warpgroup has retired S_j (K slot of j) and PV_{j-1} (V slot of j-1): refill them.
    gl.thread_barrier()
    _issue_kv(k_desc, k_ring, k_bars, kv_at, j + NUM_STAGES, n_blocks, BLOCK_N, NUM_STAGES)
    if j >= 1:
        _issue_kv(v_desc, v_ring, v_bars, kv_at, j - 1 + NUM_STAGES, n_blocks, BLOCK_N, NUM_STAGES)


@gluon.jit
def _step_overlap(q, k_ring, v_ring, k_bars, v_bars, acc, o_tok, p_busy, p, m_i, l_i, alpha, s_zero, j, n_blocks,
                  kv_at, rows, seq_k, rule, qk_scale, softcap_log2, k_desc, v_desc, BLOCK_N: gl.constexpr,
                  HEAD_D: gl.constexpr, NUM_STAGES: gl.constexpr, s_layout: gl.constexpr, o_layout: gl.constexpr,
                  p_layout: gl.constexpr, CAUSAL: gl.constexpr, LEFT: gl.constexpr, MASK: gl.constexpr,
                  SOFTCAP: gl.constexpr,
                  EARLY_S: gl.constexpr):
    """Iteration j of the FA3 schedule, rotated so that the wait for PV_{j-1} opens the loop body.

    On entry: PV_{j-1} in flight (o_tok, reading p_busy = P_{j-1}); p / m_i / l_i / alpha are the
    softmax of block j (fp32 p). Exit: PV_j in flight, softmax of block j+1 done. The rotation
    matters: ptxas hoists a wgmma.wait_group to just after the previous one inside a basic block,
    which serialised the exponentials after the PV wgmma when the wait closed the body (checked in
    SASS); at the top of the loop body it cannot move above the previous iteration's softmax."""
    acc, p_busy = warpgroup_mma_wait(num_outstanding=0, deps=[o_tok, p_busy])
    if EARLY_S:
        # S_{j+1} first: the CTA barrier + refill, the O rescale and the P conversion run under it.
        k = _kv_tile(k_ring, k_bars, j + 1, BLOCK_N, HEAD_D, NUM_STAGES)
        s_tok = warpgroup_mma(q, k.permute((1, 0)), s_zero, use_acc=False, is_async=True)
        _refill_overlap(k_desc, v_desc, k_ring, v_ring, k_bars, v_bars, kv_at, j, n_blocks, BLOCK_N, NUM_STAGES)
        acc = _rescale(acc, alpha, o_layout)
        p_op = gl.convert_layout(p.to(q.dtype), p_layout)
    else:
        acc = _rescale(acc, alpha, o_layout)
        p_op = gl.convert_layout(p.to(q.dtype), p_layout)
        _refill_overlap(k_desc, v_desc, k_ring, v_ring, k_bars, v_bars, kv_at, j, n_blocks, BLOCK_N, NUM_STAGES)
        k = _kv_tile(k_ring, k_bars, j + 1, BLOCK_N, HEAD_D, NUM_STAGES)
        s_tok = warpgroup_mma(q, k.permute((1, 0)), s_zero, use_acc=False, is_async=True)
    v = _kv_tile(v_ring, v_bars, j, BLOCK_N, HEAD_D, NUM_STAGES)
    o_tok = warpgroup_mma(p_op, v, acc, is_async=True)
    # wgmma groups retire in order: <= 1 outstanding means S_{j+1} is done, PV_j may still run.
    s = warpgroup_mma_wait(num_outstanding=1, deps=[s_tok])
    p, m_i, l_i, alpha = _softmax_update(s, m_i, l_i, kv_at[2] + (j + 1) * BLOCK_N, rows, seq_k, rule, qk_scale,
                                         softcap_log2, s, BLOCK_N, s_layout, CAUSAL, LEFT, MASK, SOFTCAP, False,
                                         k.dtype)
    return acc, o_tok, p_op, p, m_i, l_i, alpha


@gluon.jit
def _program_tile(query_blocks, chunk_heads, CAUSAL: gl.constexpr, GRID: gl.constexpr):
    """(batch * heads + head, query block) of this program of a launch of one program per tile: a 1-D
    one, or with GRID a ``common.chunk_grid`` (the launch order read off the program's indices)."""
    if GRID:
        pid_bh, block = grid_tile()
        return pid_bh, _heaviest_first(block, query_blocks, CAUSAL)
    return _tile_block(gl.program_id(0), gl.num_programs(0) // query_blocks, query_blocks, chunk_heads, CAUSAL)


@gluon.jit
def _tile_block(t, head_rows, query_blocks, chunk_heads, CAUSAL: gl.constexpr):
    """(batch * heads + head, query block) of tile ``t`` in launch order (``common.launch_order``)."""
    pid_bh, block = launch_order(t, head_rows, query_blocks, chunk_heads)
    return pid_bh, _heaviest_first(block, query_blocks, CAUSAL)


@gluon.jit
def _heaviest_first(block, query_blocks, CAUSAL: gl.constexpr):
    """The query block of launch-order block ``block``: under a causal bound the last query block,
    which sees the most keys, counts as block 0."""
    if CAUSAL:
        block = query_blocks - 1 - block
    return block


# --------------------------------------------------------------------------- kernel


# Lengths/heads are not specialised (no recompiles between ragged and aligned lengths, and the
# compile report's plain-i32 signature is the kernel that runs).
@gluon.jit(do_not_specialize=["seq_q", "seq_k", "num_heads", "group", "window_left", "query_blocks", "chunk_heads"])
def _attn_fwd_kernel(q_desc, k_desc, v_desc, o_desc, Lse, seq_q, seq_k, num_heads, group, window_left, qk_scale,
                     softcap_log2, query_blocks, chunk_heads, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr,
                     HEAD_D: gl.constexpr, CAUSAL: gl.constexpr, LEFT: gl.constexpr, SOFTCAP: gl.constexpr,
                     OVERLAP: gl.constexpr, NUM_STAGES: gl.constexpr, num_warps: gl.constexpr,
                     GRID: gl.constexpr = False):
    dtype: gl.constexpr = q_desc.dtype
    s_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[num_warps, 1],
                                                       instr_shape=[16, BLOCK_N, 16])
    o_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[num_warps, 1],
                                                       instr_shape=[16, HEAD_D, 16])
    p_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=o_layout, k_width=2)
    row_s: gl.constexpr = gl.SliceLayout(1, s_layout)
    row_o: gl.constexpr = gl.SliceLayout(1, o_layout)

    pid_bh, pid_m = _program_tile(query_blocks, chunk_heads, CAUSAL, GRID)
    batch = pid_bh // num_heads
    head = pid_bh % num_heads
    head_kv = head // group
    m0 = pid_m * BLOCK_M
    # The key blocks the tile visits, by the Triton kernels' own rule (block_range.py), counted
    # from the first: [0, n_lead) (left window edge) and [n_inner, n_blocks) (causal diagonal,
    # ragged last block) apply the mask, [n_lead, n_inner) are interior.
    first, inner_begin, inner_end, end = key_blocks_for_query_block(pid_m, seq_q, seq_k, window_left, 0, BLOCK_M,
                                                                    BLOCK_N, LEFT, CAUSAL)
    n_blocks = end - first
    n_lead = inner_begin - first
    n_inner = inner_end - first
    kv_at = (batch, head_kv, first * BLOCK_N)
    rule = (seq_k - seq_q, window_left)

    # Shared memory: Q (reused for O at the end), K and V rings, barriers.
    q_smem = gl.allocate_shared_memory(dtype, [1, 1, BLOCK_M, HEAD_D], q_desc.layout)
    k_ring = gl.allocate_shared_memory(dtype, [NUM_STAGES, 1, 1, BLOCK_N, HEAD_D], k_desc.layout)
    v_ring = gl.allocate_shared_memory(dtype, [NUM_STAGES, 1, 1, BLOCK_N, HEAD_D], v_desc.layout)
    q_bar = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    k_bars = gl.allocate_shared_memory(gl.int64, [NUM_STAGES, 1], mbarrier.MBarrierLayout())
    v_bars = gl.allocate_shared_memory(gl.int64, [NUM_STAGES, 1], mbarrier.MBarrierLayout())
    mbarrier.init(q_bar, count=1)
    for i in gl.static_range(NUM_STAGES):
        mbarrier.init(k_bars.index(i), count=1)
        mbarrier.init(v_bars.index(i), count=1)
    fence_async_shared()

    mbarrier.expect(q_bar, q_desc.block_type.nbytes)
    tma.async_copy_global_to_shared(q_desc, [batch, head, m0, 0], q_bar, q_smem)
    for i in gl.static_range(NUM_STAGES):
        _issue_kv(k_desc, k_ring, k_bars, kv_at, i, n_blocks, BLOCK_N, NUM_STAGES)
        _issue_kv(v_desc, v_ring, v_bars, kv_at, i, n_blocks, BLOCK_N, NUM_STAGES)

    rows = m0 + gl.arange(0, BLOCK_M, layout=row_s)
    m_i = gl.full([BLOCK_M], -float("inf"), gl.float32, layout=row_s)
    l_i = gl.zeros([BLOCK_M], gl.float32, layout=row_s)
    acc = gl.zeros([BLOCK_M, HEAD_D], gl.float32, layout=o_layout)
    s_zero = gl.zeros([BLOCK_M, BLOCK_N], gl.float32, layout=s_layout)

    mbarrier.wait(q_bar, 0)
    q = q_smem.reshape([BLOCK_M, HEAD_D])

    if OVERLAP > 0:
        if n_blocks > 0:
            # Prologue: S_0 and its softmax (masked path).
            k = _kv_tile(k_ring, k_bars, 0, BLOCK_N, HEAD_D, NUM_STAGES)
            s = warpgroup_mma(q, k.permute((1, 0)), s_zero, use_acc=False)
            p, m_i, l_i, alpha = _softmax_update(s, m_i, l_i, kv_at[2], rows, seq_k, rule, qk_scale, softcap_log2, s,
                                                 BLOCK_N, s_layout, CAUSAL, LEFT, True, SOFTCAP, False,
                                                 k.dtype)
            # Iteration j computes the softmax of block j+1: unmasked for blocks in [n_lead, n_inner).
            # Nothing in flight yet: a retired "PV_{-1}" token on the zero accumulator.
            o_tok = warpgroup_mma_init(acc)
            p_busy = gl.zeros([BLOCK_M, BLOCK_N], dtype, layout=p_layout)
            if LEFT:
                for j in range(0, n_lead - 1):
                    acc, o_tok, p_busy, p, m_i, l_i, alpha = _step_overlap(
                        q, k_ring, v_ring, k_bars, v_bars, acc, o_tok, p_busy, p, m_i, l_i, alpha, s_zero, j, n_blocks,
                        kv_at, rows, seq_k, rule, qk_scale, softcap_log2, k_desc, v_desc, BLOCK_N, HEAD_D,
                        NUM_STAGES, s_layout, o_layout, p_layout, CAUSAL, LEFT, True, SOFTCAP, OVERLAP == 2)
            for j in range(gl.maximum(n_lead - 1, 0), n_inner - 1):
                acc, o_tok, p_busy, p, m_i, l_i, alpha = _step_overlap(
                    q, k_ring, v_ring, k_bars, v_bars, acc, o_tok, p_busy, p, m_i, l_i, alpha, s_zero, j, n_blocks,
                    kv_at, rows, seq_k, rule, qk_scale, softcap_log2, k_desc, v_desc, BLOCK_N, HEAD_D,
                    NUM_STAGES, s_layout, o_layout, p_layout, CAUSAL, LEFT, False, SOFTCAP, OVERLAP == 2)
            for j in range(gl.maximum(n_inner - 1, 0), n_blocks - 1):
                acc, o_tok, p_busy, p, m_i, l_i, alpha = _step_overlap(
                    q, k_ring, v_ring, k_bars, v_bars, acc, o_tok, p_busy, p, m_i, l_i, alpha, s_zero, j, n_blocks,
                    kv_at, rows, seq_k, rule, qk_scale, softcap_log2, k_desc, v_desc, BLOCK_N, HEAD_D,
                    NUM_STAGES, s_layout, o_layout, p_layout, CAUSAL, LEFT, True, SOFTCAP, OVERLAP == 2)
            acc, p_busy = warpgroup_mma_wait(num_outstanding=0, deps=[o_tok, p_busy])  # PV_{n-2}
            # Epilogue: O += P_{n-1} V_{n-1}.
            acc = _rescale(acc, alpha, o_layout)
            p_op = gl.convert_layout(p.to(dtype), p_layout)
            v = _kv_tile(v_ring, v_bars, n_blocks - 1, BLOCK_N, HEAD_D, NUM_STAGES)
            acc = warpgroup_mma(p_op, v, acc)
    else:
        if LEFT:
            for j in range(0, n_lead):
                acc, m_i, l_i = _step_simple(q, k_ring, v_ring, k_bars, v_bars, acc, m_i, l_i, s_zero, j, n_blocks,
                                             kv_at, rows, seq_k, rule, qk_scale, softcap_log2, k_desc, v_desc, BLOCK_N,
                                             HEAD_D, NUM_STAGES, s_layout, o_layout, p_layout, CAUSAL, LEFT, True,
                                             SOFTCAP)
        for j in range(n_lead, n_inner):
            acc, m_i, l_i = _step_simple(q, k_ring, v_ring, k_bars, v_bars, acc, m_i, l_i, s_zero, j, n_blocks, kv_at,
                                         rows, seq_k, rule, qk_scale, softcap_log2, k_desc, v_desc, BLOCK_N, HEAD_D,
                                         NUM_STAGES, s_layout, o_layout, p_layout, CAUSAL, LEFT, False, SOFTCAP)
        for j in range(n_inner, n_blocks):
            acc, m_i, l_i = _step_simple(q, k_ring, v_ring, k_bars, v_bars, acc, m_i, l_i, s_zero, j, n_blocks, kv_at,
                                         rows, seq_k, rule, qk_scale, softcap_log2, k_desc, v_desc, BLOCK_N, HEAD_D,
                                         NUM_STAGES, s_layout, o_layout, p_layout, CAUSAL, LEFT, True, SOFTCAP)

    _epilogue(acc, m_i, l_i, rows, Lse, pid_bh.to(gl.int64) * seq_q, seq_q, q, q_smem, o_desc, batch, head, m0, row_o,
              None, o_layout, False)

    mbarrier.invalidate(q_bar)
    for i in gl.static_range(NUM_STAGES):
        mbarrier.invalidate(k_bars.index(i))
        mbarrier.invalidate(v_bars.index(i))


# --------------------------------------------------------------------------- warp-specialised kernel
#
# ``gl.warp_specialize`` splits a program into a 1-warp producer and SPLIT (2 or 3) consumer
# warpgroups of 64 query rows, each its own partition (FA3's layout; tiles of 128 or 192 rows).
# The producer (24 registers after setmaxnreg) issues every TMA load of Q, K and V into the ring,
# waiting on "empty" mbarriers; a consumer waits only on "ready" ones and releases a slot (one
# elected arrive) once the wgmma reading it retired. No CTA-wide barrier remains in any loop (the
# membar pass's barriers are named barriers over one warpgroup), so the consumer warpgroups run
# independently; PINGPONG makes them take turns issuing their GEMMs (round robin through "turn"
# mbarriers), so one warpgroup's softmax runs under another's matmuls. Consumers use the plain
# schedule: with an async wgmma pipeline inside a worker partition, ptxas (Triton 3.6) serialises
# every wgmma (C7512, the setmaxnreg of the worker dispatch defeats its register accounting).


@gluon.jit
def _tile_key(tiles, j, BLOCK_N: gl.constexpr, LISTS: gl.constexpr):
    """First key of the program's j-th key block. ``tiles`` = (first block, blocks, full blocks, list
    entries): a range of blocks from ``first``, or with LISTS the host's list (tile_lists.py)."""
    if LISTS:
        key = gl.load(tiles[3] + j) * BLOCK_N
    else:
        key = (tiles[0] + j) * BLOCK_N
    return key


@gluon.jit
def _ws_tile(t, sched, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, CAUSAL: gl.constexpr, LEFT: gl.constexpr,
             LISTS: gl.constexpr, VARLEN: gl.constexpr):
    """Where tile ``t`` (``_tile_block``) lies: (batch * heads + head, batch, head, KV head, first
    query row, its key blocks, its sequence). Key blocks = (first block, blocks, full blocks, list
    entries): with LISTS from the host's tile list (tile_lists.py: [full count, partial count,
    full..., partial...]), else the block range of block_range.py; each consumer masks those not
    interior to its rows. Sequence = (Sq, Sk, first query row, first key row, lse offset of its row
    0): the launch's one length and 0 offsets, or with VARLEN (packed sequences) the tile's own from
    the host's map (packed_tiles.py: ``query_blocks`` entries, heaviest first, in ``launch_order``
    over the heads).
    ``sched`` = the launch's runtime scalars (``attention_forward``)."""
    (head_rows, query_blocks, chunk_heads, num_heads, group, seq_q, seq_k, window_left, tile_lists, list_stride_b,
     list_stride_h, list_stride_r, list_head_div, lse_head_stride, _, _, _) = sched
    if VARLEN:  # ``tile_lists`` is the packed map
        head, _, pid_m, q_start, seq_q, k_start, seq_k = packed_tile(t, num_heads, query_blocks, chunk_heads,
                                                                     tile_lists)
        pid_bh = head
        batch = head * 0
        lse_base = head.to(gl.int64) * lse_head_stride + q_start
    else:
        pid_bh, pid_m = _tile_block(t, head_rows, query_blocks, chunk_heads, CAUSAL)
        batch = pid_bh // num_heads
        head = pid_bh % num_heads
        q_start = 0
        k_start = 0
        lse_base = pid_bh.to(gl.int64) * seq_q
    if LISTS:
        entries = (tile_lists + batch.to(gl.int64) * list_stride_b + (head // list_head_div).to(gl.int64) * list_stride_h
                   + pid_m.to(gl.int64) * list_stride_r)
        n_full = gl.load(entries)
        tiles = (n_full * 0, n_full + gl.load(entries + 1), n_full, entries + 2)
    else:
        first, _, _, end = key_blocks_for_query_block(pid_m, seq_q, seq_k, window_left, 0, BLOCK_M, BLOCK_N, LEFT,
                                                      CAUSAL)
        tiles = (first, end - first, end * 0, tile_lists)
    return pid_bh, batch, head, head // group, pid_m * BLOCK_M, tiles, (seq_q, seq_k, q_start, k_start, lse_base)


@gluon.jit
def _ws_producer(q_desc, k_desc, v_desc, bias_desc, q_smem, k_ring, v_ring, q_bars, q_empty, k_ready, v_ready, k_empty,
                 v_empty, bias_state, bias_slices, grad_in, sched, own_tile, ROWS: gl.constexpr, NQ: gl.constexpr,
                 BLOCK_N: gl.constexpr, NUM_STAGES: gl.constexpr, PERSISTENT: gl.constexpr, CAUSAL: gl.constexpr,
                 LEFT: gl.constexpr, LISTS: gl.constexpr, BIAS: gl.constexpr, VARLEN: gl.constexpr,
                 GRAD_Q: gl.constexpr):
    """The program's tile (``own_tile``, ``_ws_tile`` of its id), or with PERSISTENT each of its tiles
    in turn (``common.snake_tile``)."""
    if PERSISTENT:
        # Rounds in pairs, Q of even rounds in buffer 0 and of odd ones in buffer 1 -- static indices:
        # a buffer index computed from the round made the Q K^T wgmma read out of bounds.
        total_tiles = sched[0] * sched[1]
        loaded = 0  # key blocks loaded so far, over every tile
        for r in range(0, gl.cdiv(total_tiles, gl.num_programs(0)), 2):
            for qbuf in gl.static_range(2):
                t = snake_tile(r + qbuf, total_tiles)
                if t < total_tiles:
                    tile = _ws_tile(t, sched, NQ * ROWS, BLOCK_N, CAUSAL, LEFT, LISTS, VARLEN)
                    loaded = _ws_produce_tile(q_desc, k_desc, v_desc, bias_desc, q_smem, k_ring, v_ring, q_bars,
                                              q_empty, k_ready, v_ready, k_empty, v_empty, bias_state, bias_slices,
                                              grad_in, tile, r + qbuf, loaded, ROWS, NQ, BLOCK_N, NUM_STAGES,
                                              PERSISTENT, CAUSAL, LEFT, LISTS, BIAS, qbuf, GRAD_Q)
    else:
        _ws_produce_tile(q_desc, k_desc, v_desc, bias_desc, q_smem, k_ring, v_ring, q_bars, q_empty, k_ready, v_ready,
                         k_empty, v_empty, bias_state, bias_slices, grad_in, own_tile, 0, 0, ROWS, NQ, BLOCK_N,
                         NUM_STAGES, PERSISTENT, CAUSAL, LEFT, LISTS, BIAS, 0, GRAD_Q)


@gluon.jit
def _ws_produce_tile(q_desc, k_desc, v_desc, bias_desc, q_smem, k_ring, v_ring, q_bars, q_empty, k_ready, v_ready,
                     k_empty, v_empty, bias_state, bias_slices, grad_in, tile, r, loaded, ROWS: gl.constexpr,
                     NQ: gl.constexpr, BLOCK_N: gl.constexpr, NUM_STAGES: gl.constexpr, PERSISTENT: gl.constexpr,
                     CAUSAL: gl.constexpr, LEFT: gl.constexpr, LISTS: gl.constexpr, BIAS: gl.constexpr,
                     QBUF: gl.constexpr, GRAD_Q: gl.constexpr):
    """``tile`` (``_ws_tile``), the program's ``r``-th: Q into Q buffer QBUF (with PERSISTENT, round r's
    parity; buffer 0 where there is one) once the consumers handed it back (they stage in it the
    output of the tile that used it before), then per key block K, each consumer's bias tile (BIAS:
    ``bias_state`` = its ring and barriers; ``bias_slices`` = (bias_batches, bias_head_div)) and V,
    in the order the consumers use them. The ring's slots and phases count key blocks over all of
    the program's tiles (``loaded`` before this one; returned after it), so the next tile's first
    blocks load while the consumers finish this one. GRAD_Q (the dQ pass): dO too, ``grad_in`` =
    (its descriptor, its buffers)."""
    _, batch, head, head_kv, m0, tiles, seq = tile
    q_row0 = seq[2] + m0  # rows and keys of packed sequences (VARLEN) are offset by their sequence's first
    k_start = seq[3]
    Q_BUFFERS: gl.constexpr = q_smem.shape[0] // NQ
    for w in gl.static_range(NQ):
        b = (QBUF % Q_BUFFERS) * NQ + w
        if PERSISTENT:  # the buffer's (r // Q_BUFFERS)-th use; a fresh mbarrier counts as phase 1 complete
            mbarrier.wait(q_empty.index(b), ((r // Q_BUFFERS) & 1) ^ 1)
        if GRAD_Q:  # the dQ pass: dO's rows beside Q's, on the same barrier
            do_desc, do_smem = grad_in
            mbarrier.expect(q_bars.index(b), q_desc.block_type.nbytes + do_desc.block_type.nbytes)
            tma.async_copy_global_to_shared(do_desc, [batch, head, q_row0 + w * ROWS, 0], q_bars.index(b),
                                            do_smem.index(b))
        else:
            mbarrier.expect(q_bars.index(b), q_desc.block_type.nbytes)
        tma.async_copy_global_to_shared(q_desc, [batch, head, q_row0 + w * ROWS, 0], q_bars.index(b),
                                        q_smem.index(b))
    bias_at = (batch * bias_slices[0], head // bias_slices[1])
    for j in range(tiles[1]):
        n = loaded + j
        slot = n % NUM_STAGES
        phase = ((n // NUM_STAGES) & 1) ^ 1
        key = _tile_key(tiles, j, BLOCK_N, LISTS)
        mbarrier.wait(k_empty.index(slot), phase)
        mbarrier.expect(k_ready.index(slot), k_desc.block_type.nbytes)
        tma.async_copy_global_to_shared(k_desc, [batch, head_kv, k_start + key, 0], k_ready.index(slot),
                                        k_ring.index(slot))
        if BIAS:
            bias_ring, b_ready, b_empty = bias_state
            for w in gl.static_range(NQ):
                b = slot * NQ + w
                mbarrier.wait(b_empty.index(b), phase)
                mbarrier.expect(b_ready.index(b), bias_desc.block_type.nbytes)
                tma.async_copy_global_to_shared(bias_desc, [bias_at[0], bias_at[1], m0 + w * ROWS, key],
                                                b_ready.index(b), bias_ring.index(b))
        mbarrier.wait(v_empty.index(slot), phase)
        mbarrier.expect(v_ready.index(slot), v_desc.block_type.nbytes)
        tma.async_copy_global_to_shared(v_desc, [batch, head_kv, k_start + key, 0], v_ready.index(slot),
                                        v_ring.index(slot))
    return loaded + tiles[1]


@gluon.jit
def _bias_tile(bias_state, j, WG: gl.constexpr, NUM_STAGES: gl.constexpr, s_layout: gl.constexpr):
    """BIAS: this warpgroup's bias tile of key block j (rows x keys) from its ring slot, as fp32,
    then the slot is handed back (the load into registers has completed)."""
    bias_ring, b_ready, b_empty = bias_state
    NQ: gl.constexpr = bias_ring.shape[0] // NUM_STAGES
    slot = (j % NUM_STAGES) * NQ + WG
    mbarrier.wait(b_ready.index(slot), (j // NUM_STAGES) & 1)
    tile = bias_ring.index(slot).reshape([bias_ring.shape[3], bias_ring.shape[4]]).load(s_layout)
    mbarrier.arrive(b_empty.index(slot), count=1)
    return tile.to(gl.float32)


@gluon.jit
def _ws_dq_step(q, do, k_ring, v_ring, k_ready, v_ready, k_empty, v_empty, turn_bars, acc, lse2, delta, s_zero, j,
                turn, key_start, rows, seq_k, rule, qk_scale, softcap_log2, BLOCK_N: gl.constexpr, HEAD_D: gl.constexpr,
                NUM_STAGES: gl.constexpr, s_layout: gl.constexpr, p_layout: gl.constexpr, CAUSAL: gl.constexpr,
                LEFT: gl.constexpr, MASK: gl.constexpr, SOFTCAP: gl.constexpr, WG: gl.constexpr,
                PINGPONG: gl.constexpr, DROPOUT: gl.constexpr = False, drop=(0, 0, 0, 0, 0, 1.0)):
    """The dQ pass's step (GRAD_Q): S = Q K^T and dP = dO V^T issued together (the turn covers both),
    P = exp2(S * qk_scale - lse2) from the pre-pass's row statistics (lse2 = +inf on a row with no
    visible key: P = 0), dS = P (dP - delta), dQ += dS K with dS a register operand -- the Triton dQ
    pass's arithmetic (``kernels.triton.bwd._dq_tiles``). SOFTCAP: the scores capped first (log2
    units), and dS takes the cap's derivative 1 - tanh^2, as in the dK/dV pass. V's slot goes back
    once dP is done, K's after dS K. DROPOUT (``_ws_step``'s ``drop``): dP of a dropped probability
    is 0, a kept one's scaled, before delta is taken off."""
    slot = j % NUM_STAGES
    k = _kv_tile(k_ring, k_ready, j, BLOCK_N, HEAD_D, NUM_STAGES)
    v = _kv_tile(v_ring, v_ready, j, BLOCK_N, HEAD_D, NUM_STAGES)
    turn_wait(turn_bars, turn, WG, PINGPONG)
    s_tok = warpgroup_mma(q, k.permute((1, 0)), s_zero, use_acc=False, is_async=True)
    dp_tok = warpgroup_mma(do, v.permute((1, 0)), s_zero, use_acc=False, is_async=True)
    turn_pass(turn_bars, WG, PINGPONG)
    s = warpgroup_mma_wait(num_outstanding=1, deps=[s_tok])
    if SOFTCAP:  # log2 units now (the cap is not linear)
        s, tanh_s = log2_scores(s, qk_scale, softcap_log2, True, False, q.dtype)
        qk_scale = 1.0
    if MASK:
        s = keep_scores(s, rows, key_start, seq_k, rule, CAUSAL, LEFT, True, False)
    p = gl.exp2(s * qk_scale - gl.expand_dims(lse2, 1))
    dp = warpgroup_mma_wait(num_outstanding=0, deps=[dp_tok])
    mbarrier.arrive(v_empty.index(slot), count=1)
    if DROPOUT:
        seed, batch_head, first_row, first_key, threshold, dropout_scale = drop
        dp = dropout_zero(dp, seed, batch_head, first_row, first_key, threshold, s_layout) * dropout_scale
    ds = p * (dp - gl.expand_dims(delta, 1))
    if SOFTCAP:
        ds = ds * (1.0 - tanh_s * tanh_s)
    ds = gl.convert_layout(ds.to(k.dtype), p_layout)
    acc = warpgroup_mma(ds, k, acc)
    mbarrier.arrive(k_empty.index(slot), count=1)
    return acc


@gluon.jit
def _ws_step(q, k_ring, v_ring, k_ready, v_ready, k_empty, v_empty, turn_bars, bias_state, acc, m_i, l_i, s_zero, j,
             turn, key_start, rows, seq_k, rule, qk_scale, softcap_log2, BLOCK_N: gl.constexpr, HEAD_D: gl.constexpr,
             NUM_STAGES: gl.constexpr, s_layout: gl.constexpr, o_layout: gl.constexpr, p_layout: gl.constexpr,
             CAUSAL: gl.constexpr, LEFT: gl.constexpr, MASK: gl.constexpr, SOFTCAP: gl.constexpr, WG: gl.constexpr,
             PINGPONG: gl.constexpr, BIAS: gl.constexpr, do, GRAD_Q: gl.constexpr, ALIBI: gl.constexpr = False,
             alibi_slope=0.0, alibi_shift=0.0, DROPOUT: gl.constexpr = False, drop=(0, 0, 0, 0, 0, 1.0),
             BITS: gl.constexpr = False):
    """Key block j of a tile (the ring's count) on one warpgroup, its ``turn``-th S issue in the
    turns' round robin: the forward's online-softmax step, or with GRAD_Q the
    dQ pass's (``_ws_dq_step``; its row state (m_i, l_i) is then (lse2, delta), read only). DROPOUT:
    ``drop`` = (seed, batch * Hq + head, first query row, first key, threshold, scale): the dropped
    probabilities leave the sum over values but not l (the caller scales the output once). BITS: the
    forward's mask as bit words (``keep_scores``)."""
    if GRAD_Q:
        acc = _ws_dq_step(q, do, k_ring, v_ring, k_ready, v_ready, k_empty, v_empty, turn_bars, acc, m_i, l_i,
                          s_zero, j, turn, key_start, rows, seq_k, rule, qk_scale, softcap_log2, BLOCK_N, HEAD_D,
                          NUM_STAGES, s_layout, p_layout, CAUSAL, LEFT, MASK, SOFTCAP, WG, PINGPONG, DROPOUT, drop)
        return acc, m_i, l_i
    k = _kv_tile(k_ring, k_ready, j, BLOCK_N, HEAD_D, NUM_STAGES)
    turn_wait(turn_bars, turn, WG, PINGPONG)
    s_tok = warpgroup_mma(q, k.permute((1, 0)), s_zero, use_acc=False, is_async=True)
    turn_pass(turn_bars, WG, PINGPONG)
    if BIAS:  # read under the score matmul
        bias = _bias_tile(bias_state, j, WG, NUM_STAGES, s_layout)
    else:
        bias = s_zero  # never read
    s = warpgroup_mma_wait(num_outstanding=0, deps=[s_tok])
    mbarrier.arrive(k_empty.index(j % NUM_STAGES), count=1)
    p, m_i, l_i, alpha = _softmax_update(s, m_i, l_i, key_start, rows, seq_k, rule, qk_scale, softcap_log2, bias,
                                         BLOCK_N, s_layout, CAUSAL, LEFT, MASK, SOFTCAP, BIAS, k.dtype, ALIBI,
                                         alibi_slope, alibi_shift, BITS)
    acc = _rescale(acc, alpha, o_layout)
    if DROPOUT:
        seed, batch_head, first_row, first_key, threshold, _ = drop
        p = dropout_zero(p, seed, batch_head, first_row, first_key, threshold, s_layout)
    p = gl.convert_layout(p.to(k.dtype), p_layout)
    v = _kv_tile(v_ring, v_ready, j, BLOCK_N, HEAD_D, NUM_STAGES)
    acc = warpgroup_mma(p, v, acc)
    mbarrier.arrive(v_empty.index(j % NUM_STAGES), count=1)
    return acc, m_i, l_i


@gluon.jit
def _ws_pass_step(k_ready, v_ready, k_empty, v_empty, turn_bars, bias_state, j, turn, NUM_STAGES: gl.constexpr,
                  WG: gl.constexpr, PINGPONG: gl.constexpr, BIAS: gl.constexpr, TURN: gl.constexpr = True):
    """Key block j of the tile, which none of this warpgroup's rows sees (``_ws_consume_tile``): no
    matmul, only the ring's protocol -- its slots handed back once loaded (an early release would
    count towards the slot's previous use, which the other warpgroups may still be reading) -- and,
    with TURN, the turns': its ``turn``-th taken and passed on."""
    slot = j % NUM_STAGES
    phase = (j // NUM_STAGES) & 1
    mbarrier.wait(k_ready.index(slot), phase)
    if TURN:
        turn_wait(turn_bars, turn, WG, PINGPONG)
        turn_pass(turn_bars, WG, PINGPONG)
    mbarrier.arrive(k_empty.index(slot), count=1)
    if BIAS:
        bias_ring, b_ready, b_empty = bias_state
        NQ: gl.constexpr = bias_ring.shape[0] // NUM_STAGES
        mbarrier.wait(b_ready.index(slot * NQ + WG), phase)
        mbarrier.arrive(b_empty.index(slot * NQ + WG), count=1)
    mbarrier.wait(v_ready.index(slot), phase)
    mbarrier.arrive(v_empty.index(slot), count=1)


@gluon.jit
def _ws_consumer(o_desc, q_smem, k_ring, v_ring, q_bars, q_empty, k_ready, v_ready, k_empty, v_empty, turn_bars,
                 bias_state, grad_in, Lse, sched, own_tile, qk_scale, softcap_log2, WG: gl.constexpr,
                 ROWS: gl.constexpr, NQ: gl.constexpr, BLOCK_N: gl.constexpr, HEAD_D: gl.constexpr,
                 NUM_STAGES: gl.constexpr, PERSISTENT: gl.constexpr, CAUSAL: gl.constexpr, LEFT: gl.constexpr,
                 SOFTCAP: gl.constexpr, PINGPONG: gl.constexpr, LISTS: gl.constexpr, BIAS: gl.constexpr,
                 VARLEN: gl.constexpr, GRAD_Q: gl.constexpr, ALIBI: gl.constexpr, DROPOUT: gl.constexpr,
                 SINKS: gl.constexpr, PAST_END: gl.constexpr = False):
    """The program's tile, or with PERSISTENT each of its tiles in turn (``common.snake_tile``)."""
    if PERSISTENT:  # rounds in pairs, as the producer: Q buffer 0 for even rounds, 1 for odd ones
        total_tiles = sched[0] * sched[1]
        done = 0  # key blocks consumed so far, over every tile: the ring's slot and phase counter
        for r in range(0, gl.cdiv(total_tiles, gl.num_programs(0)), 2):
            for qbuf in gl.static_range(2):
                t = snake_tile(r + qbuf, total_tiles)
                if t < total_tiles:
                    tile = _ws_tile(t, sched, NQ * ROWS, BLOCK_N, CAUSAL, LEFT, LISTS, VARLEN)
                    done = _ws_consume_tile(o_desc, q_smem, k_ring, v_ring, q_bars, q_empty, k_ready, v_ready,
                                            k_empty, v_empty, turn_bars, bias_state, grad_in, Lse, sched, qk_scale,
                                            softcap_log2, tile, r + qbuf, done, WG, ROWS, NQ, BLOCK_N, HEAD_D,
                                            NUM_STAGES, PERSISTENT, CAUSAL, LEFT, SOFTCAP, PINGPONG, LISTS, BIAS,
                                            VARLEN, qbuf, GRAD_Q, ALIBI, DROPOUT, SINKS, PAST_END)
    else:
        _ws_consume_tile(o_desc, q_smem, k_ring, v_ring, q_bars, q_empty, k_ready, v_ready, k_empty, v_empty, turn_bars,
                         bias_state, grad_in, Lse, sched, qk_scale, softcap_log2, own_tile, 0, 0, WG, ROWS, NQ,
                         BLOCK_N, HEAD_D, NUM_STAGES, PERSISTENT, CAUSAL, LEFT, SOFTCAP, PINGPONG, LISTS, BIAS,
                         VARLEN, 0, GRAD_Q, ALIBI, DROPOUT, SINKS, PAST_END)


@gluon.jit
def _ws_own_blocks(mw, first, n_blocks, seq_q, seq_k, window_left, ROWS: gl.constexpr, BLOCK_N: gl.constexpr,
                   CAUSAL: gl.constexpr, LEFT: gl.constexpr, PERSISTENT: gl.constexpr, PAST_END: gl.constexpr):
    """(n_unseen, n_lead, n_inner, n_seen) of the warpgroup whose rows start at ``mw``: its own key
    blocks (block_range.py), counted from the tile's ``first`` of ``n_blocks``. The tile's range is
    the union of its warpgroups', so under a window's left edge the later rows' first blocks and
    under a causal bound the earlier rows' last ones hold nothing for this warpgroup ([0, n_unseen)
    and [n_seen, n_blocks)): passed over, not run masked; [n_unseen, n_lead) and [n_inner, n_seen)
    run masked, [n_lead, n_inner) without. A persistent launch (the heuristic's: two warpgroups,
    128-row tiles, where such a block is rare) runs them masked: its consumer code is copied for its
    two Q buffers, and the pass-over's loops measurably slowed its S=1k causal forward.

    The turns (``turn_wait``: S issues in round robin) count a warpgroup's own blocks where a left
    window offsets them (``_ws_consume_tile``'s SKEW): a 192-row tile under a 1024-key window spans
    10 key blocks, each warpgroup's rows 9, the last warpgroup's one block later than the first's.
    Counted by the tile's blocks, the first block's round has the last warpgroup only pass and the
    last block's the first one: where a step's latency (S, softmax, P V) is longer than the other
    two warpgroups' matmuls, the round lasts it anyway and the passed slot is lost. Counted by its
    own, each of 9 rounds holds a step of every warpgroup and a tenth only passes the turns on.
    ``benchmarks/turns_model.py`` models the protocol (and its deadlocks) tile by tile."""
    own_first, inner_begin, inner_end, own_end = key_blocks_for_query_block(mw // ROWS, seq_q, seq_k, window_left,
                                                                            0, ROWS, BLOCK_N, LEFT, CAUSAL)
    if PERSISTENT:
        own_first = first
        own_end = first + n_blocks
    n_unseen = gl.minimum(gl.maximum(own_first - first, 0), n_blocks)
    n_lead = gl.minimum(gl.maximum(inner_begin - first, n_unseen), n_blocks)
    n_inner = gl.minimum(gl.maximum(inner_end - first, n_lead), n_blocks)
    n_seen = gl.minimum(gl.maximum(own_end - first, n_inner), n_blocks)
    if not PERSISTENT and not PAST_END:
        # Rows all past Sq (the last tile's later warpgroups where Sq is not a multiple of the
        # tile's rows): the rule gives them the last row's keys, unmasked -- a whole row of work
        # whose output TMA clips. Every block is handed back instead (the trailing loop).
        past_end = mw >= seq_q
        n_unseen = gl.where(past_end, 0, n_unseen)
        n_lead = gl.where(past_end, 0, n_lead)
        n_inner = gl.where(past_end, 0, n_inner)
        n_seen = gl.where(past_end, 0, n_seen)
    return n_unseen, n_lead, n_inner, n_seen


@gluon.jit
def _ws_consume_tile(o_desc, q_smem, k_ring, v_ring, q_bars, q_empty, k_ready, v_ready, k_empty, v_empty, turn_bars,
                     bias_state, grad_in, Lse, sched, qk_scale, softcap_log2, tile, r, done, WG: gl.constexpr,
                     ROWS: gl.constexpr, NQ: gl.constexpr, BLOCK_N: gl.constexpr, HEAD_D: gl.constexpr,
                     NUM_STAGES: gl.constexpr, PERSISTENT: gl.constexpr, CAUSAL: gl.constexpr, LEFT: gl.constexpr,
                     SOFTCAP: gl.constexpr, PINGPONG: gl.constexpr, LISTS: gl.constexpr, BIAS: gl.constexpr,
                     VARLEN: gl.constexpr, QBUF: gl.constexpr, GRAD_Q: gl.constexpr, ALIBI: gl.constexpr,
                     DROPOUT: gl.constexpr, SINKS: gl.constexpr, PAST_END: gl.constexpr = False):
    """Query rows [m0 + WG * ROWS, + ROWS) of ``tile`` (``_ws_tile``; the program's ``r``-th, its Q in
    buffer QBUF where there are two), on one warpgroup: the tile's key blocks (the producer loads each
    once for all) that this warpgroup's rows see, with the mask on those not interior to them; the
    others it only hands back (``_ws_pass_step``). With LISTS the host's list says which: its full
    blocks first (no mask), then the partial ones (the keep rule; the Gluon kernels take only masks
    whose tiles are all empty or full, so the mask itself is never read). ``done``: key blocks the
    program consumed before this tile (the ring's slot and phase count; returned after it). The Q
    buffer goes back to the producer once the tile's output, staged in it, is stored.
    GRAD_Q (the dQ pass): ``grad_in`` = (dO's descriptor, its buffers); the row state is the
    pre-pass's (lse2, delta) rows (``Lse``, and ``sched``'s O pointer and lse head stride: the
    statistics' row stride), and the output dQ (``o_desc``). SINKS: the head's sink logit
    (``sched``'s Sinks pointer) joins each row's denominator at the end (``_with_sink``)."""
    s_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                       instr_shape=[16, BLOCK_N, 16])
    o_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                       instr_shape=[16, HEAD_D, 16])
    p_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=o_layout, k_width=2)
    row_s: gl.constexpr = gl.SliceLayout(1, s_layout)
    row_o: gl.constexpr = gl.SliceLayout(1, o_layout)
    pid_bh, batch, head, _, m0, tiles, seq = tile
    seq_q, seq_k, window_left = seq[0], seq[1], sched[7]
    rule = (seq_k - seq_q, window_left)
    s_zero = gl.zeros([ROWS, BLOCK_N], gl.float32, layout=s_layout)
    mw = m0 + WG * ROWS
    first, n_blocks, n_full, _ = tiles
    # Under a left window without lists, one program per tile: each warpgroup's turns count its own
    # key blocks, not the tile's (``_ws_own_blocks``'s docstring says why): block j's turn is then
    # turn_base + j.
    SKEW: gl.constexpr = LEFT and not LISTS and not PERSISTENT
    # The mask as bit words (``keep_scores``): faster masked steps, except with packed sequences,
    # whose forward spills registers with them and ran slower.
    MASK_BITS: gl.constexpr = not VARLEN
    if LISTS:
        n_unseen = n_full * 0
        n_lead = n_unseen
        n_inner = n_full
        n_seen = n_blocks
    else:
        n_unseen, n_lead, n_inner, n_seen = _ws_own_blocks(mw, first, n_blocks, seq_q, seq_k, window_left, ROWS,
                                                           BLOCK_N, CAUSAL, LEFT, PERSISTENT, PAST_END)
    if SKEW:
        turn_base = done - n_unseen
    else:
        turn_base = done

    rows = mw + gl.arange(0, ROWS, layout=row_s)
    # ALiBi (causal: its key-term form): slope * (j - c), c = mw + Sk - Sq, as slope * (j - key_start)
    # (``_softmax_update``) and a per-tile constant slope * (key_start - c), a shift of the row maxima
    if ALIBI:
        slope = gl.load(sched[17] + batch.to(gl.int64) * sched[3] + head) * LOG2E
    else:
        slope = 0.0
    alibi_c = mw + seq_k - seq_q
    if DROPOUT:  # sched: the seed's pointer, the threshold, the scale
        seed = gl.load(sched[18])
        batch_head = batch * sched[3] + head
    else:
        seed = 0
        batch_head = 0
    if GRAD_Q:  # the row state: lse2 and delta, rows padded past Sq (lse2 = +inf there)
        stats = pid_bh.to(gl.int64) * sched[13] + rows
        m_i = gl.load(Lse + stats)
        l_i = gl.load(sched[14] + stats)
    else:
        m_i = gl.full([ROWS], -float("inf"), gl.float32, layout=row_s)
        l_i = gl.zeros([ROWS], gl.float32, layout=row_s)
    acc = gl.zeros([ROWS, HEAD_D], gl.float32, layout=o_layout)
    Q_BUFFERS: gl.constexpr = q_smem.shape[0] // NQ
    q_index: gl.constexpr = (QBUF % Q_BUFFERS) * NQ + WG
    q_buf = q_smem.index(q_index)
    mbarrier.wait(q_bars.index(q_index), (r // Q_BUFFERS) & 1)
    q = q_buf.reshape([ROWS, HEAD_D])
    do = grad_in[1].index(q_index).reshape([ROWS, HEAD_D])  # GRAD_Q: dO's rows (else Q's, never read)
    if LEFT and not LISTS:
        if not PERSISTENT:
            for j in range(0, n_unseen):
                _ws_pass_step(k_ready, v_ready, k_empty, v_empty, turn_bars, bias_state, done + j, turn_base + j,
                              NUM_STAGES, WG, PINGPONG, BIAS, not SKEW)
        for j in range(n_unseen, n_lead):
            acc, m_i, l_i = _ws_step(q, k_ring, v_ring, k_ready, v_ready, k_empty, v_empty, turn_bars,
                                     bias_state, acc, m_i, l_i, s_zero, done + j, turn_base + j,
                                     (first + j) * BLOCK_N, rows,
                                     seq_k, rule, qk_scale, softcap_log2, BLOCK_N, HEAD_D, NUM_STAGES, s_layout,
                                     o_layout, p_layout, CAUSAL, LEFT, True, SOFTCAP, WG, PINGPONG, BIAS, do, GRAD_Q,
                                     ALIBI, slope, slope * ((first + j) * BLOCK_N - alibi_c).to(gl.float32), DROPOUT,
                                     (seed, batch_head, mw, (first + j) * BLOCK_N, sched[19], sched[20]), MASK_BITS)
    for j in range(n_lead, n_inner):  # interior: no mask, so no key index either
        acc, m_i, l_i = _ws_step(q, k_ring, v_ring, k_ready, v_ready, k_empty, v_empty, turn_bars, bias_state,
                                 acc, m_i, l_i, s_zero, done + j, turn_base + j, 0, rows, seq_k, rule, qk_scale,
                                 softcap_log2,
                                 BLOCK_N, HEAD_D, NUM_STAGES, s_layout, o_layout, p_layout, CAUSAL, LEFT, False,
                                 SOFTCAP, WG, PINGPONG, BIAS, do, GRAD_Q, ALIBI, slope,
                                 slope * ((first + j) * BLOCK_N - alibi_c).to(gl.float32), DROPOUT,
                                 (seed, batch_head, mw, (first + j) * BLOCK_N, sched[19], sched[20]), MASK_BITS)
    for j in range(n_inner, n_seen):
        acc, m_i, l_i = _ws_step(q, k_ring, v_ring, k_ready, v_ready, k_empty, v_empty, turn_bars, bias_state,
                                 acc, m_i, l_i, s_zero, done + j, turn_base + j, _tile_key(tiles, j, BLOCK_N, LISTS),
                                 rows,
                                 seq_k, rule, qk_scale, softcap_log2, BLOCK_N, HEAD_D, NUM_STAGES, s_layout,
                                 o_layout, p_layout, CAUSAL, LEFT, True, SOFTCAP, WG, PINGPONG, BIAS, do, GRAD_Q,
                                 ALIBI, slope, slope * ((first + j) * BLOCK_N - alibi_c).to(gl.float32), DROPOUT,
                                 (seed, batch_head, mw, (first + j) * BLOCK_N, sched[19], sched[20]), MASK_BITS)
    if (CAUSAL or not PAST_END) and not LISTS and not PERSISTENT:
        for j in range(n_seen, n_blocks):
            _ws_pass_step(k_ready, v_ready, k_empty, v_empty, turn_bars, bias_state, done + j, turn_base + j,
                          NUM_STAGES, WG, PINGPONG, BIAS)
    if SKEW:
        # Every warpgroup takes the tile's n_blocks turns, so the round robin stays whole: those its
        # first blocks did not take, passed last (where no matmul waits on them). The blocks past its
        # own take their turns as they are handed back, in order: handed back first, without turns,
        # they could wait on a load that waits on a warpgroup waiting for this one's turn (the last
        # tile's rows past Sq).
        for t in range(n_blocks - n_unseen, n_blocks):
            turn_wait(turn_bars, done + t, WG, PINGPONG)
            turn_pass(turn_bars, WG, PINGPONG)
    if ALIBI:  # the row term the scores left out, -slope * (i' - c), in the row maxima that make lse
        m_i = m_i - slope * (rows - mw).to(gl.float32)
    if DROPOUT and not GRAD_Q:  # the kept probabilities' scale, once (the dQ pass's dS has it)
        acc = acc * sched[20]
    if SINKS:
        acc, m_i, l_i = _with_sink(acc, m_i, l_i, gl.load(sched[21] + head), row_o)
    if GRAD_Q:
        _dq_epilogue(acc, qk_scale, softcap_log2, q, q_buf, o_desc, batch, head, mw, SOFTCAP)
    else:
        _epilogue(acc, m_i, l_i, rows, Lse, seq[4], seq_q, q, q_buf, o_desc, batch, head, mw, row_o,
                  (sched[14], sched[15], sched[16], seq[2]), o_layout, VARLEN)
    if PERSISTENT:
        mbarrier.arrive(q_empty.index(q_index), count=1)
    return done + n_blocks


@gluon.jit(do_not_specialize=["seq_q", "seq_k", "num_heads", "group", "window_left", "query_blocks", "chunk_heads",
                              "head_rows", "list_stride_b", "list_stride_h", "list_stride_r", "list_head_div",
                              "bias_batches", "bias_head_div", "lse_head_stride", "stride_out_row",
                              "stride_out_head", "dropout_threshold"])
def _attn_fwd_ws_kernel(q_desc, k_desc, v_desc, o_desc, Lse, seq_q, seq_k, num_heads, group, window_left, qk_scale,
                        softcap_log2, query_blocks, chunk_heads, head_rows, tile_lists, list_stride_b, list_stride_h,
                        list_stride_r, list_head_div, bias_desc, bias_batches, bias_head_div, lse_head_stride, Out,
                        stride_out_row, stride_out_head, do_desc, Alibi, DropoutSeed, dropout_threshold,
                        dropout_scale, Sinks, BLOCK_N: gl.constexpr, HEAD_D: gl.constexpr, CAUSAL: gl.constexpr, LEFT: gl.constexpr,
                        SOFTCAP: gl.constexpr, NUM_STAGES: gl.constexpr, SPLIT: gl.constexpr, PINGPONG: gl.constexpr,
                        LISTS: gl.constexpr, BIAS: gl.constexpr, PERSISTENT: gl.constexpr, VARLEN: gl.constexpr,
                        GRAD_Q: gl.constexpr, PRODUCER_REGS: gl.constexpr, CONSUMER_REGS: gl.constexpr,
                        num_warps: gl.constexpr, ALIBI: gl.constexpr = False, DROPOUT: gl.constexpr = False,
                        SINKS: gl.constexpr = False, PAST_END: gl.constexpr = False):
    """The default partition is consumer warpgroup 0 (4 warps); workers: consumer warpgroups 1 (and
    2), 4 warps each, and the 1-warp producer. The launch has ``head_rows * query_blocks`` tiles; a
    grid of that many programs runs one each, a smaller one (PERSISTENT) hands them out in rounds
    (``common.snake_tile``), the producer loading the next tile's first key blocks while the consumers
    finish one; Q has two buffers per warpgroup there, taken by the round's parity with static
    indices (rounds run in pairs), since the consumers stage a tile's output in its Q buffer (a
    buffer index computed from the round made the Q K^T wgmma read shared memory out of bounds,
    compute-sanitizer, Triton 3.6). LISTS: a tile's key blocks come from the
    host's tile list (a mask; tile_lists.py: [full count, partial count, full..., partial...]),
    else from the block range of block_range.py. BIAS: a 16-bit bias by elements over queries and
    keys (``bias_desc``, block (1, 1, 64, BLOCK_N) over its own (B|1, H|1, Sq, Sk) shape; its batch
    is ``batch`` when ``bias_batches`` is 1, else 0, its head ``head // bias_head_div``), one tile per
    consumer warpgroup and key block through a ring of its own. VARLEN: packed sequences
    (varlen_attention): ``tile_lists`` is the host's map of the launch's ``query_blocks`` (sequence,
    query block) entries (packed_tiles.py), every head taking each in turn; the descriptors view
    the packed (1, H, total rows, D) tensors, each tile offset by its sequence's first row; lse is
    (Hq, ``lse_head_stride``) and O (``Out``) is stored by pointers (``_epilogue``).

    GRAD_Q: the backward's dQ pass on the same tiles, walk and schedule (``dq_pass``): the producer
    loads dO (``do_desc``) beside Q, each key block's step is ``_ws_dq_step`` (S, dP, dS, dQ += dS K)
    and the output is dQ (``o_desc``); ``Lse`` and ``Out`` are the pre-pass's lse2 and delta,
    ``lse_head_stride`` their row stride. Each dQ row is summed by one warpgroup in a fixed order:
    bitwise reproducible (deterministic mode's dQ).

    A warpgroup whose rows all lie past Sq (one program per tile) hands its key blocks back;
    PAST_END (``Knobs.run_rows_past_end``, A/B timing only) runs them as the block range says."""
    gl.static_assert(not (VARLEN and (LISTS or BIAS or PERSISTENT)), "packed sequences: no mask, bias, persistence")
    gl.static_assert(not (GRAD_Q and (VARLEN or LISTS or BIAS or PERSISTENT)),
                     "the dQ pass: no packed sequences, mask, bias or persistence")
    gl.static_assert(not (DROPOUT and (VARLEN or LISTS or BIAS)), "dropout: no packed sequences, mask or bias")
    gl.static_assert(not (SINKS and (GRAD_Q or ALIBI or DROPOUT)), "sinks: the forward, without ALiBi or dropout")
    gl.static_assert(NUM_STAGES >= 2, "the release schedule assumes at least two ring slots")
    gl.static_assert(num_warps == 4, "the default partition is one consumer warpgroup")
    gl.static_assert(SPLIT == 2 or SPLIT == 3, "two or three consumer warpgroups")
    ROWS: gl.constexpr = gl.constexpr(q_desc.block_type.shape[2])  # query rows per consumer warpgroup
    dtype: gl.constexpr = q_desc.dtype

    sched = (head_rows, query_blocks, chunk_heads, num_heads, group, seq_q, seq_k, window_left, tile_lists,
             list_stride_b, list_stride_h, list_stride_r, list_head_div, lse_head_stride, Out, stride_out_row,
             stride_out_head, Alibi, DropoutSeed, dropout_threshold, dropout_scale, Sinks)
    bias_slices = (bias_batches, bias_head_div)
    # one program per tile: its tile, found here (as the partitions' argument it costs the 3-warpgroup
    # consumers fewer registers than found in each partition)
    own_tile = _ws_tile(gl.program_id(0), sched, SPLIT * ROWS, BLOCK_N, CAUSAL, LEFT, LISTS, VARLEN)

    # PERSISTENT: two Q buffers per warpgroup, so that the next tile's Q loads while this one's
    # output (staged in its Q buffer) is stored -- where shared memory holds them (two warpgroups,
    # no bias ring: the launches the heuristic makes persistent, runs_persistent)
    Q_BUFFERS: gl.constexpr = 2 if PERSISTENT and SPLIT == 2 and not BIAS else 1
    q_smem = gl.allocate_shared_memory(dtype, [Q_BUFFERS * SPLIT, 1, 1, ROWS, HEAD_D], q_desc.layout)
    k_ring = gl.allocate_shared_memory(dtype, [NUM_STAGES, 1, 1, BLOCK_N, HEAD_D], k_desc.layout)
    v_ring = gl.allocate_shared_memory(dtype, [NUM_STAGES, 1, 1, BLOCK_N, HEAD_D], v_desc.layout)
    q_bars = gl.allocate_shared_memory(gl.int64, [Q_BUFFERS * SPLIT, 1], mbarrier.MBarrierLayout())
    q_empty = gl.allocate_shared_memory(gl.int64, [Q_BUFFERS * SPLIT, 1], mbarrier.MBarrierLayout())
    turn_bars = gl.allocate_shared_memory(gl.int64, [SPLIT, 1], mbarrier.MBarrierLayout())
    k_ready = gl.allocate_shared_memory(gl.int64, [NUM_STAGES, 1], mbarrier.MBarrierLayout())
    v_ready = gl.allocate_shared_memory(gl.int64, [NUM_STAGES, 1], mbarrier.MBarrierLayout())
    k_empty = gl.allocate_shared_memory(gl.int64, [NUM_STAGES, 1], mbarrier.MBarrierLayout())
    v_empty = gl.allocate_shared_memory(gl.int64, [NUM_STAGES, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(Q_BUFFERS * SPLIT):
        mbarrier.init(q_bars.index(i), count=1)
        mbarrier.init(q_empty.index(i), count=1)
    for i in gl.static_range(SPLIT):
        mbarrier.init(turn_bars.index(i), count=1)
    for i in gl.static_range(NUM_STAGES):
        mbarrier.init(k_ready.index(i), count=1)
        mbarrier.init(v_ready.index(i), count=1)
        mbarrier.init(k_empty.index(i), count=SPLIT)  # one release per consumer warpgroup
        mbarrier.init(v_empty.index(i), count=SPLIT)
    if BIAS:  # a slot per (stage, consumer warpgroup): each warpgroup hands back its own tile
        bias_ring = gl.allocate_shared_memory(bias_desc.dtype, [NUM_STAGES * SPLIT, 1, 1, ROWS, BLOCK_N],
                                              bias_desc.layout)
        b_ready = gl.allocate_shared_memory(gl.int64, [NUM_STAGES * SPLIT, 1], mbarrier.MBarrierLayout())
        b_empty = gl.allocate_shared_memory(gl.int64, [NUM_STAGES * SPLIT, 1], mbarrier.MBarrierLayout())
        for i in gl.static_range(NUM_STAGES * SPLIT):
            mbarrier.init(b_ready.index(i), count=1)
            mbarrier.init(b_empty.index(i), count=1)
        bias_state = (bias_ring, b_ready, b_empty)
    else:
        bias_state = (k_ready, k_ready, k_ready)  # never read
    if GRAD_Q:  # dO's rows, one buffer per Q buffer
        grad_in = (do_desc, gl.allocate_shared_memory(dtype, [Q_BUFFERS * SPLIT, 1, 1, ROWS, HEAD_D], do_desc.layout))
    else:
        grad_in = (q_desc, q_smem)  # never read
    fence_async_shared()

    # Constexprs go inline in the argument tuples (a tuple bound to a name first makes them tensors).
    #
    # compute-sanitizer's racecheck reports shared-memory hazards here, attributed to the ``def`` line
    # and to the ``gl.warp_specialize`` call. As in the dK/dV pass (the comment at its call in
    # gluon/bwd.py), every reported instruction is Triton's own warp dispatch, not our buffers.
    # The default warpgroup stores each worker warp's state byte, and one captured value (this
    # launch's tile) the partitions load on entry. Between each store and its load, every thread
    # passes a CTA-wide ``bar.sync 1``; a second one keeps the captured value until every worker
    # has read it. The captured value's 4 bytes share their address with ``q_empty``, which a launch
    # that is not PERSISTENT initialises and never uses again (its waits and arrives are compiled
    # out): Triton's allocator can place the capture there because that buffer is dead.
    if SPLIT == 2:
        gl.warp_specialize([
            (_ws_consumer, (o_desc, q_smem, k_ring, v_ring, q_bars, q_empty, k_ready, v_ready, k_empty, v_empty,
                            turn_bars, bias_state, grad_in, Lse, sched, own_tile, qk_scale, softcap_log2, 0, ROWS,
                            SPLIT, BLOCK_N, HEAD_D, NUM_STAGES, PERSISTENT, CAUSAL, LEFT, SOFTCAP, PINGPONG, LISTS,
                            BIAS, VARLEN, GRAD_Q, ALIBI, DROPOUT, SINKS, PAST_END)),
            (_ws_consumer, (o_desc, q_smem, k_ring, v_ring, q_bars, q_empty, k_ready, v_ready, k_empty, v_empty,
                            turn_bars, bias_state, grad_in, Lse, sched, own_tile, qk_scale, softcap_log2, 1, ROWS,
                            SPLIT, BLOCK_N, HEAD_D, NUM_STAGES, PERSISTENT, CAUSAL, LEFT, SOFTCAP, PINGPONG, LISTS,
                            BIAS, VARLEN, GRAD_Q, ALIBI, DROPOUT, SINKS, PAST_END)),
            (_ws_producer, (q_desc, k_desc, v_desc, bias_desc, q_smem, k_ring, v_ring, q_bars, q_empty, k_ready,
                            v_ready, k_empty, v_empty, bias_state, bias_slices, grad_in, sched, own_tile, ROWS, SPLIT,
                            BLOCK_N, NUM_STAGES, PERSISTENT, CAUSAL, LEFT, LISTS, BIAS, VARLEN, GRAD_Q)),
        ], [4, 1], [CONSUMER_REGS, PRODUCER_REGS])
    else:
        gl.warp_specialize([
            (_ws_consumer, (o_desc, q_smem, k_ring, v_ring, q_bars, q_empty, k_ready, v_ready, k_empty, v_empty,
                            turn_bars, bias_state, grad_in, Lse, sched, own_tile, qk_scale, softcap_log2, 0, ROWS,
                            SPLIT, BLOCK_N, HEAD_D, NUM_STAGES, PERSISTENT, CAUSAL, LEFT, SOFTCAP, PINGPONG, LISTS,
                            BIAS, VARLEN, GRAD_Q, ALIBI, DROPOUT, SINKS, PAST_END)),
            (_ws_consumer, (o_desc, q_smem, k_ring, v_ring, q_bars, q_empty, k_ready, v_ready, k_empty, v_empty,
                            turn_bars, bias_state, grad_in, Lse, sched, own_tile, qk_scale, softcap_log2, 1, ROWS,
                            SPLIT, BLOCK_N, HEAD_D, NUM_STAGES, PERSISTENT, CAUSAL, LEFT, SOFTCAP, PINGPONG, LISTS,
                            BIAS, VARLEN, GRAD_Q, ALIBI, DROPOUT, SINKS, PAST_END)),
            (_ws_consumer, (o_desc, q_smem, k_ring, v_ring, q_bars, q_empty, k_ready, v_ready, k_empty, v_empty,
                            turn_bars, bias_state, grad_in, Lse, sched, own_tile, qk_scale, softcap_log2, 2, ROWS,
                            SPLIT, BLOCK_N, HEAD_D, NUM_STAGES, PERSISTENT, CAUSAL, LEFT, SOFTCAP, PINGPONG, LISTS,
                            BIAS, VARLEN, GRAD_Q, ALIBI, DROPOUT, SINKS, PAST_END)),
            (_ws_producer, (q_desc, k_desc, v_desc, bias_desc, q_smem, k_ring, v_ring, q_bars, q_empty, k_ready,
                            v_ready, k_empty, v_empty, bias_state, bias_slices, grad_in, sched, own_tile, ROWS, SPLIT,
                            BLOCK_N, NUM_STAGES, PERSISTENT, CAUSAL, LEFT, LISTS, BIAS, VARLEN, GRAD_Q)),
        ], [4, 4, 1], [CONSUMER_REGS, CONSUMER_REGS, PRODUCER_REGS])


# --------------------------------------------------------------------------- launcher

BLOCK_M = 128  # query rows per program of the 8-warp kernel
NUM_WARPS = 8


PERSISTENT_MAX_KEYS = 4096  # longer causal rows: one program per tile (``forward_programs``)


def forward_programs(q_shape: tuple, heads_kv: int, seqlen_k: int, spec: AttentionSpec, config: KernelConfig,
                     plain: bool, even_lists: bool, device: torch.device) -> tuple[int, int, int]:
    """(programs, tiles, head rows per chunk of the launch order) of the forward over q's (B, Hq, Sq, D)
    shape and ``heads_kv`` KV heads: the launcher's decision, which ``explain`` reports. The launch
    order: under a causal bound without a left window, one program per tile and long keys (or the
    8-warp kernel at any length), block-major in chunks of heads whose K and V fit in L2
    (``common.l2_section_rows``); else
    ``common.chunk_head_rows``. Programs: those of a persistent launch of
    the warp-specialised forward (at most one per SM, each walking its share of the tiles in rounds),
    or 0 for a launch of one program per tile. Measured (forward GPU time): persistent is faster at
    D=128 S=1k causal (two warpgroups: short tiles, their fixed cost -- Q and first K/V loads, output
    store -- half hidden), but with three warpgroups ping-ponging it spills and its static rounds
    balance long causal rows badly (slower at 16k causal and with a window): so two warpgroups,
    causal, no bias or tile lists (``plain``), and keys up to PERSISTENT_MAX_KEYS (fp16 causal
    softcap, 2 warpgroups: at 16k keys persistent was much slower than one program per tile, at 4k
    the fastest) -- and there only where the model has the static rounds ending no later than one
    program per tile, with one program per SM or one chunk of the launch order a round, whichever it
    balances better (``rounds.persistent_programs``). Also a mask's tile lists without a bias where
    they are about equally long (``even_lists``: tile_lists.rows_even), whatever the turns: short
    lists of whole tiles -- a block-sparse top-k mask -- spend much of a program on its fixed part (a
    block-sparse forward at S=4k measured faster persistent)."""
    batch, heads_q, seqlen_q, head_dim = q_shape
    causal = spec.window_right == 0
    query_blocks = cdiv(seqlen_q, WG_ROWS * config.hopper_split if config.hopper_split else BLOCK_M)
    head_rows = batch * heads_q
    chunk = chunk_head_rows(head_rows, query_blocks, spec.has_window_left and causal, device)
    tiles = head_rows * query_blocks
    if not config.hopper_split:
        programs = 0  # the 8-warp kernel: one program per tile
    elif knobs().programs is not None:
        programs = knobs().programs
    else:
        fits = seqlen_k <= PERSISTENT_MAX_KEYS
        programs = sm_count(device) if runs_persistent(config, causal, plain, even_lists) and fits else 0
        if 0 < programs < tiles and plain:
            work = rounds.forward_tile_work(seqlen_q, seqlen_k, spec.window_left if spec.has_window_left else None,
                                            head_rows, chunk, WG_ROWS * config.hopper_split, config.block_n)
            programs = rounds.persistent_programs(work, programs, chunk * query_blocks)
    programs = programs if programs < tiles else 0
    short_ws = config.hopper_split and seqlen_k <= SHORT_KEYS
    if causal and not spec.has_window_left and programs == 0 and not short_ws:
        # one program per tile over rows of uneven length: block-major in L2-sized chunks of heads
        # (measured faster at 4k-16k keys, and for the 8-warp kernel's 128-row tiles at 1k-2k keys;
        # the warp-specialised kernels at short keys keep head-major order)
        kv_bytes = seqlen_k * 2 * head_dim * 2  # K and V of one KV head (16-bit, D = Dv)
        chunk = l2_section_rows(head_rows, kv_bytes * heads_kv // heads_q, device)
    return programs, tiles, chunk


def runs_persistent(config: KernelConfig, causal: bool, plain: bool, even_lists: bool = False) -> bool:
    """Whether ``forward_programs`` makes the launch persistent (before its length limit)."""
    if config.hopper_split != 2:
        return False
    return even_lists or (not config.hopper_pingpong and causal and plain)


def attention_forward(q, k, v, out, lse, spec: AttentionSpec, config: KernelConfig,
                      tile_lists: tuple | None = None, bias: torch.Tensor | None = None, packing=None,
                      even_lists: bool = False, alibi: torch.Tensor | None = None, dropout: tuple | None = None,
                      sinks: torch.Tensor | None = None) -> bool:
    """Attention into ``out`` (the user layout) and ``lse`` ((B, Hq, Sq) float32); False, launching
    nothing, when a tensor cannot go through TMA (the caller then runs the Triton kernel).
    ``config.hopper_split`` 2 or 3: the warp-specialised kernel with that many consumer warpgroups
    (``hopper_pingpong``: taking turns); 0: the 8-warp kernel with schedule ``config.hopper_overlap``.
    ``tile_lists``: a mask's tile lists at the config's tiles, as ``kernels.triton.fwd.row_list_args``
    gives them (warp-specialised kernel only; the mask must leave no partial tile of its own:
    ``tile_lists.tiles_whole``). ``bias``: 16-bit, by elements over queries and keys, TMA-addressable
    (``dispatch.gluon_reads_bias``; warp-specialised kernel only, 2 consumer warpgroups and 2 stages: the
    bias ring takes the shared memory a third warpgroup would). ``even_lists``: the lists are about
    equally long and there is no bias (``forward_programs``). ``packing`` (spec.Packing): q, k, v,
    out are (1, total, H, D) views of packed sequences and lse (Hq, total_q) (``_packed_forward``).
    ``alibi`` (with ``spec.alibi``): the contiguous float32 (B, Hq) slopes, for causal calls on the
    warp-specialised kernel without lists, bias or packing (``dispatch.gluon_forward_takes_alibi``).
    ``dropout`` (with ``spec.dropout_p``): (the call's (1,) int64 seed, threshold, scale), for the
    warp-specialised kernel without lists, bias or packing (``dispatch.gluon_forward_takes_dropout``).
    ``sinks``: (Hq,) float32, one more logit per head in every row's denominator (the
    warp-specialised kernel, without ALiBi or dropout)."""
    assert spec.alibi == (alibi is not None), "spec.alibi and the slopes go together"
    assert sinks is None or (config.hopper_split and alibi is None and dropout is None), \
        "sinks: the warp-specialised forward without ALiBi or dropout"
    assert sinks is None or (sinks.dtype == torch.float32 and sinks.is_contiguous()), \
        "sinks: float32, contiguous (as the interface passes them to every kernel)"
    assert spec.has_dropout == (dropout is not None), "spec.dropout_p and (seed, threshold, scale) go together"
    assert dropout is None or (config.hopper_split and tile_lists is None and bias is None and packing is None), \
        "dropout: the warp-specialised forward without lists, bias or packing"
    assert alibi is None or (config.hopper_split and spec.window_right == 0 and tile_lists is None and bias is None
                             and packing is None), "ALiBi: the causal warp-specialised forward only"
    if packing is not None:
        return _packed_forward(q, k, v, out, lse, spec, config, packing, sinks)
    layout = spec.layout
    q_rows = WG_ROWS if config.hopper_split else BLOCK_M
    descs = [descriptor(q, q_rows, layout), descriptor(k, config.block_n, layout),
             descriptor(v, config.block_n, layout), descriptor(out, q_rows, layout)]
    if any(d is None for d in descs):
        return False
    q_shape, k_shape = descs[0].shape, descs[1].shape  # (B, H, S, D)
    lists = tile_lists if tile_lists is not None else (lse, 0, 0, 0, 1)
    if bias is not None:
        assert config.hopper_split == 2 and config.num_stages == 2, "the bias ring fits beside 2 x 2 tiles"
        bias_desc, bias_slices = Descriptor(bias, (1, 1, WG_ROWS, config.block_n)), bias_slice_args(bias, q_shape[1])
    else:
        bias_desc, bias_slices = descs[0], None
    launcher = _forward_launcher(tuple(q_shape), k_shape[1], k_shape[2], spec, config, tuple(lists[1:]),
                                 tile_lists is not None, bias_slices, q.device.index,
                                 even_lists=even_lists and tile_lists is not None and bias is None,
                                 dropout_args=(0, 1.0) if dropout is None else tuple(dropout[1:]),
                                 sinks=sinks is not None)
    # then the packed forward's O pointer and the dQ pass's dO descriptor (unused here)
    per_call = (*descs, lse, lists[0], bias_desc, lse, descs[0], alibi if alibi is not None else lse,
                lse if dropout is None else dropout[0], lse if sinks is None else sinks)
    launcher(*per_call[:len(launcher.slots)])  # the 8-warp kernel takes no lists or bias
    return True


@per_problem
def _forward_launcher(q_shape: tuple, heads_kv: int, seqlen_k: int, spec: AttentionSpec, config: KernelConfig,
                      list_strides: tuple, has_lists: bool, bias_slices: tuple | None, device_index: int,
                      stats_stride: int | None = None, even_lists: bool = False,
                      dropout_args: tuple = (0, 1.0), sinks: bool = False) -> Launcher:
    """The forward's launch for one problem (decided once: grid, launch order, persistence,
    registers); each call passes Q, K, V, O descriptors, lse, the tile lists and the bias
    descriptor.
    ``stats_stride`` (the row statistics' row stride): the same kernel as the dQ pass (GRAD_Q,
    ``dq_pass``), one program per tile; each call then passes Q, K, V, dQ descriptors, lse2, a
    placeholder for the tile lists, one for the bias descriptor, delta and the dO descriptor.
    ``even_lists``: see ``forward_programs``. ``dropout_args``: (threshold, scale) with dropout
    (then each call passes the seed, then the sinks or a placeholder). ``sinks``: the call passes
    them."""
    grad_q = stats_stride is not None
    batch, heads_q, seqlen_q, head_dim = q_shape
    device = torch.device("cuda", device_index)
    causal = spec.window_right == 0
    query_blocks = cdiv(seqlen_q, WG_ROWS * config.hopper_split if config.hopper_split else BLOCK_M)
    programs, tiles, chunk = forward_programs(q_shape, heads_kv, seqlen_k, spec, config,
                                              not has_lists and bias_slices is None, even_lists, device)
    programs = 0 if grad_q else programs
    grid = (tiles,)
    args = (SLOT, SLOT, SLOT, SLOT, SLOT, seqlen_q, seqlen_k, heads_q, heads_q // heads_kv, spec.window_left,
            *score_constants(spec), query_blocks, chunk)
    if not config.hopper_split:
        assert not has_lists and bias_slices is None, "tile lists, bias: the warp-specialised kernel only"
        # launch_order's chunks read off a grid where they are whole, no divisions at entry (measured
        # faster). The warp-specialised forward keeps the 1-D launch: on the grid its programs start
        # in the same order, but at D=64 causal its long tiles ran slower with the same loop code at
        # other addresses, more than the divisions saved.
        tile_grid = chunk_grid(tiles // query_blocks, query_blocks, chunk)
        grid = tile_grid or grid
        return Launcher(_attn_fwd_kernel, grid, args, BLOCK_M=BLOCK_M, BLOCK_N=config.block_n, HEAD_D=head_dim,
                        CAUSAL=causal, LEFT=spec.has_window_left, SOFTCAP=spec.has_softcap,
                        OVERLAP=config.hopper_overlap, NUM_STAGES=config.num_stages, num_warps=NUM_WARPS,
                        GRID=tile_grid is not None)
    persistent = programs > 0
    if persistent:
        grid = (programs,)
    maxnreg, consumer_regs, producer_regs = ws_registers(config.hopper_split)
    return Launcher(
        _attn_fwd_ws_kernel, grid, (*args, batch * heads_q, SLOT, *list_strides, SLOT, *(bias_slices or (0, 1)),
                                    stats_stride or 0, SLOT, 0, 0, SLOT, SLOT, SLOT, *dropout_args, SLOT),
        BLOCK_N=config.block_n, HEAD_D=head_dim, CAUSAL=causal, LEFT=spec.has_window_left, SOFTCAP=spec.has_softcap,
        NUM_STAGES=config.num_stages, SPLIT=config.hopper_split, PINGPONG=config.hopper_pingpong, LISTS=has_lists,
        BIAS=bias_slices is not None, PERSISTENT=persistent, VARLEN=False, GRAD_Q=grad_q, PRODUCER_REGS=producer_regs,
        PAST_END=knobs().run_rows_past_end,
        CONSUMER_REGS=consumer_regs, ALIBI=spec.alibi and not grad_q, DROPOUT=spec.has_dropout, SINKS=sinks,
        num_warps=4, maxnreg=maxnreg)


def _packed_forward(q, k, v, out, lse, spec: AttentionSpec, config: KernelConfig, packing, sinks=None) -> bool:
    """The warp-specialised forward over packed sequences: one program per (entry of the host's map
    of the query blocks that exist, head), heaviest entries first (packed_tiles.py); a new set of
    lengths changes the map and the grid, never the compiled kernel. False (nothing launched) for
    the 8-warp kernel's configs, tensors TMA cannot address, or offsets the host could not read
    (checked on the device under CUDA-graph capture: no map can be made)."""
    if not config.hopper_split or packing.offsets_q is None:
        return False
    q4, k4, v4 = (to_bhsd(t, spec.layout) for t in (q, k, v))
    descs = [descriptor(q4, WG_ROWS), descriptor(k4, config.block_n), descriptor(v4, config.block_n)]
    if any(d is None for d in descs):
        return False
    tile_map = packed_tiles.query_block_map(packing, WG_ROWS * config.hopper_split, spec, q.device)
    entries = tile_map.shape[1]
    if entries == 0:
        return True
    out_rows = to_bhsd(out, spec.layout)  # (1, Hq, total_q, D): rows and heads by their strides
    launcher = _packed_forward_launcher(q4.shape, k4.shape[1], out_rows.stride()[1:3], spec, config,
                                        q.device.index, sinks is not None)
    # Q's descriptor stands in the O and bias descriptor slots (never read with VARLEN)
    launcher(*descs, descs[0], lse, entries, tile_map, descs[0], out, descs[0], lse, lse,
             lse if sinks is None else sinks, grid=(entries * q4.shape[1],))
    return True


@per_problem
def _packed_forward_launcher(q_shape: tuple, heads_kv: int, out_strides: tuple, spec: AttentionSpec,
                             config: KernelConfig, device_index: int, sinks: bool = False) -> Launcher:
    """The packed forward's launch for one problem (shapes, not lengths); each call passes the Q, K,
    V, O descriptors, lse, the map's entry count, the map, the bias descriptor and O, with its grid
    (entries x heads) and a placeholder for the dQ pass's dO descriptor."""
    heads_q, total_q, head_dim = q_shape[1], q_shape[2], q_shape[3]
    maxnreg, consumer_regs, producer_regs = ws_registers(config.hopper_split)
    args = (SLOT, SLOT, SLOT, SLOT, SLOT, 0, 0, heads_q, heads_q // heads_kv, spec.window_left,
            *score_constants(spec), SLOT, hopper.packed_chunk_heads(heads_q), heads_q, SLOT, 0, 0, 0, 1, SLOT, 0, 1,
            total_q, SLOT, out_strides[1], out_strides[0], SLOT, SLOT, SLOT, 0, 1.0, SLOT)
    return Launcher(_attn_fwd_ws_kernel, None, args, BLOCK_N=config.block_n, HEAD_D=head_dim,
                    CAUSAL=spec.window_right == 0, LEFT=spec.has_window_left, SOFTCAP=spec.has_softcap,
                    NUM_STAGES=config.num_stages, SPLIT=config.hopper_split, PINGPONG=config.hopper_pingpong,
                    LISTS=False, BIAS=False, PERSISTENT=False, VARLEN=True, GRAD_Q=False, PRODUCER_REGS=producer_regs,
                    CONSUMER_REGS=consumer_regs, num_warps=4, maxnreg=maxnreg, ALIBI=False, DROPOUT=False,
                    SINKS=sinks)


def dq_pass(q, k, v, dout, lse2, delta, dq, spec: AttentionSpec, config: KernelConfig,
            dropout: tuple | None = None) -> bool:
    """The backward's dQ pass on the warp-specialised forward's skeleton (``GRAD_Q``): dQ (q's
    layout, dtype and strides) from the pre-pass's lse2 and delta ((B * Hq, padded rows) fp32, rows
    padded to a multiple of the tile height, lse2 = +inf past Sq). ``config``: a warp-specialised
    forward config (``hopper_split`` warpgroups of 64 query rows, ``block_n`` keys a step). False,
    nothing launched, where a tensor cannot go through TMA (the caller runs the Triton dQ pass).
    The caller checks the problem: no mask, bias, packed sequences or ALiBi (``dispatch.takes_gluon_dq``).
    ``dropout`` (with ``spec.dropout_p``): (the call's seed, threshold, scale)."""
    assert spec.has_dropout == (dropout is not None), "spec.dropout_p and (seed, threshold, scale) go together"
    layout = spec.layout
    descs = [descriptor(q, WG_ROWS, layout), descriptor(k, config.block_n, layout),
             descriptor(v, config.block_n, layout), descriptor(dq, WG_ROWS, layout), descriptor(dout, WG_ROWS, layout)]
    if any(d is None for d in descs):
        return False
    q_shape, k_shape = descs[0].shape, descs[1].shape  # (B, H, S, D)
    launcher = _forward_launcher(tuple(q_shape), k_shape[1], k_shape[2], spec, config, (0, 0, 0, 1), False, None,
                                 q.device.index, stats_stride=lse2.stride(0),
                                 dropout_args=(0, 1.0) if dropout is None else tuple(dropout[1:]))
    q_desc, k_desc, v_desc, dq_desc, do_desc = descs
    # no lists, bias or slopes
    launcher(q_desc, k_desc, v_desc, dq_desc, lse2, lse2, q_desc, delta, do_desc, lse2,
             lse2 if dropout is None else dropout[0], lse2)
    return True
