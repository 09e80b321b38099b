"""Hopper (sm_90) dK/dV pass in Triton's Gluon dialect, warp-specialised like the forward.

Same math as the Triton dK/dV programs of ``kernels/triton/bwd.py`` (and the same pre-pass buffers: lse2 in log2
units with +inf in padding rows, delta = rowsum(dO * O) - dlse): per key tile, for every query
block of every query head of the KV group,

    S^T = K Q^T,  P^T = exp2(S^T * scale * log2(e) - lse2),  dP^T = V dO^T,
    dS^T = P^T * (dP^T - delta),  dV += P^T dO,  dK += dS^T Q            (dK *= scale at the end)

with K and V as shared-memory A operands, so P^T and dS^T are register A operands of the two
accumulating wgmmas; delta is folded into dP^T's accumulator (it starts at -delta).

Why a Gluon pass: in plain Triton 3.6 each program waits for every wgmma as soon as it is issued
and has no warp specialisation on sm_90, so the exponentials never run under a matmul. Here (as
``gluon.fwd._attn_fwd_ws_kernel``) one program = SPLIT * 64 keys of one (batch, KV head),
``gl.warp_specialize``d into

- a producer (1 warp, few registers): TMA of each consumer's 64-key K and V tile once, then for
  every step of the walk Q, dO, lse2 and delta of one query block into a NUM_STAGES ring
  (ready/empty mbarriers per slot); at the end the TMA stores of dK and dV.
- SPLIT consumer warpgroups (4 warps each, the rest of the registers), each owning 64 keys and
  their dK, dV accumulators; after a step it releases the ring slot with one arrive (the empty
  barrier counts SPLIT). No CTA-wide barrier in any loop, so warpgroups drift apart and one's
  exponentials run while another's matmuls do.

PINGPONG (``KernelConfig.hopper_pingpong``) makes the warpgroups take turns, round robin:
  0  none: with dQ they run in lockstep (FA4's schedule), since they meet once a step where dQ
     needs both halves of dS^T; each step issues S^T and dP^T back to back, then dV, dQ, dK,
     each wait leaving one of its own matmuls queued (``_step``). Without dQ the planner gives
     such a config turns (``dispatch.dkdv_without_dq``).
  1  the turn covers issuing S^T (the forward's scheme).
  2  the turn covers S^T and dP^T: one warpgroup's exponentials and dS run under the next one's
     score matmuls, its dV/dK under the next one's elementwise work.

The walk (``_query_walk``) covers the causal rule (bottom-right aligned) for the two
windows this pass takes, none and causal: a query block is interior for the whole program when
every key of it is visible to every row (no mask math), masked on the diagonal, and skipped by a
warpgroup none of whose keys it sees. Interior steps of all heads of the group come first, then
the masked ones. Rows past Sq give p = 0 (lse2 = +inf); keys past Sk (zero-filled K, V) produce
dK, dV rows that the TMA store clips.

Gradients are bitwise reproducible: each key's dK, dV is summed by one warpgroup in a fixed
order -- except with GROUP_SUM (GQA outside deterministic mode, ``dispatch.sums_over_group``): there a
program covers one query head, not the KV head's whole group, and adds its fp32 dK, dV into
(B, Hkv, Sk, D) sums by TMA reduce-adds (staged in the K/V tiles and the ring once every walk is
over), converted to the input dtype after the pass -- "causal GQA" in the docs (causal or a
window with a right bound of 0).

The dQ pass is another kernel's (``kernels/triton/bwd.py``, or the Gluon forward's dQ mode,
``gluon/fwd.py``) -- except with DQ (dQ by atomics, i.e. not deterministic; ``computes_dq``),
FA3's 5-matmul form: every warpgroup runs every step and writes its dS^T to shared memory; at
D=128 (two warpgroups), once both halves are there, each computes 64 columns of dQ = scale * dS K
over the program's 128 keys; at D=64 with 128-row steps (two warpgroups) each computes 64 of the
step's rows over the 128 keys (FA4's split: one fp32 tile of 2 bytes per query-key pair a step
for the drain); at D=64 with 64-row steps each computes all columns over its own 64 keys, twice
the reduce-add bytes (``_dq_tile``); a 1-warp drain partition (``_drain``) sums those into an fp32 accumulator by TMA
reduce-adds while the consumers go on. dQ is then not bitwise reproducible (the order of the adds).
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
    warpgroup_mma_wait,
)


from ...spec import AttentionSpec, to_bhsd
from ..shared.config import KernelConfig
from ..shared.block_range import query_blocks_for_key_block
from ..shared.constants import REGISTER_ORDER_BASES, score_constants
from . import dkdv_key_block, ordered_heaviest_first
from .common import (LOG2E, WG_ROWS, Descriptor, UnswizzledDescriptor, bias_slice_args, chunk_grid, chunk_head_rows,
                     descriptor, dropout_mark_t, grid_tile, interleaved_chunk_rows, interleaved_order, keep_scores,
                     launch_order, log2_scores, ordered_chunk_rows, packed_chunk_heads, packed_tile,
                     row_stats_descriptor, sm_count, snake_tile, store_sequence_rows, tma_reduce_add, turn_pass,
                     turn_wait, ws_registers)
from ..shared.knobs import knobs
from ..shared.launch import SLOT, Launcher, cdiv, per_problem
from ..shared.descriptors import tma_addressable
from ..shared import packed_tiles, rounds

KEYS_PER_WG = WG_ROWS  # keys per consumer warpgroup: one wgmma M

# A program's walk of its query blocks (``_step_coords``): ascending, or under a causal bound with dQ
# summed in a fixed order (``_drain``) one of that order's two forms -- lightest program first (turns
# descending, the diagonal's program adding first) or heaviest first (turns ascending, every walk from
# the last block down). ``dkdv_walk`` picks, ``fixed_order_launch`` with the launch.
WALK_ASCENDING: gl.constexpr = gl.constexpr(0)
WALK_MASKED_FIRST: gl.constexpr = gl.constexpr(1)
WALK_DESCENDING: gl.constexpr = gl.constexpr(2)


# --------------------------------------------------------------------------- the walk


@gluon.jit
def _query_walk(n0, seq_q, seq_k, group, window_left, entries, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr,
                CAUSAL: gl.constexpr, LEFT: gl.constexpr, RAGGED: gl.constexpr, LISTS: gl.constexpr):
    """The steps of the program whose keys are [n0, n0 + BLOCK_N): (n_steps, walk). Steps [0,
    n_interior_steps) walk the interior query blocks (every key of the program visible to every
    row: no mask) of every head of the KV group (head-major), the rest the masked ones
    (``_step_coords``); query blocks that see none of the program's keys are not visited.

    LEFT (a sliding window): the blocks ``block_range.query_blocks_for_key_block`` gives, the Triton
    kernels' own rule: [inner_begin, inner_end) interior, [begin, inner_begin) (causal diagonal) and
    [inner_end, end) (left window edge) masked, all of them when the key block crosses Sk.
    Otherwise the same rule for causal or no window, written for the two cases (a block range of
    masked steps, not two: a general walk measurably slowed D=64 causal deterministic steps): [msk_begin,
    int_begin) straddle the causal diagonal (with RAGGED: or the key block crosses Sk), [int_begin,
    end) interior. RAGGED (with dQ, whose dS K reads every key; with packed sequences, whose keys
    past Sk are the next sequence's, not zeros): keys past Sk must give p = 0 exactly.

    LISTS (a mask): the host's list at ``entries`` (tile_lists.column_lists: [full count, partial
    count, full..., partial...], each ``member * query_blocks + query_block``) -- its full tiles are
    the interior steps, its partial ones the masked steps."""
    if LISTS:
        n_full = gl.load(entries)
        n_steps = n_full + gl.load(entries + 1)
        walk = (n_full, entries + 2, gl.cdiv(seq_q, BLOCK_M))
    else:
        if LEFT:
            begin, inner_begin, inner_end, end = query_blocks_for_key_block(n0 // BLOCK_N, seq_q, seq_k,
                                                                            window_left, 0, BLOCK_M, BLOCK_N, LEFT,
                                                                            CAUSAL)
            n_inner = inner_end - inner_begin
            n_lead = inner_begin - begin
            n_masked = n_lead + end - inner_end
        else:
            end = gl.cdiv(seq_q, BLOCK_M)
            if CAUSAL:
                diag = seq_k - seq_q  # query i sees key j iff j <= i + diag
                begin = gl.minimum(gl.maximum(n0 - diag, 0) // BLOCK_M, end)
                last_key = gl.minimum(n0 + BLOCK_N, seq_k) - 1
                inner_begin = gl.minimum(gl.maximum(gl.cdiv(gl.maximum(last_key - diag, 0), BLOCK_M), begin), end)
            else:
                begin = end * 0
                inner_begin = end * 0
            if RAGGED:  # keys past Sk must give p = 0 exactly: a ragged key block masks every step
                inner_begin = gl.where(n0 + BLOCK_N > seq_k, end, inner_begin)
            n_inner = end - inner_begin
            n_lead = inner_begin - begin
            n_masked = n_lead
        n_interior_steps = group * n_inner
        n_steps = n_interior_steps + group * n_masked
        walk = (n_interior_steps, n_inner, inner_begin, n_masked, n_lead, begin, group)
    return n_steps, walk


@gluon.jit
def _step_coords(t, walk, LEFT: gl.constexpr, LISTS: gl.constexpr, WALK: gl.constexpr = WALK_ASCENDING):
    """(member of the KV group, query block) of step t of ``walk`` (``_query_walk``). WALK (no lists,
    no left window but WALK_ASCENDING): WALK_ASCENDING the interior steps, then the masked ones, each
    phase's blocks ascending, a member's blocks at a time; WALK_MASKED_FIRST the masked steps first;
    WALK_DESCENDING each phase's blocks from the last down, the group's members a block at a time -- every
    program that visits query block m (the last being M - 1) reaches it at the same step, (M - 1 - m) *
    group + member, its interior and masked steps alike. The last two are the fixed dQ orders under a
    causal bound (``_drain``)."""
    if LISTS:
        entry = gl.load(walk[1] + t)
        member = entry // walk[2]
        blk = entry - member * walk[2]
    else:
        n_interior_steps, n_inner, inner_begin, n_masked, n_lead, begin, group = walk
        if WALK == WALK_MASKED_FIRST:
            n_masked_steps = group * n_masked
            inner = t >= n_masked_steps
            u = gl.where(inner, t - n_masked_steps, t)
        else:
            inner = t < n_interior_steps
            u = gl.where(inner, t, t - n_interior_steps)
        if WALK == WALK_DESCENDING:
            back = u // group
            member = u - back * group
            # interior: down from inner_begin + n_inner - 1 (the last block); masked: from inner_begin - 1
            return member, gl.where(inner, inner_begin + n_inner, begin + n_lead) - 1 - back
        n = gl.maximum(gl.where(inner, n_inner, n_masked), 1)
        member = u // n
        v = u - member * n
        if LEFT:  # masked: [begin, begin + n_lead), then past the n_inner interior blocks
            blk = gl.where(inner, inner_begin, begin) + v + gl.where(inner | (v < n_lead), 0, n_inner)
        else:  # masked: [begin, begin + n_lead) only
            blk = gl.where(inner, inner_begin, begin) + v
    return member, blk


# --------------------------------------------------------------------------- producer


@gluon.jit
def _load_step(g, t, walk, q_desc, do_desc, lse_desc, dl_desc, bias_desc, q_ring, do_ring, lse_ring, dl_ring,
               bias_ring, ready, empty, batch, first_head, stats_row0, q_start, n0, bias_at, BLOCK_M: gl.constexpr,
               NUM_STAGES: gl.constexpr, LEFT: gl.constexpr, LISTS: gl.constexpr, BIAS: gl.constexpr,
               WALK: gl.constexpr):
    """Step t of ``walk``: its Q, dO, lse2 and delta (and bias tile) into the ring's step g (its slot
    and round; g = t but in the persistent pass), once the consumers have released the slot."""
    slot = g % NUM_STAGES
    mbarrier.wait(empty.index(slot), ((g // NUM_STAGES) & 1) ^ 1)  # a fresh barrier: round 0 passes
    member, blk = _step_coords(t, walk, LEFT, LISTS, WALK)
    head = first_head + member
    row = stats_row0 + head
    bar = ready.index(slot)
    nbytes: gl.constexpr = (q_desc.block_type.nbytes + do_desc.block_type.nbytes + lse_desc.block_type.nbytes
                            + dl_desc.block_type.nbytes + (bias_desc.block_type.nbytes if BIAS else 0))
    mbarrier.expect(bar, nbytes)
    tma.async_copy_global_to_shared(q_desc, [batch, head, q_start + blk * BLOCK_M, 0], bar, q_ring.index(slot))
    tma.async_copy_global_to_shared(do_desc, [batch, head, q_start + blk * BLOCK_M, 0], bar, do_ring.index(slot))
    tma.async_copy_global_to_shared(lse_desc, [row, blk * BLOCK_M], bar, lse_ring.index(slot))
    tma.async_copy_global_to_shared(dl_desc, [row, blk * BLOCK_M], bar, dl_ring.index(slot))
    if BIAS:
        tma.async_copy_global_to_shared(bias_desc, [bias_at[0], head // bias_at[1], blk * BLOCK_M, n0], bar,
                                        bias_ring.index(slot))


@gluon.jit
def _producer(q_desc, do_desc, k_desc, v_desc, dk_desc, dv_desc, lse_desc, dl_desc, bias_desc, k_smem, v_smem, q_ring,
              do_ring, lse_ring, dl_ring, bias_ring, kv_bars, ready, empty, done, batch, head_kv, first_head, n0, seq_q,
              seq_k, heads_q, group, window_left, entries, bias_at, packed, SPLIT: gl.constexpr,
              BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, NUM_STAGES: gl.constexpr, CAUSAL: gl.constexpr,
              LEFT: gl.constexpr, DQ: gl.constexpr, LISTS: gl.constexpr, GROUP_SUM: gl.constexpr, BIAS: gl.constexpr,
              VARLEN: gl.constexpr, WALK: gl.constexpr):
    """``group``: the query heads the walk covers, from ``first_head`` on (1 with GROUP_SUM). BIAS:
    each step's bias tile (queries x the program's keys) lands in the ring slot with Q and dO, read
    in the bias's own shape at batch ``bias_at[0]``, head ``head // bias_at[1]``. ``packed``
    (``_dkdv_ws_kernel``): the first query and key rows of the program's sequence and its first row
    of the row statistics (and what the consumers take); with VARLEN the consumers store dK, dV
    themselves, but for the group sums."""
    q_start, k_start, stats_row0 = packed[0], packed[1], packed[2]
    KEYS: gl.constexpr = k_desc.block_type.shape[2]
    for c in gl.static_range(SPLIT):
        nc = n0 + c * KEYS
        if DQ:  # every tile: dQ = dS K reads all of them, and TMA zero-fills rows past Sk
            live = nc >= 0
        else:  # a tile entirely past Sk is not loaded (its consumer skips every step)
            live = nc < seq_k
        mbarrier.expect(kv_bars.index(c), k_desc.block_type.nbytes + v_desc.block_type.nbytes, pred=live)
        tma.async_copy_global_to_shared(k_desc, [batch, head_kv, k_start + nc, 0], kv_bars.index(c), k_smem.index(c),
                                        pred=live)
        tma.async_copy_global_to_shared(v_desc, [batch, head_kv, k_start + nc, 0], kv_bars.index(c), v_smem.index(c),
                                        pred=live)
    n_steps, walk = _query_walk(n0, seq_q, seq_k, group, window_left, entries, BLOCK_M, BLOCK_N, CAUSAL, LEFT,
                                DQ or VARLEN, LISTS)
    for t in range(n_steps):
        _load_step(t, t, walk, q_desc, do_desc, lse_desc, dl_desc, bias_desc, q_ring, do_ring, lse_ring, dl_ring,
                   bias_ring, ready, empty, batch, first_head, stats_row0, q_start, n0, bias_at, BLOCK_M, NUM_STAGES,
                   LEFT, LISTS, BIAS, WALK)
    # Each consumer's dK, dV out by TMA, rows past Sk clipped: stored (16-bit, in its K/V buffers),
    # or with GROUP_SUM added into the fp32 group sums (staged by ``_group_sum_staging``). The
    # producer issues them so that no consumer touches a descriptor: in a consumer, ptxas kept the
    # descriptor address live across the loop and spilled it.
    # With VARLEN the rows past Sk are the next sequence's, which a TMA store would overwrite: the
    # consumers store dK, dV by masked pointer stores; the group sums' reduce-adds add zeros there.
    STAGE_LAYOUT: gl.constexpr = dk_desc.layout
    if GROUP_SUM or not VARLEN:
        for c in gl.static_range(SPLIT):
            nc = n0 + c * KEYS
            if nc < seq_k:
                mbarrier.wait(done.index(c), 0)
                if GROUP_SUM:
                    dk_buf, dv_buf = _group_sum_staging(k_smem, v_smem, q_ring, do_ring, c, STAGE_LAYOUT)
                    tma_reduce_add(dk_desc, [batch, head_kv, k_start + nc, 0], dk_buf)
                    tma_reduce_add(dv_desc, [batch, head_kv, k_start + nc, 0], dv_buf)
                else:
                    tma.async_copy_shared_to_global(dk_desc, [batch, head_kv, nc, 0], k_smem.index(c))
                    tma.async_copy_shared_to_global(dv_desc, [batch, head_kv, nc, 0], v_smem.index(c))
        tma.store_wait(pendings=0)


@gluon.jit
def _group_sum_staging(k_smem, v_smem, q_ring, do_ring, WG: gl.constexpr, layout: gl.constexpr):
    """GROUP_SUM: the shared-memory tiles that stage warpgroup WG's fp32 dK and dV (64 keys x D,
    the size of two 16-bit K tiles) for their reduce-adds: warpgroup 0's in the K tiles and the Q
    ring, warpgroup 1's in the V tiles and the dO ring (two warpgroups, a ring of >= 128 rows). All
    of them are free once both warpgroups have finished their walk."""
    KEYS: gl.constexpr = k_smem.shape[3]
    HEAD_D: gl.constexpr = k_smem.shape[4]
    if WG == 0:
        dk_buf = k_smem._reinterpret(gl.float32, [1, 1, KEYS, HEAD_D], layout)
        dv_buf = q_ring._reinterpret(gl.float32, [1, 1, KEYS, HEAD_D], layout)
    else:
        dk_buf = v_smem._reinterpret(gl.float32, [1, 1, KEYS, HEAD_D], layout)
        dv_buf = do_ring._reinterpret(gl.float32, [1, 1, KEYS, HEAD_D], layout)
    return dk_buf, dv_buf


@gluon.jit
def _load_turn(ptr):
    """The int32 at ``ptr`` (a turn counter), read at GPU scope -- from L2, where the predecessor's
    release lands -- by every lane (one address). Relaxed, not acquire: what the turn orders is the
    drain's TMA reduce-adds, which are performed in L2 after the predecessor's (completed before its
    release, ``_bulk_writes_done``) because they are issued only once this read has returned the
    turn; the drain reads nothing through L1, which an acquire would invalidate. So the read can be
    issued a step early (``_drain``), its latency under the completion wait. An acquire there waits
    for the read before the completion wait starts (measured: half the gain)."""
    return gl.inline_asm_elementwise("ld.relaxed.gpu.global.b32 $0, [$1];", "=r,l", [ptr], dtype=gl.int32,
                                     is_pure=False, pack=1)


@gluon.jit
def _bulk_writes_done():
    """Waits until this thread's bulk async groups (the TMA reduce-adds) have completed -- their writes
    performed, not only their shared-memory sources read, as ``tma.store_wait`` waits -- and orders
    them (async proxy) before the generic-proxy release that follows. Returns 0."""
    return gl.inline_asm_elementwise("cp.async.bulk.wait_group 0;\n\tfence.proxy.async.global;\n\tmov.u32 $0, 0;",
                                     "=r", [], dtype=gl.int32, is_pure=False, pack=1)


@gluon.jit
def _dq_turn(blk, pid_n, seq_q, seq_k, key_blocks, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr,
             WALK: gl.constexpr):
    """ORDERED: how many programs add into query block ``blk``'s dQ before program ``pid_n``. The
    programs visiting a block add in launch order. Ascending key blocks -- without a window every
    program visits every query block; WALK_DESCENDING, under a causal bound, key blocks 0 .. n_max(blk)
    (the last whose keys a row of ``blk`` sees) visit it, heaviest first, each walk reaching it at the
    same step, so a program's adds trail its predecessor's by a drain hop and it must start well after
    it (``common.ordered_chunk_rows``). WALK_MASKED_FIRST (causal): descending key blocks, the lightest
    launched first and walking its masked steps first, so the diagonal's program, whose first step is
    ``blk``, never waits, nor does any program reach a block before its predecessor has."""
    if WALK == WALK_MASKED_FIRST:
        last_visible_key = (blk + 1) * BLOCK_M - 1 + (seq_k - seq_q)  # >= pid_n * BLOCK_N: pid_n visits blk
        return gl.minimum(last_visible_key // BLOCK_N, key_blocks - 1) - pid_n
    else:
        return pid_n


@gluon.jit
def _reduce_dq(g, dq_desc, dq_state, batch, head, first_row, SPLIT: gl.constexpr, BLOCK_M: gl.constexpr,
               HEAD_D: gl.constexpr, ORDERED: gl.constexpr):
    """The drain's reduce-adds of the hand-off round g (the ring's step; g = t but in the persistent
    pass): each consumer's dQ tile of the query block whose first row is ``first_row`` of ``head``,
    once it is staged (dq_full)."""
    dq_s, dq_full = dq_state[1], dq_state[3]
    ROWS: gl.constexpr = _dq_tile_rows(dq_desc.block_type.shape)
    COLS: gl.constexpr = _dq_tile_cols(dq_desc.block_type.shape)
    RUNS: gl.constexpr = _in_register_order(dq_desc.block_type.shape)
    BY_KEYS: gl.constexpr = _dq_by_keys(ROWS, COLS, BLOCK_M, HEAD_D)
    for w in gl.static_range(SPLIT):
        mbarrier.wait(dq_full.index(w), g & 1)
        row0 = first_row + (w * ROWS) % BLOCK_M
        col0 = (w * COLS) % HEAD_D
        if RUNS:  # the tile's run: run r of a head covers rows [64 (r // (D / 64)), + 64)
            run = (row0 // ROWS) * (HEAD_D // COLS) + col0 // COLS
            tma_reduce_add(dq_desc, [batch, head, run * dq_desc.block_type.shape[2], 0], dq_s.index(w))
        else:
            tma_reduce_add(dq_desc, [batch, head, row0, col0], dq_s.index(w))
        if ORDERED and BY_KEYS:  # every warpgroup's tile covers the same entries: one add at a time
            _bulk_writes_done()


@gluon.jit
def _drain(dq_desc, dbias_desc, dq_state, batch, first_head, n0, seq_q, seq_k, group, window_left, entries, bias_at,
           q_start, order_at, SPLIT: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr,
           HEAD_D: gl.constexpr, CAUSAL: gl.constexpr, LEFT: gl.constexpr, DQ: gl.constexpr, LISTS: gl.constexpr,
           DBIAS: gl.constexpr, VARLEN: gl.constexpr, ORDERED: gl.constexpr, WALK: gl.constexpr):
    """DQ: per step, each consumer's dQ tile (fp32, shared) into the fp32 accumulator by one TMA
    reduce-add (rows past Sq clipped), then the staging buffers are handed back: its columns
    (D=128), its rows (D=64, 128-row steps) or all columns over its own keys (D=64, ``_dq_tile``).
    DBIAS: also the step's dS (queries x the program's keys, staged query-major by ``_stage_ds``) stored as the bias gradient,
    one program per entry (a bias of the full (B, Hq, Sq, Sk) shape), rows past Sq and keys past Sk
    clipped. Without DQ: nothing. With VARLEN the rows past Sq are the next sequence's: their dS is
    0 (lse2 = +inf in the statistics' padding), so their reduce-adds add zeros.
    ORDERED (deterministic mode; no lists, window, bias or packing): each query block's dQ is summed
    in a fixed order of programs. ``order_at`` = (the zeroed int32 turn counters, one per (batch *
    Hq + head, query block), heads_q, key_blocks): the drain waits for its turn (``_dq_turn``) before
    its reduce-adds and passes the turn on once they have completed; WALK (``_step_coords``) is the
    order the programs reach the blocks in."""
    if DQ:
        ds_s, dq_empty = dq_state[0], dq_state[4]
        n_steps, walk = _query_walk(n0, seq_q, seq_k, group, window_left, entries, BLOCK_M, BLOCK_N, CAUSAL, LEFT,
                                    DQ or VARLEN, LISTS)
        if ORDERED:  # the first step's counter (the group's first one where there is no step: in bounds)
            query_blocks = gl.cdiv(seq_q, BLOCK_M)
            locks = order_at[0] + (batch * order_at[1] + first_head).to(gl.int64) * query_blocks  # its first head's
            member, blk = _step_coords(0, walk, LEFT, LISTS, WALK)
            seen = _load_turn(locks + gl.where(n_steps > 0, member * query_blocks + blk, 0))
        for t in range(n_steps):
            member, blk = _step_coords(t, walk, LEFT, LISTS, WALK)
            if ORDERED:
                lock = locks + member * query_blocks + blk
                turn = _dq_turn(blk, n0 // BLOCK_N, seq_q, seq_k, order_at[2], BLOCK_M, BLOCK_N, WALK)
                while seen != turn:  # ``seen``: read a step early
                    seen = _load_turn(lock)
            _reduce_dq(t, dq_desc, dq_state, batch, first_head + member, q_start + blk * BLOCK_M, SPLIT, BLOCK_M,
                       HEAD_D, ORDERED)
            if DBIAS:  # every warpgroup's dQ wgmma came after its dS store: the whole tile is there
                tma.async_copy_shared_to_global(dbias_desc, [bias_at[0], (first_head + member) // bias_at[1],
                                                             blk * BLOCK_M, n0], ds_s.index(t % 2))
            tma.store_wait(pendings=0)
            for w in gl.static_range(SPLIT):
                mbarrier.arrive(dq_empty.index(w), count=1)
            if ORDERED:
                # The next step's counter read now, its round trip under this step's completion wait:
                # read after it, the drain's step (read, adds, completion, release) outlasts a
                # 64-row step at D=128 and paces the consumers (they wait for dq_empty).
                member, blk = _step_coords(gl.minimum(t + 1, n_steps - 1), walk, LEFT, LISTS, WALK)
                seen = _load_turn(locks + member * query_blocks + blk)
                # the next program's turn once the adds are in memory
                gl.atomic_add(lock, 1 + _bulk_writes_done(), sem="release", scope="gpu")


# --------------------------------------------------------------------------- consumers


@gluon.jit
def _skip(t, ready, empty, turn_bars, WG: gl.constexpr, NUM_STAGES: gl.constexpr, PINGPONG: gl.constexpr):
    """A step none of this warpgroup's keys sees: take the turn, wait for the slot to land (so that
    the release counts in this round of empty[slot]) and release it."""
    slot = t % NUM_STAGES
    turn_wait(turn_bars, t, WG, PINGPONG)
    turn_pass(turn_bars, WG, PINGPONG)
    mbarrier.wait(ready.index(slot), (t // NUM_STAGES) & 1)
    mbarrier.arrive(empty.index(slot), count=1)


@gluon.jit
def _ds_buffer(ds_s, t, BIAS: gl.constexpr):
    """DQ split by columns: step t's shared dS buffer (double-buffered by parity) as ``_stage_ds``
    writes it and ``_dq_tile`` reads it -- (keys x queries), or with BIAS (queries x keys)."""
    buf = ds_s.index(t % 2)
    if BIAS:
        buf = buf.reshape([ds_s.shape[3], ds_s.shape[4]])
    return buf


# dQ's staging, two forms; the host picks one with the accumulator's descriptor
# (``dq_accumulator_descriptor``), whose box the staging buffer takes:
# - the accumulator's own (rows, 64) tile, 128-byte swizzled: 64-bit stores with 2-way bank conflicts
#   (a half-warp's 4 rows of 32 bytes fall on 4 of the swizzle's 8 16-byte chunks);
# - register order: the 64 x 64 tile as one run of 4096 floats in the wgmma accumulator's register
#   order (``constants.REGISTER_ORDER_BASES``: each thread's (r, c), (r, c + 1), (r + 8, c), (r + 8,
#   c + 1) one 16-byte vector, a warp's lanes 0-7 on 8 different 16-byte chunks), stored without bank
#   conflicts and added with one reduce-add through a (128, 32) unswizzled box over the accumulator
#   viewed as runs; ``triton_bwd._convert_dq_kernel`` puts the elements back in place. Whole 64-row
#   tiles only.
RUN_BOX = (128, 32)  # a 64 x 64 run as the reduce-add's box: 128 rows of 32 floats


@gluon.constexpr_function
def _register_order_layout():
    return gl.SharedLinearLayout(offset_bases=[list(b) for b in REGISTER_ORDER_BASES])


@gluon.constexpr_function
def _in_register_order(box):
    """Whether a dQ staging box (its shape: the descriptor's block or the staging buffer, last two
    dims) holds runs: a tile's own box is 64 columns wide."""
    return box[-1] == RUN_BOX[1]


