"""The host's model of persistent launches (kernels/shared/rounds.py): the launch order, the rounds and
the block ranges it reads, each against a tile-by-tile walk written from its definition, and its
decisions at the shapes where both launches were timed on one H200."""

import pytest
import torch

from fusedattn.kernels.shared import rounds


def walk_launch_order(head_rows, blocks, chunk_heads):
    """Blocks in launch order: chunk after chunk of head rows, within each every row's block 0, then
    every row's block 1, ..."""
    order = []
    for first in range(0, head_rows, chunk_heads):
        rows = range(first, min(first + chunk_heads, head_rows))
        for block in range(blocks):
            order += [block for _ in rows]
    return order


def walk_rounds(tiles, programs):
    """Program of each tile: round after round one tile per program, odd rounds in reverse."""
    owner = []
    for first in range(0, tiles, programs):
        round_programs = list(range(programs))
        if (first // programs) % 2:
            round_programs.reverse()
        owner += round_programs[:tiles - first]
    return owner


def kept(seqlen_q, seqlen_k, window_left):
    """Query i keeps key j under a causal bound, bottom-right aligned, and an optional left window."""
    i = torch.arange(seqlen_q)[:, None]
    j = torch.arange(seqlen_k)[None, :]
    keep = j <= i + seqlen_k - seqlen_q
    if window_left is not None:
        keep &= j >= i + seqlen_k - seqlen_q - window_left
    return keep


def blocks_touched(keep, block_rows, block_cols):
    """For each column block, the row blocks holding a kept pair."""
    rows, cols = keep.shape
    return [sum(bool(keep[r:r + block_rows, c:c + block_cols].any()) for r in range(0, rows, block_rows))
            for c in range(0, cols, block_cols)]


@pytest.mark.parametrize("head_rows,blocks,chunk_heads", [(7, 5, 3), (12, 8, 4), (5, 4, 1), (6, 3, 6), (9, 2, 16)])
def test_launch_order_blocks_follow_the_launch_order(head_rows, blocks, chunk_heads):
    chunk_heads = min(chunk_heads, head_rows)
    assert rounds.launch_order_blocks(head_rows, blocks, chunk_heads).tolist() == walk_launch_order(
        head_rows, blocks, chunk_heads)


@pytest.mark.parametrize("tiles,programs", [(10, 3), (12, 4), (7, 7), (5, 8), (131, 13)])
def test_snake_programs_follow_the_rounds(tiles, programs):
    assert rounds.snake_programs(tiles, programs).tolist() == walk_rounds(tiles, programs)


LENGTHS = [(1000, 1000, None), (517, 333, None), (333, 517, None), (1000, 1000, 300), (700, 1200, 100), (64, 64, None),
           (200, 70, 0)]


@pytest.mark.parametrize("seqlen_q,seqlen_k,window_left", LENGTHS)
@pytest.mark.parametrize("block_m,block_n", [(128, 128), (64, 128)])
def test_block_steps_are_the_blocks_holding_kept_pairs(seqlen_q, seqlen_k, window_left, block_m, block_n):
    keep = kept(seqlen_q, seqlen_k, window_left)
    assert rounds.causal_key_block_steps(seqlen_q, seqlen_k, window_left, block_m, block_n).tolist() == \
        blocks_touched(keep, block_m, block_n)
    assert rounds.causal_query_block_steps(seqlen_q, seqlen_k, window_left, block_m, block_n).tolist() == \
        blocks_touched(keep.T, block_n, block_m)


def test_greedy_finish_starts_each_tile_on_the_first_free_sm():
    assert rounds.greedy_finish(torch.tensor([4.0, 1, 1, 1]), 2) == 4.0  # three short tiles beside the long one
    assert rounds.greedy_finish(torch.tensor([4.0, 1, 1, 1, 1, 1]), 2) == 5.0  # the fifth waits for a free SM
    assert rounds.greedy_finish(torch.tensor([1.0, 1, 1, 1, 4]), 2) == 6.0  # the long one last
    assert rounds.greedy_finish(torch.ones(1000), 10) == pytest.approx(100.0)  # the even share, many tiles an SM


def test_rounds_finish_is_the_busiest_programs_sum():
    work = torch.tensor([5.0, 4, 3, 2, 1, 0])  # rounds of 3: programs 0, 1, 2 then 2, 1, 0
    assert rounds.rounds_finish(work, 3) == 5.0  # program 0: 5 + 0, 1: 4 + 1, 2: 3 + 2


def test_aligned_programs_take_whole_periods():
    assert rounds.aligned_programs(132, 8) == 128
    assert rounds.aligned_programs(132, 12) == 132
    assert rounds.aligned_programs(132, 40) == 120
    assert rounds.aligned_programs(132, 144) == 0


def test_persistent_programs_choose_between_the_counts():
    level = torch.ones(8 * 40)  # three rounds whichever count: the aligned one (128)
    assert rounds.persistent_programs(level, 132, 8) == 128
    uneven_periods = torch.ones(3000)  # 100 programs (period 100) take 30 rounds, 132 take 23: one per SM
    assert rounds.persistent_programs(uneven_periods, 132, 100) == 132
    one_long = torch.tensor([40.0] + [1.0] * 300)  # the long tile's program walks two more: one per tile
    assert rounds.persistent_programs(one_long, 132, 301) == 0


SMS = 132
# Kernel times (us) measured on one H200 in one run (benchmarks/persistent_balance.py, causal, bf16) by
# programs: 0 = one program per tile, 132 = one per SM, 128 = one launch-order chunk a round.
# (batch, heads, length): the D=64 dK/dV pass (128-row steps over 128-key tiles; launch chunks of
# round(SMs / key blocks) head rows) and the D=128 forward (128-row tiles over 128-key blocks, head-major).
DKDV_TIMED = [((16, 32, 1024), {0: 490.8, 132: 458.5, 128: 434.0}),
              ((4, 32, 4096), {0: 1372.6, 132: 1359.9, 128: 1325.3}),
              ((1, 32, 4096), {0: 358.2, 132: 571.8, 128: 347.6}),
              ((1, 32, 1024), {0: 33.1, 132: 46.2, 128: 30.9}),
              ((1, 32, 2048), {0: 107.1, 132: 165.0, 128: 101.1}),
              ((4, 32, 1024), {0: 132.0, 132: 172.7, 128: 119.5})]
FORWARD_TIMED = [((2, 18, 1024), {0: 36.8, 132: 43.4, 128: 43.2}),
                 ((1, 16, 2048), {0: 55.5, 132: 50.9, 128: 42.2}),
                 ((16, 16, 1024), {0: 192.7, 132: 164.8, 128: 164.1})]


def dkdv_work(batch, heads, length):
    key_blocks = length // 128
    chunk = max(1, min(batch * heads, round(SMS / key_blocks)))
    return rounds.dkdv_tile_work(length, length, None, 1, batch * heads, chunk, 128, 128), chunk * key_blocks


def forward_work(batch, heads, length):
    return rounds.forward_tile_work(length, length, None, batch * heads, 1, 128, 128), length // 128


@pytest.mark.parametrize("work_of,shape,measured", [(dkdv_work, *row) for row in DKDV_TIMED] +
                         [(forward_work, *row) for row in FORWARD_TIMED])
def test_the_model_calls_each_count_as_measured(work_of, shape, measured):
    """Each persistent count against one program per tile: faster where the model says so."""
    work, _ = work_of(*shape)
    for programs in (128, 132):
        assert rounds.persistent_wins(work, programs, SMS) == (measured[programs] < measured[0]), programs


@pytest.mark.parametrize("work_of,shape,measured", [(dkdv_work, *row) for row in DKDV_TIMED] +
                         [(forward_work, *row) for row in FORWARD_TIMED])
def test_the_rule_picks_the_fastest_measured_launch(work_of, shape, measured):
    work, period = work_of(*shape)
    chosen = rounds.persistent_programs(work, SMS, period)
    assert measured[chosen] <= 1.01 * min(measured.values()), (chosen, measured)


@pytest.fixture
def launchers_on_132_sms(monkeypatch):
    """The Gluon launchers' host side with 132 SMs and an H200's 60 MB of L2 (the launch is built,
    never run: no GPU needed)."""
    from fusedattn.kernels.gluon import bwd, common, fwd

    for module in (bwd, fwd, common):
        monkeypatch.setattr(module, "sm_count", lambda device: SMS)
    monkeypatch.setattr(common, "_l2_bytes", lambda index: 60 * 2 ** 20)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    return bwd, fwd


def fastest(launcher, tiles, measured):
    """Whether the launch's grid is the timed launch form that ran fastest (within 1%)."""
    grid = launcher.grid
    programs = grid[0] if len(grid) == 1 and grid[0] < tiles else 0  # a persistent grid: fewer programs
    return measured[programs] <= 1.01 * min(measured.values())


def test_the_launchers_ask_the_model(launchers_on_132_sms):
    """The dK/dV pass's and the forward's launches at the timed shapes: the launch form (one program
    per tile, per SM, or per launch-order chunk) that ran fastest."""
    from fusedattn.spec import AttentionSpec
    from fusedattn.tuning.configs import KernelConfig

    bwd, fwd = launchers_on_132_sms
    causal = AttentionSpec("bhsd", -1, 0, 0.125, 0.0, False)
    dkdv_config = KernelConfig(128, 128, 4, 2, True, 0, 2, 0)  # D=64: dQ split by rows, no turns
    for (batch, heads, length), measured in DKDV_TIMED:
        launcher = bwd._dkdv_launcher.__wrapped__((batch, heads, length, 64), heads, length, causal, dkdv_config,
                                                  True, (0, 0, 0), False, False, None, False, 0)
        assert fastest(launcher, batch * heads * (length // 128), measured), (batch, heads, length)
    forward_config = KernelConfig(128, 128, 4, 2, True, 0, 2, 0)  # D=128 short causal: two warpgroups
    for (batch, heads, length), measured in FORWARD_TIMED:
        launcher = fwd._forward_launcher.__wrapped__((batch, heads, length, 128), heads, length, causal,
                                                     forward_config, (0, 0, 0, 0), False, None, 0)
        assert fastest(launcher, batch * heads * (length // 128), measured), (batch, heads, length)


def test_the_chunked_dkdv_launch_reads_its_order_off_a_grid_of_whole_chunks(launchers_on_132_sms):
    """A dK/dV launch in chunks of about a wave (a window here) whose chunks are whole is a grid (rows
    of a chunk, key blocks, chunks): programs started in the grid's order (x fastest) take the tiles
    in launch order with no division in the kernel (CHUNKED 2); a last partial chunk keeps the 1-D
    launch (CHUNKED 1) and no chunk the 2-D head-major grid (CHUNKED 0)."""
    from fusedattn.spec import UNBOUNDED, AttentionSpec
    from fusedattn.tuning.configs import KernelConfig

    bwd, _ = launchers_on_132_sms
    window = AttentionSpec("bhsd", 1023, 0, 0.125, 0.0, False)
    full = AttentionSpec("bhsd", UNBOUNDED, UNBOUNDED, 0.125, 0.0, False)
    config = KernelConfig(64, 128, 4, 2, True, 0, 2, 0)  # D=128, two warpgroups, 128-key programs

    def launcher(batch, heads, length, spec):
        return bwd._dkdv_launcher.__wrapped__((batch, heads, length, 128), heads, length, spec, config, True,
                                              (0, 0, 0), False, False, None, False, 0)

    built = launcher(4, 16, 4096, window)  # 64 head rows, 32 key blocks: chunks of 4 rows
    assert built.grid == (4, 32, 16) and built.options["CHUNKED"] == 2
    rows_in_chunk, blocks, chunks = built.grid
    started = [(z * rows_in_chunk + x, y) for z in range(chunks) for y in range(blocks) for x in range(rows_in_chunk)]
    in_launch_order = [(row, block) for first in range(0, 64, 4) for block in range(32)
                       for row in range(first, first + 4)]
    assert started == in_launch_order
    assert [block for _, block in started] == rounds.launch_order_blocks(64, 32, 4).tolist()

    built = launcher(7, 9, 4096, window)  # 63 rows: the last chunk has 3
    assert built.grid == (63 * 32,) and built.options["CHUNKED"] == 1
    built = launcher(4, 16, 4096, full)
    assert built.grid == (32, 64) and built.options["CHUNKED"] == 0


def test_the_8_warp_forward_reads_its_tile_off_a_grid_of_whole_chunks(launchers_on_132_sms):
    """The 8-warp forward (one program per 128-row tile) is a ``chunk_grid`` launch where its chunks are
    whole (GRID): started x fastest, the grid gives each program the tile the 1-D launch order gave it
    -- a causal launch's L2 sections, head-major order (chunks of one row); a last partial chunk keeps
    the 1-D launch, and so does the warp-specialised forward."""
    from fusedattn.kernels.gluon.common import chunk_grid
    from fusedattn.spec import UNBOUNDED, AttentionSpec
    from fusedattn.tuning.configs import KernelConfig

    _, fwd = launchers_on_132_sms
    eight = KernelConfig(128, 128, 8, 2, True, 0, 0, 0)  # D=64 short keys: the 8-warp kernel
    three = KernelConfig(192, 128, 4, 2, True, 0, 3, 1)  # 192-row tiles, warp-specialised
    causal = AttentionSpec("bhsd", UNBOUNDED, 0, 0.125, 0.0, False)
    full = AttentionSpec("bhsd", UNBOUNDED, UNBOUNDED, 0.125, 0.0, False)
    device = torch.device("cuda", 0)

    def launch(batch, heads, length, spec, config=eight):
        built = fwd._forward_launcher.__wrapped__((batch, heads, length, 64), heads, length, spec, config,
                                                  (0, 0, 0, 0), False, None, 0)
        _, tiles, chunk = fwd.forward_programs((batch, heads, length, 64), heads, length, spec, config, True,
                                               False, device)
        return built, tiles, chunk

    for batch, spec in ((16, causal), (16, full), (2, causal)):
        built, tiles, chunk = launch(batch, 32, 1024, spec)
        rows = batch * 32
        blocks = tiles // rows
        assert built.grid == chunk_grid(rows, blocks, chunk) == (chunk, blocks, rows // chunk), (spec, built.grid)
        assert built.options["GRID"]
        started = [(z * chunk + x, y) for z in range(rows // chunk) for y in range(blocks) for x in range(chunk)]
        in_order = [(row, block) for first in range(0, rows, chunk) for block in range(blocks)
                    for row in range(first, first + chunk)]
        assert started == in_order
        assert [y for _, y in started] == rounds.launch_order_blocks(rows, blocks, chunk).tolist()
    built, tiles, chunk = launch(3, 100, 1024, causal)  # 300 rows in L2 sections of 128
    assert chunk == 128 and built.grid == (tiles,) and not built.options["GRID"]
    built, tiles, chunk = launch(4, 16, 4096, causal, three)
    assert built.grid == (tiles,) and "GRID" not in built.options


def test_the_causal_forward_launches_block_major_in_l2_sections(launchers_on_132_sms, monkeypatch):
    """One program per tile under a causal bound at long keys: block-major chunks of as many head rows
    as their K and V fit in L2, a power of two (benchmarks/NOTES.md v78: 4-7% off the forward at 4k
    and 16k against head-major order); a left window keeps chunks of about a wave, no causal bound
    and short keys head-major order."""
    from fusedattn.kernels.shared import knobs
    from fusedattn.spec import UNBOUNDED, AttentionSpec
    from fusedattn.tuning.configs import KernelConfig

    _, fwd = launchers_on_132_sms
    three = KernelConfig(192, 128, 4, 2, True, 0, 3, 1)  # the long-key forward: 192-row tiles
    device = torch.device("cuda", 0)

    def chunk(q_shape, heads_kv, spec):
        programs, tiles, rows = fwd.forward_programs(q_shape, heads_kv, q_shape[2], spec, three, True, False, device)
        assert programs == 0 and tiles == q_shape[0] * q_shape[1] * -(-q_shape[2] // 192)
        return rows

    causal = AttentionSpec("bhsd", UNBOUNDED, 0, 0.125, 0.0, False)
    assert chunk((4, 16, 4096, 128), 16, causal) == 16  # 2 MiB of K and V a head: 30 fit, 16
    assert chunk((4, 32, 4096, 64), 32, causal) == 32  # 1 MiB: 60 fit, 32
    assert chunk((1, 16, 16384, 128), 16, causal) == 4  # 8 MiB: 7 fit, 4
    assert chunk((4, 16, 4096, 128), 2, causal) == 64  # GQA 16/2: 8 query heads share one: every row
    assert chunk((1, 8, 262144, 128), 8, causal) == 1  # one head's K and V overflow L2
    assert chunk((4, 16, 2048, 128), 16, causal) == 1  # short keys: head-major
    window = AttentionSpec("bhsd", 1023, 0, 0.125, 0.0, False)
    assert chunk((4, 16, 4096, 128), 16, window) == round(SMS / 22)  # about a wave (chunk_head_rows)
    full = AttentionSpec("bhsd", UNBOUNDED, UNBOUNDED, 0.125, 0.0, False)
    assert chunk((4, 16, 4096, 128), 16, full) == 1
    monkeypatch.setattr(knobs, "_current", knobs.Knobs(chunk_heads=8))
    assert chunk((4, 16, 4096, 128), 16, causal) == 8  # the experiment switch wins


def test_the_ordered_dq_pass_launches_in_chunks_of_about_a_wave(launchers_on_132_sms, monkeypatch):
    """Deterministic mode's fixed dQ order (each key block's program waits on the previous block's
    adds): chunks of about a wave of programs -- measured 4-8% off the deterministic backward at 4k
    keys against head-major order, level at 16k (benchmarks/NOTES.md v83) -- but where a causal
    order launches its heaviest programs first (64-row steps, not interleaved: the switch off), which
    takes chunks of sqrt(64 SMs / key blocks) rows, to a power of two: 16 at 32 key blocks, 8 at 128
    (benchmarks/NOTES.md v87). Without the order, no causal bound keeps head-major order."""
    from fusedattn.spec import UNBOUNDED, AttentionSpec
    from fusedattn.kernels.shared import knobs
    from fusedattn.tuning.configs import KernelConfig

    bwd, _ = launchers_on_132_sms
    lockstep = KernelConfig(64, 128, 4, 2, True, 0, 2, 0)  # D=128: dQ split by columns, no turns
    device = torch.device("cuda", 0)
    monkeypatch.setattr(knobs, "_current", knobs.Knobs(ordered_interleave=False))
    full = AttentionSpec("bhsd", UNBOUNDED, UNBOUNDED, 0.125, 0.0, False)
    causal = AttentionSpec("bhsd", UNBOUNDED, 0, 0.125, 0.0, False)

    def chunk(q_shape, heads_kv, spec, ordered):
        programs, tiles, rows = bwd.dkdv_programs(q_shape, heads_kv, q_shape[2], spec, lockstep, True, False, False,
                                                  ordered, False, device)
        assert programs == 0 and tiles == q_shape[0] * heads_kv * -(-q_shape[2] // 128)
        return rows

    assert chunk((4, 16, 4096, 128), 16, full, True) == round(SMS / 32)  # 32 key blocks a head row
    assert chunk((4, 16, 4096, 128), 2, full, True) == round(SMS / 32)  # GQA: a KV head's row
    assert chunk((1, 16, 16384, 128), 16, full, True) == 1  # 128 key blocks: about a wave already
    assert chunk((4, 16, 4096, 128), 16, full, False) == 1  # summed in any order: head-major
    assert chunk((4, 16, 4096, 128), 16, causal, True) == 16  # heaviest first
    assert chunk((1, 16, 16384, 128), 16, causal, True) == 8
    assert chunk((4, 16, 4096, 128), 2, causal, True) == 8  # GQA 16/2: all 8 KV head rows
    lightest_first = KernelConfig(128, 128, 4, 2, True, 0, 2, 0)  # D=64: 128-row steps
    programs, _, rows = bwd.dkdv_programs((4, 32, 4096, 64), 32, 4096, causal, lightest_first, True, False, False,
                                          True, False, device)
    assert programs == 0 and rows == round(SMS / 32)
    monkeypatch.setattr(knobs, "_current", knobs.Knobs())  # interleaved (``fixed_order_launch``)
    assert chunk((4, 16, 4096, 128), 16, causal, True) == 8
    assert chunk((1, 16, 16384, 128), 16, causal, True) == 2


def test_the_causal_fixed_order_walks_heaviest_first_with_64_row_steps():
    """Under a causal bound the fixed dQ order launches its heaviest programs first, every walk from
    the last query block down, with 64-row steps (D=128), and its lightest first, masked steps first,
    with 128-row steps (D=64; benchmarks/NOTES.md v87); any other pass walks ascending."""
    from fusedattn.kernels.gluon import bwd
    from fusedattn.tuning.configs import KernelConfig

    rows64, rows128 = KernelConfig(64, 128, 4, 2, True, 0, 2, 0), KernelConfig(128, 128, 4, 2, True, 0, 2, 0)
    assert bwd.dkdv_walk(True, rows64, True) == bwd.WALK_DESCENDING
    assert bwd.dkdv_walk(True, rows128, True) == bwd.WALK_MASKED_FIRST
    assert bwd.dkdv_walk(True, rows128, True, interleaved=True) == bwd.WALK_DESCENDING
    for config in (rows64, rows128):
        assert bwd.dkdv_walk(False, config, True) == bwd.WALK_ASCENDING  # every program visits every block
        assert bwd.dkdv_walk(True, config, False) == bwd.WALK_ASCENDING  # summed in any order


def walk_interleaved_order(head_rows, blocks, chunk_heads):
    """(row, block) in launch order: chunk 0's heavy half (blocks [0, blocks // 2)), then for each
    chunk its light half's groups alternating with the next chunk's heavy half's, light first, a
    group being one block of each of the chunk's rows; the last chunk's light half alone at the end."""
    half = blocks // 2
    chunks = [range(first, first + chunk_heads) for first in range(0, head_rows, chunk_heads)]

    def groups(rows, block_range):
        return [[(row, block) for row in rows] for block in block_range]

    order = sum(groups(chunks[0], range(half)), [])
    for k, rows in enumerate(chunks):
        light = groups(rows, range(half, blocks))
        heavy = groups(chunks[k + 1], range(half)) if k + 1 < len(chunks) else []
        for i in range(max(len(light), len(heavy))):
            order += (light[i] if i < len(light) else []) + (heavy[i] if i < len(heavy) else [])
    return order


@pytest.mark.parametrize("head_rows,blocks,chunk_heads", [(4, 5, 2), (16, 32, 8), (12, 7, 3), (8, 2, 4), (6, 9, 2)])
def test_the_interleaved_launch_follows_its_definition_and_keeps_each_rows_blocks_in_order(head_rows, blocks,
                                                                                           chunk_heads):
    """``interleaved_order``'s host mirror against a walk written from its definition; every tile once,
    and each row's blocks in ascending launch order: a program's dQ adds wait on the previous block's
    program of its row (heaviest first), which must have been launched before it."""
    rows, blocks_ = rounds.interleaved_order_tiles(head_rows, blocks, chunk_heads)
    order = list(zip(rows.tolist(), blocks_.tolist()))
    assert order == walk_interleaved_order(head_rows, blocks, chunk_heads)
    assert sorted(order) == [(r, b) for r in range(head_rows) for b in range(blocks)]
    for r in range(head_rows):
        assert [b for row, b in order if row == r] == list(range(blocks))


def test_the_causal_fixed_order_interleaves_where_two_chunks_of_rows_fit_l2(launchers_on_132_sms, monkeypatch):
    """Heaviest first with each chunk's light half among the next chunk's heavy half
    (``gluon.bwd.fixed_order_launch``) in chunks of the power of two nearest L2 / (2 rows' Q, dO and dQ
    accumulator), at most the spaced chunk: the sweep's best at each measured shape (benchmarks/NOTES.md
    v88, one H200, 60 MiB of L2: 8 rows at D=128 4k, 4 at 8k, 2 at 16k; 16 at D=64 4k, 4 at 16k). Not
    at one row a chunk, a single chunk, chunks that do not divide the rows, or GQA (each program walks
    a KV group); there the earlier orders stand: heaviest first with 64-row steps, lightest first
    with 128-row ones."""
    from fusedattn.kernels.shared import knobs
    from fusedattn.tuning.configs import KernelConfig

    bwd, _ = launchers_on_132_sms
    device = torch.device("cuda", 0)
    rows64, rows128 = KernelConfig(64, 128, 4, 2, True, 0, 2, 0), KernelConfig(128, 128, 4, 2, True, 0, 2, 0)
    heaviest, lightest = bwd.WALK_DESCENDING, bwd.WALK_MASKED_FIRST

    def launch(q_shape, heads_kv, config):
        return bwd.fixed_order_launch(q_shape, heads_kv, q_shape[2], config, device)

    assert launch((4, 16, 4096, 128), 16, rows64) == (heaviest, 8, True)  # 4 MiB a row: 7.5 -> 8
    assert launch((2, 16, 8192, 128), 16, rows64) == (heaviest, 4, True)
    assert launch((1, 16, 16384, 128), 16, rows64) == (heaviest, 2, True)
    assert launch((1, 16, 32768, 128), 16, rows64) == (heaviest, 8, False)  # 1 row a chunk: spaced chunks
    assert launch((16, 16, 1024, 128), 16, rows64) == (heaviest, 32, True)  # at most the spaced chunk
    assert launch((4, 16, 4096, 64), 16, rows128) == (heaviest, 16, True)
    assert launch((1, 16, 16384, 64), 16, rows128) == (heaviest, 4, True)
    assert launch((1, 12, 16384, 64), 12, rows128) == (heaviest, 4, True)
    assert launch((1, 10, 16384, 64), 10, rows128) == (lightest, 1, False)  # 4 does not divide 10 rows
    assert launch((1, 2, 16384, 128), 2, rows64) == (heaviest, 2, False)  # one chunk
    assert launch((4, 16, 4096, 128), 2, rows64) == (heaviest, 8, False)  # GQA 16/2
    assert launch((4, 16, 4096, 64), 2, rows128) == (lightest, 4, False)
    monkeypatch.setattr(knobs, "_current", knobs.Knobs(ordered_interleave=False))
    assert launch((4, 16, 4096, 128), 16, rows64) == (heaviest, 16, False)
    assert launch((4, 16, 4096, 64), 16, rows128) == (lightest, 4, False)


def test_the_interleaved_fixed_order_is_a_1d_launch_with_its_chunk_and_walk(launchers_on_132_sms, monkeypatch):
    """The launcher passes the decision on: an interleaved launch is 1-D (CHUNKED 3, the kernel's
    ``interleaved_order``), its chunk the rule's, its walk heaviest first -- at D=64 too, where the
    order without the interleave goes lightest first."""
    from fusedattn.kernels.shared import knobs
    from fusedattn.spec import UNBOUNDED, AttentionSpec
    from fusedattn.tuning.configs import KernelConfig

    bwd, _ = launchers_on_132_sms
    causal = AttentionSpec("bhsd", UNBOUNDED, 0, 0.125, 0.0, True)  # deterministic

    def built(q_shape, config):
        return bwd._dkdv_launcher.__wrapped__(q_shape, q_shape[1], q_shape[2], causal, config, True, (0, 0, 0),
                                              False, False, None, False, 0, ordered=True)

    rows64, rows128 = KernelConfig(64, 128, 4, 2, True, 0, 2, 0), KernelConfig(128, 128, 4, 2, True, 0, 2, 0)
    for q_shape, config, rows in (((4, 16, 4096, 128), rows64, 8), ((1, 16, 16384, 64), rows128, 4)):
        launch = built(q_shape, config)
        tiles = q_shape[0] * q_shape[1] * q_shape[2] // 128
        assert launch.grid == (tiles,) and launch.options["CHUNKED"] == 3, launch.grid
        key_blocks = q_shape[2] // 128
        triples = list(zip(launch.template, launch.template[1:], launch.template[2:]))
        assert launch.options["WALK"] == bwd.WALK_DESCENDING and (key_blocks, rows, tiles) in triples
    monkeypatch.setattr(knobs, "_current", knobs.Knobs(ordered_interleave=False))
    launch = built((1, 16, 16384, 64), rows128)
    assert launch.options["CHUNKED"] != 3 and launch.options["WALK"] == bwd.WALK_MASKED_FIRST


def test_the_fixed_dq_order_takes_causal_launches_lightest_first_only_with_many_programs_an_sm():
    """Where the causal fixed order launches lightest first (128-row steps), with few programs an SM
    the pass ends on the heaviest (benchmarks/NOTES.md v83: GQA 16/2 at 4k keys, 256 programs on 132
    SMs, 1.5x the dQ pass's backward), so such launches keep the dQ pass; launched heaviest first
    (64-row steps) the same GQA launch beats the dQ pass (v87); without a bound any count runs."""
    from fusedattn.dispatch import ORDERED_CAUSAL_PROGRAMS_PER_SM, ordered_dq_balances
    from fusedattn.spec import UNBOUNDED, AttentionSpec
    from fusedattn.tuning.configs import KernelConfig

    full = AttentionSpec("bhsd", UNBOUNDED, UNBOUNDED, 0.125, 0.0, False)
    causal = AttentionSpec("bhsd", UNBOUNDED, 0, 0.125, 0.0, False)
    lightest_first = KernelConfig(128, 128, 4, 2, True, 0, 2, 0)  # 128-row steps (D=64)
    heaviest_first = KernelConfig(64, 128, 4, 2, True, 0, 2, 0)  # 64-row steps (D=128)
    assert ordered_dq_balances(causal, lightest_first, 4 * 32 * 32, SMS)  # MHA B4 H32 at 4k: 4096 programs
    assert ordered_dq_balances(causal, lightest_first, 32 * 128, SMS)  # MHA B1 H32 at 16k
    assert not ordered_dq_balances(causal, lightest_first, 4 * 2 * 32, SMS)  # B4, 2 KV heads at 4k
    assert ordered_dq_balances(causal, heaviest_first, 4 * 2 * 32, SMS)  # GQA 16/2 B4 at 4k
    assert ordered_dq_balances(full, lightest_first, 4 * 2 * 32, SMS)
    assert ordered_dq_balances(causal, lightest_first, ORDERED_CAUSAL_PROGRAMS_PER_SM * SMS, SMS)
    assert not ordered_dq_balances(causal, lightest_first, ORDERED_CAUSAL_PROGRAMS_PER_SM * SMS - 1, SMS)


def test_the_8_warp_causal_forward_launches_block_major_at_short_keys(launchers_on_132_sms):
    """The 8-warp Gluon forward (D=64 at short keys: 128-row tiles, one program each) takes the L2
    sections at 1k-2k keys too (benchmarks/NOTES.md v79: 3-5% off its forward against head-major
    order), where the warp-specialised forwards keep head-major order."""
    from fusedattn.spec import UNBOUNDED, AttentionSpec
    from fusedattn.tuning.configs import KernelConfig

    _, fwd = launchers_on_132_sms
    eight_warps = KernelConfig(128, 64, 8, 2, tma_loads=True, hopper_overlap=0)  # hopper_split 0
    device = torch.device("cuda", 0)

    def launch(q_shape, spec):
        return fwd.forward_programs(q_shape, q_shape[1], q_shape[2], spec, eight_warps, True, False, device)

    causal = AttentionSpec("bhsd", UNBOUNDED, 0, 0.125, 0.0, False)
    assert launch((16, 32, 1024, 64), causal) == (0, 16 * 32 * 8, 128)  # 256 KiB a head: 240 fit, 128
    assert launch((8, 32, 2048, 64), causal) == (0, 8 * 32 * 16, 64)  # 512 KiB: 120 fit, 64
    full = AttentionSpec("bhsd", UNBOUNDED, UNBOUNDED, 0.125, 0.0, False)
    assert launch((16, 32, 1024, 64), full)[2] == 1  # rows of one length: head-major


@pytest.mark.parametrize("batch,heads,length,l2_rows", [(4, 16, 4096, 16), (4, 32, 4096, 32), (1, 16, 16384, 4),
                                                        (1, 32, 16384, 8), (2, 16, 8192, 8)])
def test_l2_sections_end_the_causal_forward_near_the_even_share(batch, heads, length, l2_rows):
    """The host's greedy model of one program per tile (an SM takes the next program in launch order
    as it frees up; 192-row tiles' key blocks as their work): in head-major order the grid ends 3.5-10%
    past the even share of its work (ncu measured our busiest SM 10% above the average at 4k, D=128),
    in the rule's chunks (their sizes at an H200's 60 MB of L2, D=128; D=64 at 4k) within 2%."""
    rows = batch * heads
    share = rounds.forward_tile_work(length, length, None, rows, 1, 192, 128).sum().item() / SMS
    head_major = rounds.greedy_finish(rounds.forward_tile_work(length, length, None, rows, 1, 192, 128), SMS)
    sections = rounds.greedy_finish(rounds.forward_tile_work(length, length, None, rows, l2_rows, 192, 128), SMS)
    assert head_major > 1.03 * share
    assert sections < 1.02 * share
