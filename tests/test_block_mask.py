"""Tile classification of masks (block_mask.py, kernels/tile_lists.py) against brute force,
and the promise it makes: a tile classed EMPTY is never read, by the forward or the backward.

The classification is host code (torch ops), so most of these run fast on the CPU; the
skipping test runs the Triton kernels (GPU, or the interpreter)."""

import itertools

import pytest
import torch

import fusedattn
from fusedattn.block_mask import EMPTY, FULL, PARTIAL, BlockMask, classify
from fusedattn.kernels.shared import tile_lists
from fusedattn.kernels.shared.tile_lists import (column_lists, row_lists, rows_even, rule_states, tile_states, tiles_whole,
                                          whole_and_even)
from fusedattn.reference import reference_attention
from fusedattn.spec import keep_mask, resolve_spec
from numerics import assert_close_to_reference

ON_GPU = torch.cuda.is_available()
DEVICE = "cuda" if ON_GPU else "cpu"

WINDOWS = [dict(), dict(causal=True), dict(window=(9, 4)), dict(window=(-1, 5)), dict(window=(20, -1)),
           dict(window=(0, 0))]
LENGTHS = [(1, 1), (17, 33), (33, 17), (64, 64), (100, 37), (37, 100)]
TILES = [(16, 16), (16, 32), (64, 16), (32, 64)]