@gluon.constexpr_function
def _dq_tile_rows(box):
    """Rows of the warpgroup's dQ tile staged in ``box`` (as ``_in_register_order``)."""
    return 64 if _in_register_order(box) else box[-2]


@gluon.constexpr_function
def _dq_tile_cols(box):
    return 64 if _in_register_order(box) else box[-1]


@gluon.constexpr_function
def _dq_by_keys(dq_rows, dq_cols, block_m, head_d):
    """Whether dQ is split by keys (each warpgroup's tile is all of the step's rows and columns, over
    its own keys): else by columns or rows, over every warpgroup's keys of a shared dS buffer."""
    return dq_rows == block_m and dq_cols == head_d


@gluon.jit
def _stage_ds(t, ds16, k_smem, dq_state, WG: gl.constexpr, BIAS: gl.constexpr):
    """DQ: this warpgroup's dS^T of dS round t (the step's round of ds_bar) into shared memory for the
    dQ wgmmas of ``_dq_tile``, fenced for the async proxy and, with dQ split by columns, announced to
    the other warpgroups.
    ``_step`` calls it while this warpgroup's dV and dK wgmmas run.

    Split by columns (``dq_cols`` < D: D=128, two warpgroups): a slice of the step's shared dS
    buffer per warpgroup, then an arrive on ds_bar. dS is double-buffered by step parity: a
    warpgroup rewrites buffer t % 2 at step t + 2 only after passing ds_bar at t + 1, which the
    others arrive on only after their dQ wgmmas of step t.
    Split by rows (D=64 with 128-row steps: each warpgroup's dQ tile is 64 of the step's rows) the
    same way: each warpgroup reads every warpgroup's keys of dS.
    Split by keys (``dq_cols`` = D with 64-row steps: D=64, whose 128-byte K rows are one swizzle
    atom and cannot be split by columns): this warpgroup's own dS^T buffer (rewritten a step later,
    after this step's dQ wgmma has finished); no barrier between warpgroups.
    BIAS (columns split only): dS is staged query-major instead -- a (queries x keys) tile, this
    warpgroup's keys a column slice, written transposed -- so that the drain can store it as the
    bias gradient (TMA cannot transpose); dQ's wgmma then reads it K-major."""
    ds_s, dq_s, ds_bar, dq_full, dq_empty, _ = dq_state
    KEYS: gl.constexpr = k_smem.shape[3]
    BY_KEYS: gl.constexpr = _dq_by_keys(_dq_tile_rows(dq_s.shape), _dq_tile_cols(dq_s.shape), ds16.shape[1],
                                        k_smem.shape[4])
    if BY_KEYS:
        ds_s.index(WG).store(ds16)
    elif BIAS:
        _ds_buffer(ds_s, t, BIAS).slice(WG * KEYS, KEYS, dim=1).store(ds16.permute((1, 0)))
    else:
        _ds_buffer(ds_s, t, BIAS).slice(WG * KEYS, KEYS, dim=0).store(ds16)
    fence_async_shared()
    gl.thread_barrier()  # this warpgroup's stores are done (a named barrier over the partition)
    if not BY_KEYS:
        mbarrier.arrive(ds_bar.index(t % 2), count=1)


