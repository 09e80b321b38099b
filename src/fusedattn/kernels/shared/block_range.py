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
side is unbounded when its HAS_* flag is off). Interior classification may be
conservative (a fully-kept tile may be called boundary) but never the reverse.

Integer divisions below only ever see non-negative operands, so truncating and
flooring division agree (the GPU truncates).
"""

import triton
import triton.language as tl


@triton.jit
def key_blocks_for_query_block(
    m_block, seqlen_q, seqlen_k, window_left, window_right,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    HAS_LEFT: tl.constexpr, HAS_RIGHT: tl.constexpr,
):
    first_row = m_block * BLOCK_M
    last_row = tl.minimum(first_row + BLOCK_M, seqlen_q) - 1
    return key_blocks_for_rows(first_row, last_row, seqlen_q, seqlen_k, window_left, window_right, BLOCK_N,
                               HAS_LEFT, HAS_RIGHT)


@triton.jit
def key_blocks_for_rows(
    first_row, last_row, seqlen_q, seqlen_k, window_left, window_right,
    BLOCK_N: tl.constexpr, HAS_LEFT: tl.constexpr, HAS_RIGHT: tl.constexpr,
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
    HAS_LEFT: tl.constexpr, HAS_RIGHT: tl.constexpr,
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
    begin = row_begin // BLOCK_M
    end = tl.maximum(tl.cdiv(tl.maximum(row_end, 0), BLOCK_M), begin)
    interior_begin = tl.minimum(tl.maximum(tl.cdiv(full_begin, BLOCK_M), begin), end)
    interior_end = tl.minimum(tl.maximum(tl.maximum(full_end, 0) // BLOCK_M, interior_begin), end)
    # A key block cut by seqlen_k needs the bounds mask on every tile.
    key_block_is_partial = first_col + BLOCK_N > seqlen_k
    interior_begin = tl.where(key_block_is_partial, end, interior_begin)
    interior_end = tl.where(key_block_is_partial, end, interior_end)
    return begin, interior_begin, interior_end, end
