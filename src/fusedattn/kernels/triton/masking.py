"""The masking functions: ``adjust_scores`` applies, to a score tile, the user's bias, the keep
rule of ``causal`` / ``window`` / ``chunk`` (``apply_mask``) and the user's boolean mask; forward and both
backward passes call it, so every path modifies scores the same way.

Interior tiles (see ``block_range``) skip the keep rule. The backward's dK/dV pass holds
tiles transposed -- keys along rows -- and asks for ``TRANSPOSED=True``.
Masked scores become -inf, never a large negative number: a finite stand-in leaks
probability into masked keys on long rows.

The rule is turned into an inclusive key range per query row,
``[i + diag - window_left, min(i + diag + window_right, seqlen_k - 1)]``, so each
element costs two compares against per-row bounds rather than index arithmetic on
the whole tile (boundary tiles are register-bound in the backward).
"""

import triton
import triton.language as tl

from .softmax import LOG2E

# MASK_SHIFT_Q of a mask with one query row for every query ((B|1, H|1, 1, Sk)): not a shift, the
# rule "every query reads row 0" (``load_mask_tile``).
ONE_ROW: tl.constexpr = tl.constexpr(-1)


@triton.jit
def apply_mask(
    scores, offs_q, offs_k, seqlen_q, seqlen_k, window_left, window_right,
    HAS_LEFT: tl.constexpr, HAS_RIGHT: tl.constexpr, TRANSPOSED: tl.constexpr,
    chunk=1, HAS_CHUNK: tl.constexpr = False,
):
    diag = seqlen_k - seqlen_q
    last_key = seqlen_k - 1 + offs_q * 0
    if HAS_RIGHT:
        last_key = tl.minimum(last_key, offs_q + (diag + window_right))
    if HAS_CHUNK:
        # the keys of the row's chunk, [chunk_first, chunk_first + chunk); none for a row at a negative
        # aligned position (clamped to 0 first: the GPU's division truncates)
        position = offs_q + diag
        chunk_first = tl.maximum(position, 0) // chunk * chunk
        last_key = tl.minimum(last_key, tl.where(position < 0, -1, chunk_first + chunk - 1))
    if TRANSPOSED:
        keep = offs_k[:, None] <= last_key[None, :]
        if HAS_LEFT:
            keep = keep & (offs_k[:, None] >= (offs_q + (diag - window_left))[None, :])
        if HAS_CHUNK:
            keep = keep & (offs_k[:, None] >= chunk_first[None, :])
    else:
        keep = offs_k[None, :] <= last_key[:, None]
        if HAS_LEFT:
            keep = keep & (offs_k[None, :] >= (offs_q + (diag - window_left))[:, None])
        if HAS_CHUNK:
            keep = keep & (offs_k[None, :] >= chunk_first[:, None])
    return tl.where(keep, scores, float("-inf"))


@triton.jit
def tile_inside(offs_q, offs_k, seqlen_q, seqlen_k, TRANSPOSED: tl.constexpr):
    """Which entries of a score tile lie within Sq x Sk."""
    # One return: Triton type-checks every return of a function, constexpr branches included, and
    # a transposed tile of another shape would not match.
    if TRANSPOSED:
        inside = (offs_k[:, None] < seqlen_k) & (offs_q[None, :] < seqlen_q)
    else:
        inside = (offs_q[:, None] < seqlen_q) & (offs_k[None, :] < seqlen_k)
    return inside


@triton.jit
def tile_offsets(offs_q, offs_k, stride_q, stride_k, TRANSPOSED: tl.constexpr):
    """Offsets of a score tile's entries in one (batch, head) of a (B, H, Sq, Sk) mask, bias or
    bias gradient; broadcast dims have stride 0."""
    if TRANSPOSED:  # one return, as in tile_inside
        offsets = offs_k[:, None].to(tl.int64) * stride_k + offs_q[None, :].to(tl.int64) * stride_q
    else:
        offsets = offs_q[:, None].to(tl.int64) * stride_q + offs_k[None, :].to(tl.int64) * stride_k
    return offsets


@triton.jit
def broadcast_tile_offsets(offs_q, offs_k, seqlen_q, seqlen_k, stride_q, stride_k, TRANSPOSED: tl.constexpr):
    """(``tile_offsets``, ``tile_inside``) of a score tile."""
    return (tile_offsets(offs_q, offs_k, stride_q, stride_k, TRANSPOSED),
            tile_inside(offs_q, offs_k, seqlen_q, seqlen_k, TRANSPOSED))