@gluon.jit
def _dv_operand(p, a_layout: gl.constexpr, dtype: gl.constexpr, DROPOUT: gl.constexpr):
    """P^T as dV's register A operand: what multiplied V in the forward -- with DROPOUT the kept
    probabilities (a dropped one carries its sign bit, ``dropout_mark_t``; the keep scale comes at
    the end)."""
    if DROPOUT:
        p = gl.maximum(p, 0.0)
    return gl.convert_layout(p.to(dtype), a_layout)


@gluon.constexpr_function
def _dq_wgmmas(dq_rows, dq_cols, block_m, head_d, split):
    """How many wgmmas ``_dq_issue`` chains: one split by keys, else one per warpgroup's keys."""
    return 1 if _dq_by_keys(dq_rows, dq_cols, block_m, head_d) else split


@gluon.jit
def _dq_issue(t, k_smem, dq_state, dq_zero, WG: gl.constexpr, SPLIT: gl.constexpr, BLOCK_M: gl.constexpr,
              BIAS: gl.constexpr):
    """DQ: issues this warpgroup's share of the step's dQ = dS K (unscaled) from the dS^T ``_stage_ds``
    staged: with dQ split by columns, once every warpgroup's dS^T is there (ds_bar),
    dQ[:, 64 WG : 64 WG + 64] over all the program's keys; split by rows, likewise
    dQ[64 WG : 64 WG + 64, :]; split by keys, all columns over this warpgroup's own 64 keys (the
    drain adds every warpgroup's tile). Returns the last wgmma's token (SPLIT chained wgmmas, or one
    split by keys)."""
    ds_s, dq_s, ds_bar, dq_full, dq_empty, _ = dq_state
    KEYS: gl.constexpr = k_smem.shape[3]
    HEAD_D: gl.constexpr = k_smem.shape[4]
    ROWS: gl.constexpr = _dq_tile_rows(dq_s.shape)
    COLS: gl.constexpr = _dq_tile_cols(dq_s.shape)
    if _dq_by_keys(ROWS, COLS, BLOCK_M, HEAD_D):
        ds_own = ds_s.index(WG)
        dq = warpgroup_mma(ds_own.permute((1, 0)), k_smem.index(WG).reshape([KEYS, HEAD_D]), dq_zero,
                           use_acc=False, is_async=True)
    else:
        mbarrier.wait(ds_bar.index(t % 2), (t // 2) & 1)
        ds_buf = _ds_buffer(ds_s, t, BIAS)
        dq = dq_zero
        for c in gl.static_range(SPLIT):
            k_cols = k_smem.index(c).reshape([KEYS, HEAD_D])
            if COLS != HEAD_D:
                k_cols = k_cols.slice(WG * COLS, COLS, dim=1)
            if BIAS:
                ds_keys = ds_buf.slice(c * KEYS, KEYS, dim=1)
            else:
                ds_keys = ds_buf.slice(c * KEYS, KEYS, dim=0)
                if ROWS != BLOCK_M:  # this warpgroup's rows: one 128-byte swizzle atom of dS^T's rows
                    ds_keys = ds_keys.slice(WG * ROWS, ROWS, dim=1)
                ds_keys = ds_keys.permute((1, 0))
            dq = warpgroup_mma(ds_keys, k_cols, dq, use_acc=c > 0, is_async=True)
    return dq


@gluon.jit
def _dq_hand_off(t, dq, dq_state, scale, WG: gl.constexpr):
    """DQ: this warpgroup's finished dQ tile, scaled, into its staging tile for the drain's reduce-add,
    once the drain has reduced the previous step's: in register order where the staging buffer holds
    runs (16-byte stores without bank conflicts), else as the accumulator's own (rows, 64) tile."""
    dq_s, dq_full, dq_empty = dq_state[1], dq_state[3], dq_state[4]
    mbarrier.wait(dq_empty.index(WG), (t & 1) ^ 1)
    if _in_register_order(dq_s.shape):
        tile = dq_s.index(WG)._reinterpret(gl.float32, [dq.shape[0], dq.shape[1]], _register_order_layout())
    else:
        tile = dq_s.index(WG).reshape([dq.shape[0], dq.shape[1]])
    tile.store(dq * scale)
    fence_async_shared()
    gl.thread_barrier()
    mbarrier.arrive(dq_full.index(WG), count=1)


@gluon.jit
def _dq_tile(t, ds_t, k_smem, dq_state, dq_zero, scale, WG: gl.constexpr, SPLIT: gl.constexpr,
             BLOCK_M: gl.constexpr, BIAS: gl.constexpr):
    """DQ: this warpgroup's share of the step's dQ (``_dq_issue``, from dS round ``ds_t``), its wgmmas
    retired by one wait, then handed to the drain (``_dq_hand_off``, ring step t)."""
    dq = _dq_issue(ds_t, k_smem, dq_state, dq_zero, WG, SPLIT, BLOCK_M, BIAS)
    dq = warpgroup_mma_wait(num_outstanding=0, deps=[dq])
    _dq_hand_off(t, dq, dq_state, scale, WG)


@gluon.jit
def _alibi_step(t, walk, alibi_at, BLOCK_M: gl.constexpr, LEFT: gl.constexpr, LISTS: gl.constexpr,
                ALIBI: gl.constexpr, WALK: gl.constexpr = WALK_ASCENDING):
    """(slope in log2 units, first query row) of step t for ALiBi (``_step``); (0.0, 0) without it."""
    if ALIBI:
        member, blk = _step_coords(t, walk, LEFT, LISTS, WALK)
        slopes, first_row = alibi_at
        return gl.load(slopes + first_row + member) * LOG2E, blk * BLOCK_M
    else:
        return 0.0, 0


@gluon.jit
def _dropout_step(t, walk, dropout_at, first_key, BLOCK_M: gl.constexpr, LEFT: gl.constexpr, LISTS: gl.constexpr,
                  DROPOUT: gl.constexpr, WALK: gl.constexpr = WALK_ASCENDING):
    """Step t's dropout arguments for ``_step``: (seed, batch * Hq + head, first query row, first key,
    threshold, scale); ``dropout_at`` = (the call's seed, the statistics row of the group's first
    head, the threshold, the scale). Zeros without DROPOUT."""
    if DROPOUT:
        member, blk = _step_coords(t, walk, LEFT, LISTS, WALK)
        seed, first_row, threshold, keep_scale = dropout_at
        return seed, first_row + member, blk * BLOCK_M, first_key, threshold, keep_scale
    else:
        return 0, 0, 0, 0, 0, 1.0


@gluon.jit
def _step(t, ds_t, k_smem, v_s, q_ring, do_ring, lse_ring, dl_ring, ready, empty, turn_bars, dq_state, dk, dv, s_zero,
          dq_zero, keys, first_row, rule, seq_k, qk_scale, softcap_log2, scale, BLOCK_M: gl.constexpr,
          HEAD_D: gl.constexpr, NUM_STAGES: gl.constexpr, s_layout: gl.constexpr, a_layout: gl.constexpr,
          WG: gl.constexpr, SPLIT: gl.constexpr, PINGPONG: gl.constexpr, MASK: gl.constexpr, CAUSAL: gl.constexpr,
          LEFT: gl.constexpr, SOFTCAP: gl.constexpr, DQ: gl.constexpr, BIAS: gl.constexpr, RAGGED: gl.constexpr,
          ALIBI: gl.constexpr = False, alibi_slope=0.0, alibi_row0=0, DROPOUT: gl.constexpr = False,
          drop=(0, 0, 0, 0, 0, 1.0)):
    """One query block against this warpgroup's keys: the ring's step t, dS round ``ds_t`` (the same
    index, but in the persistent pass, whose tiles each take one dS round more than they have steps,
    ``_consumer_tiles``); first_row is used on MASK steps only (RAGGED:
    keys past Sk are masked there too, ``_query_walk``). With
    SOFTCAP the scores are capped before the mask, and dS^T takes the cap's derivative 1 - tanh^2.
    BIAS (with DQ, without SOFTCAP): the slot's bias tile, this warpgroup's keys read transposed,
    added in log2 units (its -inf entries give p = 0; a row with no key has lse2 = +inf). DROPOUT:
    the keep tile of ``drop`` (``_dropout_step``) says which probabilities reached the output: dV
    takes the kept ones, scaled; dP's dropped entries are 0 before delta is taken off (delta =
    rowsum(dO * O) of the dropped output), so dS^T = P^T * (keep * scale * dP^T - delta). The steps
    sum these without the keep scale, which dK, dQ and dV take once (``_consumer``)."""
    col_layout: gl.constexpr = gl.SliceLayout(0, s_layout)
    k_s = k_smem.index(WG).reshape([k_smem.shape[3], HEAD_D])
    slot = t % NUM_STAGES
    mbarrier.wait(ready.index(slot), (t // NUM_STAGES) & 1)
    q = q_ring.index(slot).reshape([BLOCK_M, HEAD_D])
    do = do_ring.index(slot).reshape([BLOCK_M, HEAD_D])
    # With dQ: S^T and dP^T issued back to back (with ping-pong 2 under one turn), dP^T's accumulator
    # not initialised (no register written before its issue), the exponentials under it -- with
    # ping-pong 2, and with no turns (FA4's schedule: the warpgroups meet only where dQ needs both
    # halves of dS^T). Without dQ the planner gives a config without turns turns
    # (dispatch.dkdv_without_dq).
    BACK_TO_BACK: gl.constexpr = DQ and PINGPONG != 1
    # Then, with dQ and no turns, FA4's order for the rest of the step (``DQ_FIRST`` below): with
    # the warpgroups in lockstep no other warpgroup's matmuls fill the tensor cores while one waits,
    # so each wait leaves a matmul of its own queued.
    DQ_FIRST: gl.constexpr = BACK_TO_BACK and PINGPONG == 0 and not SOFTCAP
    turn_wait(turn_bars, t, WG, PINGPONG)
    if PINGPONG == 1:
        s_tok = warpgroup_mma(k_s, q.permute((1, 0)), s_zero, use_acc=False, is_async=True)
        turn_pass(turn_bars, WG, PINGPONG)
        s = warpgroup_mma_wait(num_outstanding=0, deps=[s_tok])
    elif BACK_TO_BACK:
        s_tok = warpgroup_mma(k_s, q.permute((1, 0)), s_zero, use_acc=False, is_async=True)
        dp_tok = warpgroup_mma(v_s, do.permute((1, 0)), s_zero, use_acc=False, is_async=True)
        turn_pass(turn_bars, WG, PINGPONG)
        s = warpgroup_mma_wait(num_outstanding=1, deps=[s_tok])
    else:
        s = warpgroup_mma(k_s, q.permute((1, 0)), s_zero, use_acc=False)
    if PINGPONG == 2 and not BACK_TO_BACK:
        # dP^T's accumulator (-delta) is materialised only now: fewer registers live across S^T.
        delta = dl_ring.index(slot).reshape([BLOCK_M]).load(col_layout)
        if DROPOUT:  # dP^T itself: the dropped entries go before delta is taken off
            dp = warpgroup_mma(v_s, do.permute((1, 0)), s_zero)
        else:
            dp = warpgroup_mma(v_s, do.permute((1, 0)), s_zero - gl.expand_dims(delta, 0))
        turn_pass(turn_bars, WG, PINGPONG)
    if SOFTCAP:  # log2 units now (the cap is not linear)
        s, tanh_s = log2_scores(s, qk_scale, softcap_log2, True, True, k_s.dtype)
        qk_scale = 1.0
    if BIAS:
        bias_ring = dq_state[5]
        KEYS: gl.constexpr = k_smem.shape[3]
        bias = bias_ring.index(slot).reshape([BLOCK_M, bias_ring.shape[4]]).slice(WG * KEYS, KEYS, dim=1)
        s = s * qk_scale + bias.permute((1, 0)).load(s_layout).to(gl.float32) * LOG2E
        qk_scale = 1.0
    if ALIBI:
        # causal ALiBi's key-term form (kernels/triton/masking.alibi_mode), anchored at the step's first
        # aligned query row c: slope * (j - c) over this warpgroup's keys (the tile's rows), and the row
        # term slope * (i' - c) taken out of lse below
        key_part = alibi_slope * (keys - (alibi_row0 + rule[0])).to(gl.float32)
        s = s * qk_scale + gl.expand_dims(key_part, 1)
        qk_scale = 1.0
    if MASK:
        # keys past Sk reach dQ or are another sequence's: RAGGED gives them p = 0 exactly. Causal
        # softcap and causal dropout keep the per-column bounds: their steps measured slower per key row
        s = keep_scores(s, keys, first_row, seq_k, rule, CAUSAL, LEFT, RAGGED, True,
                        KEY_ROWS=not ((SOFTCAP or DROPOUT) and not LEFT))
    lse2 = lse_ring.index(slot).reshape([BLOCK_M]).load(col_layout)  # loaded late: not live across S^T
    if ALIBI:
        lse2 = lse2 + alibi_slope * gl.arange(0, BLOCK_M, layout=col_layout).to(gl.float32)
    p = gl.exp2(s * qk_scale - gl.expand_dims(lse2, 0))  # P^T (keys x queries), fp32
    if DROPOUT:
        # The keep bit rides in p's sign bit (a dropped p is stored negated, -0.0 included), so no
        # tile of bits stays live across dP^T: p >= 0, and the cap's derivative below keeps the sign.
        seed, batch_head, first_query, first_key, threshold, dropout_scale = drop
        p = dropout_mark_t(p, seed, batch_head, first_key, first_query, threshold, s_layout)
    if SOFTCAP:
        # dV first: then only P^T times the cap's derivative stays live across dP^T, not P^T and
        # tanh both (D=128 causal: 48 -> 24 B of stack, with dQ 104 -> 64 B).
        dv = warpgroup_mma(_dv_operand(p, a_layout, k_s.dtype, DROPOUT), do, dv)
        p = p * (1.0 - tanh_s * tanh_s)
    if PINGPONG != 2 and not BACK_TO_BACK:
        delta = dl_ring.index(slot).reshape([BLOCK_M]).load(col_layout)
        if DROPOUT:
            dp = warpgroup_mma(v_s, do.permute((1, 0)), s_zero)
        else:
            dp = warpgroup_mma(v_s, do.permute((1, 0)), s_zero - gl.expand_dims(delta, 0))  # dP^T - delta
    if BACK_TO_BACK:
        dp = warpgroup_mma_wait(num_outstanding=0, deps=[dp_tok])
        delta = dl_ring.index(slot).reshape([BLOCK_M]).load(col_layout)
        if not DROPOUT:  # dP^T - delta (with dropout, delta is taken off after the keep, below)
            dp = dp - gl.expand_dims(delta, 0)
    if DROPOUT:
        # A dropped probability's value never reached the output: its dP is 0. With the keep scale
        # taken out (dK, dQ, dV take it at the end) and delta divided by it, dS^T = P_kept dP^T -
        # P delta: a multiply-add, P_kept = max(p, 0) and P = |p|.
        kept_delta = gl.expand_dims(delta / dropout_scale, 0)
        ds16 = gl.fma(gl.maximum(p, 0.0), dp, -(gl.abs(p) * kept_delta)).to(k_s.dtype)
    else:
        ds16 = (p * dp).to(k_s.dtype)
    if DQ_FIRST:
        # dV issued, dS^T staged under it, dQ issued once every warpgroup's dS^T is there, then dK:
        # dV retired with dQ queued, dQ retired with dK queued, and dQ's hand-off to the drain
        # under dK.
        p_a = _dv_operand(p, a_layout, k_s.dtype, DROPOUT)
        dv = warpgroup_mma(p_a, do, dv, is_async=True)
        _stage_ds(ds_t, ds16, k_smem, dq_state, WG, BIAS)
        dq = _dq_issue(ds_t, k_smem, dq_state, dq_zero, WG, SPLIT, BLOCK_M, BIAS)
        # dQ's chained wgmmas stay queued: dV alone is retired
        DQ_WGMMAS: gl.constexpr = _dq_wgmmas(_dq_tile_rows(dq_state[1].shape), _dq_tile_cols(dq_state[1].shape),
                                             BLOCK_M, HEAD_D, SPLIT)
        dv, _ = warpgroup_mma_wait(num_outstanding=DQ_WGMMAS, deps=[dv, p_a])
        ds_a = gl.convert_layout(ds16, a_layout)
        dk = warpgroup_mma(ds_a, q, dk, is_async=True)
        dq = warpgroup_mma_wait(num_outstanding=1, deps=[dq])
        _dq_hand_off(t, dq, dq_state, scale, WG)
        dk, _ = warpgroup_mma_wait(num_outstanding=0, deps=[dk, ds_a])
        mbarrier.arrive(empty.index(slot), count=1)  # every wgmma reading the slot has retired
        return dk, dv
    # Otherwise with DQ, dV and dK are issued together and retired by one wait, this step's dS^T
    # staged for dQ under them: one wgmma round trip a step less, and the hand-off's store, fence
    # and barrier off the critical path (the D=128 dK/dV+dQ pass measured faster). Without DQ the
    # pair saves the round trip only: at D=128 level or a little faster, but D=64 causal slower, and
    # a mask's tile-list walk at D=128 spills with it (16 B) -- so there each wgmma keeps its own wait.
    ds_a = gl.convert_layout(ds16, a_layout)
    if not SOFTCAP:
        p_a = _dv_operand(p, a_layout, k_s.dtype, DROPOUT)
        dv = warpgroup_mma(p_a, do, dv, is_async=DQ)
    dk = warpgroup_mma(ds_a, q, dk, is_async=DQ)
    if DQ:
        _stage_ds(ds_t, ds16, k_smem, dq_state, WG, BIAS)
        if SOFTCAP:
            dk, _ = warpgroup_mma_wait(num_outstanding=0, deps=[dk, ds_a])
        else:
            dv, dk, _, _ = warpgroup_mma_wait(num_outstanding=0, deps=[dv, dk, p_a, ds_a])
    mbarrier.arrive(empty.index(slot), count=1)  # every wgmma reading the slot has retired
    if DQ:
        _dq_tile(t, ds_t, k_smem, dq_state, dq_zero, scale, WG, SPLIT, BLOCK_M, BIAS)
    return dk, dv


@gluon.constexpr_function
def _consumer_layout(columns):
    """A consumer warpgroup's wgmma accumulator layout, ``columns`` wide (64 rows: S^T, dP^T, dK, dV
    over its keys; its dQ tile)."""
    return gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, columns, 16])


@gluon.jit
def _consumer(k_smem, v_smem, q_ring, do_ring, lse_ring, dl_ring, kv_bars, ready, empty, done, walked, turn_bars,
              dq_state, n0, seq_q, seq_k, group, window_left, entries, qk_scale, softcap_log2, scale, WG: gl.constexpr,
              SPLIT: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, HEAD_D: gl.constexpr,
              NUM_STAGES: gl.constexpr, CAUSAL: gl.constexpr, LEFT: gl.constexpr, SOFTCAP: gl.constexpr,
              PINGPONG: gl.constexpr, DQ: gl.constexpr, LISTS: gl.constexpr, GROUP_SUM: gl.constexpr,
              stage_layout: gl.constexpr, BIAS: gl.constexpr, packed, VARLEN: gl.constexpr, alibi_at=0,
              ALIBI: gl.constexpr = False, dropout_at=0, DROPOUT: gl.constexpr = False,
              WALK: gl.constexpr = WALK_ASCENDING):
    """Keys [n0 + WG * 64, + 64) of the program, on one warpgroup, its steps in WALK's order
    (``_step_coords``; with DQ, no lists or left window but WALK_ASCENDING: the drain's ordered dQ). ALIBI
    (causal, no lists, bias or packing): ``alibi_at`` = (the (B, Hq) slopes, the statistics row of
    the group's first head); each step reads its query head's slope. DROPOUT (no lists, bias or
    packing): ``dropout_at`` (``_dropout_step``). VARLEN (packed sequences): dK, dV of the keys
    inside the sequence go out by pointer stores (``packed`` = (first query row, first key row,
    first statistics row, KV head, dK, dV, their row and head strides))."""
    RAGGED: gl.constexpr = DQ or VARLEN
    s_layout: gl.constexpr = _consumer_layout(BLOCK_M)  # S^T, dP^T: keys x queries
    acc_layout: gl.constexpr = _consumer_layout(HEAD_D)  # dK, dV: keys x D
    a_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=acc_layout, k_width=2)
    dtype: gl.constexpr = k_smem.dtype
    KEYS: gl.constexpr = k_smem.shape[3]

    n_steps, walk = _query_walk(n0, seq_q, seq_k, group, window_left, entries, BLOCK_M, BLOCK_N, CAUSAL, LEFT,
                                RAGGED, LISTS)
    n_interior_steps = walk[0]
    if DROPOUT:  # the steps sum unscaled kept terms (``_step``): dK, dQ and dV take the keep scale once
        scale = scale * dropout_at[3]
    rule = (seq_k - seq_q, window_left)
    nc = n0 + WG * KEYS
    k_s = k_smem.index(WG).reshape([KEYS, HEAD_D])
    v_s = v_smem.index(WG).reshape([KEYS, HEAD_D])
    keys = nc + gl.arange(0, KEYS, layout=gl.SliceLayout(1, s_layout))
    dk = gl.zeros([KEYS, HEAD_D], gl.float32, layout=acc_layout)
    dv = gl.zeros([KEYS, HEAD_D], gl.float32, layout=acc_layout)
    s_zero = gl.zeros([KEYS, BLOCK_M], gl.float32, layout=s_layout)
    if DQ:  # this warpgroup's dQ tile (``_dq_tile``)
        DQ_ROWS: gl.constexpr = _dq_tile_rows(dq_state[1].shape)
        DQ_COLS: gl.constexpr = _dq_tile_cols(dq_state[1].shape)
        dq_layout: gl.constexpr = _consumer_layout(DQ_COLS)
        dq_zero = gl.zeros([DQ_ROWS, DQ_COLS], gl.float32, layout=dq_layout)
    else:
        dq_zero = s_zero  # never read
    if DQ:
        # Every warpgroup runs every step (dQ needs all of dS; its keys past Sk or the diagonal
        # give p = 0 on masked steps) and reads every K tile.
        active = nc >= 0
        for c in gl.static_range(SPLIT):
            mbarrier.wait(kv_bars.index(c), 0)
        # Two phases, interior steps then masked ones -- or, WALK_MASKED_FIRST, the other way round (a
        # phase's MASK is ``(phase == 0) == MASKED_FIRST``, written out: an unrolled constexpr cannot
        # be bound to a name twice).
        MASKED_FIRST: gl.constexpr = WALK == WALK_MASKED_FIRST
        first_end = n_steps - n_interior_steps if MASKED_FIRST else n_interior_steps
        for phase in gl.static_range(2):
            if phase == 0:
                t_begin, t_end = 0, first_end
            else:
                t_begin, t_end = first_end, n_steps
            for t in range(t_begin, t_end):
                if (phase == 0) == MASKED_FIRST:
                    member, blk = _step_coords(t, walk, LEFT, LISTS, WALK)
                    first_row = blk * BLOCK_M
                else:
                    first_row = 0
                slope, row0 = _alibi_step(t, walk, alibi_at, BLOCK_M, LEFT, LISTS, ALIBI, WALK)
                drop = _dropout_step(t, walk, dropout_at, nc, BLOCK_M, LEFT, LISTS, DROPOUT, WALK)
                dk, dv = _step(t, t, k_smem, v_s, q_ring, do_ring, lse_ring, dl_ring, ready, empty, turn_bars, dq_state,
                               dk, dv, s_zero, dq_zero, keys, first_row, rule, seq_k, qk_scale, softcap_log2, scale,
                               BLOCK_M, HEAD_D, NUM_STAGES, s_layout, a_layout, WG, SPLIT, PINGPONG,
                               (phase == 0) == MASKED_FIRST, CAUSAL, LEFT, SOFTCAP, DQ, BIAS, RAGGED, ALIBI, slope,
                               row0, DROPOUT, drop)
        if not _dq_by_keys(DQ_ROWS, DQ_COLS, BLOCK_M, HEAD_D):
            # The other warpgroups' dQ wgmmas read this K tile: one more round of ds_bar before it
            # is overwritten with dK.
            ds_bar = dq_state[2]
            mbarrier.arrive(ds_bar.index(n_steps % 2), count=1)
            mbarrier.wait(ds_bar.index(n_steps % 2), (n_steps // 2) & 1)
    else:
        active = nc < seq_k  # else its keys are all past Sk: every step is skipped and nothing is stored
        mbarrier.wait(kv_bars.index(WG), 0, pred=active)
        interior_end = gl.where(active, n_interior_steps, 0)
        for t in range(0, interior_end):
            slope, row0 = _alibi_step(t, walk, alibi_at, BLOCK_M, LEFT, LISTS, ALIBI)
            drop = _dropout_step(t, walk, dropout_at, nc, BLOCK_M, LEFT, LISTS, DROPOUT)
            dk, dv = _step(t, t, k_smem, v_s, q_ring, do_ring, lse_ring, dl_ring, ready, empty, turn_bars, dq_state, dk,
                           dv, s_zero, dq_zero, keys, 0, rule, seq_k, qk_scale, softcap_log2, scale, BLOCK_M, HEAD_D,
                           NUM_STAGES, s_layout, a_layout, WG, SPLIT, PINGPONG, False, CAUSAL, LEFT, SOFTCAP, DQ, BIAS,
                           RAGGED, ALIBI, slope, row0, DROPOUT, drop)
        # Masked steps: run those whose query block sees some key of this warpgroup, skip the others
        # (every step, when inactive): query blocks [w_begin, w_end) are visible.
        w_end = 2147483647
        if LISTS:  # every partial tile of the list (the mask's own tiles are whole: the rule masks)
            w_begin = gl.where(active, 0, 2147483647)
        elif LEFT:  # this warpgroup's query blocks (block_range.py, for its 64 keys)
            w_begin, _, _, w_end = query_blocks_for_key_block(nc // KEYS, seq_q, seq_k, window_left, 0, BLOCK_M,
                                                              KEYS, LEFT, CAUSAL)
            w_begin = gl.where(active, w_begin, 2147483647)
        elif CAUSAL:  # query blocks before w_begin see none of this warpgroup's keys
            w_begin = gl.where(active, gl.maximum(nc - (seq_k - seq_q), 0) // BLOCK_M, 2147483647)
        else:  # VARLEN without a bound: every step of a key block crossing Sk is masked, and seen
            w_begin = gl.where(active, 0, 2147483647)
        if CAUSAL or LEFT or LISTS or VARLEN:
            for t in range(interior_end, n_steps):
                member, blk = _step_coords(t, walk, LEFT, LISTS)
                if LEFT:
                    visible = (blk >= w_begin) & (blk < w_end)
                else:
                    visible = blk >= w_begin
                if visible:
                    slope, row0 = _alibi_step(t, walk, alibi_at, BLOCK_M, LEFT, LISTS, ALIBI)
                    drop = _dropout_step(t, walk, dropout_at, nc, BLOCK_M, LEFT, LISTS, DROPOUT)
                    dk, dv = _step(t, t, k_smem, v_s, q_ring, do_ring, lse_ring, dl_ring, ready, empty, turn_bars,
                                   dq_state, dk, dv, s_zero, dq_zero, keys, blk * BLOCK_M, rule, seq_k, qk_scale,
                                   softcap_log2, scale, BLOCK_M, HEAD_D, NUM_STAGES, s_layout, a_layout, WG, SPLIT,
                                   PINGPONG, True, CAUSAL, LEFT, SOFTCAP, DQ, BIAS, RAGGED, ALIBI, slope, row0,
                                   DROPOUT, drop)
                else:
                    _skip(t, ready, empty, turn_bars, WG, NUM_STAGES, PINGPONG)
        else:
            for t in range(interior_end, n_steps):
                _skip(t, ready, empty, turn_bars, WG, NUM_STAGES, PINGPONG)
    if DROPOUT:
        dv = dv * dropout_at[3]
    if GROUP_SUM:
        # fp32 dK (* scale) and dV staged for the producer's reduce-adds, in buffers every
        # warpgroup's walk reads (K tiles, the ring): only once all walks are over (``walked``).
        gl.thread_barrier()
        mbarrier.arrive(walked, count=1)
        mbarrier.wait(walked, 0)
        if active:
            dk_buf, dv_buf = _group_sum_staging(k_smem, v_smem, q_ring, do_ring, WG, stage_layout)
            dk_buf.reshape([KEYS, HEAD_D]).store(dk * scale)
            dv_buf.reshape([KEYS, HEAD_D]).store(dv)
            fence_async_shared()
            gl.thread_barrier()
            mbarrier.arrive(done.index(WG), count=1)
    elif VARLEN:
        if active:  # the keys inside the sequence, by pointers (the rows past Sk are the next sequence's)
            _, k_start, _, head_kv, dk_ptr, dv_ptr, stride_row, stride_head = packed
            head_offset = head_kv.to(gl.int64) * stride_head
            store_sequence_rows(dk_ptr + head_offset, (dk * scale).to(dtype), nc, k_start, seq_k, stride_row,
                                acc_layout)
            store_sequence_rows(dv_ptr + head_offset, dv.to(dtype), nc, k_start, seq_k, stride_row, acc_layout)
    elif active:
        # dK (* scale) and dV into this warpgroup's K/V buffers (its wgmmas have all retired); the
        # producer stores them (those of keys past Sk are not stored).
        k_s.store((dk * scale).to(dtype))
        v_s.store(dv.to(dtype))
        fence_async_shared()
        gl.thread_barrier()  # a named barrier over this partition's warps
        mbarrier.arrive(done.index(WG), count=1)


# --------------------------------------------------------------------------- persistent pass
#
# One program per SM walks tiles (key blocks of a (batch, KV head)) in turn, in rounds over the
# launch order (``common.snake_tile``). What a tile costs beside its steps -- the launch, the
# barriers' set-up, the warps' dispatch, its K/V loads, its dK/dV stores -- then runs under the
# neighbouring tiles' work: the next tile's K and V are loaded as soon as every warpgroup has read
# the last ones, while dK and dV are staged and stored from the dS buffer that neither tile is using
# (a tile takes one dS round more than it has steps, ``_consumer_tiles``). The K/V tiles cannot
# stage dK/dV here: the next tile's K and V land in them. Where it runs: ``dkdv_programs``.


@gluon.jit
def _tiles_of_program(schedule):
    """How many tiles this program walks (``common.snake_tile``'s rounds; only the last round leaves
    programs without one)."""
    rounds = gl.cdiv(schedule[0], gl.num_programs(0))
    return rounds - (snake_tile(rounds - 1, schedule[0]) >= schedule[0]).to(gl.int32)


@gluon.jit
def _tile_at(i, schedule, BLOCK_N: gl.constexpr, CHUNKED: gl.constexpr):
    """(batch, KV head, first query head of its group, first key) of this program's i-th tile
    (``common.snake_tile``). ``schedule`` = (tiles, key blocks, head rows per chunk, Hkv, group): a
    tile index in ``launch_order`` (CHUNKED) or head-major, as the one-tile launch numbers its programs."""
    tiles, key_blocks, chunk_heads, heads_kv, group = schedule
    u = snake_tile(i, tiles)
    if CHUNKED:
        pid_bh, pid_n = launch_order(u, tiles // key_blocks, key_blocks, chunk_heads)
    else:
        pid_bh = u // key_blocks
        pid_n = u - pid_bh * key_blocks
    batch = pid_bh // heads_kv
    head_kv = pid_bh - batch * heads_kv
    return batch, head_kv, head_kv * group, pid_n * BLOCK_N


@gluon.jit
def _dkdv_staging(ds_s, end, dtype: gl.constexpr, layout: gl.constexpr, SPLIT: gl.constexpr, KEYS: gl.constexpr,
                  HEAD_D: gl.constexpr):
    """The persistent pass's dK, dV staging: the dS buffer of round ``end`` (a tile's extra round,
    read by no dQ wgmma), as 2 * SPLIT tiles of (KEYS, HEAD_D) -- warpgroup w's dK at w, its dV at
    SPLIT + w -- in the dK/dV descriptors' layout."""
    return ds_s.index(end % 2)._reinterpret(dtype, [2 * SPLIT, 1, 1, KEYS, HEAD_D], layout)


@gluon.jit
def _store_tile(i, end, batch, head_kv, n0, seq_k, dk_desc, dv_desc, ds_s, done, staged_free, SPLIT: gl.constexpr):
    """The producer's stores of tile i's dK and dV (keys past Sk clipped, tiles wholly past it not
    stored) once every consumer has staged them, then the staging buffer handed back."""
    KEYS: gl.constexpr = dk_desc.block_type.shape[2]
    HEAD_D: gl.constexpr = dk_desc.block_type.shape[3]
    DTYPE: gl.constexpr = dk_desc.dtype
    LAYOUT: gl.constexpr = dk_desc.layout
    staging = _dkdv_staging(ds_s, end, DTYPE, LAYOUT, SPLIT, KEYS, HEAD_D)
    for c in gl.static_range(SPLIT):
        nc = n0 + c * KEYS
        mbarrier.wait(done.index(c), i & 1)
        if nc < seq_k:
            tma.async_copy_shared_to_global(dk_desc, [batch, head_kv, nc, 0], staging.index(c))
            tma.async_copy_shared_to_global(dv_desc, [batch, head_kv, nc, 0], staging.index(SPLIT + c))
    tma.store_wait(pendings=0)  # the staging buffer read
    mbarrier.arrive(staged_free, count=1)


@gluon.jit
def _producer_tiles(q_desc, do_desc, k_desc, v_desc, dk_desc, dv_desc, lse_desc, dl_desc, k_smem, v_smem, q_ring,
                    do_ring, lse_ring, dl_ring, kv_bars, ready, empty, done, kv_free, staged_free, ds_s, schedule,
                    seq_q, seq_k, heads_q, window_left, SPLIT: gl.constexpr, BLOCK_M: gl.constexpr,
                    BLOCK_N: gl.constexpr, NUM_STAGES: gl.constexpr, CAUSAL: gl.constexpr, LEFT: gl.constexpr,
                    CHUNKED: gl.constexpr):
    """The persistent pass's loads and stores, tile after tile: K and V once the consumers have read
    the last tile's (``kv_free``), the ring's steps, and the previous tile's dK/dV stores after
    the tile's first step is issued (``_store_tile``; the consumers need the buffer back only at the
    step after)."""
    KEYS: gl.constexpr = k_desc.block_type.shape[2]
    group = schedule[4]
    ring = 0  # steps loaded so far; tile i - 1's last dS round is ring + i - 1 (``_consumer_tiles``)
    prev_batch = 0
    prev_head = 0
    prev_n0 = 0
    for i in range(_tiles_of_program(schedule)):
        batch, head_kv, first_head, n0 = _tile_at(i, schedule, BLOCK_N, CHUNKED)
        mbarrier.wait(kv_free, (i - 1) & 1, pred=i > 0)
        for c in gl.static_range(SPLIT):
            mbarrier.expect(kv_bars.index(c), k_desc.block_type.nbytes + v_desc.block_type.nbytes)
            tma.async_copy_global_to_shared(k_desc, [batch, head_kv, n0 + c * KEYS, 0], kv_bars.index(c),
                                            k_smem.index(c))
            tma.async_copy_global_to_shared(v_desc, [batch, head_kv, n0 + c * KEYS, 0], kv_bars.index(c),
                                            v_smem.index(c))
        n_steps, walk = _query_walk(n0, seq_q, seq_k, group, window_left, 0, BLOCK_M, BLOCK_N, CAUSAL, LEFT, True,
                                    False)
        for t in range(n_steps):
            if (t == 1) & (i > 0):
                _store_tile(i - 1, ring + i - 1, prev_batch, prev_head, prev_n0, seq_k, dk_desc, dv_desc, ds_s,
                            done, staged_free, SPLIT)
            _load_step(ring + t, t, walk, q_desc, do_desc, lse_desc, dl_desc, q_desc, q_ring, do_ring, lse_ring,
                       dl_ring, q_ring, ready, empty, batch, first_head, batch * heads_q, 0, n0, (0, 1), BLOCK_M,
                       NUM_STAGES, LEFT, False, False, False)
        if (n_steps < 2) & (i > 0):
            _store_tile(i - 1, ring + i - 1, prev_batch, prev_head, prev_n0, seq_k, dk_desc, dv_desc, ds_s, done,
                        staged_free, SPLIT)
        ring += n_steps
        prev_batch = batch
        prev_head = head_kv
        prev_n0 = n0
    n_tiles = _tiles_of_program(schedule)
    if n_tiles > 0:
        _store_tile(n_tiles - 1, ring + n_tiles - 1, prev_batch, prev_head, prev_n0, seq_k, dk_desc, dv_desc, ds_s,
                    done, staged_free, SPLIT)


@gluon.jit
def _drain_tiles(dq_desc, dq_state, schedule, seq_q, seq_k, window_left, SPLIT: gl.constexpr, BLOCK_M: gl.constexpr,
                 BLOCK_N: gl.constexpr, HEAD_D: gl.constexpr, CAUSAL: gl.constexpr, LEFT: gl.constexpr,
                 CHUNKED: gl.constexpr):
    """The persistent pass's dQ drain (``_drain``'s, tile after tile)."""
    dq_empty = dq_state[4]
    ring = 0
    for i in range(_tiles_of_program(schedule)):
        batch, _, first_head, n0 = _tile_at(i, schedule, BLOCK_N, CHUNKED)
        n_steps, walk = _query_walk(n0, seq_q, seq_k, schedule[4], window_left, 0, BLOCK_M, BLOCK_N, CAUSAL, LEFT,
                                    True, False)
        for t in range(n_steps):
            member, blk = _step_coords(t, walk, LEFT, False)
            _reduce_dq(ring + t, dq_desc, dq_state, batch, first_head + member, blk * BLOCK_M, SPLIT, BLOCK_M,
                       HEAD_D, False)
            tma.store_wait(pendings=0)
            for w in gl.static_range(SPLIT):
                mbarrier.arrive(dq_empty.index(w), count=1)
        ring += n_steps


@gluon.jit
def _consumer_tiles(k_smem, v_smem, q_ring, do_ring, lse_ring, dl_ring, kv_bars, ready, empty, done, kv_free,
                    staged_free, dq_state, schedule, seq_q, seq_k, window_left, qk_scale, softcap_log2, scale,
                    stage_layout: gl.constexpr, WG: gl.constexpr, SPLIT: gl.constexpr, BLOCK_M: gl.constexpr,
                    BLOCK_N: gl.constexpr, HEAD_D: gl.constexpr, NUM_STAGES: gl.constexpr, CAUSAL: gl.constexpr,
                    LEFT: gl.constexpr, SOFTCAP: gl.constexpr, PINGPONG: gl.constexpr, CHUNKED: gl.constexpr):
    """The persistent pass's warpgroup WG (``_consumer``'s with dQ, tile after tile). A tile's dS
    rounds are its steps and one more: after it every warpgroup's dQ wgmmas have read the K tiles
    (``kv_free``: the producer may load the next ones) and the dS buffer of that round is free to
    stage dK and dV (``_dkdv_staging``). The next tile's step 1 (or, with fewer steps, its staging)
    writes that buffer again: it waits until the stores have read it (``staged_free``)."""
    s_layout: gl.constexpr = _consumer_layout(BLOCK_M)  # S^T, dP^T: keys x queries
    acc_layout: gl.constexpr = _consumer_layout(HEAD_D)  # dK, dV: keys x D
    a_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=acc_layout, k_width=2)
    dtype: gl.constexpr = k_smem.dtype
    KEYS: gl.constexpr = k_smem.shape[3]
    DQ_ROWS: gl.constexpr = _dq_tile_rows(dq_state[1].shape)
    DQ_COLS: gl.constexpr = _dq_tile_cols(dq_state[1].shape)
    dq_layout: gl.constexpr = _consumer_layout(DQ_COLS)
    dq_zero = gl.zeros([DQ_ROWS, DQ_COLS], gl.float32, layout=dq_layout)
    s_zero = gl.zeros([KEYS, BLOCK_M], gl.float32, layout=s_layout)
    rule = (seq_k - seq_q, window_left)
    k_s = k_smem.index(WG).reshape([KEYS, HEAD_D])
    v_s = v_smem.index(WG).reshape([KEYS, HEAD_D])
    ds_s, ds_bar = dq_state[0], dq_state[2]
    ring = 0  # steps walked so far; a tile's dS rounds are its steps and one, so dS round = ring step + i
    for i in range(_tiles_of_program(schedule)):
        _, _, _, n0 = _tile_at(i, schedule, BLOCK_N, CHUNKED)
        n_steps, walk = _query_walk(n0, seq_q, seq_k, schedule[4], window_left, 0, BLOCK_M, BLOCK_N, CAUSAL, LEFT,
                                    True, False)
        n_interior_steps = walk[0]
        keys = n0 + WG * KEYS + gl.arange(0, KEYS, layout=gl.SliceLayout(1, s_layout))
        dk = gl.zeros([KEYS, HEAD_D], gl.float32, layout=acc_layout)
        dv = gl.zeros([KEYS, HEAD_D], gl.float32, layout=acc_layout)
        for c in gl.static_range(SPLIT):
            mbarrier.wait(kv_bars.index(c), i & 1)
        for phase in gl.static_range(2):  # interior steps, then masked ones (``_consumer``)
            if phase == 0:
                t_begin, t_end = 0, n_interior_steps
            else:
                t_begin, t_end = n_interior_steps, n_steps
            for t in range(t_begin, t_end):
                mbarrier.wait(staged_free, (i - 1) & 1, pred=(t == 1) & (i > 0))
                if phase == 1:
                    member, blk = _step_coords(t, walk, LEFT, False)
                    first_row = blk * BLOCK_M
                else:
                    first_row = 0
                # (no dropout: ``_dropout_step`` gives its zero arguments, as tensors)
                dk, dv = _step(ring + t, ring + t + i, k_smem, v_s, q_ring, do_ring, lse_ring, dl_ring, ready, empty,
                               ready, dq_state, dk, dv, s_zero, dq_zero, keys, first_row, rule, seq_k, qk_scale,
                               softcap_log2, scale, BLOCK_M, HEAD_D, NUM_STAGES, s_layout, a_layout, WG, SPLIT,
                               PINGPONG, phase == 1, CAUSAL, LEFT, SOFTCAP, True, False, True, False, 0.0, 0, False,
                               _dropout_step(t, walk, 0, 0, BLOCK_M, LEFT, False, False))
        end = ring + n_steps + i
        mbarrier.arrive(ds_bar.index(end % 2), count=1)
        mbarrier.wait(ds_bar.index(end % 2), (end // 2) & 1)
        mbarrier.arrive(kv_free, count=1)
        mbarrier.wait(staged_free, (i - 1) & 1, pred=(n_steps < 2) & (i > 0))
        staging = _dkdv_staging(ds_s, end, dtype, stage_layout, SPLIT, KEYS, HEAD_D)
        staging.index(WG).reshape([KEYS, HEAD_D]).store((dk * scale).to(dtype))
        staging.index(SPLIT + WG).reshape([KEYS, HEAD_D]).store(dv.to(dtype))
        fence_async_shared()
        gl.thread_barrier()
        mbarrier.arrive(done.index(WG), count=1)
        ring += n_steps


# --------------------------------------------------------------------------- kernel


@gluon.jit(do_not_specialize=["seq_q", "seq_k", "heads_q", "heads_kv", "group", "window_left", "list_stride_b",
                              "list_stride_h", "list_stride_n", "bias_batches", "bias_head_div", "key_blocks",
                              "chunk_heads", "tiles", "stride_kv_row", "stride_kv_head", "dropout_threshold"])
def _dkdv_ws_kernel(q_desc, do_desc, k_desc, v_desc, dk_desc, dv_desc, lse_desc, dl_desc, dq_desc, seq_q, seq_k,
                    heads_q, heads_kv, group, window_left, qk_scale, softcap_log2, scale, tile_lists, list_stride_b,
                    list_stride_h, list_stride_n, bias_desc, dbias_desc, bias_batches, bias_head_div, key_blocks,
                    chunk_heads, tiles, DK, DV, stride_kv_row, stride_kv_head, Alibi, DropoutSeed, dropout_threshold,
                    dropout_scale, DqLock, BLOCK_M: gl.constexpr,
                    HEAD_D: gl.constexpr,
                    CAUSAL: gl.constexpr, LEFT: gl.constexpr, SOFTCAP: gl.constexpr, NUM_STAGES: gl.constexpr,
                    SPLIT: gl.constexpr, PINGPONG: gl.constexpr, CHUNKED: gl.constexpr, DQ: gl.constexpr,
                    LISTS: gl.constexpr, GROUP_SUM: gl.constexpr, BIAS: gl.constexpr, DBIAS: gl.constexpr,
                    VARLEN: gl.constexpr, PRODUCER_REGS: gl.constexpr, CONSUMER_REGS: gl.constexpr,
                    num_warps: gl.constexpr, ALIBI: gl.constexpr = False, DROPOUT: gl.constexpr = False,
                    ORDERED: gl.constexpr = False, PERSISTENT: gl.constexpr = False,
                    WALK: gl.constexpr = WALK_ASCENDING):
    """The default partition is consumer warpgroup 0 (4 warps); workers: consumer warpgroups 1 (and
    2), 4 warps each, the 1-warp producer and, with DQ, the 1-warp dQ drain. LISTS: the steps come
    from the host's tile list of the program's key block (a mask), else from ``_query_walk``'s rule.
    A program covers one KV head's whole group of query heads, or with GROUP_SUM one query head,
    its dK/dV added into fp32 (B, Hkv, Sk, D) sums (``dk_desc``, ``dv_desc``) by reduce-adds.
    BIAS: a 16-bit bias by elements (``bias_desc``, block (1, 1, BLOCK_M, BLOCK_N) over its own
    (B|1, H|1, Sq, Sk) shape; batch index ``batch * bias_batches``, head ``head // bias_head_div``);
    DBIAS: its gradient stored through ``dbias_desc`` (same block, the full shape). Only in the
    5-matmul form with dQ split by columns (D=128), without softcap (``dispatch.gluon_dkdv_takes_bias``).
    VARLEN: packed sequences (varlen_attention): ``tile_lists`` is the host's map of the launch's
    ``key_blocks`` (sequence, key block) entries (packed_tiles.py), every head row taking each in
    turn; the descriptors view the packed (1, H, total rows, D) tensors, each step offset by its
    sequence's first rows; the row statistics are (sequences * Hq, padded rows); dK, dV go out by
    pointers (``DK``, ``DV``: row and head strides ``stride_kv_*``) or into the group sums.
    ORDERED (deterministic mode, with DQ; no lists, left window, bias, group sums or packing): each
    query block's dQ summed in a fixed order of programs (``_drain``), ``DqLock`` its turn counters
    (int32 (B * Hq, query blocks), zeroed); causal programs then walk in WALK's order
    (``_step_coords``, ``dkdv_walk``).
    PERSISTENT (with DQ split by rows, two warpgroups without turns; no lists, bias, group sums,
    packing, ALiBi, dropout or fixed order): a program per SM walks the launch's ``tiles`` tiles in
    rounds (``_consumer_tiles``)."""
    gl.static_assert(not (VARLEN and (LISTS or BIAS)), "packed sequences: no mask, no bias")
    gl.static_assert(not ORDERED or (DQ and not (LISTS or LEFT or BIAS or GROUP_SUM or VARLEN)),
                     "dQ in a fixed order: with DQ; no lists, left window, bias, group sums or packing")
    gl.static_assert(WALK == WALK_ASCENDING or (ORDERED and CAUSAL), "a fixed order's walk: ordered, causal")
    gl.static_assert(CHUNKED != 3 or WALK == WALK_DESCENDING, "the interleaved launch: heaviest first")
    gl.static_assert(not BIAS or (DQ and not SOFTCAP and HEAD_D == 128), "a bias: D=128, with dQ, no softcap")
    gl.static_assert(BIAS or not DBIAS, "a bias gradient needs the bias")
    gl.static_assert(num_warps == 4, "the default partition is one consumer warpgroup")
    gl.static_assert(SPLIT == 2 or SPLIT == 3, "two or three consumer warpgroups")
    gl.static_assert(NUM_STAGES >= 2, "at least two ring slots")
    gl.static_assert(not PERSISTENT or (DQ and SPLIT == 2 and PINGPONG == 0 and BLOCK_M >= 2 * HEAD_D
                                        and not (LISTS or BIAS or GROUP_SUM or VARLEN or ALIBI or DROPOUT
                                                 or ORDERED)),
                     "persistent: dQ split by rows (a dS buffer holds dK and dV), 2 warpgroups, no turns, plain")

    KEYS: gl.constexpr = k_desc.block_type.shape[2]
    gl.static_assert(not GROUP_SUM or (SPLIT == 2 and NUM_STAGES * BLOCK_M >= 2 * KEYS and not LISTS),
                     "group sums: staged in two warpgroups' K/V tiles and a ring of >= 128 rows; no lists")
    gl.static_assert(KEYS == 64, "K/V descriptors: 64-key blocks (one wgmma M of a warpgroup)")
    BLOCK_N: gl.constexpr = SPLIT * KEYS
    dtype: gl.constexpr = q_desc.dtype
    STAGE_LAYOUT: gl.constexpr = dk_desc.layout  # GROUP_SUM: the fp32 dK/dV tiles' (``_group_sum_staging``)

    if VARLEN:  # an entry of the map (heaviest first) and a head row, in launch order; batch 0
        pid_bh, sequence, pid_n, q_start, seq_q, k_start, seq_k = packed_tile(
            gl.program_id(0), heads_q if GROUP_SUM else heads_kv, key_blocks, chunk_heads, tile_lists)
    elif CHUNKED == 2:  # launch_order's chunks read off the grid (``common.chunk_grid``): no divisions
        pid_bh, pid_n = grid_tile()
    elif CHUNKED == 3:  # heaviest first, each chunk's light half among the next chunk's heavy half
        pid_bh, pid_n = interleaved_order(gl.program_id(0), gl.num_programs(0) // key_blocks, key_blocks,
                                          chunk_heads)
    elif CHUNKED:  # a 1-D launch, key block 0 (the heaviest under a causal bound) first in each chunk of rows
        pid_bh, pid_n = launch_order(gl.program_id(0), gl.num_programs(0) // key_blocks, key_blocks, chunk_heads)
    else:
        # Head-major: a 2-D grid (key blocks, rows). Block indices read from the grid cost no registers
        # across the loops (computed ones cost D=64's three-warpgroup pass 8 bytes of spills).
        pid_n = gl.program_id(0)
        pid_bh = gl.program_id(1)
    if WALK == WALK_MASKED_FIRST:  # descending key blocks: the order their dQ adds take (``_dq_turn``)
        pid_n = key_blocks - 1 - pid_n
    if GROUP_SUM:  # one query head
        batch = pid_bh // heads_q
        first_head = pid_bh % heads_q
        head_kv = first_head // group
        walk_group = 1
    else:  # the whole group of the KV head
        batch = pid_bh // heads_kv
        head_kv = pid_bh % heads_kv
        first_head = head_kv * group
        walk_group = group
    if VARLEN:
        stats_row0 = sequence * heads_q
    else:
        q_start = 0
        k_start = 0
        stats_row0 = batch * heads_q
    packed = (q_start, k_start, stats_row0, head_kv, DK, DV, stride_kv_row, stride_kv_head)
    alibi_at = (Alibi, stats_row0 + first_head)  # ALIBI: the slopes of the group's heads
    if DROPOUT:  # the call's seed, read once
        dropout_at = (gl.load(DropoutSeed), stats_row0 + first_head, dropout_threshold, dropout_scale)
    else:
        dropout_at = (0, 0, 0, 1.0)
    n0 = pid_n * BLOCK_N
    entries = tile_lists  # LISTS: this program's list (indexed by KV head)
    if LISTS:
        entries = (tile_lists + batch.to(gl.int64) * list_stride_b + head_kv.to(gl.int64) * list_stride_h
                   + pid_n.to(gl.int64) * list_stride_n)

    k_smem = gl.allocate_shared_memory(dtype, [SPLIT, 1, 1, KEYS, HEAD_D], k_desc.layout)
    v_smem = gl.allocate_shared_memory(dtype, [SPLIT, 1, 1, KEYS, HEAD_D], v_desc.layout)
    q_ring = gl.allocate_shared_memory(dtype, [NUM_STAGES, 1, 1, BLOCK_M, HEAD_D], q_desc.layout)
    do_ring = gl.allocate_shared_memory(dtype, [NUM_STAGES, 1, 1, BLOCK_M, HEAD_D], do_desc.layout)
    lse_ring = gl.allocate_shared_memory(gl.float32, [NUM_STAGES, 1, BLOCK_M], lse_desc.layout)
    dl_ring = gl.allocate_shared_memory(gl.float32, [NUM_STAGES, 1, BLOCK_M], dl_desc.layout)
    kv_bars = gl.allocate_shared_memory(gl.int64, [SPLIT, 1], mbarrier.MBarrierLayout())
    done = gl.allocate_shared_memory(gl.int64, [SPLIT, 1], mbarrier.MBarrierLayout())
    walked = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())  # GROUP_SUM: all walks over
    turn_bars = gl.allocate_shared_memory(gl.int64, [SPLIT, 1], mbarrier.MBarrierLayout())
    ready = gl.allocate_shared_memory(gl.int64, [NUM_STAGES, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [NUM_STAGES, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(SPLIT):
        mbarrier.init(kv_bars.index(i), count=1)
        mbarrier.init(done.index(i), count=1)
        mbarrier.init(turn_bars.index(i), count=1)
    for i in gl.static_range(NUM_STAGES):
        mbarrier.init(ready.index(i), count=1)
        mbarrier.init(empty.index(i), count=SPLIT)  # one release per consumer warpgroup
    mbarrier.init(walked, count=SPLIT)
    if DQ:
        # dS (keys x queries, every warpgroup's part, double-buffered) and each warpgroup's dQ tile:
        # its columns or rows, or all of them over its own keys (``_dq_tile``).
        DQ_ROWS: gl.constexpr = _dq_tile_rows(dq_desc.block_type.shape)
        DQ_COLS: gl.constexpr = _dq_tile_cols(dq_desc.block_type.shape)
        gl.static_assert((DQ_ROWS == BLOCK_M and (DQ_COLS == HEAD_D or DQ_COLS * SPLIT == HEAD_D))
                         or (DQ_COLS == HEAD_D and DQ_ROWS * SPLIT == BLOCK_M and not BIAS),
                         "dQ tiles: split by keys, columns or rows")
        if _dq_by_keys(DQ_ROWS, DQ_COLS, BLOCK_M, HEAD_D):  # each warpgroup's own dS^T (its wgmmas finish first)
            ds_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([KEYS, BLOCK_M], dtype)
            ds_s = gl.allocate_shared_memory(dtype, [SPLIT, KEYS, BLOCK_M], ds_layout)
        elif BIAS:  # query-major, laid out as the bias gradient's TMA tiles (``_stage_ds``)
            ds_s = gl.allocate_shared_memory(dtype, [2, 1, 1, BLOCK_M, BLOCK_N], bias_desc.layout)
        else:
            ds_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_N, BLOCK_M], dtype)
            ds_s = gl.allocate_shared_memory(dtype, [2, BLOCK_N, BLOCK_M], ds_layout)
        DQ_BOX: gl.constexpr = dq_desc.block_type.shape  # the staging buffer takes the reduce-add's box
        dq_s = gl.allocate_shared_memory(gl.float32, [SPLIT, 1, 1, DQ_BOX[2], DQ_BOX[3]], dq_desc.layout)
        ds_bar = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
        dq_full = gl.allocate_shared_memory(gl.int64, [SPLIT, 1], mbarrier.MBarrierLayout())
        dq_empty = gl.allocate_shared_memory(gl.int64, [SPLIT, 1], mbarrier.MBarrierLayout())
        for i in gl.static_range(2):
            mbarrier.init(ds_bar.index(i), count=SPLIT)
        for i in gl.static_range(SPLIT):
            mbarrier.init(dq_full.index(i), count=1)
            mbarrier.init(dq_empty.index(i), count=1)
        if BIAS:  # one bias tile per ring slot, loaded with its Q and dO
            bias_ring = gl.allocate_shared_memory(bias_desc.dtype, [NUM_STAGES, 1, 1, BLOCK_M, BLOCK_N],
                                                  bias_desc.layout)
        else:
            bias_ring = ds_s  # never read
        dq_state = (ds_s, dq_s, ds_bar, dq_full, dq_empty, bias_ring)
    else:
        bias_ring = ready  # never read
        dq_state = (ready, ready, ready, ready, ready, ready)  # never read
    bias_at = (batch * bias_batches, bias_head_div)
    fence_async_shared()

    # Constexprs go inline in the argument tuples (a tuple bound to a name first makes them tensors).
    # The 1-warp drain partition runs (and does nothing) without DQ too: one list per warpgroup count.
    #
    # compute-sanitizer's racecheck reports shared-memory hazards on this kernel, attributed to its
    # ``def`` line and to the ``gl.warp_specialize`` call below. None is in this kernel's own buffers:
    # every reported instruction (benchmarks/sanitize.py disassembles them) is Triton's dispatch of
    # the warps to their partitions, which its warp-specialize lowering writes into the kernel:
    #   - the default warpgroup stores one state byte per worker warp (which partition to run) just
    #     after our mbarrier inits and fence, and again, as the exit state, when it returns;
    #   - each worker warp loads its state byte at the head of its dispatch loop.
    # Both sides reach ``bar.sync 1`` (CTA-wide, every thread) between the stores and the load, on
    # entry and on exit: each store is ordered before the load it feeds, and no load can be overtaken
    # by the next store. So they cannot race. Memcheck and synccheck find nothing, and results are
    # bitwise repeatable (tests/test_semantics.py).
    if PERSISTENT:
        kv_free = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
        staged_free = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
        mbarrier.init(kv_free, count=SPLIT)
        mbarrier.init(staged_free, count=1)
        fence_async_shared()
        schedule = (tiles, key_blocks, chunk_heads, heads_kv, group)
        gl.warp_specialize([
            (_consumer_tiles, (k_smem, v_smem, q_ring, do_ring, lse_ring, dl_ring, kv_bars, ready, empty, done, kv_free,
                               staged_free, dq_state, schedule, seq_q, seq_k, window_left, qk_scale, softcap_log2,
                               scale, STAGE_LAYOUT, 0, SPLIT, BLOCK_M, BLOCK_N, HEAD_D, NUM_STAGES, CAUSAL, LEFT,
                               SOFTCAP, PINGPONG, CHUNKED)),
            (_consumer_tiles, (k_smem, v_smem, q_ring, do_ring, lse_ring, dl_ring, kv_bars, ready, empty, done, kv_free,
                               staged_free, dq_state, schedule, seq_q, seq_k, window_left, qk_scale, softcap_log2,
                               scale, STAGE_LAYOUT, 1, SPLIT, BLOCK_M, BLOCK_N, HEAD_D, NUM_STAGES, CAUSAL, LEFT,
                               SOFTCAP, PINGPONG, CHUNKED)),
            (_producer_tiles, (q_desc, do_desc, k_desc, v_desc, dk_desc, dv_desc, lse_desc, dl_desc, k_smem, v_smem,
                               q_ring, do_ring, lse_ring, dl_ring, kv_bars, ready, empty, done, kv_free, staged_free,
                               dq_state[0], schedule, seq_q, seq_k, heads_q, window_left, SPLIT, BLOCK_M, BLOCK_N,
                               NUM_STAGES, CAUSAL, LEFT, CHUNKED)),
            (_drain_tiles, (dq_desc, dq_state, schedule, seq_q, seq_k, window_left, SPLIT, BLOCK_M, BLOCK_N, HEAD_D,
                            CAUSAL, LEFT, CHUNKED)),
        ], [4, 1, 1], [CONSUMER_REGS, PRODUCER_REGS, PRODUCER_REGS])
    elif SPLIT == 2:
        gl.warp_specialize([
            (_consumer, (k_smem, v_smem, q_ring, do_ring, lse_ring, dl_ring, kv_bars, ready, empty, done, walked,
                         turn_bars, dq_state, n0, seq_q, seq_k, walk_group, window_left, entries, qk_scale,
                         softcap_log2, scale, 0, SPLIT, BLOCK_M, BLOCK_N, HEAD_D, NUM_STAGES, CAUSAL, LEFT, SOFTCAP,
                         PINGPONG, DQ, LISTS, GROUP_SUM, STAGE_LAYOUT, BIAS, packed, VARLEN, alibi_at, ALIBI, dropout_at,
                         DROPOUT, WALK)),
            (_consumer, (k_smem, v_smem, q_ring, do_ring, lse_ring, dl_ring, kv_bars, ready, empty, done, walked,
                         turn_bars, dq_state, n0, seq_q, seq_k, walk_group, window_left, entries, qk_scale,
                         softcap_log2, scale, 1, SPLIT, BLOCK_M, BLOCK_N, HEAD_D, NUM_STAGES, CAUSAL, LEFT, SOFTCAP,
                         PINGPONG, DQ, LISTS, GROUP_SUM, STAGE_LAYOUT, BIAS, packed, VARLEN, alibi_at, ALIBI, dropout_at,
                         DROPOUT, WALK)),
            (_producer, (q_desc, do_desc, k_desc, v_desc, dk_desc, dv_desc, lse_desc, dl_desc, bias_desc, k_smem,
                         v_smem, q_ring, do_ring, lse_ring, dl_ring, bias_ring, kv_bars, ready, empty, done, batch,
                         head_kv, first_head, n0, seq_q, seq_k, heads_q, walk_group, window_left, entries, bias_at,
                         packed, SPLIT, BLOCK_M, BLOCK_N, NUM_STAGES, CAUSAL, LEFT, DQ, LISTS, GROUP_SUM, BIAS,
                         VARLEN, WALK)),
            (_drain, (dq_desc, dbias_desc, dq_state, batch, first_head, n0, seq_q, seq_k, walk_group, window_left,
                      entries, bias_at, q_start, (DqLock, heads_q, key_blocks), SPLIT, BLOCK_M, BLOCK_N, HEAD_D,
                      CAUSAL, LEFT, DQ, LISTS, DBIAS, VARLEN, ORDERED, WALK)),
        ], [4, 1, 1], [CONSUMER_REGS, PRODUCER_REGS, PRODUCER_REGS])
    else:
        gl.warp_specialize([
            (_consumer, (k_smem, v_smem, q_ring, do_ring, lse_ring, dl_ring, kv_bars, ready, empty, done, walked,
                         turn_bars, dq_state, n0, seq_q, seq_k, walk_group, window_left, entries, qk_scale,
                         softcap_log2, scale, 0, SPLIT, BLOCK_M, BLOCK_N, HEAD_D, NUM_STAGES, CAUSAL, LEFT, SOFTCAP,
                         PINGPONG, DQ, LISTS, GROUP_SUM, STAGE_LAYOUT, BIAS, packed, VARLEN, alibi_at, ALIBI, dropout_at,
                         DROPOUT, WALK)),
            (_consumer, (k_smem, v_smem, q_ring, do_ring, lse_ring, dl_ring, kv_bars, ready, empty, done, walked,
                         turn_bars, dq_state, n0, seq_q, seq_k, walk_group, window_left, entries, qk_scale,
                         softcap_log2, scale, 1, SPLIT, BLOCK_M, BLOCK_N, HEAD_D, NUM_STAGES, CAUSAL, LEFT, SOFTCAP,
                         PINGPONG, DQ, LISTS, GROUP_SUM, STAGE_LAYOUT, BIAS, packed, VARLEN, alibi_at, ALIBI, dropout_at,
                         DROPOUT, WALK)),
            (_consumer, (k_smem, v_smem, q_ring, do_ring, lse_ring, dl_ring, kv_bars, ready, empty, done, walked,
                         turn_bars, dq_state, n0, seq_q, seq_k, walk_group, window_left, entries, qk_scale,
                         softcap_log2, scale, 2, SPLIT, BLOCK_M, BLOCK_N, HEAD_D, NUM_STAGES, CAUSAL, LEFT, SOFTCAP,
                         PINGPONG, DQ, LISTS, GROUP_SUM, STAGE_LAYOUT, BIAS, packed, VARLEN, alibi_at, ALIBI, dropout_at,
                         DROPOUT, WALK)),
            (_producer, (q_desc, do_desc, k_desc, v_desc, dk_desc, dv_desc, lse_desc, dl_desc, bias_desc, k_smem,
                         v_smem, q_ring, do_ring, lse_ring, dl_ring, bias_ring, kv_bars, ready, empty, done, batch,
                         head_kv, first_head, n0, seq_q, seq_k, heads_q, walk_group, window_left, entries, bias_at,
                         packed, SPLIT, BLOCK_M, BLOCK_N, NUM_STAGES, CAUSAL, LEFT, DQ, LISTS, GROUP_SUM, BIAS,
                         VARLEN, WALK)),
            (_drain, (dq_desc, dbias_desc, dq_state, batch, first_head, n0, seq_q, seq_k, walk_group, window_left,
                      entries, bias_at, q_start, (DqLock, heads_q, key_blocks), SPLIT, BLOCK_M, BLOCK_N, HEAD_D,
                      CAUSAL, LEFT, DQ, LISTS, DBIAS, VARLEN, ORDERED, WALK)),
        ], [4, 4, 1, 1], [CONSUMER_REGS, CONSUMER_REGS, PRODUCER_REGS, PRODUCER_REGS])


# --------------------------------------------------------------------------- launcher


def computes_dq(head_dim: int, config: KernelConfig) -> bool:
    """Whether the pass can also sum dQ (the 5-matmul form). With 64-row query steps: at D=128 two
    warpgroups each take a 64-column half (one 128-byte swizzle atom of the K tile; 128-row steps
    would need 330 KB of shared memory for the dS^T and fp32 dQ staging tiles, the SM has 227 KB), at
    D=64 each warpgroup (two or three) takes all 64 columns over its own keys. With 128-row steps at
    D=64 (two warpgroups): each takes 64 of the step's rows over all 128 keys (``_dq_tile``)."""
    if config.block_m == 64:
        return head_dim == 128 and config.hopper_split == 2 or head_dim == 64
    return config.block_m == 128 and head_dim == 64 and config.hopper_split == 2


DQ_COLS = 64  # columns of a warpgroup's dQ tile: half of D=128, all of D=64 (``computes_dq``)


def dq_tile_shape(block_m: int) -> tuple[int, int]:
    """(rows, columns) of one warpgroup's dQ tile: its rows a step's (``block_m`` = 64) or half of
    them (128-row steps, dQ split by rows)."""
    return min(block_m, 64), DQ_COLS


def dq_accumulator_descriptor(dq_accum: torch.Tensor, block_m: int, register_order: bool = False):
    """The fp32 (B, Hq, Sq, D) dQ accumulator, block (1, 1, ``dq_tile_shape``): one warpgroup's tile;
    or, ``register_order`` (Sq and D multiples of 64), viewed as runs of 64 x 64 tiles, (B, Hq, Sq *
    D / 32, 32), block (1, 1, ``RUN_BOX``), unswizzled."""
    if not register_order:
        return Descriptor(dq_accum, (1, 1, *dq_tile_shape(block_m)))
    batch, heads, rows, cols = dq_accum.shape
    assert rows % 64 == 0 and cols % 64 == 0 and dq_accum.is_contiguous()
    return UnswizzledDescriptor(dq_accum.view(batch, heads, rows * cols // RUN_BOX[1], RUN_BOX[1]), (1, 1, *RUN_BOX))


def dkdv_pass(q, k, v, dout, lse2, delta, dk, dv, spec: AttentionSpec, config: KernelConfig,
              dq_accum=None, tile_lists: tuple | None = None, group_sum: bool = False,
              bias: torch.Tensor | None = None, dbias: torch.Tensor | None = None, packing=None,
              alibi: torch.Tensor | None = None, dropout: tuple | None = None,
              dq_lock: torch.Tensor | None = None, dq_register_order: bool = False) -> bool:
    """dK, dV into ``dk``, ``dv`` (user layout) from the pre-pass's ``lse2``, ``delta`` ((B*Hq,
    padded rows), rows a multiple of ``config.block_m``); with ``dq_accum`` (fp32 (B, Hq, Sq, D),
    zeroed; ``computes_dq``) also dQ (scaled), summed into it by TMA reduce-adds in no fixed order.
    Returns False, launching nothing, where TMA cannot address a tensor (the caller then runs the
    Triton pass). The caller checked ``dispatch.gluon_support``; ``config.hopper_split`` (2 or 3) and
    ``hopper_pingpong`` (0, 1, 2) pick the schedule, ``block_m`` the query rows per step,
    ``num_stages`` the ring depth; programs start in ``common.launch_order``. ``tile_lists``: a mask's
    lists (lists, batch, head, key-block strides; ``kernels.triton.bwd.column_list_args``) at the config's
    tiles, whose own tiles are all empty or full.
    ``group_sum`` (``dispatch.sums_over_group``): a program per query head, dK/dV summed over each group in
    fp32 buffers, then converted into ``dk``, ``dv``. ``bias`` (with ``dq_accum``, D=128, no softcap;
    ``dispatch.gluon_reads_bias``): read by tiles; ``dbias`` (its gradient, the full (B, Hq, Sq, Sk)
    shape, the bias's dtype, its unvisited tiles already zero) stored tile by tile. ``packing``
    (spec.Packing; no mask or bias): q, k, v, dout, dk, dv are (1, total, H, D) views of packed
    sequences, the row statistics (sequences * Hq, padded rows) (``_packed_dkdv``). ``dq_lock``
    (with ``dq_accum``; no lists, left window, bias, group sums or packing): zeroed int32 turn
    counters, ``dq_lock_size`` of them, with which dQ is summed in a fixed order instead
    (deterministic mode, ``_drain``). ``dq_register_order`` (with ``dq_accum``, whose rows are then a
    multiple of 64; no packing): dQ's tiles staged and summed as register-order runs (the
    conversion takes ``triton_bwd.dq_from_sums(..., register_order=True)``)."""
    assert not dq_register_order or (dq_accum is not None and packing is None), \
        "dQ in register order: the pass with dQ, without packing"
    assert dq_lock is None or (dq_accum is not None and tile_lists is None and not group_sum and bias is None
                               and packing is None and not spec.has_window_left), \
        "dQ in a fixed order: the pass with dQ, without lists, window, bias, group sums or packing"
    assert spec.alibi == (alibi is not None), "spec.alibi and the slopes go together"
    assert spec.has_dropout == (dropout is not None), "spec.dropout_p and (seed, threshold, scale) go together"
    assert dropout is None or (packing is None and tile_lists is None and bias is None), \
        "dropout: the pass without lists, bias or packing (dispatch.gluon_dkdv_takes_dropout)"
    assert alibi is None or (packing is None and tile_lists is None and bias is None and spec.window_right == 0), \
        "ALiBi: the causal pass without lists, bias or packing (dispatch.gluon_dkdv_takes_alibi)"
    if packing is not None:
        return _packed_dkdv(q, k, v, dout, lse2, delta, dk, dv, spec, config, dq_accum, group_sum, packing)
    layout = spec.layout
    outputs = () if group_sum else (dk, dv)
    descs = [descriptor(q, config.block_m, layout), descriptor(dout, config.block_m, layout),
             *(descriptor(t, KEYS_PER_WG, layout) for t in (k, v, *outputs))]
    if any(d is None for d in descs):
        return False
    batch, heads_q, seqlen_q, head_dim = descs[0].shape  # (B, H, S, D) order: no views made
    heads_kv, seqlen_k = descs[2].shape[1:3]
    assert config.hopper_split in (2, 3) and lse2.shape[1] % config.block_m == 0
    assert dq_accum is None or computes_dq(head_dim, config)
    if group_sum:  # dK (scaled), dV summed over each group here, in fp32
        sums = torch.zeros((2, batch, heads_kv, seqlen_k, head_dim), dtype=torch.float32, device=q.device)
        descs += [Descriptor(t, (1, 1, KEYS_PER_WG, head_dim)) for t in sums]
    descs += [row_stats_descriptor(t, config.block_m) for t in (lse2, delta)]
    if dq_accum is not None:
        dq_desc = dq_accumulator_descriptor(dq_accum, config.block_m, dq_register_order)
    else:
        dq_desc = descs[-1]
    bias_slices = None
    if bias is not None:
        assert dq_accum is not None and head_dim == 128 and not spec.has_softcap
        if dbias is not None and not tma_addressable(dbias):
            return False
        tile = (1, 1, config.block_m, dkdv_key_block(config))
        bias_descs = (Descriptor(bias, tile), Descriptor(dbias, tile) if dbias is not None else dq_desc)
        bias_slices = bias_slice_args(bias, heads_q)
    else:
        bias_descs = (dq_desc, dq_desc)
    lists = tile_lists if tile_lists is not None else (lse2, 0, 0, 0)
    launcher = _dkdv_launcher(tuple(descs[0].shape), heads_kv, seqlen_k, spec, config, dq_accum is not None,
                              tuple(lists[1:]), tile_lists is not None, group_sum, bias_slices, dbias is not None,
                              q.device.index, (0, 1.0) if dropout is None else tuple(dropout[1:]), dq_lock is not None)
    launcher(*descs, dq_desc, lists[0], *bias_descs, alibi if alibi is not None else lse2,
             lse2 if dropout is None else dropout[0], dq_lock if dq_lock is not None else lse2)
    if group_sum:
        to_bhsd(dk, layout).copy_(sums[0])
        to_bhsd(dv, layout).copy_(sums[1])
    return True


@per_problem
def _dkdv_launcher(q_shape: tuple, heads_kv: int, seqlen_k: int, spec: AttentionSpec, config: KernelConfig, dq: bool,
                   list_strides: tuple, has_lists: bool, group_sum: bool, bias_slices: tuple | None, dbias: bool,
                   device_index: int, dropout_args: tuple = (0, 1.0), ordered: bool = False) -> Launcher:
    """The pass's launch for one problem (decided once: grid, launch order, registers); each call
    passes the 8 descriptors of Q, dO, K, V, dK, dV (or the group sums), lse2, delta, then dQ's, the
    tile lists, the bias's and its gradient's, the ALiBi slopes, the dropout seed and dQ's turn
    counters (any fp32 tensor where off). ``dropout_args``: (threshold, scale) with dropout;
    ``ordered``: dQ summed in a fixed order (``dkdv_pass``'s ``dq_lock``)."""
    batch, heads_q, seqlen_q, head_dim = q_shape
    key_blocks = cdiv(seqlen_k, dkdv_key_block(config))
    programs, tiles, chunk = dkdv_programs(q_shape, heads_kv, seqlen_k, spec, config, dq, has_lists, group_sum,
                                           ordered, bias_slices is not None, torch.device("cuda", device_index))
    heads = tiles // key_blocks
    maxnreg, consumer_regs, producer_regs = ws_registers(config.hopper_split)
    args = ((SLOT,) * 9 + (seqlen_q, seqlen_k, heads_q, heads_kv, heads_q // heads_kv, spec.window_left,
                           *score_constants(spec), spec.scale, SLOT, *list_strides, SLOT, SLOT,
                           *(bias_slices or (0, 1)), key_blocks, chunk, tiles, None, None, 0, 0, SLOT, SLOT,
                           *dropout_args, SLOT))
    walk, interleaved = int(WALK_ASCENDING), False
    if ordered and spec.window_right == 0:
        walk, _, interleaved = fixed_order_launch(q_shape, heads_kv, seqlen_k, config,
                                                  torch.device("cuda", device_index))
    # CHUNKED: 0 head-major (a 2-D grid), 1 launch_order's chunks in a 1-D launch, 2 read off a
    # chunk_grid, 3 interleaved_order's (1-D)
    chunked = int(chunk > 1)
    tile_grid = chunk_grid(heads, key_blocks, chunk) if chunked else None
    if interleaved:
        grid, chunked = (tiles,), 3
    elif programs:
        grid = (programs,)
    elif tile_grid is not None:
        grid, chunked = tile_grid, 2
    else:
        grid = (tiles,) if chunked else (key_blocks, heads)
    return Launcher(_dkdv_ws_kernel, grid, args, BLOCK_M=config.block_m, HEAD_D=head_dim,
                    CAUSAL=spec.window_right == 0, LEFT=spec.has_window_left, SOFTCAP=spec.has_softcap,
                    NUM_STAGES=config.num_stages, SPLIT=config.hopper_split, PINGPONG=config.hopper_pingpong,
                    CHUNKED=chunked, DQ=dq, LISTS=has_lists, GROUP_SUM=group_sum, BIAS=bias_slices is not None,
                    DBIAS=dbias, VARLEN=False, PRODUCER_REGS=producer_regs, CONSUMER_REGS=consumer_regs, num_warps=4,
                    maxnreg=maxnreg, ALIBI=spec.alibi, DROPOUT=spec.has_dropout, ORDERED=ordered,
                    PERSISTENT=programs > 0, WALK=walk)


def dkdv_walk(causal: bool, config: KernelConfig, ordered: bool, interleaved: bool = False) -> int:
    """The programs' walk (``_step_coords``): ascending but with dQ summed in a fixed order under a
    causal bound, whose launch goes heaviest first (``interleaved``, or ``ordered_heaviest_first``) or
    lightest first."""
    if not (ordered and causal):
        return int(WALK_ASCENDING)
    return int(WALK_DESCENDING if interleaved or ordered_heaviest_first(config) else WALK_MASKED_FIRST)


def fixed_order_launch(q_shape: tuple, heads_kv: int, seqlen_k: int, config: KernelConfig,
                       device: torch.device) -> tuple[int, int, bool]:
    """The launch of the dK/dV pass summing dQ in a fixed order under a causal bound, for q's (B, Hq,
    Sq, D) shape: (walk, head rows per chunk, interleaved). Heaviest first with each chunk's light half
    interleaved among the next chunk's heavy half (``common.interleaved_order``) wherever its chunks
    fit (``interleaved_chunk_rows``; a head row keeps its queries' Q and dO, 16-bit, and dQ accumulator,
    fp32, in flight; never where a program walks a KV group); else heaviest first in chunks of
    ``ordered_chunk_rows`` with 64-row steps, lightest first in chunks of a wave with 128-row ones
    (``ordered_heaviest_first``). The interleave measured faster than either at both head sizes from
    4k queries, level at 1k (docs/PERFORMANCE.md, section 5d)."""
    batch, heads_q, seqlen_q, head_dim = q_shape
    heads, key_blocks = batch * heads_kv, cdiv(seqlen_k, dkdv_key_block(config))
    spaced = ordered_chunk_rows(heads, key_blocks, device)
    rows = 0
    if heads_q == heads_kv and knobs().ordered_interleave:
        rows = interleaved_chunk_rows(heads, seqlen_q * head_dim * (2 + 2 + 4), spaced, device)
    walk = dkdv_walk(True, config, True, interleaved=rows > 0)
    if rows:
        return walk, rows, True
    return walk, spaced if walk == int(WALK_DESCENDING) else chunk_head_rows(heads, key_blocks, True, device), False


def persistent_dkdv_fits(head_dim: int, config: KernelConfig, dq: bool, extras: bool) -> bool:
    """Whether the persistent dK/dV pass can run (``_dkdv_ws_kernel``'s PERSISTENT): a dS buffer stages
    both warpgroups' dK and dV (dQ split by rows: D=64's 128-row steps over two warpgroups without
    turns), and no per-program ``extras`` (a mask's lists, group sums, a fixed dQ order, a bias, packing,
    ALiBi, dropout)."""
    return (dq and not extras and config.hopper_split == 2 and config.hopper_pingpong == 0
            and config.block_m >= 2 * head_dim)


PERSISTENT_DKDV_MAX_KEYS = 4096  # the most keys a query may see for the persistent dK/dV pass to run


def dkdv_programs(q_shape: tuple, heads_kv: int, seqlen_k: int, spec: AttentionSpec, config: KernelConfig, dq: bool,
                  lists: bool, group_sum: bool, ordered: bool, bias: bool,
                  device: torch.device) -> tuple[int, int, int]:
    """(programs, tiles, head rows per chunk of the launch order) of the pass over q's (B, Hq, Sq, D)
    shape: the launcher's decision, which ``explain`` reports. Programs: those of a persistent pass
    (at most one per SM, ``_consumer_tiles``), or 0 for one program a tile. Where it can run
    (``persistent_dkdv_fits``: none of a mask's ``lists``, group sums, a fixed dQ order, a ``bias``),
    the rule runs it where tiles are short: a causal bound (a window's right edge at the diagonal)
    and at most PERSISTENT_DKDV_MAX_KEYS keys seen per query -- measured (the dK/dV pass, one H200):
    S=1k causal -6.6%, 4k causal -1.5%, a 1024-key window at 4k -7.5%; but 16k causal +8.9%, and
    without a bound +5.7% at 4k (its step loop spills), so not there. And only with more tiles than
    programs, and where the model has the static rounds ending no later than one program per tile
    (``rounds.persistent_programs``, which also picks the count: one program per SM or one chunk of
    the launch order a round): at some head counts one program per SM gives one program far more
    than its share (one sequence of 4k keys and 32 heads among them)."""
    batch, heads_q, seqlen_q, head_dim = q_shape
    key_blocks = cdiv(seqlen_k, dkdv_key_block(config))
    heads = batch * (heads_q if group_sum else heads_kv)
    # A fixed dQ order chains each key block's program to the previous block's adds: launched in
    # chunks of about a wave, a program starts several launches after the one it waits on, not
    # next to it (measured faster at 4k keys, level at 16k where a chunk is one head row). Under a
    # causal bound the launch is its own (``fixed_order_launch``).
    if ordered and spec.window_right == 0:
        chunk = fixed_order_launch(q_shape, heads_kv, seqlen_k, config, device)[1]
    else:
        chunk = chunk_head_rows(heads, key_blocks, spec.has_window_right or ordered, device)
    tiles = heads * key_blocks
    forced = knobs().dkdv_programs
    extras = lists or group_sum or ordered or bias or spec.alibi or spec.has_dropout
    if not persistent_dkdv_fits(head_dim, config, dq, extras) or forced == 0:
        return 0, tiles, chunk
    if forced is not None:
        return (forced if forced < tiles else 0), tiles, chunk
    seen = seqlen_k if not spec.has_window_left else min(seqlen_k, spec.window_left + 1)
    if spec.window_right != 0 or seen > PERSISTENT_DKDV_MAX_KEYS:
        return 0, tiles, chunk
    # each tile walks its key block's query blocks for every query head of its KV head (no group sums here)
    work = rounds.dkdv_tile_work(seqlen_q, seqlen_k, spec.window_left if spec.has_window_left else None,
                                 heads_q // heads_kv, heads, chunk, config.block_m, dkdv_key_block(config))
    return rounds.persistent_programs(work, sm_count(device), chunk * key_blocks), tiles, chunk


def dq_lock_size(q_shape: tuple, config: KernelConfig) -> int:
    """The turn counters of dQ summed in a fixed order (``dkdv_pass``'s ``dq_lock``): one per (batch,
    query head, query block) of q's (B, Hq, Sq, D) shape."""
    batch, heads_q, seqlen_q = q_shape[:3]
    return batch * heads_q * cdiv(seqlen_q, config.block_m)


def _packed_dkdv(q, k, v, dout, lse2, delta, dk, dv, spec: AttentionSpec, config: KernelConfig, dq_accum,
                 group_sum: bool, packing) -> bool:
    """The pass over packed sequences: one program per (entry of the host's map of the key blocks
    that exist, head row), heaviest entries first (packed_tiles.py); a new set of lengths changes
    the map and the grid, never the compiled kernel. dK, dV by pointer stores (or summed over
    each group in fp32, then converted); dQ, with ``dq_accum`` ((1, Hq, total_q, D) fp32, zeroed),
    by reduce-adds."""
    if packing.offsets_q is None:  # offsets checked on the device (CUDA-graph capture): no host map
        return False
    q4, k4, v4, do4, dk4, dv4 = (to_bhsd(t, spec.layout) for t in (q, k, v, dout, dk, dv))
    heads_q, head_dim = q4.shape[1], q4.shape[3]
    heads_kv = k4.shape[1]
    descs = [descriptor(q4, config.block_m), descriptor(do4, config.block_m),
             descriptor(k4, KEYS_PER_WG), descriptor(v4, KEYS_PER_WG)]
    if any(d is None for d in descs):
        return False
    if group_sum:
        sums = torch.zeros((2, 1, heads_kv, k4.shape[2], head_dim), dtype=torch.float32, device=q.device)
        descs += [Descriptor(t, (1, 1, KEYS_PER_WG, head_dim)) for t in sums]
    else:
        descs += descs[2:4]  # not read: the consumers store dK, dV by pointers
    descs += [row_stats_descriptor(t, config.block_m) for t in (lse2, delta)]
    dq_desc = dq_accumulator_descriptor(dq_accum, config.block_m) if dq_accum is not None else descs[-1]
    tile_map = packed_tiles.key_block_map(packing, dkdv_key_block(config), spec, q.device)
    entries = tile_map.shape[1]
    if entries:
        launcher = _packed_dkdv_launcher(q4.shape, k4.shape, dk4.stride()[1:3], spec, config, dq_accum is not None,
                                         group_sum, q.device.index)
        head_rows = heads_q if group_sum else heads_kv
        # dQ's descriptor stands in the bias and bias-gradient slots (never read with VARLEN)
        launcher(*descs, dq_desc, tile_map, dq_desc, dq_desc, entries, dk4, dv4, lse2, lse2, lse2,
                 grid=(entries * head_rows,))
    if group_sum:
        dk4.copy_(sums[0])
        dv4.copy_(sums[1])
    elif not entries:
        dk.zero_()
        dv.zero_()
    return True


@per_problem
def _packed_dkdv_launcher(q_shape: tuple, k_shape: tuple, dkv_strides: tuple, spec: AttentionSpec,
                          config: KernelConfig, dq: bool, group_sum: bool, device_index: int) -> Launcher:
    """The packed pass's launch for one problem (shapes, not lengths); each call passes the 9
    descriptors of ``dkdv_pass``, the map, the bias and bias-gradient descriptors, the map's entry
    count, dK and dV, the ALiBi slopes', dropout seed's and dQ turn counters' stand-ins (any fp32
    tensor), with its grid (entries x head rows)."""
    heads_q, head_dim = q_shape[1], q_shape[3]
    heads_kv = k_shape[1]
    maxnreg, consumer_regs, producer_regs = ws_registers(config.hopper_split)
    args = ((SLOT,) * 9 + (0, 0, heads_q, heads_kv, heads_q // heads_kv, spec.window_left, *score_constants(spec),
                           spec.scale, SLOT, 0, 0, 0, SLOT, SLOT, 0, 1, SLOT,
                           packed_chunk_heads(heads_q if group_sum else heads_kv), 0, SLOT, SLOT, dkv_strides[1],
                           dkv_strides[0], SLOT, SLOT, 0, 1.0, SLOT))
    return Launcher(_dkdv_ws_kernel, None, args, BLOCK_M=config.block_m, HEAD_D=head_dim,
                    CAUSAL=spec.window_right == 0, LEFT=spec.has_window_left, SOFTCAP=spec.has_softcap,
                    NUM_STAGES=config.num_stages, SPLIT=config.hopper_split, PINGPONG=config.hopper_pingpong,
                    CHUNKED=False, DQ=dq, LISTS=False, GROUP_SUM=group_sum, BIAS=False, DBIAS=False, VARLEN=True,
                    PRODUCER_REGS=producer_regs, CONSUMER_REGS=consumer_regs, num_warps=4, maxnreg=maxnreg,
                    ALIBI=False, DROPOUT=False)