def brute_states(keep: torch.Tensor, block_q: int, block_k: int, whole_only: bool) -> torch.Tensor:
    """int8 states of a (..., Sq, Sk) bool tensor per (block_q, block_k) tile, one tile at a time.
    ``whole_only``: a tile cut by Sq or Sk is never FULL (the kernels' rule)."""
    seqlen_q, seqlen_k = keep.shape[-2:]
    rows, cols = -(-seqlen_q // block_q), -(-seqlen_k // block_k)
    out = torch.empty((*keep.shape[:-2], rows, cols), dtype=torch.int8)
    for m, n in itertools.product(range(rows), range(cols)):
        tile = keep[..., m * block_q:(m + 1) * block_q, n * block_k:(n + 1) * block_k]
        whole = (m + 1) * block_q <= seqlen_q and (n + 1) * block_k <= seqlen_k
        all_kept = tile.flatten(-2).all(-1) & (whole or not whole_only)
        out[..., m, n] = torch.where(all_kept, FULL, torch.where(tile.flatten(-2).any(-1), PARTIAL, EMPTY))
    return out


def random_cells(shape, cell: int, seed: int) -> torch.Tensor:
    """A bool mask of ``shape`` whose (cell x cell) squares are each dropped, kept or random."""
    gen = torch.Generator().manual_seed(seed)
    cells = torch.randint(0, 3, (*shape[:-2], -(-shape[-2] // cell), -(-shape[-1] // cell)), generator=gen)
    cells = cells.repeat_interleave(cell, -2).repeat_interleave(cell, -1)[..., :shape[-2], :shape[-1]]
    noise = torch.rand(shape, generator=gen) < 0.5
    return torch.where(cells == 0, False, torch.where(cells == 1, True, noise))


@pytest.mark.parametrize("shape", [(2, 3, 37, 50), (1, 1, 16, 16), (2, 1, 1, 70), (1, 2, 45, 1), (1, 1, 5, 3)])
def test_classify_matches_brute_force(shape):
    mask = random_cells(shape, 8, seed=sum(shape))
    expected = brute_states(mask, 16 if shape[2] > 1 else 1, 16 if shape[3] > 1 else 1, whole_only=False)
    assert torch.equal(classify(mask, 16, 16), expected)


@pytest.mark.parametrize("lengths", LENGTHS, ids=str)
@pytest.mark.parametrize("options", WINDOWS, ids=str)
def test_rule_states_match_the_keep_rule(lengths, options):
    """EMPTY iff no pair of the tile is kept; FULL iff every pair is, and the tile is whole."""
    seqlen_q, seqlen_k = lengths
    spec = resolve_spec(32, layout="bshd", scale=None, softcap=None, deterministic=False,
                        causal=options.get("causal", False), window=options.get("window"))
    keep = keep_mask(seqlen_q, seqlen_k, spec.window_left, spec.window_right)
    for block_q, block_k in TILES:
        assert torch.equal(rule_states(seqlen_q, seqlen_k, spec, block_q, block_k, "cpu"),
                           brute_states(keep, block_q, block_k, whole_only=True)), (block_q, block_k)


@pytest.mark.parametrize("lengths", LENGTHS, ids=str)
@pytest.mark.parametrize("options", WINDOWS[:3], ids=str)
def test_tile_states_of_an_element_mask_are_sound(lengths, options):
    """Merged with the rule and brought to any kernel tile size (a multiple of the 16-cell grid),
    the states never class a tile with a kept pair EMPTY, nor one with a dropped pair FULL. They
    equal brute force on (mask & rule) without a window; with one, a tile that both the mask and
    the diagonal cut is PARTIAL even if their intersection is empty (classified apart, merged)."""
    seqlen_q, seqlen_k = lengths
    spec = resolve_spec(32, layout="bshd", scale=None, softcap=None, deterministic=False,
                        causal=options.get("causal", False), window=options.get("window"))
    mask = random_cells((2, 3, seqlen_q, seqlen_k), 16, seed=seqlen_q * 1000 + seqlen_k)
    keep = mask & keep_mask(seqlen_q, seqlen_k, spec.window_left, spec.window_right)
    block_mask = BlockMask.from_mask(mask)
    for block_q, block_k in TILES:
        got = tile_states(block_mask, spec, seqlen_q, seqlen_k, block_q, block_k)
        expected = brute_states(keep, block_q, block_k, whole_only=True)
        assert torch.equal(got == FULL, expected == FULL), (block_q, block_k)
        assert not ((got == EMPTY) & (expected != EMPTY)).any(), (block_q, block_k)
        if not options:
            assert torch.equal(got, expected), (block_q, block_k)


def test_tile_states_of_a_block_mask_finer_and_coarser_than_its_blocks():
    """A keep map of 32x32 blocks on 16x16 tiles (each takes its block's state) and on 64x64 tiles
    (mixed blocks are PARTIAL: the kernels then read the keep map per element)."""
    seqlen_q, seqlen_k = 100, 90
    keep = torch.rand(2, 1, 4, 3, generator=torch.Generator().manual_seed(5)) < 0.5
    block_mask = BlockMask.from_blocks(keep, (32, 32), seqlen_q, seqlen_k)
    dense = block_mask.to_dense()
    assert dense.shape == (2, 1, seqlen_q, seqlen_k)
    assert torch.equal(dense[:, :, 40, 70], keep[:, :, 1, 2])
    spec = resolve_spec(32, layout="bshd", scale=None, softcap=None, deterministic=False, causal=False, window=None)
    for block_q, block_k in [(16, 16), (64, 64), (32, 16)]:
        got = tile_states(block_mask, spec, seqlen_q, seqlen_k, block_q, block_k)
        assert torch.equal(got, brute_states(dense, block_q, block_k, whole_only=True)), (block_q, block_k)


def test_tiles_whole_says_whether_any_tile_of_the_mask_is_partial():
    """The Gluon kernels take a mask only where none of its own tiles is partial at their tile size
    (they never read the mask): checked against brute force for block masks and element masks."""
    seqlen_q, seqlen_k = 300, 200
    keep = torch.rand(2, 1, 3, 2, generator=torch.Generator().manual_seed(3)) < 0.5
    keep[0, 0, 0, 0], keep[0, 0, 0, 1] = True, False  # one block row mixed: 256-key tiles are partial
    by_blocks = BlockMask.from_blocks(keep, (128, 128), seqlen_q, seqlen_k)
    lengths = torch.tensor([200, 128])  # key padding at a 128 multiple (and none)
    padding = torch.arange(seqlen_k)[None, None, None, :] < lengths[:, None, None, None]
    by_elements = BlockMask.from_mask(padding)
    ragged = BlockMask.from_mask(torch.arange(seqlen_k)[None, None, None, :] < 100)
    for block_mask in (by_blocks, by_elements, ragged):
        dense = block_mask.to_dense().expand(2, 1, seqlen_q, seqlen_k)
        for block_q, block_k in [(64, 64), (128, 128), (128, 256), (64, 32)]:
            expected = not bool((brute_states(dense, block_q, block_k, whole_only=False) == PARTIAL).any())
            assert tiles_whole(block_mask, seqlen_q, seqlen_k, block_q, block_k) == expected, (block_mask, block_q,
                                                                                               block_k)
    assert tiles_whole(by_blocks, seqlen_q, seqlen_k, 128, 128) and not tiles_whole(ragged, seqlen_q, seqlen_k, 128, 128)
    assert not tiles_whole(by_blocks, seqlen_q, seqlen_k, 128, 256)


def test_row_and_column_lists_name_every_non_empty_tile_full_ones_first():
    heads_q, heads_kv, seqlen_q, seqlen_k = 4, 2, 70, 50
    spec = resolve_spec(32, layout="bshd", scale=None, softcap=None, deterministic=False, causal=True, window=None)
    block_mask = BlockMask.from_mask(random_cells((2, heads_q, seqlen_q, seqlen_k), 16, seed=11))
    states = tile_states(block_mask, spec, seqlen_q, seqlen_k, 16, 32)
    blocks_q, blocks_k = states.shape[-2:]
    rows = row_lists(block_mask, spec, seqlen_q, seqlen_k, 16, 32)
    for b, h, m in itertools.product(range(2), range(heads_q), range(blocks_q)):
        full, partial = rows[b, h, m, :2].tolist()
        listed = rows[b, h, m, 2:2 + full + partial].tolist()
        row = states[b, h, m]
        assert listed == [n for n in range(blocks_k) if row[n] == FULL] + [n for n in range(blocks_k) if row[n] == PARTIAL]
    columns = column_lists(block_mask, spec, seqlen_q, seqlen_k, 16, 32, heads_q, heads_kv)
    group = heads_q // heads_kv
    for b, h_kv, n in itertools.product(range(2), range(heads_kv), range(blocks_k)):
        full, partial = columns[b, h_kv, n, :2].tolist()
        visited = [divmod(e, blocks_q) for e in columns[b, h_kv, n, 2:2 + full + partial].tolist()]
        tiles = [(member, m) for member in range(group) for m in range(blocks_q)]
        kinds = {s: [t for t in tiles if states[b, h_kv * group + t[0], t[1], n] == s] for s in (FULL, PARTIAL)}
        assert visited == kinds[FULL] + kinds[PARTIAL]


def test_rows_even_says_whether_the_forward_lists_are_about_equally_long():
    """The forward runs persistent over a mask's lists only where they are even (the longest within
    15% of the mean, hopper_fwd.forward_programs): a block-sparse top-k mask's are, a causal-shaped
    block mask's or the causal rule's are not; counted against the lists themselves."""
    seqlen, blocks = 1024, 8
    full = resolve_spec(32, layout="bshd", scale=None, softcap=None, deterministic=False, causal=False, window=None)
    causal = resolve_spec(32, layout="bshd", scale=None, softcap=None, deterministic=False, causal=True, window=None)
    scores = torch.randn(2, 3, seqlen, seqlen, generator=torch.Generator().manual_seed(5))
    top_k = fusedattn.topk_block_mask(scores, 2, block_size=(128, 128))
    lower = torch.ones(blocks, blocks, dtype=torch.bool).tril()
    causal_shaped = BlockMask.from_blocks(lower, (128, 128), seqlen, seqlen)
    one_longer = torch.zeros(blocks, blocks, dtype=torch.bool)
    one_longer[:, :4] = True
    one_longer[0, 4] = True  # 5 tiles against 4: 1.22x the mean of 4.125
    nearly = torch.zeros(1, 2, blocks, blocks, dtype=torch.bool)
    nearly[:, :, :, :8] = True
    nearly[0, 0, 0, 7] = False  # 7 against a mean of 7.94
    cases = [(top_k, full, True), (top_k, causal, False), (causal_shaped, full, False),
             (BlockMask.from_blocks(one_longer, (128, 128), seqlen, seqlen), full, False),
             (BlockMask.from_blocks(nearly, (128, 128), seqlen, seqlen), full, True)]
    for block_mask, spec, expected in cases:
        lengths = row_lists(block_mask, spec, seqlen, seqlen, 128, 128)[..., :2].sum(-1).float()
        assert (lengths.max() <= 1.15 * lengths.mean()).item() == expected
        assert rows_even(block_mask, spec, seqlen, seqlen, 128, 128) == expected, (block_mask, spec.window_right)


def test_whole_and_even_answer_both_from_one_read(monkeypatch):
    """The Gluon forward asks of a new mask whether its tiles are whole and its lists even: one
    host read answers both (``whole_and_even``), and the other two functions then read nothing."""
    seqlen = 1024
    full = resolve_spec(32, layout="bshd", scale=None, softcap=None, deterministic=False, causal=False, window=None)
    scores = torch.randn(1, 2, seqlen, seqlen, generator=torch.Generator().manual_seed(6))
    ragged = BlockMask.from_mask(torch.arange(seqlen)[None, None, None, :] < 1000)
    for block_mask, expected in ((fusedattn.topk_block_mask(scores, 3, block_size=(128, 128)), (True, True)),
                                 (ragged, (False, True))):
        assert whole_and_even(block_mask, full, seqlen, seqlen, 128, 128) == expected
        monkeypatch.setattr(tile_lists, "_partial_any", None)  # any further read would fail
        monkeypatch.setattr(tile_lists, "_lists", None)
        assert tiles_whole(block_mask, seqlen, seqlen, 128, 128) == expected[0]
        assert rows_even(block_mask, full, seqlen, seqlen, 128, 128) == expected[1]
        monkeypatch.undo()


@pytest.mark.parametrize("options", [dict(), dict(causal=True)], ids=["full", "causal"])
def test_empty_tiles_are_never_read(options):
    """Keys past a padding length that is a multiple of every tile size are masked for all queries,
    and hold NaN in K and V: a pass that read a tile of them would turn some output or gradient
    into NaN (0 * NaN). Output and gradients must match the reference on the unpadded keys, and
    dK, dV of the padded keys be 0."""
    valid, seqlen_k, seqlen_q = (256, 300, 200) if ON_GPU else (32, 47, 40)
    dtype = torch.bfloat16 if ON_GPU else torch.float32
    gen = torch.Generator().manual_seed(3)
    q, k, v, dout = (torch.randn(2, s, 4, 64, generator=gen).to(DEVICE, dtype)
                     for s in (seqlen_q, seqlen_k, seqlen_k, seqlen_q))
    k[:, valid:], v[:, valid:] = float("nan"), float("nan")
    mask = torch.zeros(2, 1, 1, seqlen_k, dtype=torch.bool, device=DEVICE)
    mask[..., :valid] = True
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    with fusedattn.use_backend("triton"):
        out = fusedattn.attention(*leaves, mask=mask, **options)
    dq, dk, dv = torch.autograd.grad(out, leaves, dout)
    # the reference sees only the valid keys (and a causal diagonal aligned to them: cut Sk, not pad)
    ref_options = dict(window=(-1, seqlen_k - valid)) if options.get("causal") else {}  # j - i <= Sk - Sq

    def reference(dtype):
        leaves = [t.to(dtype).requires_grad_() for t in (q, k[:, :valid], v[:, :valid])]
        out = reference_attention(*leaves, **ref_options)
        return (out, *torch.autograd.grad(out, leaves, dout.to(dtype)))

    ours = (out, dq, dk[:, :valid], dv[:, :valid])
    for name, got, lowp, ref64 in zip(("out", "dq", "dk", "dv"), ours, reference(dtype), reference(torch.float64)):
        assert_close_to_reference(name, got, lowp, ref64)
    assert torch.count_nonzero(dk[:, valid:]) == 0 and torch.count_nonzero(dv[:, valid:]) == 0


def test_one_block_mask_serves_many_calls():
    """Built once, used by calls of different inputs and options (as every layer of a step would),
    each matching the reference; the object is not changed by use."""
    gen = torch.Generator().manual_seed(9)
    mask = random_cells((1, 2, 40, 40), 16, seed=4).to(DEVICE)
    block_mask = fusedattn.BlockMask.from_mask(mask)
    states = block_mask.states.clone()
    dtype = torch.bfloat16 if ON_GPU else torch.float32
    for options in (dict(), dict(causal=True), dict(window=(8, 8), softcap=5.0)):
        q, k, v = (torch.randn(1, 40, 2, 32, generator=gen).to(DEVICE, dtype) for _ in range(3))
        with fusedattn.use_backend("triton"):
            out = fusedattn.attention(q, k, v, mask=block_mask, **options)
        lowp, ref64 = (reference_attention(q.to(t), k.to(t), v.to(t), mask=mask, **options)
                       for t in (dtype, torch.float64))
        assert_close_to_reference(str(options), out, lowp, ref64)
    assert torch.equal(block_mask.states, states)


@pytest.mark.parametrize("make, error, words", [
    (lambda: BlockMask.from_blocks(torch.ones(2, 2, dtype=torch.bool), (24, 32), 48, 64), ValueError, ["block_q", "24"]),
    (lambda: BlockMask.from_blocks(torch.ones(2, 2, dtype=torch.bool), (32, 8), 64, 16), ValueError, ["block_k"]),
    (lambda: BlockMask.from_blocks(torch.ones(2, 3, dtype=torch.bool), (32, 32), 64, 64), ValueError, ["(2, 2)"]),
    (lambda: BlockMask.from_blocks(torch.ones(2, 2), (32, 32), 64, 64), TypeError, ["bool"]),
    (lambda: BlockMask.from_mask(torch.ones(4, 4)), TypeError, ["bool"]),
    (lambda: BlockMask.from_mask(torch.ones(1, 1, 1, 4, 4, dtype=torch.bool)), ValueError, ["at most 4 dims"]),
    (lambda: BlockMask.from_blocks(torch.ones(2, 2, dtype=torch.bool), 32.0, 64, 64), TypeError, ["`block_size`"]),
    (lambda: BlockMask.from_blocks(torch.ones(2, 2, dtype=torch.bool), 32, 64, 0), ValueError, ["`seqlen_k`"]),
], ids=["block-not-power-of-two", "block-too-small", "keep-shape", "keep-floats", "mask-floats", "mask-5d",
        "block-size-float", "no-keys"])
def test_block_mask_errors(make, error, words):
    with pytest.raises(error) as info:
        make()
    for word in words:
        assert word in str(info.value)


@pytest.mark.parametrize("shape", [(2, 3, 37, 50), (1, 2, 1, 70), (1, 2, 45, 1), (2, 1, 100, 600)], ids=str)
def test_classify_kernel_matches_torch_reductions(shape):
    """The one-pass Triton kernel the GPU uses (here: the interpreter) on a strided (transposed)
    mask, against the torch reductions and brute force."""
    from fusedattn.block_mask import classify_with_torch
    from fusedattn.kernels.triton.classify import classify_cells

    mask = random_cells(shape[:2] + shape[:1:-1], 8, seed=sum(shape)).to(DEVICE).transpose(2, 3)  # strided
    states = classify_cells(mask, 16, 16)
    assert torch.equal(states.cpu(), classify_with_torch(mask.cpu(), 16, 16))
    expected = brute_states(mask.cpu(), 16 if shape[2] > 1 else 1, 16 if shape[3] > 1 else 1, whole_only=False)
    assert torch.equal(states.cpu(), expected)


TMA_MASKS = [  # (mask shape from (B, H, Sq, Sk), Sk, by blocks, read through TMA)
    (lambda b, h, sq, sk: (b, h, sq, sk), 256, False, True),
    (lambda b, h, sq, sk: (sq, sk), 272, False, True),  # one (Sq, Sk) mask for every batch and head
    (lambda b, h, sq, sk: (b, h, sq, sk), 250, False, False),  # rows not 16-byte aligned: pointers
    (lambda b, h, sq, sk: (b, 1, 1, sk), 256, False, False),  # key padding: one row, by pointers
    (lambda b, h, sq, sk: (b, h, -(-sq // 32), -(-sk // 32)), 256, True, False),  # whole blocks: shifted indices
]


@pytest.mark.skipif(not ON_GPU, reason="TMA descriptors exist on the GPU only")
@pytest.mark.parametrize("make_shape, seqlen_k, by_blocks, tma", TMA_MASKS,
                         ids=["full", "shared", "unaligned", "keys", "blocks"])
def test_masks_by_elements_are_read_through_tma_where_aligned(monkeypatch, make_shape, seqlen_k, by_blocks, tma):
    """A mask by elements whose rows TMA can address is read through descriptors by the forward
    and both backward passes (MASK_TMA); the other forms by pointers; every one matches the
    reference (random entries: every tile partial, so the mask is read on every visited tile)."""
    from attention_runner import launcher_constexprs
    from fusedattn.kernels.triton import bwd
    from fusedattn.kernels.triton import fwd

    flags = []

    def spy(kernel, grid, args, real=fwd.launch, **constexprs):  # the Triton forward
        if "MASK_TMA" in constexprs:
            flags.append(constexprs["MASK_TMA"])
        return real(kernel, grid, args, **constexprs)

    monkeypatch.setattr(fwd, "launch", spy)
    backward_flags = launcher_constexprs(monkeypatch, bwd._backward_kernel, lambda constexprs: constexprs["MASK_TMA"])
    batch, heads, seqlen_q, dim = 2, 2, 200, 64
    gen = torch.Generator().manual_seed(seqlen_k)
    q, dout = (torch.randn(batch, seqlen_q, heads, dim, generator=gen).to(DEVICE, torch.bfloat16) for _ in range(2))
    k, v = (torch.randn(batch, seqlen_k, heads, dim, generator=gen).to(DEVICE, torch.bfloat16) for _ in range(2))
    keep = torch.rand(make_shape(batch, heads, seqlen_q, seqlen_k), generator=gen) < 0.7
    if by_blocks:
        mask = BlockMask.from_blocks(keep.to(DEVICE), (32, 32), seqlen_q, seqlen_k)
        dense = mask.to_dense()
    else:
        mask = dense = keep.to(DEVICE)
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    with fusedattn.use_backend("triton"):
        out = fusedattn.attention(*leaves, mask=mask, causal=True)
    grads = torch.autograd.grad(out, leaves, dout)
    assert flags and backward_flags and all(flag == tma for flag in flags + backward_flags), (flags, backward_flags)

    def reference(dtype):
        ref_leaves = [t.to(dtype).requires_grad_() for t in (q, k, v)]
        ref = reference_attention(*ref_leaves, mask=dense.reshape((1,) * (4 - dense.dim()) + dense.shape), causal=True)
        return (ref, *torch.autograd.grad(ref, ref_leaves, dout.to(dtype)))

    for name, got, lowp, ref64 in zip(("out", "dq", "dk", "dv"), (out, *grads), reference(torch.bfloat16),
                                      reference(torch.float64)):
        assert_close_to_reference(name, got, lowp, ref64)


@pytest.mark.parametrize("edit", ["in place", "through a view"])
@pytest.mark.parametrize("kind", ["from_mask", "from_blocks"])
def test_a_block_mask_whose_tensor_was_edited_raises(kind, edit):
    """A BlockMask refers to the caller's tensor without copying it; its tile states describe the tensor
    as it was. Editing the tensor afterwards (directly or through a view) must make every call given
    the object raise -- never run the old tile map over the new bits -- and a new object works."""
    gen = torch.Generator().manual_seed(2)
    q, k, v = (torch.randn(1, 64, 2, 16, generator=gen).to(DEVICE, torch.float16) for _ in range(3))
    if kind == "from_mask":
        tensor = random_cells((1, 1, 64, 64), 16, seed=3).to(DEVICE)
        build = BlockMask.from_mask
    else:
        tensor = (torch.rand(1, 1, 4, 4, generator=gen) < 0.5).to(DEVICE)
        build = lambda t: BlockMask.from_blocks(t, (16, 16), 64, 64)  # noqa: E731
    block_mask = build(tensor)
    with fusedattn.use_backend("triton"):
        fusedattn.attention(q, k, v, mask=block_mask)  # current: runs
    if edit == "in place":
        tensor.logical_not_()
    else:
        tensor.view(-1)[:5] = True
    for backend in ("triton", "torch"):  # the PyTorch path would read the new bits; it raises alike
        with fusedattn.use_backend(backend), pytest.raises(ValueError, match="modified in place"):
            fusedattn.attention(q, k, v, mask=block_mask)
    fresh = build(tensor)
    with fusedattn.use_backend("triton"):
        out = fusedattn.attention(q, k, v, mask=fresh)
    dense = fresh.to_dense()
    lowp, ref64 = (reference_attention(q.to(t), k.to(t), v.to(t), mask=dense) for t in (torch.float16, torch.float64))
    assert_close_to_reference("fresh BlockMask", out, lowp, ref64)


@pytest.mark.parametrize("shape", [(), (40,), (33, 40), (2, 33, 40), (2, 1, 33, 40)], ids=str)
def test_from_mask_takes_every_shape_attention_takes(shape):
    """Fewer than 4 dims are leading 1s, as for attention's own mask argument (0-D and 1-D included)."""
    gen = torch.Generator().manual_seed(len(shape))
    mask = torch.rand(shape, generator=gen) < 0.6 if shape else torch.tensor(True)
    q = torch.randn(2, 33, 2, 16, generator=gen)
    k, v = (torch.randn(2, 40, 2, 16, generator=gen) for _ in range(2))
    with fusedattn.use_backend("torch"):
        direct = fusedattn.attention(q, k, v, mask=mask)
        built = fusedattn.attention(q, k, v, mask=BlockMask.from_mask(mask))
    assert torch.equal(direct, built)
