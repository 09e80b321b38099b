"""What the Hopper (sm_90) Gluon kernels share: their TMA descriptors, the register split of a
warp-specialised launch and the ping-pong turn barriers. Which problems they take is the package's
own (``gluon.problem_support``), asked by the planner (``dispatch.gluon_support``).

The forward (``gluon/fwd.py``) and the dK/dV pass (``gluon/bwd.py``) are both warp-specialised
the same way: one TMA producer warp feeds 2 or 3 consumer warpgroups through mbarrier rings, and
the consumers may take turns at the tensor cores (ping-pong). Imported only where a Gluon kernel
runs: never under the interpreter.
"""

from __future__ import annotations

import functools
import math

import torch
from triton._C.libtriton import ir
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language._core import builtin
from triton.experimental.gluon.language.nvidia.hopper import mbarrier
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

from . import WG_ROWS, multiprocessors  # noqa: F401  (the kernels' modules take WG_ROWS from here too)
from ..shared import constants, packed_tiles
from ..shared.knobs import knobs
from ..shared import descriptors

GL_DTYPES = {torch.bfloat16: gl.bfloat16, torch.float16: gl.float16}
LOG2E = gl.constexpr(constants.LOG2E)
PRODUCER_REGS = 24  # registers the 1-warp TMA producer keeps; the consumers take the rest


# --------------------------------------------------------------------------- descriptors

_GL_TYPES = {**GL_DTYPES, torch.float32: gl.float32}


class Descriptor(descriptors.Descriptor):
    """A descriptor a Gluon kernel takes (``descriptors.Descriptor``): through Triton it is Gluon's
    TensorDescriptor, with the shared-memory layout ``smem_layout`` makes of its block and dtype."""

    __slots__ = ()

    def for_triton(self) -> TensorDescriptor:
        return TensorDescriptor(self.base, list(self.shape), list(self.strides), list(self.block_shape),
                                smem_layout(self.block_shape, self.base.dtype))


class UnswizzledDescriptor(Descriptor):
    """A descriptor whose block lands in shared memory unswizzled: a contiguous run of elements."""

    __slots__ = ()

    def for_triton(self) -> TensorDescriptor:
        return TensorDescriptor(self.base, list(self.shape), list(self.strides), list(self.block_shape),
                                unswizzled_layout(len(self.block_shape), self.base.dtype))


def unswizzled_layout(rank: int, torch_dtype):
    """The shared-memory layout of an ``UnswizzledDescriptor``'s block."""
    return gl.NVMMASharedLayout(swizzle_byte_width=0, element_bitwidth=torch_dtype.itemsize * 8, rank=rank)


@functools.lru_cache(maxsize=None)
def smem_layout(block_shape: tuple, torch_dtype):
    return gl.NVMMASharedLayout.get_default_for(list(block_shape), _GL_TYPES[torch_dtype])


def descriptor(t: torch.Tensor, rows: int, layout: str = "bhsd"):
    """A 4-D TMA descriptor over ``t`` in (B, H, S, D) order (``layout``: its user layout; no view
    is made), block (1, 1, rows, D): rows past a head's length are zero-filled on load and clipped
    on store. None where TMA cannot address the tensor (base or a stride not a multiple of 16 bytes)."""
    return Descriptor.if_addressable(t, (1, 1, rows, t.shape[-1]), layout)


def row_stats_descriptor(stats: torch.Tensor, rows: int):
    """A 2-D descriptor over fp32 (B*H, padded rows) row statistics, block (1, rows)."""
    return Descriptor(stats, (1, rows))


def bias_slice_args(bias: torch.Tensor, heads_q: int) -> tuple[int, int]:
    """(bias_batches, bias_head_div) of the Gluon kernels: where a query head's slice of a (B|1,
    Hq|Hkv|1, Sq, Sk) bias lies -- batch index times 1 or 0, head index divided by 1 (Hq), the
    group size (Hkv) or Hq (one head for all: index 0)."""
    return int(bias.shape[0] > 1), heads_q // bias.shape[1]


@gluon.jit
def launch_order(pid, head_rows, blocks, chunk_heads):
    """(head row, block) of program ``pid`` of a 1-D launch of ``head_rows * blocks`` programs, in
    chunks of ``chunk_heads`` head rows: within a chunk every row's block 0, then every row's block
    1, ... (the caller makes block 0 its heaviest). chunk_heads = 1 is head-major order,
    ``head_rows`` block-major (``chunk_head_rows`` picks it)."""
    chunk_tiles = chunk_heads * blocks
    chunk = pid // chunk_tiles
    first_row = chunk * chunk_heads
    rows = gl.minimum(chunk_heads, head_rows - first_row)
    within = pid - chunk * chunk_tiles
    block = within // rows
    return first_row + within - block * rows, block


