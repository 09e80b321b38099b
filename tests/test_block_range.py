"""block_range against brute force: every kept (query, key) pair lies in a visited tile,
interior tiles are entirely kept and in bounds, and the first and last visited tiles are
not wasted. Run through a probe kernel, so the jit functions are tested as compiled."""

import itertools

import pytest
import torch
import triton
import triton.language as tl

from fusedattn.kernels.shared.block_range import key_blocks_for_query_block, query_blocks_for_key_block
from fusedattn.spec import fold_window, keep_mask

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


@triton.jit
def _probe_kernel(Out, seqlen_q, seqlen_k, window_left, window_right, chunk,
                  BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                  HAS_LEFT: tl.constexpr, HAS_RIGHT: tl.constexpr, BY_KEY_BLOCK: tl.constexpr,
                  HAS_CHUNK: tl.constexpr):
    block = tl.program_id(0)
    if BY_KEY_BLOCK:
        a, b, c, d = query_blocks_for_key_block(block, seqlen_q, seqlen_k, window_left, window_right,
                                                BLOCK_M, BLOCK_N, HAS_LEFT, HAS_RIGHT, chunk, HAS_CHUNK)
    else:
        a, b, c, d = key_blocks_for_query_block(block, seqlen_q, seqlen_k, window_left, window_right,
                                                BLOCK_M, BLOCK_N, HAS_LEFT, HAS_RIGHT, chunk, HAS_CHUNK)
    tl.store(Out + block * 4 + 0, a)
    tl.store(Out + block * 4 + 1, b)
    tl.store(Out + block * 4 + 2, c)
    tl.store(Out + block * 4 + 3, d)


def _ranges(seqlen_q, seqlen_k, left, right, block_m, block_n, by_key_block, chunk=0):
    n_programs = triton.cdiv(seqlen_k if by_key_block else seqlen_q, block_n if by_key_block else block_m)
    out = torch.full((n_programs, 4), -999, dtype=torch.int32, device=DEVICE)
    _probe_kernel[(n_programs,)](out, seqlen_q, seqlen_k, left, right, max(chunk, 1), block_m, block_n,
                                 left != -1, right != -1, by_key_block, chunk > 0)
    return out.cpu().tolist()


