"""Whether a persistent launch's static rounds beat one program per tile: the host's model, asked by
the planner.

A persistent Gluon launch (one program per SM) hands its tiles out in rounds over the launch order
(``gluon.common.snake_tile``): each round one tile per program, even rounds in program order, odd
ones reversed, so that a program given a heavy tile in one round gets a light one in the next.
That pairing holds only where the tiles' lengths, read in launch order, repeat with the rounds:
the launch order runs in chunks of head rows, heaviest block first (``gluon.common.launch_order``),
and where a chunk's length and the number of programs do not line up, every round puts its heavy
tiles on the same programs. One program per tile has no such failure: the hardware starts each tile
on the first SM that frees up (a greedy list schedule in launch order). Persistence hides part of
each tile's fixed cost (loads before its first step, stores after its last) and nothing else, so a
launch runs persistent only where the model says its busiest program ends no later than the greedy
schedule (``persistent_wins``), and with a count of programs whose rounds line up with the launch
order's chunks where that balances better (``persistent_programs``).

The model counts a tile's work in steps (query blocks of a dK/dV tile, key blocks of a forward
tile) plus a fixed cost a tile, fitted from the one-program-per-tile D=64 causal dK/dV pass at two
lengths (same tiles, different step counts), of which a persistent program hides about a quarter
(what the persistent pass gained at short rows). It predicted the persistent / one-tile ratio of
every launch timed against it within ~0.1, on both sides of 1 (benchmarks/NOTES.md).

Pure torch on the CPU: the kernels' launch order and rounds written out for the host (tests check
them against a tile-by-tile walk); the block ranges are ``block_range.py``'s under a causal bound.
"""

from __future__ import annotations

import heapq

import torch

from .launch import cdiv  # ints and tensors alike

FIXED_STEPS = 2.0  # a tile's cost beyond its steps with one program per tile, in steps
PERSISTENT_FIXED_STEPS = 1.5  # the same in a persistent program: part of it runs under the neighbours
TOLERANCE = 0.01  # persistent where the model has it at most this much slower (the standard shapes: 1.00)
GREEDY_TILES_PER_SM = 64  # more tiles than this a SM: the greedy schedule is taken as an even share


def launch_order_blocks(head_rows: int, blocks: int, chunk_heads: int) -> torch.Tensor:
    """The block of every tile, in launch order (``gluon.common.launch_order``): chunks of
    ``chunk_heads`` head rows, within a chunk every row's block 0, then every row's block 1, ..."""
    tile = torch.arange(head_rows * blocks)
    chunk_tiles = chunk_heads * blocks
    chunk = tile // chunk_tiles
    rows = (head_rows - chunk * chunk_heads).clamp(max=chunk_heads)
    return (tile - chunk * chunk_tiles) // rows