@gluon.jit
def interleaved_order(pid, head_rows, blocks, chunk_heads):
    """(head row, block) of program ``pid`` of a 1-D launch in ``launch_order``'s chunks (block-major
    within a chunk), each chunk's light half -- blocks [blocks // 2, blocks) -- launched interleaved,
    block by block, with the next chunk's heavy half: H_0, (T_0 H_1), (T_1 H_2), ..., T_last, where a
    merged segment alternates its groups (one block of each of the chunk's rows) T, H, T, H, ...
    A row's blocks stay in ascending launch order; its light ones start twice as many launches apart
    as in ``launch_order``, among long programs, so they do not all start together when a chunk's
    heavy programs end. ``head_rows`` a multiple of ``chunk_heads`` (``interleaved_chunk_rows``); the
    host's mirror is ``rounds.interleaved_order_tiles``."""
    half = blocks // 2
    chunks = head_rows // chunk_heads
    heavy_head = chunk_heads * half  # H_0: the first chunk's heavy half alone
    first = pid < heavy_head
    within = gl.maximum(pid - heavy_head, 0)
    segment_tiles = chunk_heads * blocks
    segment = within // segment_tiles
    within = within - segment * segment_tiles
    group = within // chunk_heads
    row = within - group * chunk_heads
    last = segment == chunks - 1  # the last segment is T_last alone
    even = (group % 2) == 0  # in the others, the even groups are T's
    block = gl.where(last, half + group, gl.where(even, half + group // 2, group // 2))
    chunk = gl.where(last | even, segment, segment + 1)
    first_group = pid // chunk_heads
    first_row = pid - first_group * chunk_heads
    block = gl.where(first, first_group, block)
    chunk = gl.where(first, 0, chunk)
    row = gl.where(first, first_row, row)
    return chunk * chunk_heads + row, block


def chunk_grid(head_rows: int, blocks: int, chunk_heads: int) -> tuple | None:
    """``launch_order``'s chunks as a grid (rows of a chunk, blocks, chunks) where the chunks are whole,
    else None. The hardware starts a grid's programs x fastest, then y, then z -- ``launch_order``'s
    order -- so a program reads its head row and block off its indices (``grid_tile``) instead of
    dividing at entry, where the divisions' chains run again in each warp-specialised partition
    (measured: benchmarks/NOTES.md, the chunked launch read off its grid)."""
    if head_rows % chunk_heads or max(blocks, head_rows // chunk_heads) >= 65536:
        return None
    return chunk_heads, blocks, head_rows // chunk_heads


@gluon.jit
def grid_tile():
    """(head row, block) of this program of a ``chunk_grid`` launch."""
    return gl.program_id(2) * gl.num_programs(0) + gl.program_id(0), gl.program_id(1)


@gluon.jit
def snake_tile(round_index, total_tiles):
    """The tile this program takes in round ``round_index`` of a launch of fewer programs than tiles
    (a persistent launch): tiles are handed out in launch order (heaviest first in each chunk), each
    round one per program, even rounds in program order and odd ones reversed, so that a program
    given one of a round's heavy tiles gets a light one of the next. ``total_tiles`` or more: none
    (the last round's spare programs)."""
    programs = gl.num_programs(0)
    pid = gl.program_id(0)
    within = gl.where((round_index & 1) == 0, pid, programs - 1 - pid)
    return round_index * programs + within


# Fields of a packed-sequence tile map (packed_tiles.py), as the kernels read them.
MAP_SEQUENCE: gl.constexpr = gl.constexpr(packed_tiles.SEQUENCE)
MAP_BLOCK: gl.constexpr = gl.constexpr(packed_tiles.BLOCK)
MAP_Q_START: gl.constexpr = gl.constexpr(packed_tiles.Q_START)
MAP_SEQ_Q: gl.constexpr = gl.constexpr(packed_tiles.SEQ_Q)
MAP_K_START: gl.constexpr = gl.constexpr(packed_tiles.K_START)
MAP_SEQ_K: gl.constexpr = gl.constexpr(packed_tiles.SEQ_K)


@gluon.jit
def packed_tile(pid, head_rows, entries, chunk_heads, tile_map):
    """Program ``pid`` of a launch over a packed-sequence map (packed_tiles.py: ``entries`` entries,
    field-major) times ``head_rows`` head rows, in ``launch_order``: (head row, sequence, block,
    first query row, Sq, first key row, Sk) -- one load a field."""
    row, entry = launch_order(pid, head_rows, entries, chunk_heads)
    fields = tile_map + entry
    return (row, gl.load(fields + MAP_SEQUENCE * entries), gl.load(fields + MAP_BLOCK * entries),
            gl.load(fields + MAP_Q_START * entries), gl.load(fields + MAP_SEQ_Q * entries),
            gl.load(fields + MAP_K_START * entries), gl.load(fields + MAP_SEQ_K * entries))


@gluon.jit
def store_sequence_rows(base, tile, first, seq_start, seq_len, stride_row, layout: gl.constexpr):
    """Store ``tile`` (rows x columns, ``layout``), row r of it at ``base + (seq_start + first + r) *
    stride_row``, rows from ``seq_len`` on dropped: the pointer store of packed sequences (O, dK, dV),
    whose rows past a sequence's end are the next sequence's -- a TMA store clips only at the tensor's."""
    rows = first + gl.arange(0, tile.shape[0], layout=gl.SliceLayout(1, layout))
    cols = gl.arange(0, tile.shape[1], layout=gl.SliceLayout(0, layout))
    offsets = gl.expand_dims((seq_start + rows).to(gl.int64) * stride_row, 1) + gl.expand_dims(cols, 0)
    keep = gl.expand_dims(rows < seq_len, 1) & gl.expand_dims(cols >= 0, 0)  # the row mask, broadcast
    gl.store(base + offsets, tile, mask=keep)


def chunk_head_rows(head_rows: int, blocks: int, chunked: bool, device: torch.device) -> int:
    """Head rows per chunk of ``launch_order``: 1 (head-major) unless ``chunked``, else about one
    wave of programs, round(SMs / blocks) rows, heaviest block first in each chunk. The hardware
    starts programs in launch order as SMs free up; with programs of uneven length, head-major
    order starts the last heads' long programs late and the grid ends on a tail, block-major order
    puts every head's operands in flight at once (measured a little faster for MHA). Measured in
    chunks of 4 rows at S=4k: the dK/dV pass under a causal bound shortened the backward (GQA 16/2
    causal more so), and the forward of a sliding window gained too. The causal forward gained
    nothing from chunks of a wave; it takes chunks of several waves (``l2_section_rows``)."""
    forced = _forced_chunk_rows(head_rows)
    if forced is not None:
        return forced
    if not chunked:
        return 1
    return max(1, min(head_rows, round(sm_count(device) / blocks)))


def ordered_chunk_rows(head_rows: int, blocks: int, device: torch.device) -> int:
    """Head rows per chunk of ``launch_order`` for the dK/dV pass summing dQ in a fixed order under a
    causal bound (heaviest block first, each program's adds after the previous block's, ``bwd._drain``):
    the power of two nearest sqrt(64 * SMs / blocks). A block's program waits for the previous block's
    adds at every step, so the two must start well apart: launched close together (small chunks, where
    a chunk's first programs start together) the later waits one drain hop per block before it; spread
    over too many rows, every row's operands are in flight at once and overflow L2. Measured (the
    backward, one H200, chunks of 1 to all rows): best at 16 rows with 32 key blocks (4k keys), 8 with
    128 (16k); all 8 of GQA 16/2's rows; all 64 rows at 4k keys 17% slower than 16."""
    forced = _forced_chunk_rows(head_rows)
    if forced is not None:
        return forced
    return min(head_rows, _nearest_power_of_two((64 * sm_count(device) / blocks) ** 0.5))


def interleaved_chunk_rows(head_rows: int, row_bytes: int, spaced_rows: int, device: torch.device) -> int:
    """Head rows per chunk of ``interleaved_order`` for the dK/dV pass summing dQ in a fixed order
    heaviest first, or 0 where it does not run. ``row_bytes``: what one head row's programs keep in
    flight, its queries' Q and dO (16-bit) and dQ accumulator (fp32). Interleaved, two chunks' rows are
    in flight at once: the power of two nearest L2 / (2 row_bytes), at most ``spaced_rows``
    (``ordered_chunk_rows``): swept from 1 to 32 rows a chunk, the fastest chunk matched this rule at
    every head size and length measured, and twice as many rows overflowed L2 and ran slower. It needs
    two chunks and at least two rows a chunk (at one, a row's light blocks start together again:
    slower), and whole chunks. A KV group walked by one program (GQA) is not interleaved: its rows
    overflow L2 at any chunk of two rows or more, and it measured slower than all rows heaviest first
    at every chunk size (docs/PERFORMANCE.md, section 5d)."""
    forced = _forced_chunk_rows(head_rows)
    if forced is not None:
        rows = forced
    else:
        rows = min(spaced_rows, _nearest_power_of_two(_l2_bytes(device.index) / (2 * max(1, row_bytes))))
    return rows if 2 <= rows < head_rows and head_rows % rows == 0 else 0


def _nearest_power_of_two(x: float) -> int:
    """The power of two nearest ``x`` on a log scale, at least 1."""
    return 1 << round(math.log2(max(x, 1.0)))


def l2_section_rows(head_rows: int, bytes_per_row: int, device: torch.device) -> int:
    """Head rows per chunk of ``launch_order`` for a launch of programs of uneven length (a causal
    bound), one program per tile: as many rows as the operands they share fit in L2 (``bytes_per_row``:
    the K and V bytes one head row's programs read, a KV head's shared by its query heads), rounded
    down to a power of two -- FlashAttention-4's sections. Programs start in launch order as SMs free
    up: in head-major order the last heads' heaviest programs start inside the last wave and the grid
    ends on them (the causal forward's busiest SM ran 10% above the average, ncu); block-major chunks
    of several waves start them early, and within L2 the chunk's programs still share their operands
    there (block-major over all heads, whose K and V overflow L2, measured slower: docs/PERFORMANCE.md
    5d)."""
    forced = _forced_chunk_rows(head_rows)
    if forced is not None:
        return forced
    rows = max(1, _l2_bytes(device.index) // max(1, bytes_per_row))
    return min(head_rows, 1 << (rows.bit_length() - 1))


def _forced_chunk_rows(head_rows: int) -> int | None:
    """The experiment switch ``Knobs.chunk_heads`` (0: all rows), clamped to the launch; None if unset."""
    forced = knobs().chunk_heads
    return None if forced is None else max(1, min(forced or head_rows, head_rows))


@functools.lru_cache(maxsize=None)
def _l2_bytes(device_index: int | None) -> int:
    return torch.cuda.get_device_properties(device_index).L2_cache_size


def packed_chunk_heads(heads: int) -> int:
    """Head rows per chunk of ``launch_order`` over a packed map: one -- head-major, each head
    walking the map's entries heaviest first -- unless the experiment switch ``Knobs.chunk_heads``
    says otherwise. Measured (16 documents, D=128 causal): the dK/dV pass ran far slower with each
    entry's heads one after another (chunks of all heads) than in chunks of 4, and head-major was
    fastest: programs running together share one head's Q and dO (K and V in the forward) in L2."""
    forced = knobs().chunk_heads
    if forced is not None:
        return max(1, min(forced or heads, heads))
    return 1


def sm_count(device: torch.device) -> int:
    return multiprocessors(device.index)


def ws_registers(split: int) -> tuple[int, int, int]:
    """(maxnreg at launch, consumer registers, producer registers) for ``split`` consumer warpgroups:
    the launch divides the register file over every warp (the producer's warpgroup included); the
    producer then gives up all but PRODUCER_REGS and the consumers take the rest."""
    total_warps = 4 * split + 4
    maxnreg = (65536 // (total_warps * 32)) // 8 * 8
    consumer = (maxnreg * total_warps - PRODUCER_REGS * 4) // (total_warps - 4) // 8 * 8
    return maxnreg, consumer, PRODUCER_REGS


@gluon.jit
def _rcp_fma(d):
    """1 / d for d >= 1 on the FMA pipe: a first guess from the exponent bits (within 12%), then
    three Newton steps (12% -> 1.4% -> 2e-4 -> 4e-8). d is clamped to 2^100 first (the guess of
    inf would be garbage); 1 / 2^100 is 0 wherever the caller uses it."""
    d = gl.minimum(d, 1.2676506002282294e30)
    y = (0x7EF311C3 - d.to(gl.int32, bitcast=True)).to(gl.float32, bitcast=True)
    y = y * (2.0 - d * y)
    y = y * (2.0 - d * y)
    return y * (2.0 - d * y)


@gluon.jit
def _rcp(x):
    # rcp.approx: one MUFU op, ~1 ulp; 1 / inf = 0 (used by tanh for large arguments)
    return gl.inline_asm_elementwise("rcp.approx.ftz.f32 $0, $1;", "=r,r", [x], dtype=gl.float32, is_pure=True,
                                     pack=1)


@gluon.jit
def _tanh_approx(x):
    # tanh.approx.f32: one MUFU op, relative error <= 2^-11 (``log2_scores``: bf16 inputs only)
    return gl.inline_asm_elementwise("tanh.approx.f32 $0, $1;", "=r,r", [x], dtype=gl.float32, is_pure=True,
                                     pack=1)


@gluon.jit
def log2_scores(s, qk_scale, softcap_log2, SOFTCAP: gl.constexpr, RCP_ON_FMA: gl.constexpr = False,
                INPUT_DTYPE: gl.constexpr = None):
    """(scores in log2 units, tanh of the capped argument or None) of raw fp32 scores ``s``.

    Softcap: tanh(x) = 1 - 2 / (1 + e^{2x}): ex2 and a reciprocal -- rcp.approx (a MUFU op) or, with
    RCP_ON_FMA, Newton steps on the FMA pipe (``_rcp_fma``) --, an absolute error of a few fp32 ulps
    (what the score and the backward's 1 - tanh^2 need; the relative error near 0 does not matter
    there). The dK/dV pass takes RCP_ON_FMA (measured a little faster at softcap 30); the forward does
    not: slower with 3 warpgroups (at 128 registers they spilled) and with 2.
    ``INPUT_DTYPE`` (the kernel's inputs', every caller passes it) bf16: tanh.approx.f32 -- the rule
    ``kernels.triton.fwd.softcap_mode`` gives the Triton kernels, so that every pass of a call computes
    the same scores --, one MUFU op instead of two -- the softcap forward was bound by them, three a
    score. Its 2^-11 relative error is a logit error of at most 0.015 at softcap 30: a quarter of
    what rounding the scores to bf16 costs (2^-9 of scores of 10-30), but as large as fp16 rounding, so fp16 keeps the
    exact form."""
    if SOFTCAP:
        if INPUT_DTYPE == gl.bfloat16:
            t = _tanh_approx(s * qk_scale)
            return t * softcap_log2, t
        e = gl.exp2(s * (qk_scale * 2.8853900817779268))  # e^{2x} = 2^{2 log2(e) x}
        if RCP_ON_FMA:
            t = 1.0 - 2.0 * _rcp_fma(1.0 + e)
        else:
            t = 1.0 - 2.0 * _rcp(1.0 + e)
        return t * softcap_log2, t
    else:
        return s * qk_scale, s


@gluon.jit
def window_bounds(rows, diag, window_left, seq_k, CAUSAL: gl.constexpr):
    """(first, last) key that each query row keeps under a left window (bottom-right
    aligned: ``diag`` = Sk - Sq), the right bound causal or none, keys past Sk excluded: the
    bounds ``_where_in_window`` takes, for the forward (rows along dim 0) and the dK/dV pass (along 1)."""
    last = rows * 0 + (seq_k - 1)
    if CAUSAL:
        last = gl.minimum(rows + diag, seq_k - 1)
    return rows + (diag - window_left), last


@gluon.jit
def _where_le(s, a, b):
    """``s`` where a <= b, else -inf (broadcastable int32 tensors): one compare and one select a
    score, in PTX. Written as a compare and ``gl.where`` over a tile, LLVM vectorises the compare into
    a (64 x i1) vector that the backend packs into bit fields and unpacks again -- about six
    instructions a score, and spills in the dK/dV pass, which runs at its register limit."""
    return gl.inline_asm_elementwise(
        "{ .reg .pred keep; setp.le.s32 keep, $2, $3; selp.f32 $0, $1, 0fFF800000, keep; }",
        "=r,r,r,r", [s, a, b], dtype=gl.float32, is_pure=True, pack=1)


@gluon.jit
def _keep_by_key(s, keys, col0, cols, seq_k, diag, window_left, CAUSAL: gl.constexpr, LEFT: gl.constexpr,
                 RAGGED: gl.constexpr):
    """``keep_scores`` for keys along dim 0 (the dK/dV pass's S^T) under a causal bound or a left
    window, with every bound held per key row: query col0 + c keeps key k where its distance
    d = col0 + c + diag - k lies in [0, window_left] (a left window; [0, inf) causal, (-inf,
    window_left] a left window alone), k < Sk. The columns split into their bits 1-2 and the rest
    (``cols & 6``, ``cols & -7``: for a wgmma accumulator the first is the lane's part of every
    column, the second a constant a register), so a score's bound is a per-row value against a
    constant: one value live a key row (two a thread) where per-column bounds keep 16 a thread."""
    lane_part = gl.expand_dims(cols & 6, 0)
    constant = gl.expand_dims(cols & -7, 0)
    keys2 = gl.expand_dims(keys, 1)
    if LEFT:
        # d = (col0 + diag + lane part - k) + constant; a key past Sk gets a distance no bound keeps:
        # below 0 where the compare is unsigned (causal: 0 <= d <= window), else above any window
        # (one wider than 2^30 keys bounds no sequence that fits in memory)
        PAST_SK: gl.constexpr = -(1 << 30) if CAUSAL else 1 << 30
        base = gl.where(keys2 < seq_k, (col0 + diag) - keys2 + lane_part, PAST_SK)
        bound = window_left if CAUSAL else gl.minimum(window_left, (1 << 30) - 256)
        return _where_offset_below(s, base, constant, bound, CAUSAL)
    # causal alone: keep while k - diag - col0 - lane part <= constant
    limit = keys2 - (col0 + diag) - lane_part
    if RAGGED:
        limit = gl.where(keys2 < seq_k, limit, 1 << 30)
    return _where_le(s, limit, constant)


@gluon.jit
def _where_offset_below(s, base, offset, bound, UNSIGNED: gl.constexpr):
    """``s`` where base + offset <= bound (unsigned with ``UNSIGNED``: also base + offset >= 0), else
    -inf: an add, a compare and a select a score (``_where_le``'s form)."""
    compare: gl.constexpr = "setp.le.u32" if UNSIGNED else "setp.le.s32"
    return gl.inline_asm_elementwise(
        "{ .reg .pred keep; .reg .b32 d; add.s32 d, $2, $3; " + compare + " keep, d, $4; "
        "selp.f32 $0, $1, 0fFF800000, keep; }",
        "=r,r,r,r,r", [s, base, offset, bound], dtype=gl.float32, is_pure=True, pack=1)


@gluon.jit
def _where_in_window(s, keys, first, last):
    """``s`` where first <= keys <= last, else -inf (``_where_le``'s form): one unsigned compare of
    keys - first against the span last - first + 1 (a query whose bounds cross keeps nothing)."""
    span = gl.maximum(last - first + 1, 0)
    return gl.inline_asm_elementwise(
        "{ .reg .pred keep; .reg .b32 d; sub.s32 d, $2, $3; setp.lt.u32 keep, d, $4; "
        "selp.f32 $0, $1, 0fFF800000, keep; }",
        "=r,r,r,r,r", [s, keys, first, span], dtype=gl.float32, is_pure=True, pack=1)


@gluon.jit
def _element_count(x):
    """Of a thread's columns 8 k + 2 (lane % 4) + {0, 1} of a wgmma accumulator, how many lie below
    its own column x (counted from its first, 0 <= x <= the tile's columns): numbered 2 k + {0, 1},
    they are the first 2 (x // 8) + min(x % 8, 2)."""
    return (x >> 3) * 2 + gl.minimum(x & 7, 2)


@gluon.jit
def _keep_interval(s, lo, hi, cols):
    """``s`` where lo <= column < hi, else -inf. ``lo``, ``hi``: int32 per row of s (its row slice),
    counted from the tile's first column; ``cols``: the tile's column numbers 0 .. C - 1 (s's column
    slice). For a wgmma accumulator with warps along the rows (every Gluon kernel's) and C <= 128: a
    thread holds C / 4 <= 32 columns of a row, 8 k + 2 (lane % 4) + {0, 1}, so the row's interval is
    one 32-bit word of its columns -- a few instructions a row -- and a score takes a bit test and a
    select (ptxas turns a word's bit tests into R2P, a register's bits to predicates), where a
    compare against the bounds takes three instructions."""
    C: gl.constexpr = s.shape[1]
    gl.static_assert(C <= 128, "a row's columns must fit one 32-bit word a thread")
    lane = gl.inline_asm_elementwise("mov.u32 $0, %laneid;", "=r,r", [lo], dtype=gl.int32, is_pure=True, pack=1)
    first_col = (lane & 3) * 2
    below_lo = _element_count(gl.minimum(gl.maximum(lo - first_col, 0), C))
    below_hi = _element_count(gl.minimum(gl.maximum(hi - first_col, 0), C))
    # bits [below_lo, below_hi); PTX's shl gives 0 for a shift of 32
    word = gl.inline_asm_elementwise(
        "{ .reg .b32 a, b; mov.b32 a, -1; shl.b32 a, a, $2; not.b32 a, a; mov.b32 b, -1; shl.b32 b, b, $1; "
        "and.b32 $0, a, b; }",
        "=r,r,r", [below_lo, below_hi], dtype=gl.int32, is_pure=True, pack=1)
    # each column's bit: a constant per register (the lane's part of ``cols`` is bits 1-2)
    bit = 1 << ((cols >> 3) * 2 + (cols & 1))
    return gl.inline_asm_elementwise(
        "{ .reg .pred keep; .reg .b32 t; and.b32 t, $2, $3; setp.ne.b32 keep, t, 0; "
        "selp.f32 $0, $1, 0fFF800000, keep; }",
        "=r,r,r,r", [s, gl.expand_dims(word, 1), gl.expand_dims(bit, 0)], dtype=gl.float32, is_pure=True, pack=1)


@gluon.jit
def keep_scores(s, lines, col0, seq_k, rule, CAUSAL: gl.constexpr, LEFT: gl.constexpr, RAGGED: gl.constexpr,
                TRANSPOSED: gl.constexpr, BITS: gl.constexpr = False, KEY_ROWS: gl.constexpr = False):
    """The keep rule, one form for both Gluon kernels (the Triton kernels' is ``masking.apply_mask``):
    ``s`` with the (query, key) pairs the causal and window bounds drop set to -inf, and keys past Sk
    where ``RAGGED`` (a left window's bounds exclude those already). ``lines``: the indices along
    dim 0 (a slice of s's layout), ``col0`` the index of the tile's first column (the columns run on
    from it); ``rule`` = (Sk - Sq, left window).
    ``TRANSPOSED``: keys along dim 0 (the dK/dV pass holds S^T), else queries along dim 0 (the forward).
    Each query keeps the keys in [first, last]: last = its diagonal (causal) capped at Sk - 1 (keys past
    Sk), first = last's window bound (a left window).

    ``BITS`` (the forward, queries along dim 0; tiles of at most 128 keys): each query's keys [first,
    last] as a bit mask over the thread's columns (``_keep_interval``). Else a compare per score. The warp-specialised forward's masked steps run faster with the bit mask
    (window rows most); the dK/dV pass and the 8-warp forward ran slower with it (the bit words live
    at their step's register peak), so they keep the compares.

    ``KEY_ROWS`` (keys along dim 0, under a causal bound or a left window): every bound held per key
    row against a constant a column (``_keep_by_key``), where the per-column form keeps 16 bounds
    live a thread. The dK/dV pass's masked steps run faster so (plain, ALiBi, a window with softcap
    or dropout); causal softcap's and causal dropout's ran slower (softcap's compiled stack grew) and
    keep the per-column form."""
    diag, window_left = rule
    cols = gl.arange(0, s.shape[1], layout=gl.SliceLayout(0, s.type.layout))
    if TRANSPOSED:
        keys = lines
        rows = col0 + cols
        keys2 = gl.expand_dims(keys, 1)
        rows2 = gl.expand_dims(rows, 0)
    else:
        rows = lines
        keys = col0 + cols
        keys2 = gl.expand_dims(keys, 0)
        rows2 = gl.expand_dims(rows, 1)
    if BITS and (LEFT or CAUSAL) and s.shape[1] <= 128:
        gl.static_assert(not TRANSPOSED, "the bit mask form takes queries along dim 0")
        if LEFT:
            first, last = window_bounds(rows, diag, window_left, seq_k, CAUSAL)
            lo = first - col0
        else:
            lo = rows * 0  # no bound below: clamped to the tile's first column
            last = rows + diag
            if RAGGED:
                last = gl.minimum(last, seq_k - 1)
        kept = _keep_interval(s, lo, last + 1 - col0, cols)
    elif KEY_ROWS and TRANSPOSED and (LEFT or CAUSAL):
        kept = _keep_by_key(s, keys, col0, cols, seq_k, diag, window_left, CAUSAL, LEFT, RAGGED)
    elif LEFT:
        first, last = window_bounds(rows2, diag, window_left, seq_k, CAUSAL)
        kept = _where_in_window(s, keys2, first, last)
    elif CAUSAL:
        last = rows2 + diag
        if RAGGED:
            last = gl.minimum(last, seq_k - 1)
        kept = _where_le(s, keys2, last)
    else:
        # Keys past Sk alone: a compare per key, broadcast over the queries. Kept in the form the
        # non-causal kernels were measured with: ptxas schedules their step loops by the whole
        # kernel, this branch included (the compare-and-select form slowed D=64's full dK/dV pass
        # by 2.5% through its unmasked loop).
        if TRANSPOSED:
            keep = keys2 >= 0
            if RAGGED:
                keep = keep & gl.expand_dims(keys < seq_k, 1)
        elif RAGGED:
            keep = keys2 < seq_k
        else:
            keep = keys2 >= 0
        kept = gl.where(keep, s, -float("inf"))
    return kept


# --------------------------------------------------------------------------- dropout

# Philox4x32's constants (Random123; Triton's tl.philox has the same), for the kernels' own rounds:
# Gluon has no philox of its own.
_PHILOX_KEY_A = gl.constexpr(0x9E3779B9)
_PHILOX_KEY_B = gl.constexpr(0xBB67AE85)
_PHILOX_ROUND_A = gl.constexpr(0xD2511F53)
_PHILOX_ROUND_B = gl.constexpr(0xCD9E8D57)
DROPOUT_ROUNDS = gl.constexpr(7)  # dropout.ROUNDS


@gluon.jit
def _philox(seed, c0, c1, c2, c3):
    """Philox4x32 with DROPOUT_ROUNDS rounds of counter (c0, c1, c2, c3) (uint32 tensors) keyed by
    the int64 ``seed``, word for word what ``tl.philox(seed, c0, c1, c2, c3, DROPOUT_ROUNDS)`` gives."""
    seed = seed.to(gl.uint64)
    k0 = (seed & 0xFFFFFFFF).to(gl.uint32)
    k1 = ((seed >> 32) & 0xFFFFFFFF).to(gl.uint32)
    for _ in gl.static_range(DROPOUT_ROUNDS):
        a, b = c0, c2
        c0 = gl.umulhi(b, _PHILOX_ROUND_B) ^ c1 ^ k0
        c2 = gl.umulhi(a, _PHILOX_ROUND_A) ^ c3 ^ k1
        c1 = gl.mul(b, _PHILOX_ROUND_B, sanitize_overflow=False)
        c3 = gl.mul(a, _PHILOX_ROUND_A, sanitize_overflow=False)
        k0 = gl.add(k0, _PHILOX_KEY_A, sanitize_overflow=False)
        k1 = gl.add(k1, _PHILOX_KEY_B, sanitize_overflow=False)
    return c0, c1, c2, c3


@gluon.jit
def _kept_bits(word, t_low7, t_all):
    """Bit 8b + 7 of the result says whether byte b of the uint32 ``word`` is at least the
    threshold (``t_all`` = threshold * 0x01010101, ``t_low7`` = t_all & 0x7F7F7F7F; threshold
    <= 255); the other bits are garbage. Four bytes in three operations: the low seven bits of
    each byte compared by a subtraction that cannot borrow across bytes, the top bits decide
    where they differ."""
    below = gl.sub(word | 0x80808080, t_low7, sanitize_overflow=False)
    differ = word ^ t_all
    return (differ & word) | (~differ & below)


@gluon.jit
def _call_kept_bits(seed, batch_head, key_groups, queries, threshold):
    """The four words of kept bits (``_kept_bits``) of the Philox calls at counters (key_groups,
    queries, batch_head, 0) (uint32 tensors of one shape and layout): word u, bit 8b + 7, for key
    16 * group + 4u + b."""
    zero = key_groups * 0
    w0, w1, w2, w3 = _philox(seed, key_groups, queries, zero + batch_head.to(gl.uint32), zero)
    t_all = threshold.to(gl.uint32) * 0x01010101
    t_low7 = t_all & 0x7F7F7F7F
    return (_kept_bits(w0, t_low7, t_all), _kept_bits(w1, t_low7, t_all), _kept_bits(w2, t_low7, t_all),
            _kept_bits(w3, t_low7, t_all))


@gluon.constexpr_function
def _log2(n):
    return n.bit_length() - 1


@gluon.constexpr_function
def _row_layouts(groups):
    """The forward's keep-tile layouts over a warpgroup's 64 rows (the wgmma accumulator gives lane
    4 (r % 8) + c the row r of warp r // 16 and the keys 8 j + 2 c + {0, 1}): calls (rows, groups),
    lane c making the call of group 4 j + c, and their words (rows, groups, 4) as the lanes of a
    quad take them, word c in lane c."""
    g = _log2(groups)
    calls = gl.DistributedLinearLayout(
        [[8, 0]] + [[0, 4 << j] for j in range(g - 2)],
        [[0, 1], [0, 2], [1, 0], [2, 0], [4, 0]], [[16, 0], [32, 0]], [], [64, groups])
    words = gl.DistributedLinearLayout(
        [[8, 0, 0]] + [[0, 1 << j, 0] for j in range(g)],
        [[0, 0, 1], [0, 0, 2], [1, 0, 0], [2, 0, 0], [4, 0, 0]], [[16, 0, 0], [32, 0, 0]], [], [64, groups, 4])
    return calls, words


@gluon.constexpr_function
def _key_layouts(rows):
    """The dK/dV pass's keep-tile layouts (S^T: the wgmma accumulator gives lane 4 r + c the keys
    16 w + r and + 8 of warp w, and the queries 8 i + 2 c + {0, 1}): calls (4 groups, 32, rows //
    32), group w in warp w, index m = 4 i + c in the lanes, the queries 64 h + 2 m + e in a thread's
    registers (n = 2 h + e); their bytes (4, 32, 8) as the destination lanes take them, byte r in
    the lanes of keys r and 8 + r."""
    n = rows // 32
    calls = gl.DistributedLinearLayout(
        [[0, 0, 1 << j] for j in range(_log2(n))],
        [[0, 1, 0], [0, 2, 0], [0, 4, 0], [0, 8, 0], [0, 16, 0]], [[1, 0, 0], [2, 0, 0]], [], [4, 32, n])
    bytes_ = gl.DistributedLinearLayout(
        [[0, 4, 0], [0, 8, 0], [0, 16, 0]],
        [[0, 1, 0], [0, 2, 0], [0, 0, 1], [0, 0, 2], [0, 0, 4]], [[1, 0, 0], [2, 0, 0]], [], [4, 32, 8])
    return calls, bytes_


@gluon.jit
def _per_probability(values, positions, shape: gl.constexpr, order: gl.constexpr, out_layout: gl.constexpr):
    """Each probability's word of kept bits and the position of its bit, (ROWS, KEYS) in
    ``out_layout``: ``values`` (..., V) repeated once for each of the positions (constants, joined
    into the trailing axes the same way), permuted by ``order`` and read as ``shape``."""
    gl.static_assert(len(positions) == 4 or len(positions) == 8, "two or three joined axes")
    if len(positions) == 4:
        words = gl.join(gl.join(values, values), gl.join(values, values))
        bits = gl.join(gl.join(values * 0 + positions[0], values * 0 + positions[1]),
                       gl.join(values * 0 + positions[2], values * 0 + positions[3]))
    else:
        words = gl.join(gl.join(gl.join(values, values), gl.join(values, values)),
                        gl.join(gl.join(values, values), gl.join(values, values)))
        bits = gl.join(gl.join(gl.join(values * 0 + positions[0], values * 0 + positions[1]),
                               gl.join(values * 0 + positions[2], values * 0 + positions[3])),
                       gl.join(gl.join(values * 0 + positions[4], values * 0 + positions[5]),
                               gl.join(values * 0 + positions[6], values * 0 + positions[7])))
    words = gl.convert_layout(gl.reshape(gl.permute(gl.reshape(words, shape[0]), order), shape[1]), out_layout)
    bits = gl.convert_layout(gl.reshape(gl.permute(gl.reshape(bits, shape[0]), order), shape[1]), out_layout)
    return words, bits


@gluon.jit
def _row_keep_words(seed, batch_head, first_row, first_key, threshold, ROWS: gl.constexpr, KEYS: gl.constexpr,
                    out_layout: gl.constexpr):
    """The forward's keep words (``_per_probability``) over a warpgroup's (ROWS, KEYS) tile. One
    Philox call per (query, 16 keys): counter (key // 16, query, batch_head, 0); its bytes, word
    after word, little-endian, belong to the 16 keys in order (``fusedattn/dropout.py``).

    The accumulator gives lane c of a quad 4 of a call's 16 keys (2c, 2c + 1, 8 + 2c, 9 + 2c), so
    the quad's lanes make one call each and trade 32-bit words of kept bits: each lane then holds
    its own probabilities' bits, in place."""
    GROUPS: gl.constexpr = KEYS // 16
    gl.static_assert(ROWS == 64 and GROUPS >= 4, "a warpgroup's 64 rows; a quad's calls over 64 keys or more")
    layouts: gl.constexpr = _row_layouts(GROUPS)
    call_layout: gl.constexpr = layouts[0]
    rows = gl.arange(0, ROWS, layout=gl.SliceLayout(1, call_layout))
    groups = gl.arange(0, GROUPS, layout=gl.SliceLayout(0, call_layout))
    zero = gl.zeros([ROWS, GROUPS], gl.uint32, layout=call_layout)
    k0, k1, k2, k3 = _call_kept_bits(seed, batch_head,
                                     zero + gl.expand_dims((first_key // 16 + groups).to(gl.uint32), 0),
                                     zero + gl.expand_dims((first_row + rows).to(gl.uint32), 1), threshold)
    # lane c's word: keys 2c, 2c + 1 (half c % 2 of word c // 2) low, keys 8 + 2c, 9 + 2c high:
    # the bit of key 8 h + 2 c + e at 8 (2 h + e) + 7
    words = gl.join(gl.join((k0 & 0xFFFF) | (k2 << 16), (k1 & 0xFFFF) | (k3 << 16)),
                    gl.join((k0 >> 16) | (k2 & 0xFFFF0000), (k1 >> 16) | (k3 & 0xFFFF0000)))
    words = gl.convert_layout(gl.reshape(words, (ROWS, GROUPS, 4)), layouts[1])  # [.., a, b] -> c = 2a + b
    # joined (rows, groups, c, e, h) -> (rows, groups, h, c, e), read as (rows, keys)
    return _per_probability(words, (7, 15, 23, 31), ((ROWS, GROUPS, 4, 2, 2), (ROWS, KEYS)), (0, 1, 4, 2, 3),
                            out_layout)


@gluon.jit
def _key_keep_words(seed, batch_head, first_key, first_row, threshold, KEYS: gl.constexpr, ROWS: gl.constexpr,
                    out_layout: gl.constexpr):
    """The dK/dV pass's keep words (``_per_probability``) over a warpgroup's S^T tile (KEYS, ROWS):
    the probability of key first_key + r and query first_row + c, ``_row_keep_words``' calls.

    Warp w holds the keys [16 w, + 16), the group of one call per query; the accumulator gives
    lane 4 r + c the keys r and 8 + r of the queries 8 i + 2 c + {0, 1}. Each lane makes the calls
    of queries 64 h + 2 (4 i + c) + e for its (i, c) and every (h, e), packs the two bits each of
    the 8 lanes r = 0..7 of its quad column needs into one byte per r, and the lanes trade those
    bytes: 8 values per lane move."""
    N: gl.constexpr = ROWS // 32
    gl.static_assert(KEYS == 64 and (ROWS == 64 or ROWS == 128), "one 16-key group per warp; 64 or 128 queries")
    layouts: gl.constexpr = _key_layouts(ROWS)
    call_layout: gl.constexpr = layouts[0]
    groups = gl.arange(0, 4, layout=gl.SliceLayout(1, gl.SliceLayout(2, call_layout)))
    m = gl.arange(0, 32, layout=gl.SliceLayout(0, gl.SliceLayout(2, call_layout)))
    n = gl.arange(0, N, layout=gl.SliceLayout(0, gl.SliceLayout(1, call_layout)))
    queries = gl.expand_dims(gl.expand_dims(2 * m, 0), 2) + gl.expand_dims(gl.expand_dims(64 * (n // 2) + n % 2, 0), 1)
    zero = gl.zeros([4, 32, N], gl.uint32, layout=call_layout)
    k0, k1, k2, k3 = _call_kept_bits(seed, batch_head,
                                     zero + gl.expand_dims(gl.expand_dims((first_key // 16 + groups).to(gl.uint32), 1), 2),
                                     zero + (first_row + queries).to(gl.uint32), threshold)
    # byte s of a_u: bit 0 key 4u + s kept, bit 1 key 8 + 4u + s
    a0 = ((k0 >> 7) & 0x01010101) | ((k2 >> 6) & 0x02020202)
    a1 = ((k1 >> 7) & 0x01010101) | ((k3 >> 6) & 0x02020202)
    # byte s of y_u, bits 2 n + {0, 1}: the two of query n's call
    if N == 2:
        lo0, hi0 = gl.split(a0)
        lo1, hi1 = gl.split(a1)
        y0 = lo0 | (hi0 << 2)
        y1 = lo1 | (hi1 << 2)
    else:
        e0, e1 = gl.split(gl.reshape(a0, (4, 32, 2, 2)))  # (h, e) -> e
        h0, h1 = gl.split(e0 | (e1 << 2))
        y0 = h0 | (h1 << 4)
        e0, e1 = gl.split(gl.reshape(a1, (4, 32, 2, 2)))
        h0, h1 = gl.split(e0 | (e1 << 2))
        y1 = h0 | (h1 << 4)
    # (4, 32, 8): byte r for the lanes of keys r and 8 + r; joined [.., a, b, c] is r = a + 2b + 4c
    lanes = gl.join(gl.join(gl.join(y0 & 0xFF, (y0 >> 8) & 0xFF), gl.join((y0 >> 16) & 0xFF, y0 >> 24)),
                    gl.join(gl.join(y1 & 0xFF, (y1 >> 8) & 0xFF), gl.join((y1 >> 16) & 0xFF, y1 >> 24)))
    lanes = gl.convert_layout(gl.reshape(gl.permute(lanes, (0, 1, 4, 3, 2)), (4, 32, 8)), layouts[1])
    if N == 2:
        # joined (g, i, c, r, half, e) -> (g, half, r, i, c, e), read as (keys, queries)
        return _per_probability(lanes, (0, 1, 2, 3), ((4, 8, 4, 8, 2, 2), (KEYS, ROWS)), (0, 4, 3, 1, 2, 5),
                                out_layout)
    else:
        # joined (g, i, c, r, half, e, h) -> (g, half, r, h, i, c, e)
        return _per_probability(lanes, (0, 1, 2, 3, 4, 5, 6, 7), ((4, 8, 4, 8, 2, 2, 2), (KEYS, ROWS)),
                                (0, 4, 3, 6, 1, 2, 5), out_layout)


@gluon.jit
def dropout_zero(p, seed, batch_head, first_row, first_key, threshold, out_layout: gl.constexpr):
    """``p`` (a warpgroup's (64, KEYS) fp32 tile of the forward's S layout ``out_layout``, queries
    first_row.., keys first_key..) with its dropped entries 0. The select is opaque to the compiler,
    which would otherwise move it past the conversion to 16 bits and select halves there."""
    words, bits = _row_keep_words(seed, batch_head, first_row, first_key, threshold, p.shape[0], p.shape[1],
                                  out_layout)
    return gl.inline_asm_elementwise(
        "{ .reg .pred kept; .reg .b32 t; and.b32 t, $2, $3; setp.ne.b32 kept, t, 0; selp.b32 $0, $1, 0, kept; }",
        "=r,r,r,r", [p, words, (bits * 0 + 1) << bits], dtype=gl.float32, is_pure=True, pack=1)


@gluon.jit
def dropout_mark_t(p, seed, batch_head, first_key, first_row, threshold, out_layout: gl.constexpr):
    """``p`` (a warpgroup's (64, ROWS) fp32 tile of the dK/dV pass's S^T layout ``out_layout``, keys
    first_key.., queries first_row..) with its dropped entries negated (-0.0 for a 0): the keep bit
    rides in the sign bit."""
    words, bits = _key_keep_words(seed, batch_head, first_key, first_row, threshold, p.shape[0], p.shape[1],
                                  out_layout)
    dropped_sign = ~(words << (31 - bits)) & 0x80000000
    return (p.to(gl.uint32, bitcast=True) ^ dropped_sign).to(gl.float32, bitcast=True)


@gluon.jit
def turn_wait(turn_bars, t, WG: gl.constexpr, PINGPONG: gl.constexpr):
    """Ping-pong: wait for this warpgroup's t-th turn (round robin 0, 1, (2,) 0, ...)."""
    if PINGPONG:
        if WG == 0:
            mbarrier.wait(turn_bars.index(0), (t & 1) ^ 1)  # a fresh barrier: turn 0 passes
        else:
            mbarrier.wait(turn_bars.index(WG), t & 1)


@gluon.jit
def turn_pass(turn_bars, WG: gl.constexpr, PINGPONG: gl.constexpr):
    if PINGPONG:
        NWG: gl.constexpr = turn_bars.shape[0]
        mbarrier.arrive(turn_bars.index((WG + 1) % NWG), count=1)


@builtin
def tma_reduce_add(tensor_desc, coord, src, _semantic=None):
    """TMA bulk reduce-add (cp.reduce.async.bulk.tensor .add) of shared-memory tile ``src`` into
    ``tensor_desc`` at ``coord``, out-of-bounds elements dropped; commits a bulk async group that
    ``tma.store_wait`` waits for. Gluon 3.6 has no wrapper for it: this calls the builder's
    create_async_tma_reduce, the op Triton's own ``descriptor.atomic_add`` lowers to."""
    coord = _semantic._convert_to_ir_values(coord, require_i64=False)
    _semantic.builder.create_async_tma_reduce(ir.DESCRIPTOR_REDUCE_KIND.ADD, tensor_desc.handle, coord, src.handle)
