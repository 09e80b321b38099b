"""``topk_mask`` and ``topk_block_mask`` (dynamic_mask.py) against a brute-force statement of
their definition, and trained through ``attention`` as the issue writes it:
``attention(q, k, v, bias=b, mask=topk_mask(b.detach(), k, causal=True), causal=True)``."""

import itertools

import pytest
import torch

import fusedattn
from fusedattn import dynamic_mask
from fusedattn.reference import reference_attention
from fusedattn.spec import fold_window, keep_mask
from numerics import assert_close_to_reference

ON_GPU = torch.cuda.is_available()
DEVICE = "cuda" if ON_GPU else "cpu"
RULES = [dict(), dict(causal=True), dict(window=(6, 3)), dict(causal=True, window=(10, -1))]


def allowed(seqlen_q, seqlen_k, options):
    return keep_mask(seqlen_q, seqlen_k, *fold_window(options.get("causal", False), options.get("window")))


def brute_topk(scores: torch.Tensor, k: int, options: dict) -> torch.Tensor:
    """Row by row: the k largest finite scores among the allowed keys (all of them if fewer)."""
    rule = allowed(*scores.shape[-2:], options)
    out = torch.zeros(scores.shape, dtype=torch.bool)
    for index in itertools.product(*(range(n) for n in scores.shape[:-1])):
        row = scores[index]
        candidates = [j for j in range(row.numel()) if rule[index[-1], j] and torch.isfinite(row[j])]
        for j in sorted(candidates, key=lambda j: -row[j].item())[:k]:
            out[index + (j,)] = True
    return out


def random_scores(shape, seed: int) -> torch.Tensor:
    scores = torch.randn(shape, generator=torch.Generator().manual_seed(seed))
    scores.view(-1)[::7] = float("-inf")  # never kept
    scores.view(-1)[3::13] = float("nan")  # never kept
    return scores


@pytest.mark.parametrize("options", RULES, ids=str)
@pytest.mark.parametrize("shape,k", [((2, 3, 17, 23), 5), ((9, 40), 8), ((1, 2, 30, 12), 20), ((3, 5, 1), 1)],
                         ids=str)
def test_topk_mask_keeps_the_k_largest_allowed_scores(shape, k, options, monkeypatch):
    monkeypatch.setattr(dynamic_mask, "CHUNK_ELEMENTS", 64)  # several row chunks even on small shapes
    scores = random_scores(shape, seed=k + len(shape))
    assert torch.equal(fusedattn.topk_mask(scores, k, **options), brute_topk(scores, k, options))