def _tiles(keep, block_m, block_n):
    """Per tile: (any kept pair, all pairs kept and the tile entirely in bounds)."""
    sq, sk = keep.shape
    padded = torch.zeros(triton.cdiv(sq, block_m) * block_m, triton.cdiv(sk, block_n) * block_n, dtype=torch.bool)
    padded[:sq, :sk] = keep
    tiles = padded.reshape(padded.shape[0] // block_m, block_m, padded.shape[1] // block_n, block_n)
    any_kept = tiles.any(dim=3).any(dim=1)
    # A partial query block's padding rows do not matter (they are never stored); a partial
    # key block is never interior (its padding keys must be masked).
    rows_valid = torch.zeros(padded.shape[0], dtype=torch.bool)
    rows_valid[:sq] = True
    rows_valid = rows_valid.reshape(-1, block_m)
    all_kept = torch.stack([
        torch.stack([tiles[m, :, n][rows_valid[m]].all() for n in range(tiles.shape[2])])
        for m in range(tiles.shape[0])
    ])
    key_full = torch.tensor([(n + 1) * block_n <= sk for n in range(tiles.shape[2])])
    return any_kept, all_kept & key_full[None, :]


LENGTHS = [(1, 1), (1, 40), (40, 1), (37, 53), (53, 37), (64, 64), (100, 33)]
WINDOWS = [(False, None), (True, None), (False, (5, 3)), (False, (0, 0)), (True, (16, -1)), (False, (-1, 20)),
           (False, (40, 2))]
BLOCKS = [(16, 16), (16, 32), (32, 16)]


@pytest.mark.parametrize("by_key_block", [False, True], ids=["key-blocks-of-query-block", "query-blocks-of-key-block"])
@pytest.mark.parametrize("block_m,block_n", BLOCKS)
def test_block_ranges_cover_exactly_the_kept_tiles(by_key_block, block_m, block_n):
    for (sq, sk), (causal, window) in itertools.product(LENGTHS, WINDOWS):
        left, right = fold_window(causal, window)
        any_kept, interior = _tiles(keep_mask(sq, sk, left, right), block_m, block_n)
        if by_key_block:  # program n walks query blocks m: look at the transposed tile grid
            any_kept, interior = any_kept.T, interior.T
            # For dK/dV every row of a query block must be kept, padding rows included only
            # through their zero contributions; the kernel additionally requires whole query blocks.
            full_rows = torch.tensor([(m + 1) * block_m <= sq for m in range(any_kept.shape[1])])
            interior = interior & full_rows[None, :]
        for program, (begin, interior_begin, interior_end, end) in enumerate(
                _ranges(sq, sk, left, right, block_m, block_n, by_key_block)):
            where = f"Sq={sq} Sk={sk} window=({left},{right}) blocks={block_m}x{block_n} program {program}"
            assert 0 <= begin <= interior_begin <= interior_end <= end <= any_kept.shape[1], where
            visited = torch.zeros(any_kept.shape[1], dtype=torch.bool)
            visited[begin:end] = True
            assert not (any_kept[program] & ~visited).any(), f"{where}: a kept tile is skipped"
            assert interior[program, interior_begin:interior_end].all(), f"{where}: an interior tile needs masking"
            if end > begin:
                assert any_kept[program, begin] and any_kept[program, end - 1], f"{where}: visits an empty tile"


# chunk=C (chunked local attention): chunks that divide the blocks, straddle them, are longer than
# the keys, and C=1; with no window, with causal (Llama 4's form) and with a window
CHUNKS = [1, 5, 16, 23, 64]
CHUNK_WINDOWS = [(False, None), (True, None), (False, (5, 3))]


@pytest.mark.parametrize("by_key_block", [False, True], ids=["key-blocks-of-query-block", "query-blocks-of-key-block"])
@pytest.mark.parametrize("block_m,block_n", BLOCKS)
def test_block_ranges_with_chunks(by_key_block, block_m, block_n):
    """Every kept tile is visited and interior tiles are entirely kept, as above; with the chunk
    rule alone the walk visits exactly the tiles that hold a kept pair (whole key blocks outside a
    query block's chunks are skipped), which also counts the blocks visited against the expected."""
    for (sq, sk), (causal, window), chunk in itertools.product(LENGTHS, CHUNK_WINDOWS, CHUNKS):
        left, right = fold_window(causal, window)
        any_kept, interior = _tiles(keep_mask(sq, sk, left, right, chunk=chunk), block_m, block_n)
        if by_key_block:
            any_kept, interior = any_kept.T, interior.T
            full_rows = torch.tensor([(m + 1) * block_m <= sq for m in range(any_kept.shape[1])])
            interior = interior & full_rows[None, :]
        visited_total = 0
        for program, (begin, interior_begin, interior_end, end) in enumerate(
                _ranges(sq, sk, left, right, block_m, block_n, by_key_block, chunk)):
            where = f"Sq={sq} Sk={sk} window=({left},{right}) chunk={chunk} blocks={block_m}x{block_n} program {program}"
            assert 0 <= begin <= interior_begin <= interior_end <= end <= any_kept.shape[1], where
            visited = torch.zeros(any_kept.shape[1], dtype=torch.bool)
            visited[begin:end] = True
            visited_total += end - begin
            assert not (any_kept[program] & ~visited).any(), f"{where}: a kept tile is skipped"
            assert interior[program, interior_begin:interior_end].all(), f"{where}: an interior tile needs masking"
            if window is None:
                assert torch.equal(visited, any_kept[program]), f"{where}: visits {visited.tolist()}"
        if window is None and not causal:
            assert visited_total == int(any_kept.sum()), (sq, sk, chunk)
