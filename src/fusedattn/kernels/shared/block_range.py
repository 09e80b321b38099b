"""The one place that decides which tiles a program visits (without a user mask; with one,
``tile_lists.py`` makes the same decision on the host, merged with the mask's tile states).

Forward and the dQ pass walk key blocks for one query block; the dK/dV pass walks
query blocks for one key block (the inverse map). Each returns four block indices
``begin <= full_begin <= full_end <= end``: blocks in ``[full_begin, full_end)`` are
*interior* -- every (query, key) pair in them is kept and in bounds, so the caller
runs them without any mask math; blocks in ``[begin, full_begin)`` and
``[full_end, end)`` are *boundary* tiles that go through ``masking.apply_mask``;
blocks outside ``[begin, end)`` hold no kept pair and are skipped.

Rules (bottom-right aligned, ``diag = seqlen_k - seqlen_q``): query i keeps
key j iff ``j < seqlen_k`` and ``-window_left <= j - i - diag <= window_right`` (a
side is unbounded when its HAS_* flag is off), and with HAS_CHUNK iff
``floor((i + diag) / chunk) == j // chunk`` (a row at a negative aligned position keeps no key):
the walk then starts at the chunk start of the first row's aligned position and ends at the chunk
end of the last row's (forward, dQ), or covers the rows whose chunk holds the key block (dK/dV). Interior classification may be
conservative (a fully-kept tile may be called boundary) but never the reverse.

Integer divisions below only ever see non-negative operands (aligned positions are clamped to
0 first), so truncating and flooring division agree (the GPU truncates).
"""

import triton
import triton.language as tl


@triton.jit
def key_blocks_for_query_block(
    m_block, seqlen_q, seqlen_k, window_left, window_right,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    HAS_LEFT: tl.constexpr, HAS_RIGHT: tl.constexpr, chunk=1, HAS_CHUNK: tl.constexpr = False,
):
    first_row = m_block * BLOCK_M
    last_row = tl.minimum(first_row + BLOCK_M, seqlen_q) - 1
    return key_blocks_for_rows(first_row, last_row, seqlen_q, seqlen_k, window_left, window_right, BLOCK_N,
                               HAS_LEFT, HAS_RIGHT, chunk, HAS_CHUNK)


@triton.jit
def key_blocks_for_rows(
    first_row, last_row, seqlen_q, seqlen_k, window_left, window_right,
    BLOCK_N: tl.constexpr, HAS_LEFT: tl.constexpr, HAS_RIGHT: tl.constexpr, chunk=1,
    HAS_CHUNK: tl.constexpr = False,
):
    """``key_blocks_for_query_block`` of the query rows ``first_row..last_row`` (the KV-cache kernel's
    programs hold a few query positions times the query heads of one KV head)."""
    diag = seqlen_k - seqlen_q
    key_begin = first_row * 0  # a runtime zero of the right type
    key_end = seqlen_k + key_begin
    # Interior keys: kept for *every* row of the block, and a whole key block in bounds.
    full_begin = key_begin
    full_end = key_end
    if HAS_RIGHT:
        key_end = tl.minimum(key_end, last_row + diag + window_right + 1)
        full_end = tl.minimum(full_end, first_row + diag + window_right + 1)
    if HAS_LEFT:
        key_begin = tl.maximum(key_begin, first_row + diag - window_left)
        full_begin = tl.maximum(full_begin, last_row + diag - window_left)
    if HAS_CHUNK:
        # Rows at negative aligned positions keep no key: clamping them to -1 / 0 makes their chunk end 0
        # (nothing to walk, no interior) and leaves the start at key 0.
        first_pos = first_row + diag
        last_pos = last_row + diag
        key_begin = tl.maximum(key_begin, tl.maximum(first_pos, 0) // chunk * chunk)
        key_end = tl.minimum(key_end, tl.cdiv(tl.maximum(last_pos + 1, 0), chunk) * chunk)
        full_begin = tl.maximum(full_begin, tl.maximum(last_pos, 0) // chunk * chunk)
        full_end = tl.minimum(full_end, tl.cdiv(tl.maximum(first_pos + 1, 0), chunk) * chunk)
    begin = key_begin // BLOCK_N
    end = tl.maximum(tl.cdiv(tl.maximum(key_end, 0), BLOCK_N), begin)
    interior_begin = tl.minimum(tl.maximum(tl.cdiv(full_begin, BLOCK_N), begin), end)
    interior_end = tl.minimum(tl.maximum(tl.maximum(full_end, 0) // BLOCK_N, interior_begin), end)
    return begin, interior_begin, interior_end, end


@triton.jit
def split_key_blocks(begin, end, split, num_splits):
    """Split-KV: the share of split ``split`` of ``num_splits`` in a program's key blocks
    ``[begin, end)`` (``key_blocks_for_rows``), as (first, end, step): blocks ``begin + split``,
    ``begin + split + num_splits``, ... below ``end`` -- interleaved, so the shares differ by at most
    one block (with more splits than blocks some are empty) and at any moment the splits read
    neighbouring blocks. Runs of whole blocks measured slower at B=1 / 8k."""
    return begin + split, end, num_splits


@triton.jit
def query_blocks_for_key_block(
    n_block, seqlen_q, seqlen_k, window_left, window_right,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    HAS_LEFT: tl.constexpr, HAS_RIGHT: tl.constexpr, chunk=1, HAS_CHUNK: tl.constexpr = False,
):
    diag = seqlen_k - seqlen_q
    first_col = n_block * BLOCK_N
    last_col = tl.minimum(first_col + BLOCK_N, seqlen_k) - 1
    row_begin = first_col * 0
    row_end = seqlen_q + row_begin
    # Interior rows: kept for every key of a *whole* key block, and a whole query block in bounds.
    full_begin = row_begin
    full_end = row_end
    if HAS_RIGHT:  # j <= i + diag + right  <=>  i >= j - diag - right
        row_begin = tl.maximum(row_begin, first_col - diag - window_right)
        full_begin = tl.maximum(full_begin, first_col + BLOCK_N - 1 - diag - window_right)
    if HAS_LEFT:  # j >= i + diag - left  <=>  i <= j - diag + left
        row_end = tl.minimum(row_end, last_col - diag + window_left + 1)
        full_end = tl.minimum(full_end, first_col - diag + window_left + 1)
    if HAS_CHUNK:  # rows whose aligned position i + diag lies in a chunk of the block's keys
        row_begin = tl.maximum(row_begin, first_col // chunk * chunk - diag)
        row_end = tl.minimum(row_end, (last_col // chunk + 1) * chunk - diag)
        # interior: rows in the chunk holding all of a whole key block (none if the block spans two)
        full_begin = tl.maximum(full_begin, (first_col + BLOCK_N - 1) // chunk * chunk - diag)
        full_end = tl.minimum(full_end, (first_col // chunk + 1) * chunk - diag)
    begin = row_begin // BLOCK_M
    end = tl.maximum(tl.cdiv(tl.maximum(row_end, 0), BLOCK_M), begin)
    interior_begin = tl.minimum(tl.maximum(tl.cdiv(full_begin, BLOCK_M), begin), end)
    interior_end = tl.minimum(tl.maximum(tl.maximum(full_end, 0) // BLOCK_M, interior_begin), end)
    # A key block cut by seqlen_k needs the bounds mask on every tile.
    key_block_is_partial = first_col + BLOCK_N > seqlen_k
    interior_begin = tl.where(key_block_is_partial, end, interior_begin)
    interior_end = tl.where(key_block_is_partial, end, interior_end)
    return begin, interior_begin, interior_end, end