def interleaved_order_tiles(head_rows: int, blocks: int, chunk_heads: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(head row, block) of every tile, in launch order (``gluon.common.interleaved_order``): each
    chunk's light half -- blocks [blocks // 2, blocks) -- launched block by block among the next chunk's
    heavy half, H_0, (T_0 H_1), ..., T_last, each merged segment alternating T, H, T, H, ...
    ``head_rows`` a multiple of ``chunk_heads``."""
    pid = torch.arange(head_rows * blocks)
    half, chunks = blocks // 2, head_rows // chunk_heads
    first = pid < chunk_heads * half
    within = (pid - chunk_heads * half).clamp(min=0)
    segment, within = within // (chunk_heads * blocks), within % (chunk_heads * blocks)
    group, row = within // chunk_heads, within % chunk_heads
    last = segment == chunks - 1
    light = last | (group % 2 == 0)
    block = torch.where(last, half + group, torch.where(light, half + group // 2, group // 2))
    chunk = torch.where(light, segment, segment + 1)
    block = torch.where(first, pid // chunk_heads, block)
    chunk = torch.where(first, 0, chunk)
    row = torch.where(first, pid % chunk_heads, row)
    return chunk * chunk_heads + row, block


def snake_programs(tiles: int, programs: int) -> torch.Tensor:
    """The program that walks each tile (``gluon.common.snake_tile``'s rounds)."""
    tile = torch.arange(tiles)
    rounds, within = tile // programs, tile % programs
    return torch.where(rounds % 2 == 0, within, programs - 1 - within)


def rounds_finish(work: torch.Tensor, programs: int) -> float:
    """When the busiest program of a persistent launch ends: the largest sum of ``work`` (each tile's,
    in launch order) over the tiles the rounds give one program."""
    return float(torch.bincount(snake_programs(work.numel(), programs), weights=work.double(),
                                minlength=programs).max())


def greedy_finish(work: torch.Tensor, sms: int) -> float:
    """When a launch of one program per tile ends: each tile, in launch order, starts on the SM that
    frees up first. With many tiles a SM, the even share (the schedule's lower bound; the last
    tiles' spread is a small part of it)."""
    if work.numel() > GREEDY_TILES_PER_SM * sms:
        return float(work.double().sum()) / sms
    finish = [0.0] * sms
    for cost in work.tolist():
        heapq.heapreplace(finish, finish[0] + cost)
    return max(finish)


def persistent_wins(work: torch.Tensor, programs: int, sms: int) -> bool:
    """Whether a persistent launch of ``programs`` programs is modelled to end no later (within
    TOLERANCE) than one program per tile for tiles of ``work`` steps each (in launch order)."""
    persistent = rounds_finish(work + PERSISTENT_FIXED_STEPS, programs)
    return persistent <= (1.0 + TOLERANCE) * greedy_finish(work + FIXED_STEPS, sms)


def aligned_programs(sms: int, period: int) -> int:
    """The most programs, at most ``sms``, whose rounds each cover whole periods of the launch order
    (``period``: the tiles of one chunk of head rows), 0 where one period is more tiles than SMs."""
    return sms // period * period


def persistent_programs(work: torch.Tensor, sms: int, period: int) -> int:
    """Programs of a persistent launch for tiles of ``work`` steps each (in launch order), or 0 for one
    program per tile. Two counts are modelled: one program per SM, and the most programs whose rounds
    each take whole periods of the launch order (``aligned_programs``). Aligned rounds each take the
    same chunk's tiles, heaviest block paired with the lightest by the reversed rounds, and where the
    period does not divide the SMs the unaligned rounds drift across it and keep giving the same
    programs the heavy blocks. Where the model has the two level (within TOLERANCE) the aligned count
    runs: measured faster at the standard shapes, where its rounds also keep each chunk's heads
    together in L2 (benchmarks/NOTES.md). Then persistent only where ``persistent_wins``."""
    candidates = [p for p in (aligned_programs(sms, period), sms) if 0 < p < work.numel()]
    if not candidates:
        return 0
    finish = [rounds_finish(work + PERSISTENT_FIXED_STEPS, p) for p in candidates]
    programs = next(p for p, f in zip(candidates, finish) if f <= (1.0 + TOLERANCE) * min(finish))
    return programs if persistent_wins(work, programs, sms) else 0


def causal_key_block_steps(seqlen_q: int, seqlen_k: int, window_left: int | None, block_m: int,
                           block_n: int) -> torch.Tensor:
    """Query blocks the dK/dV pass walks for each key block under a causal bound (bottom-right
    aligned) and an optional left window (``block_range.query_blocks_for_key_block``)."""
    diag = seqlen_k - seqlen_q
    first_col = torch.arange(cdiv(seqlen_k, block_n)) * block_n
    last_col = (first_col + block_n).clamp(max=seqlen_k) - 1
    row_begin = (first_col - diag).clamp(min=0)
    row_end = torch.full_like(first_col, seqlen_q)
    if window_left is not None:
        row_end = torch.minimum(row_end, last_col - diag + window_left + 1)
    begin = torch.div(row_begin, block_m, rounding_mode="floor")
    end = torch.maximum(cdiv(row_end.clamp(min=0), block_m), begin)
    return end - begin


def causal_query_block_steps(seqlen_q: int, seqlen_k: int, window_left: int | None, block_m: int,
                             block_n: int) -> torch.Tensor:
    """Key blocks the forward walks for each query block under a causal bound (bottom-right aligned)
    and an optional left window (``block_range.key_blocks_for_query_block``)."""
    diag = seqlen_k - seqlen_q
    first_row = torch.arange(cdiv(seqlen_q, block_m)) * block_m
    last_row = (first_row + block_m).clamp(max=seqlen_q) - 1
    key_end = (last_row + diag + 1).clamp(max=seqlen_k)
    key_begin = torch.zeros_like(first_row)
    if window_left is not None:
        key_begin = (first_row + diag - window_left).clamp(min=0)
    begin = torch.div(key_begin, block_n, rounding_mode="floor")
    end = torch.maximum(cdiv(key_end.clamp(min=0), block_n), begin)
    return end - begin


def dkdv_tile_work(seqlen_q: int, seqlen_k: int, window_left: int | None, group: int, head_rows: int,
                   chunk_heads: int, block_m: int, block_n: int) -> torch.Tensor:
    """Steps of every tile of a causal dK/dV launch, in launch order: its key block's query blocks
    for each of the ``group`` query heads it walks."""
    steps = causal_key_block_steps(seqlen_q, seqlen_k, window_left, block_m, block_n)
    return group * steps[launch_order_blocks(head_rows, steps.numel(), chunk_heads)]


def forward_tile_work(seqlen_q: int, seqlen_k: int, window_left: int | None, head_rows: int, chunk_heads: int,
                      block_m: int, block_n: int) -> torch.Tensor:
    """Key blocks of every tile of a causal forward launch, in launch order: its launch block 0 is
    the last query block, which sees the most keys (``gluon.fwd._tile_block``)."""
    steps = causal_query_block_steps(seqlen_q, seqlen_k, window_left, block_m, block_n)
    return steps.flip(0)[launch_order_blocks(head_rows, steps.numel(), chunk_heads)]
