"""A model of the warp-specialised forward's protocol for one tile (``kernels/gluon/fwd.py``:
``_ws_produce_tile``, ``_ws_consume_tile``): the producer loading each key block's K and V into
rings of ``stages`` slots, the consumer warpgroups handing slots back and taking turns (round robin)
on their score matmuls, every mbarrier a counter of completed phases. It runs the agents until all
finish or none can move (a deadlock), and counts the rounds of turns in which a warpgroup only
passes beside others' steps. No GPU, no kernel: a check of an ordering before it goes into the kernel, where a wrong one
hangs the GPU.

Orders of a warpgroup's turns (``ORDERS``):
- ``tile``: turns by the tile's key blocks; a block the warpgroup's rows never see is passed with its
  turn (the kernel before v80);
- ``own``: turns by the warpgroup's own blocks; the blocks before its own handed back without a
  turn, those after its own with theirs, the turns left passed at the end (the kernel's, under a
  left window);
- ``own-early-release``: as ``own`` but every block past its own handed back before any turn is
  passed (the first form, which hung on the GPU).

    python benchmarks/turns_model.py [--seqlen 4096] [--window 1024]
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass

ORDERS = ("tile", "own", "own-early-release")


@dataclass(frozen=True)
class Tile:
    """A tile of ``warpgroups`` x ``rows`` query rows from ``first_row``, over keys in ``block_n``
    blocks, under a causal bound with a left window of ``window`` keys (the query's own included;
    0: none) at ``seqlen`` queries and keys."""

    first_row: int
    seqlen: int
    window: int
    warpgroups: int = 3
    rows: int = 64
    block_n: int = 128
    stages: int = 2

    def own_blocks(self, wg: int) -> tuple[int, int] | None:
        """[first, end) of the key blocks warpgroup ``wg``'s rows see; None for rows all past the end."""
        top = self.first_row + wg * self.rows
        if top >= self.seqlen:
            return None
        bottom = min(top + self.rows, self.seqlen) - 1
        first_key = max(0, top - self.window + 1) if self.window else 0
        return first_key // self.block_n, bottom // self.block_n + 1

    def blocks(self) -> tuple[int, int]:
        """[first, end) of the tile's key blocks: the union of its warpgroups'."""
        ranges = [r for r in map(self.own_blocks, range(self.warpgroups)) if r is not None]
        return min(r[0] for r in ranges), max(r[1] for r in ranges)


def _consumer(tile: Tile, wg: int, order: str):
    first, end = tile.blocks()
    n_blocks = end - first
    own = tile.own_blocks(wg)
    unseen, seen = (0, 0) if own is None else (own[0] - first, own[1] - first)
    turn_base = -unseen if order != "tile" else 0
    nq, stages = tile.warpgroups, tile.stages

    def take_turn(t):
        if wg == 0:
            yield ("wait", ("turn", 0), (t & 1) ^ 1)  # a fresh barrier: turn 0 passes
        else:
            yield ("wait", ("turn", wg), t & 1)
        yield ("arrive", ("turn", (wg + 1) % nq), 1)
        yield ("turn", t)

    def block(j, turn, step):
        slot, phase = j % stages, (j // stages) & 1
        yield ("wait", ("k_ready", slot), phase)
        if turn is not None:
            yield from take_turn(turn)
            if step:
                yield ("step", j)
        yield ("arrive", ("k_empty", slot), nq)
        yield ("wait", ("v_ready", slot), phase)
        yield ("arrive", ("v_empty", slot), nq)

    for j in range(unseen):
        yield from block(j, j if order == "tile" else None, False)
    for j in range(unseen, seen):
        yield from block(j, turn_base + j, True)
    if order == "own-early-release":
        for j in range(seen, n_blocks):
            yield from block(j, None, False)
        for t in range(seen - unseen, n_blocks):
            yield from take_turn(t)
        return
    for j in range(seen, n_blocks):
        yield from block(j, turn_base + j, False)
    if order == "own":
        for t in range(n_blocks - unseen, n_blocks):
            yield from take_turn(t)


def _producer(tile: Tile):
    first, end = tile.blocks()
    for j in range(end - first):
        slot, phase = j % tile.stages, ((j // tile.stages) & 1) ^ 1
        for ring in ("k", "v"):
            yield ("wait", (f"{ring}_empty", slot), phase)
            yield ("arrive", (f"{ring}_ready", slot), 1)


def run(tile: Tile, order: str) -> dict:
    """Runs the tile's agents to the end. Returns ``deadlock`` (True where none can move before all
    finish), ``rounds`` (turns a warpgroup took, the same for all), ``mixed_rounds`` (rounds in which
    some warpgroups run a step and another only passes its turn: a round lasts a step's latency
    whatever the others do, so its passed slot is lost) and ``bare_rounds`` (rounds in which every
    warpgroup only passes: no matmul waits on them)."""
    phases: dict = {}
    arrivals: dict = {}
    agents = [_producer(tile)] + [_consumer(tile, wg, order) for wg in range(tile.warpgroups)]
    pending = [next(a, None) for a in agents]
    turns_with_step: dict = {}
    turns_taken: dict = {}
    last_turn: dict = {}
    while any(op is not None for op in pending):
        moved = False
        for i, agent in enumerate(agents):
            while pending[i] is not None:
                kind, *rest = pending[i]
                if kind == "wait":
                    barrier, parity = rest
                    if phases.get(barrier, 0) % 2 == parity:  # the phase of that parity not complete yet
                        break
                elif kind == "arrive":
                    barrier, count = rest
                    arrivals[barrier] = arrivals.get(barrier, 0) + 1
                    if arrivals[barrier] == count:
                        arrivals[barrier] = 0
                        phases[barrier] = phases.get(barrier, 0) + 1
                elif kind == "turn":
                    turns_taken[(i, rest[0])] = True
                    last_turn[i] = rest[0]
                elif kind == "step":
                    turns_with_step[(i, last_turn[i])] = True
                moved = True
                pending[i] = next(agent, None)
        if not moved:
            return dict(deadlock=True, rounds=None, mixed_rounds=None, bare_rounds=None)
    rounds = max(t for _, t in turns_taken) + 1 if turns_taken else 0
    consumers = range(1, tile.warpgroups + 1)
    steps = [sum((i, t) in turns_with_step for i in consumers) for t in range(rounds)]
    mixed = sum(1 for n in steps if 0 < n < tile.warpgroups)
    return dict(deadlock=False, rounds=rounds, mixed_rounds=mixed, bare_rounds=steps.count(0))


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--seqlen", type=int, default=4096)
    p.add_argument("--window", type=int, default=1024)
    p.add_argument("--warpgroups", type=int, default=3)
    args = p.parse_args()
    tile_rows = 64 * args.warpgroups
    for order in ORDERS:
        results = [run(Tile(m0, args.seqlen, args.window, args.warpgroups), order)
                   for m0 in range(0, args.seqlen, tile_rows)]
        stuck = sum(r["deadlock"] for r in results)
        done = [r for r in results if not r["deadlock"]]
        print(f"{order:18s} tiles {len(results)}, deadlocked {stuck}, rounds {sum(r['rounds'] for r in done)}: "
              f"{sum(r['mixed_rounds'] for r in done)} with a passed slot beside steps, "
              f"{sum(r['bare_rounds'] for r in done)} of passes alone")


if __name__ == "__main__":
    main()
