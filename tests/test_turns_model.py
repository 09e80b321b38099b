"""benchmarks/turns_model.py, the model of the warp-specialised forward's ring and turns protocol
for one tile: the kernel's order of turns never deadlocks a tile (on the GPU a deadlock hangs the
kernel), and the model does find the deadlock of the order that hung (its hand-backs before its
turns, on the last tile's rows past Sq). No GPU."""

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
from turns_model import Tile, run  # noqa: E402

SEQLENS = (65, 200, 333, 700, 1100, 1500, 4096)
WINDOWS = (0, 5, 20, 150, 300, 548, 1023, 2048)


@pytest.mark.parametrize("order", ["tile", "own"])
@pytest.mark.parametrize("warpgroups, block_n", [(3, 128), (2, 128), (2, 64), (3, 64)])
def test_no_tile_deadlocks(order, warpgroups, block_n):
    for seqlen in SEQLENS:
        for window in WINDOWS:
            for first_row in range(0, seqlen, 64 * warpgroups):
                tile = Tile(first_row, seqlen, window, warpgroups, block_n=block_n)
                assert not run(tile, order)["deadlock"], tile


def test_the_model_finds_the_hung_order():
    """The first form handed every block past its own back before passing its remaining turns: on the
    last tile at S=4k (rows 4032-4223, two warpgroups past the end) that waits on a load that waits on
    the first warpgroup, which waits on their turns."""
    last = Tile(4032, 4096, 1024)
    assert run(last, "own-early-release")["deadlock"]
    assert not run(last, "own")["deadlock"]


def test_own_turns_leave_fewer_passed_slots_beside_steps():
    """At a 1024-key window every tile takes as many rounds either way; by their own blocks the
    warpgroups pass bare rounds at the end instead of slots beside the others' steps (benchmarks/NOTES.md
    v80: 45 such rounds a head at S=4k by the tile's blocks, 15 by their own)."""
    tiles = [Tile(m0, 4096, 1024) for m0 in range(0, 4096, 192)]
    by_tile = [run(t, "tile") for t in tiles]
    by_own = [run(t, "own") for t in tiles]
    assert [r["rounds"] for r in by_tile] == [r["rounds"] for r in by_own]
    assert sum(r["mixed_rounds"] for r in by_tile) == 45
    assert sum(r["mixed_rounds"] for r in by_own) == 15