def brute_block_topk(scores, k, block, options, pool):
    """Per (query block, key block): the pool of its allowed finite scores; the k largest pooled per
    query block (tiles without any such score never)."""
    rule = allowed(*scores.shape[-2:], options)
    seqlen_q, seqlen_k = scores.shape[-2:]
    blocks_q, blocks_k = -(-seqlen_q // block[0]), -(-seqlen_k // block[1])
    keep = torch.zeros((*scores.shape[:-2], blocks_q, blocks_k), dtype=torch.bool)
    for index in itertools.product(*(range(n) for n in scores.shape[:-2])):
        for m in range(blocks_q):
            pooled = {}
            for n in range(blocks_k):
                rows, cols = slice(m * block[0], (m + 1) * block[0]), slice(n * block[1], (n + 1) * block[1])
                tile = scores[index][rows, cols]
                values = tile[rule[rows, cols] & torch.isfinite(tile)]
                if values.numel():
                    pooled[n] = values.max().item() if pool == "max" else values.double().mean().item()
            for n in sorted(pooled, key=lambda n: -pooled[n])[:k]:
                keep[index + (m, n)] = True
    return keep


@pytest.mark.parametrize("pool", ["mean", "max"])
@pytest.mark.parametrize("options", RULES[:3], ids=str)
def test_topk_block_mask_keeps_the_k_best_tiles(options, pool):
    scores = random_scores((2, 2, 70, 90), seed=4)
    block_mask = fusedattn.topk_block_mask(scores, 2, block_size=(16, 32), pool=pool, **options)
    assert block_mask.shape == (2, 2, 70, 90) and block_mask.cell == (16, 32)
    expected = brute_block_topk(scores, 2, (16, 32), options, pool)
    assert torch.equal(block_mask.source, expected)


@pytest.mark.parametrize("make, error, words", [
    (lambda: fusedattn.topk_mask(torch.ones(4, 4), 0), ValueError, ["`k`", ">= 1"]),
    (lambda: fusedattn.topk_mask(torch.ones(4, 4, dtype=torch.bool), 2), TypeError, ["`scores`", "floating"]),
    (lambda: fusedattn.topk_mask(torch.ones(4), 2), ValueError, ["`scores`", "2 to 4 dims"]),
    (lambda: fusedattn.topk_block_mask(torch.ones(4, 4), 1, pool="sum"), ValueError, ["`pool`"]),
    (lambda: fusedattn.topk_block_mask(torch.ones(40, 40), 1, block_size=(20, 16)), ValueError, ["block_q"]),
    # causal, window and block sizes are checked exactly as attention checks them
    (lambda: fusedattn.topk_mask(torch.ones(4, 4), 2, causal="no"), TypeError, ["`causal`", "bool", "'no'"]),
    (lambda: fusedattn.topk_block_mask(torch.ones(4, 4), 1, causal=1), TypeError, ["`causal`", "bool"]),
    (lambda: fusedattn.topk_mask(torch.ones(4, 4), 2, window=(-3, 0)), ValueError, ["`window` left", "-3"]),
    (lambda: fusedattn.topk_mask(torch.ones(4, 4), 2, window=(2.5, 0)), TypeError, ["`window` left", "float"]),
    (lambda: fusedattn.topk_block_mask(torch.ones(4, 4), 1, window=(1, 2, 3)), ValueError, ["`window`"]),
    (lambda: fusedattn.topk_block_mask(torch.ones(40, 40), 1, block_size=(16,)), TypeError, ["`block_size`"]),
    (lambda: fusedattn.topk_block_mask(torch.ones(40, 40), 1, block_size=24), ValueError, ["block_q", "24"]),
    (lambda: fusedattn.topk_mask(torch.ones(4, 4), 2.0), ValueError, ["`k`"]),
], ids=["k-zero", "bool-scores", "1d-scores", "pool", "block-size", "causal-str", "causal-int", "window-negative",
        "window-float", "window-triple", "block-size-one", "block-size-int-24", "k-float"])
def test_dynamic_mask_errors(make, error, words):
    with pytest.raises(error) as info:
        make()
    for word in words:
        assert word in str(info.value)


@pytest.mark.parametrize("block_sparse", [False, True], ids=["topk", "block-topk"])
def test_bias_trains_through_the_kept_entries(block_sparse):
    """The issue's example, small: the mask from the detached bias, the bias trained through it.
    Output and every gradient match the reference on the same mask; the bias gradient is exactly
    0 where the mask dropped the entry."""
    batch, heads, seqlen, dim = 2, 2, 70, 32
    dtype = torch.bfloat16 if ON_GPU else torch.float32
    gen = torch.Generator().manual_seed(21)
    q, k, v, dout = (torch.randn(batch, seqlen, heads, dim, generator=gen).to(DEVICE, dtype) for _ in range(4))
    bias = (2 * torch.randn(batch, heads, seqlen, seqlen, generator=gen)).to(DEVICE, dtype)
    if block_sparse:
        mask = fusedattn.topk_block_mask(bias, 2, block_size=(16, 16), causal=True)
        dense = mask.to_dense()
    else:
        mask = dense = fusedattn.topk_mask(bias, 12, causal=True)

    def run(fn, dtype_, mask_):
        leaves = [t.to(dtype_).requires_grad_() for t in (q, k, v, bias)]
        out = fn(*leaves[:3], bias=leaves[3], mask=mask_, causal=True)
        return (out, *torch.autograd.grad(out, leaves, dout.to(dtype_)))

    with fusedattn.use_backend("triton"):
        ours = run(fusedattn.attention, dtype, mask)
    lowp, ref64 = run(reference_attention, dtype, dense), run(reference_attention, torch.float64, dense)
    for name, *tensors in zip(("out", "dq", "dk", "dv", "dbias"), ours, lowp, ref64):
        assert_close_to_reference(name, *tensors)
    assert torch.count_nonzero(ours[4][~dense.expand_as(bias)]) == 0


def test_numpy_scalars_and_an_int_block_size_mean_what_python_ints_do():
    import numpy as np

    scores = torch.randn(2, 40, 50, generator=torch.Generator().manual_seed(8))
    assert torch.equal(fusedattn.topk_mask(scores, np.int64(7), window=(np.int64(9), np.int32(2))),
                       fusedattn.topk_mask(scores, 7, window=(9, 2)))
    by_numpy = fusedattn.topk_block_mask(scores, np.int64(2), block_size=np.int64(16), causal=True)
    by_python = fusedattn.topk_block_mask(scores, 2, block_size=(16, 16), causal=True)
    assert torch.equal(by_numpy.source, by_python.source) and by_numpy.cell == by_python.cell == (16, 16)