@triton.jit
def slice_indices(batch, head, stride_b, stride_h, head_div):
    """(batch, head) of a query head's slice in a bias's or mask's own (B|1, Hq|Hkv|1, ...) shape:
    0 on a broadcast dim (stride 0), ``head // head_div`` for one slice per KV group."""
    return tl.where(stride_b == 0, 0, batch), tl.where(stride_h == 0, 0, head // head_div)


@triton.jit
def load_bias_tile(desc, base, bias_batch, bias_head, start_q, start_k, offs_q, offs_k, seqlen_q, seqlen_k,
                   stride_q, stride_k, USE_DESC: tl.constexpr, TRANSPOSED: tl.constexpr):
    """The bias of a score tile as float32, 0 past Sq or Sk (keys along rows when ``TRANSPOSED``).

    ``USE_DESC``: ``desc`` is a TMA descriptor over the bias's own (B|1, H|Hkv|1, Sq, Sk) shape with
    block (1, 1, queries, keys), read at (``bias_batch``, ``bias_head``): the copy engine does the
    addressing and the zero fill, so no tile of pointers lives in registers (with pointers the D=128
    kernels spilled registers). Otherwise pointers from ``base``,
    this (batch, head)'s start, with broadcast dims at stride 0."""
    if USE_DESC:
        tile = desc.load([bias_batch, bias_head, start_q, start_k])
        tile = tile.reshape(desc.block_shape[2], desc.block_shape[3]).to(tl.float32)
        if TRANSPOSED:
            return tl.trans(tile)
        return tile
    else:
        offsets, inside = broadcast_tile_offsets(offs_q, offs_k, seqlen_q, seqlen_k, stride_q, stride_k, TRANSPOSED)
        return tl.load(base + offsets, mask=inside, other=0.0).to(tl.float32)


@triton.jit
def load_mask_tile(desc, base, mask_batch, mask_head, start_q, start_k, offs_q, offs_k, seqlen_q, seqlen_k, stride_q,
                   stride_k, SHIFT_Q: tl.constexpr, SHIFT_K: tl.constexpr, USE_DESC: tl.constexpr,
                   TRANSPOSED: tl.constexpr):
    """A score tile's entries of a boolean mask (bytes, 0 past Sq or Sk) as a bool tile.

    ``USE_DESC``: ``desc`` is a TMA descriptor over the mask's own (B|1, H|Hkv|1, Sq, Sk) bytes with
    block (1, 1, queries, keys), read at (``mask_batch``, ``mask_head``) -- no tile of 64-bit offsets
    in registers (with them the top-k forward ran out of registers and spilled). Otherwise entry
    (i, j) at (i >> SHIFT_Q, j >> SHIFT_K) of this (batch, head)'s slice at
    ``base``; the shifts are constexprs: 0 folds away, so the key offsets stay provably contiguous
    and the bytes load as vectors (runtime shifts made the top-k forward measurably slower).
    Either way the tile is read with keys along the fast axis and transposed in registers for the
    dK/dV pass: a transposed gather of single bytes measured much slower in that pass.
    SHIFT_Q = ``ONE_ROW``: the mask has one query row, read as a key vector (the returned keep is
    (1, keys), or (keys, 1) when ``TRANSPOSED``, and broadcasts over the queries)."""
    if USE_DESC:
        keep = desc.load([mask_batch, mask_head, start_q, start_k])
        keep = keep.reshape(desc.block_shape[2], desc.block_shape[3])
        if TRANSPOSED:
            keep = tl.trans(keep)
    elif SHIFT_Q == ONE_ROW:
        # One row for every query (a (B|1, H|1, 1, Sk) mask): a vector of the tile's keys, broadcast
        # over its queries -- no (queries x keys) tile of offsets (the random key mask row).
        keys = tl.load(base + (offs_k >> SHIFT_K).to(tl.int64) * stride_k, mask=offs_k < seqlen_k, other=0)
        if TRANSPOSED:
            keep = keys[:, None]
        else:
            keep = keys[None, :]
    else:
        offsets = tile_offsets(offs_q >> SHIFT_Q, offs_k >> SHIFT_K, stride_q, stride_k, False)
        inside = tile_inside(offs_q, offs_k, seqlen_q, seqlen_k, False)
        keep = tl.load(base + offsets, mask=inside, other=0)
        if TRANSPOSED:
            keep = tl.trans(keep)
    return keep != 0


@triton.jit
def alibi_slope(Alibi, batch, head, heads_q):
    """The ALiBi slope of (batch, head) in the kernels' log2 units, from the contiguous float32
    (B, Hq) slopes (``checks.check_alibi``; packed sequences: B = sequences)."""
    return tl.load(Alibi + batch.to(tl.int64) * heads_q + head) * LOG2E


# HAS_ALIBI's values: the distance form, and the key-term form where no kept key lies right of the
# diagonal (``alibi_mode``).
ALIBI_DISTANCE: tl.constexpr = tl.constexpr(1)
ALIBI_KEY_TERM: tl.constexpr = tl.constexpr(2)


def alibi_mode(spec) -> int:
    """The Triton attention kernels' HAS_ALIBI: 0 without ALiBi; ``ALIBI_KEY_TERM`` where every kept
    key is at or left of its query's aligned position (a right bound <= 0: causal), so
    ``-slope * |i' - j| = slope * (j - c) - slope * (i' - c)`` for any c: the kernels add the key term
    ``slope * (j - c)`` to each score (one add, c the tile's first aligned row: small numbers near the
    diagonal, where the row maxima are) and fold the row term into the row statistics
    (``alibi_row_term``); else ``ALIBI_DISTANCE``, the distance per score."""
    if not spec.alibi:
        return 0
    if spec.has_window_right and spec.window_right <= 0:
        return ALIBI_KEY_TERM.value
    return ALIBI_DISTANCE.value


@triton.constexpr_function
def alibi_in_scores(mode):
    """The HAS_ALIBI a loop passes to ``adjust_scores`` where it adds the key-term form itself: the
    distance form stays there, the key term does not (a constexpr: a local assigned from one is not)."""
    return 0 if mode == ALIBI_KEY_TERM else mode


@triton.constexpr_function
def alibi_distance(mode):
    """ALiBi in its distance form wherever it is on: for a pass that reads the true lse and adds no
    key term of its own (the deterministic bias-gradient pass)."""
    return ALIBI_DISTANCE if mode else 0


@triton.jit
def alibi_row_term(offs_q, start_q, slope_log2):
    """The row term ``-slope * (i' - c)`` of the key-term form (log2 units), with c the aligned
    position of row ``start_q``: what the true scores of row i differ from the kernels' by."""
    return -slope_log2 * (offs_q - start_q).to(tl.float32)


@triton.jit
def alibi_scores(scores, offs_q, offs_k, seqlen_q, seqlen_k, slope_log2, TRANSPOSED: tl.constexpr):
    """``scores - slope * |i + Sk - Sq - j|`` (``slope_log2``: the slope times log2 e, the scores'
    units), ALiBi's distance form; the torch statement is ``spec.alibi_distances``. (The key-term
    form is each loop's own: ``alibi_mode``.)"""
    diagonal = offs_q + (seqlen_k - seqlen_q)
    if TRANSPOSED:
        distance = tl.abs(offs_k[:, None] - diagonal[None, :])
    else:
        distance = tl.abs(offs_k[None, :] - diagonal[:, None])
    return scores - slope_log2 * distance.to(tl.float32)


@triton.jit
def adjust_scores(
    scores, offs_q, offs_k, start_q, start_k, seqlen_q, seqlen_k, window_left, window_right,
    mask_desc, mask_base, mask_batch, mask_head, stride_mq, stride_mk, MASK_SHIFT_Q: tl.constexpr,
    MASK_SHIFT_K: tl.constexpr, bias_desc, bias_base, bias_batch, bias_head,
    stride_bq, stride_bk, HAS_LEFT: tl.constexpr, HAS_RIGHT: tl.constexpr, HAS_MASK: tl.constexpr, HAS_BIAS: tl.constexpr,
    BIAS_TMA: tl.constexpr, MASK_TMA: tl.constexpr, IS_MASKED: tl.constexpr, TRANSPOSED: tl.constexpr,
    alibi_slope_log2=0.0, HAS_ALIBI: tl.constexpr = False, chunk=1, HAS_CHUNK: tl.constexpr = False,
):
    """Everything attention does to a log2-domain score tile after scale and softcap: the user's
    bias (times log2 e; -inf entries mask), ALiBi's distance form (``HAS_ALIBI``: ``alibi_scores`` with
    the program's slope, ``alibi_slope``), the keep rule (boundary tiles only: ``IS_MASKED``)
    and the user's boolean mask (True = attend). ``mask_base`` / ``bias_base`` point at this
    (batch, head) of their 4-D tensor; either may instead come through a descriptor read at its
    own (batch, head) indices (``load_bias_tile``, ``load_mask_tile``).
    The mask entry of (i, j) is at (i >> MASK_SHIFT_Q, j >> MASK_SHIFT_K): shifts 0 for a mask by
    elements, log2 of the block size for a keep map of whole blocks (``block_mask.from_blocks``).
    Entries past Sq or Sk read bias 0 and mask False."""
    if HAS_BIAS:
        scores += load_bias_tile(bias_desc, bias_base, bias_batch, bias_head, start_q, start_k, offs_q, offs_k,
                                 seqlen_q, seqlen_k, stride_bq, stride_bk, BIAS_TMA, TRANSPOSED) * LOG2E
    if HAS_ALIBI:
        tl.static_assert(HAS_ALIBI != ALIBI_KEY_TERM, "the key-term form is the loop's own (alibi_in_scores)")
        scores = alibi_scores(scores, offs_q, offs_k, seqlen_q, seqlen_k, alibi_slope_log2, TRANSPOSED)
    if IS_MASKED:
        scores = apply_mask(scores, offs_q, offs_k, seqlen_q, seqlen_k, window_left, window_right,
                            HAS_LEFT, HAS_RIGHT, TRANSPOSED, chunk, HAS_CHUNK)
    if HAS_MASK:
        keep = load_mask_tile(mask_desc, mask_base, mask_batch, mask_head, start_q, start_k, offs_q, offs_k, seqlen_q,
                              seqlen_k, stride_mq, stride_mk, MASK_SHIFT_Q, MASK_SHIFT_K, MASK_TMA, TRANSPOSED)
        scores = tl.where(keep, scores, float("-inf"))
    return scores
