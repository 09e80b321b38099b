"""The PyTorch path for CPU tensors (``fusedattn.cpu``): its two ways through -- torch's fused CPU
kernel on the sub-problems ``fused_parts`` cuts, and the tiled math path for softcap, bias and masks --
against the float64 reference by SPEC 4's rule (output, lse and every gradient), and which way each
problem takes.

CASES runs twice: with the path's tile sizes cut to a few dozen rows (odd, so that every length here
crosses several tiles and leaves a ragged one, and a window band spans several sub-problems), and
at the shipped sizes on the cases long enough to cross them. Lengths: 1, 17, 113, 127, 129, 255 and
beyond 256, Sq != Sk both ways; every mask form of SPEC 3.2 (causal, narrow / wide / one-sided
windows, windows that leave rows with no key); GQA and MQA; D != Dv both ways; softcap, sinks,
bias with its gradient, boolean masks and BlockMasks; a gradient on lse; fp32, bf16, fp16; both
layouts.
"""

from __future__ import annotations

import re
import threading
from dataclasses import replace

import pytest
import torch

import fusedattn
from fusedattn import cpu
from fusedattn.spec import keep_mask, resolve_spec
from attention_runner import check_case, forward_backward, make_inputs
from cases import Case

F32, BF16, F16 = torch.float32, torch.bfloat16, torch.float16

# What the fused kernel takes (no softcap, bias or mask): every causal/window form, lengths, heads,
# head dims, sinks and dlse, in each dtype and layout.
FUSED_CASES = [
    Case(seqlen_q=1, seqlen_k=1, dtype=F32),
    Case(seqlen_q=1, seqlen_k=17, causal=True, dtype=BF16),
    Case(heads_q=4, heads_kv=1, seqlen_q=1, seqlen_k=113, window=(70, 0), sinks=True, dtype=F32),  # decoding
    Case(seqlen_q=17, seqlen_k=1, dtype=F16, layout="bhsd"),
    Case(seqlen_q=113, seqlen_k=127, dtype=F32, layout="bhsd"),
    Case(seqlen_q=127, seqlen_k=127, causal=True, dtype=F32, layout="bhsd", lse_grad=True),
    Case(seqlen_q=113, seqlen_k=255, causal=True, dtype=BF16),  # Sq < Sk: a full key range and a square
    Case(seqlen_q=255, seqlen_k=129, causal=True, dtype=F16, layout="bhsd"),  # Sq > Sk: rows with no key
    Case(seqlen_q=129, seqlen_k=129, window=(2, 1), dtype=F32),  # narrow
    Case(seqlen_q=255, seqlen_k=255, window=(100, 60), dtype=BF16, layout="bhsd"),  # wide
    Case(seqlen_q=127, seqlen_k=113, window=(-1, 5), dtype=F32, lse_grad=True),  # open to the left
    Case(seqlen_q=113, seqlen_k=127, window=(9, -1), dtype=F16),  # open to the right
    Case(seqlen_q=129, seqlen_k=113, causal=True, window=(30, -1), dtype=F32, layout="bhsd"),  # both given
    Case(seqlen_q=113, seqlen_k=40, window=(3, 2), dtype=F32, lse_grad=True),  # the first 71 rows see nothing
    Case(seqlen_q=40, seqlen_k=113, window=(0, 0), dtype=BF16),  # one key a row
    Case(heads_q=6, heads_kv=2, seqlen_q=129, seqlen_k=255, causal=True, dtype=F32, lse_grad=True),  # GQA
    Case(heads_q=4, heads_kv=1, seqlen_q=255, seqlen_k=127, window=(20, 7), dtype=BF16, layout="bhsd"),  # MQA
    Case(batch=2, heads_q=4, heads_kv=2, seqlen_q=17, seqlen_k=113, head_dim=64, head_dim_v=24, causal=True,
         dtype=F32),  # D > Dv
    Case(batch=2, seqlen_q=113, seqlen_k=113, head_dim=24, head_dim_v=96, window=(12, 12), dtype=F16,
         lse_grad=True, layout="bhsd"),  # D < Dv
    Case(seqlen_q=129, seqlen_k=127, head_dim=256, dtype=BF16),
    Case(seqlen_q=113, seqlen_k=113, head_dim=8, head_dim_v=40, causal=True, dtype=F32, layout="bhsd"),
    Case(heads_q=4, heads_kv=2, seqlen_q=129, seqlen_k=113, causal=True, sinks=True, lse_grad=True, dtype=F32),
    Case(seqlen_q=255, seqlen_k=129, window=(9, 4), sinks=True, dtype=BF16, layout="bhsd"),
    Case(batch=3, seqlen_q=127, seqlen_k=127, scale=0.3, sinks=True, dtype=F16),
]
# What the tiled math path takes: softcap, bias (with and without its gradient) and masks, with
# the mask forms, GQA, sinks and dlse.
MATH_CASES = [
    Case(seqlen_q=127, seqlen_k=113, softcap=5.0, dtype=F32),
    Case(heads_q=4, heads_kv=1, seqlen_q=1, seqlen_k=113, head_dim=40, head_dim_v=24, softcap=20.0, window=(70, 0),
         sinks=True, dtype=F32),  # one query row (decoding) with sinks
    Case(heads_q=4, heads_kv=2, seqlen_q=255, seqlen_k=129, softcap=3.0, causal=True, sinks=True, dtype=BF16,
         layout="bhsd", lse_grad=True),
    Case(seqlen_q=113, seqlen_k=40, softcap=4.0, window=(3, 2), dtype=F32),  # rows with no key
    Case(seqlen_q=129, seqlen_k=255, bias="full", causal=True, dtype=F32, lse_grad=True),
    Case(heads_q=4, heads_kv=2, seqlen_q=113, seqlen_k=127, bias="kv-heads", window=(20, 7), dtype=F16),
    Case(batch=2, seqlen_q=127, seqlen_k=113, bias="keys", bias_dtype=F32, dtype=BF16, layout="bhsd"),
    Case(heads_q=4, heads_kv=1, seqlen_q=129, seqlen_k=129, bias="rows", window=(-1, 3), dtype=F32),
    Case(seqlen_q=113, seqlen_k=129, bias="shared", bias_trainable=False, causal=True, dtype=F32),
    Case(heads_q=4, heads_kv=2, seqlen_q=129, seqlen_k=113, mask="full", causal=True, dtype=F32, lse_grad=True),
    Case(batch=2, seqlen_q=113, seqlen_k=255, mask="keys", window=(40, 40), sinks=True, dtype=BF16),
    Case(heads_q=4, heads_kv=2, seqlen_q=127, seqlen_k=129, mask="kv-heads", mask_cells=16, softcap=5.0, dtype=F16,
         layout="bhsd"),
    Case(heads_q=4, heads_kv=2, seqlen_q=129, seqlen_k=255, mask="heads", mask_blocks=(16, 32), causal=True,
         bias="full", dtype=F32),
    Case(heads_q=4, heads_kv=1, seqlen_q=255, seqlen_k=127, mask="shared", mask_blocks=(32, 16), window=(30, 5),
         sinks=True, lse_grad=True, dtype=BF16),
]
CASES = FUSED_CASES + MATH_CASES
# Past the shipped tile sizes (256): ragged tails at the real sizes, every way through.
LONG_CASES = [
    Case(seqlen_q=300, seqlen_k=517, causal=True, dtype=F32, lse_grad=True),
    Case(heads_q=4, heads_kv=2, seqlen_q=517, seqlen_k=300, window=(100, 20), dtype=BF16, layout="bhsd"),
    Case(seqlen_q=600, seqlen_k=600, window=(257, 0), sinks=True, dtype=F32),
    Case(seqlen_q=300, seqlen_k=517, softcap=5.0, bias="heads", causal=True, dtype=F32),
    Case(heads_q=4, heads_kv=2, seqlen_q=517, seqlen_k=300, mask="kv-heads", window=(100, 20), dtype=BF16),
]


@pytest.fixture
def small_tiles(monkeypatch):
    """Tile sizes a few dozen rows wide, odd and unequal, so that these lengths cross several."""
    monkeypatch.setattr(cpu, "QUERY_TILE", 37)
    monkeypatch.setattr(cpu, "KEY_TILE", 29)
    monkeypatch.setattr(cpu, "BAND_ROWS", 41)


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.id)
def test_small_tiles_match_reference(case, small_tiles):
    check_case(case, "torch", "cpu")


@pytest.mark.parametrize("case", LONG_CASES, ids=lambda c: c.id)
def test_shipped_tiles_match_reference(case):
    check_case(case, "torch", "cpu")


# ----------------------------------------------------------------------------- rows with no key


@pytest.mark.parametrize("options", [dict(causal=True), dict(window=(3, 2)), dict(window=(3, 2), softcap=4.0),
                                     dict(causal=True, sinks=True)], ids=["causal", "window", "window-softcap",
                                                                          "causal-sinks"])
def test_rows_with_no_key_are_zero_with_minus_inf_lse_and_zero_grads(options, small_tiles):
    """Sq > Sk: the rows above the shifted diagonal see no key: out 0, lse -inf (the sink's logit with
    sinks), every gradient of theirs 0, no NaN anywhere -- on the fused path, whose kernel would answer
    otherwise for such rows, and on the math path."""
    options = dict(options)
    sinks = torch.randn(2) if options.pop("sinks", False) else None
    case = Case(heads_q=2, heads_kv=1, seqlen_q=113, seqlen_k=40, dtype=F32, **options)
    q, k, v, dout, dlse = make_inputs(case, "cpu")
    spec = resolve_spec(case.head_dim, layout=case.layout, causal=case.causal, window=case.window, scale=None,
                        softcap=case.softcap, deterministic=False)
    empty = ~keep_mask(113, 40, spec.window_left, spec.window_right).any(dim=1)
    assert empty[:20].all() and not empty.all()
    with fusedattn.use_backend("torch"):
        out, lse, dq, dk, dv = forward_backward(
            lambda a, b, c: fusedattn.attention(a, b, c, sinks=sinks, return_lse=True, **case.options()),
            q, k, v, dout, dlse, lse_grad=True)
    for name, t in (("out", out), ("lse", lse), ("dq", dq), ("dk", dk), ("dv", dv)):
        assert not torch.isnan(t).any(), f"NaN in {name}"
    assert torch.equal(out[:, empty], torch.zeros_like(out[:, empty]))
    assert torch.equal(dq[:, empty], torch.zeros_like(dq[:, empty]))
    expected_lse = torch.full_like(lse[:, :, empty], float("-inf")) if sinks is None else \
        sinks.view(1, 2, 1).expand_as(lse[:, :, empty])
    assert torch.equal(lse[:, :, empty], expected_lse)
    assert torch.isfinite(lse[:, :, ~empty]).all()


def test_keys_no_row_sees_are_never_read():
    """Keys outside every row's window, NaN, leave every result as it is with them zeroed (their own
    dK, dV: 0): neither way through visits a key range no row of a block can see."""
    case = Case(heads_q=4, heads_kv=2, seqlen_q=90, seqlen_k=600, window=(40, 10), dtype=F32, lse_grad=True)
    q, k, v, dout, dlse = make_inputs(case, "cpu")
    unseen = slice(0, 600 - 90 - 40)  # below the first row's band
    assert not keep_mask(90, 600, 40, 10)[:, unseen].any()

    def run(value, softcap):
        k_, v_ = k.clone(), v.clone()
        k_[:, unseen], v_[:, unseen] = value, value
        with fusedattn.use_backend("torch"):
            return forward_backward(
                lambda a, b, c: fusedattn.attention(a, b, c, return_lse=True,
                                                    **replace(case, softcap=softcap).options()),
                q, k_, v_, dout, dlse, lse_grad=True)

    for softcap in (None, 5.0):  # the fused path, the math path
        for name, a, b in zip(("out", "lse", "dq", "dk", "dv"), run(0.0, softcap), run(float("nan"), softcap)):
            assert torch.isfinite(b).all() and torch.equal(a, b), (softcap, name)


@pytest.mark.parametrize("as_block_mask", [False, True], ids=["bool-mask", "block-mask"])
def test_key_tiles_a_mask_empties_are_never_read(as_block_mask, monkeypatch):
    """The math path skips the key tiles a mask hides from every row (its tile states): NaN keys
    there leave every result as it is with them zeroed."""
    monkeypatch.setattr(cpu, "KEY_TILE", 64)
    case = Case(batch=2, heads_q=4, heads_kv=2, seqlen_q=70, seqlen_k=320, softcap=5.0, dtype=F32)
    q, k, v, dout, dlse = make_inputs(case, "cpu")
    hidden = slice(128, 256)  # two whole key tiles
    mask = torch.rand(case.seqlen_q, case.seqlen_k, generator=torch.Generator().manual_seed(1)) < 0.7
    mask[:, hidden] = False
    if as_block_mask:
        mask = fusedattn.BlockMask.from_mask(mask)

    def run(value):
        k_, v_ = k.clone(), v.clone()
        k_[:, hidden], v_[:, hidden] = value, value
        with fusedattn.use_backend("torch"):
            return forward_backward(lambda a, b, c: fusedattn.attention(a, b, c, mask=mask, return_lse=True,
                                                                        **case.options()),
                                    q, k_, v_, dout, dlse, lse_grad=True)

    for name, a, b in zip(("out", "lse", "dq", "dk", "dv"), run(0.0), run(float("nan"))):
        assert torch.isfinite(b).all() and torch.equal(a, b), name


# ----------------------------------------------------------------------------- which way each problem takes


class FusedCalls:
    """Spies on the fused kernel's forward and backward: each call as (rows, keys, causal, masked, heads
    of q, heads of k), after the tensors are shaped as the kernel takes them. Only the calls made on
    the test's own thread count (a CPU backward runs on its caller's): an earlier test's CUDA backward
    may still be running on an autograd device thread through the patched functions."""

    def __init__(self, monkeypatch):
        # The probe of whether the kernel pairs grouped heads itself calls the kernel once per
        # process, on first use: run it before spying, so a test's count does not depend on
        # whether an earlier test in the process already took a grouped-head case.
        cpu.fused_kernel_takes_gqa()
        self.forward, self.backward = [], []
        real_forward, real_backward = cpu._flash_forward, cpu._flash_backward
        own_thread = threading.get_ident()

        def forward(q, k, v, causal, mask, scale):
            if threading.get_ident() == own_thread:
                self.forward.append((q.shape[2], k.shape[2], causal, mask is not None, q.shape[1], k.shape[1]))
            return real_forward(q, k, v, causal, mask, scale)

        def backward(dout, q, k, v, out, lse, causal, mask, scale):
            if threading.get_ident() == own_thread:
                self.backward.append((q.shape[2], k.shape[2], causal, mask is not None, q.shape[1], k.shape[1]))
            return real_backward(dout, q, k, v, out, lse, causal, mask, scale)

        monkeypatch.setattr(cpu, "_flash_forward", forward)
        monkeypatch.setattr(cpu, "_flash_backward", backward)


def _run(case: Case, **extra):
    q, k, v, dout, _ = make_inputs(case, "cpu")
    leaves = [t.requires_grad_() for t in (q, k, v)]
    with fusedattn.use_backend("torch"):
        out = fusedattn.attention(*leaves, **case.options(), **extra)
    out.backward(dout)
    return out, leaves


@pytest.mark.parametrize("case,expected", [
    # no window: one call, everything; nothing merged
    (Case(seqlen_q=113, seqlen_k=127, dtype=F32), [(113, 127, False, False)]),
    # causal, Sq == Sk: the kernel's own top-left causal rule on the whole square (SDPA's is_causal)
    (Case(seqlen_q=127, seqlen_k=127, causal=True, dtype=BF16), [(127, 127, True, False)]),
    # Sq < Sk: the keys every row sees, then the square on the shifted diagonal
    (Case(seqlen_q=113, seqlen_k=255, causal=True, dtype=F32), [(113, 142, False, False), (113, 113, True, False)]),
    # Sq > Sk: the rows with no key are left out; the rest is a square
    (Case(seqlen_q=255, seqlen_k=129, causal=True, dtype=F32), [(129, 129, True, False)]),
    # window open to the left, Sq == Sk: the rows whose band ends inside the keys, then the rest
    (Case(seqlen_q=127, seqlen_k=127, window=(-1, 5), dtype=F32),
     [(122, 5, False, False), (122, 122, True, False), (5, 127, False, False)]),
])
def test_the_fused_kernel_takes_what_it_expresses_exactly(case, expected, monkeypatch):
    calls = FusedCalls(monkeypatch)
    _run(case)
    assert [c[:4] for c in calls.forward] == expected
    assert [c[:4] for c in calls.backward] == expected  # the backward cuts the problem the same way


def test_a_window_band_visits_only_the_keys_its_rows_see(monkeypatch):
    """A sliding window: blocks of BAND_ROWS rows, each against its rows' key range (the band, never
    the whole sequence), the keep rule as a mask; the pairs computed are the kept ones and the
    triangles a block's edges cut."""
    monkeypatch.setattr(cpu, "BAND_ROWS", 64)
    calls = FusedCalls(monkeypatch)
    case = Case(seqlen_q=600, seqlen_k=600, window=(100, 0), dtype=F32)
    _run(case)
    assert len(calls.forward) == len(calls.backward) == 10  # ceil(600 / 64)
    assert all(masked and not causal for _, _, causal, masked, _, _ in calls.forward)
    assert max(keys for _, keys, *_ in calls.forward) == 64 + 100
    kept = int(keep_mask(600, 600, 100, 0).sum())
    computed = sum(rows * keys for rows, keys, *_ in calls.forward)
    assert kept < computed <= kept + 10 * 64 * 64


@pytest.mark.parametrize("extra,case", [
    (dict(), Case(seqlen_q=33, seqlen_k=47, softcap=5.0, dtype=F32)),
    (dict(bias=torch.randn(1, 2, 33, 47)), Case(seqlen_q=33, seqlen_k=47, dtype=F32)),
    (dict(mask=torch.rand(33, 47) < 0.7), Case(seqlen_q=33, seqlen_k=47, causal=True, dtype=F32)),
], ids=["softcap", "bias", "mask"])
def test_what_the_fused_kernel_cannot_express_takes_the_math_path(extra, case, monkeypatch):
    calls = FusedCalls(monkeypatch)
    _run(case, **extra)
    assert calls.forward == [] and calls.backward == []


def test_sinks_take_the_fused_kernel_and_are_merged_by_lse(monkeypatch):
    calls = FusedCalls(monkeypatch)
    case = Case(heads_q=4, heads_kv=2, seqlen_q=47, seqlen_k=47, causal=True, sinks=True, dtype=F32)
    _run(case, sinks=torch.randn(4))
    assert len(calls.forward) == len(calls.backward) == 1
    check_case(case, "torch", "cpu")


def test_grouped_heads_reach_the_kernel_unexpanded(monkeypatch):
    """The kernel pairs query head h with K/V head h // G itself (where this torch's does): K/V reach
    it with their own head count, and their gradients come back in it."""
    assert cpu.fused_kernel_takes_gqa()
    calls = FusedCalls(monkeypatch)
    case = Case(heads_q=6, heads_kv=2, seqlen_q=47, seqlen_k=65, causal=True, dtype=F32)
    _, (_, k, v) = _run(case)
    assert [(c[4], c[5]) for c in calls.forward + calls.backward] == [(6, 2)] * 4  # a full range, a square
    assert k.grad.shape == k.shape and v.grad.shape == v.shape


@pytest.mark.parametrize("case", [
    Case(heads_q=6, heads_kv=2, seqlen_q=129, seqlen_k=113, causal=True, lse_grad=True, dtype=F32),
    Case(heads_q=4, heads_kv=1, seqlen_q=113, seqlen_k=127, window=(20, 7), sinks=True, dtype=BF16, layout="bhsd"),
], ids=lambda c: c.id)
def test_a_kernel_without_grouped_heads_gets_them_expanded(case, monkeypatch, small_tiles):
    """Where the kernel cannot pair query heads with fewer K/V heads (older torch), K/V go in expanded
    per query head and their gradients are summed back per group."""
    monkeypatch.setattr(cpu, "fused_kernel_takes_gqa", lambda: False)
    calls = FusedCalls(monkeypatch)
    check_case(case, "torch", "cpu")
    assert calls.forward and all(hq == hkv == case.heads_q for *_, hq, hkv in calls.forward + calls.backward)


def test_heads_of_bhsd_tensors_go_in_as_batches_and_nothing_is_copied_back(monkeypatch):
    """(B, H, S, D) tensors with a K/V head per query head go in as B * H problems of one head: the
    kernel then writes out, dq, dk, dv in (B, H, S, D) order, and they come back as the kernel wrote
    them (no copy); (B, S, H, D) tensors go in as they are, for the same reason."""
    written = []
    real_forward, real_backward = cpu._flash_forward, cpu._flash_backward
    monkeypatch.setattr(cpu, "_flash_forward", lambda *a: written.append((a[0].shape[1], real_forward(*a))) or
                        written[-1][1])
    monkeypatch.setattr(cpu, "_flash_backward", lambda *a: written.append((a[1].shape[1], real_backward(*a))) or
                        written[-1][1])
    for layout in ("bhsd", "bshd"):
        case = Case(batch=2, heads_q=3, heads_kv=3, seqlen_q=40, seqlen_k=40, causal=True, layout=layout, dtype=F32)
        q, k, v, dout, _ = make_inputs(case, "cpu")
        spec = resolve_spec(case.head_dim, layout=layout, causal=True, window=None, scale=None, softcap=None,
                            deterministic=False)
        written.clear()
        out, lse = cpu.forward(q, k, v, spec)
        dq, dk, dv, _ = cpu.backward(dout, None, q, k, v, out, lse, spec)
        (heads_fwd, (kernel_out, _)), (heads_bwd, kernel_grads) = written
        assert heads_fwd == heads_bwd == (1 if layout == "bhsd" else 3)
        for name, ours, kernels in zip(("out", "dq", "dk", "dv"), (out, dq, dk, dv), (kernel_out, *kernel_grads)):
            assert ours.is_contiguous() and ours.data_ptr() == kernels.data_ptr(), name


def test_chunked_forward_stays_plain_torch(monkeypatch):
    """``chunked_forward`` (what autograd differentiates for double backward, forward-mode AD and
    torch.func) never calls the fused kernel, stays differentiable twice, and agrees with ``forward``."""
    calls = FusedCalls(monkeypatch)
    case = Case(heads_q=4, heads_kv=2, seqlen_q=47, seqlen_k=65, causal=True, dtype=F32)
    q, k, v, dout, _ = make_inputs(case, "cpu")
    spec = resolve_spec(case.head_dim, layout="bshd", causal=True, window=None, scale=None, softcap=None,
                        deterministic=False)
    leaves = [t.requires_grad_() for t in (q, k, v)]
    out, lse = cpu.chunked_forward(*leaves, spec)
    (dq,) = torch.autograd.grad((out * dout).sum(), leaves[0], create_graph=True)
    (ddq,) = torch.autograd.grad(dq.square().sum(), leaves[0])
    assert calls.forward == [] and dq.grad_fn is not None and torch.isfinite(ddq).all()
    fused_out, fused_lse = cpu.forward(q.detach(), k.detach(), v.detach(), spec)
    assert calls.forward
    torch.testing.assert_close(fused_out, out.detach(), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(fused_lse, lse.detach(), rtol=1e-5, atol=1e-5)


# ----------------------------------------------------------------------------- the plan itself


@pytest.mark.parametrize("seqlen_q,seqlen_k", [(1, 1), (17, 1), (1, 17), (113, 127), (129, 113), (255, 40)])
@pytest.mark.parametrize("window", [(-1, -1), (-1, 0), (-1, 5), (0, 0), (2, 1), (100, 60), (9, -1), (30, 0)])
def test_fused_parts_cover_every_kept_pair_once(seqlen_q, seqlen_k, window):
    """Every (row, key) pair the rule keeps lies in exactly one part (as a causal part keeps it: its
    top-left rule), no part holds a pair a masked part does not mask off, every row of a part sees
    one of its keys, and two parts' rows are the same or disjoint (results merge by row blocks)."""
    left, right = window
    keep = keep_mask(seqlen_q, seqlen_k, left, right)
    covered = torch.zeros(seqlen_q, seqlen_k, dtype=torch.int64)
    parts = cpu.fused_parts(seqlen_q, seqlen_k, left, right, band_rows=37)
    row_blocks = {(p.q0, p.q1) for p in parts}
    assert all(a == b or a[1] <= b[0] or b[1] <= a[0] for a in row_blocks for b in row_blocks)
    for part in parts:
        block = torch.ones(part.q1 - part.q0, part.k1 - part.k0, dtype=torch.bool)
        if part.causal:
            assert part.q1 - part.q0 == part.k1 - part.k0
            block = block.tril()
        elif part.masked:
            block = keep[part.q0:part.q1, part.k0:part.k1]
        assert block.any(dim=1).all(), part
        covered[part.q0:part.q1, part.k0:part.k1] += block
    assert torch.equal(covered, keep.long())


# ----------------------------------------------------------------------------- the CPU benchmark's rows


def test_cpu_bench_rows_agree_with_sdpa_and_print_ratios():
    """The CPU bench's peer gets the same problem: SDPA's default backend with is_causal, enable_gqa,
    and the window row as a dense mask; outputs agree before timing; the table prints SDPA's time over
    ours, forward and forward+backward."""
    from fusedattn.bench.__main__ import cpu_table, measure
    from fusedattn.bench.systems import CPU_SYSTEMS, Shape

    ours, sdpa = CPU_SYSTEMS
    rows = []
    for shape in (Shape(1, 4, 80, 16, True, F32, heads_kv=2), Shape(1, 2, 90, 16, True, F32, window=24)):
        mine, out = measure(ours, shape, "cpu")
        peer, _ = measure(sdpa, shape, "cpu", baseline_out=out)
        assert peer["output_agrees"] and peer["max_diff_vs_fusedattn"] < 1e-5, peer
        rows += [mine, peer]
    assert rows[2]["window"] == 24 and rows[2]["fwd_tflops"] > 0
    lines = cpu_table(rows).splitlines()
    assert len(lines) == 3 and all(re.search(r"\d\.\d\dx.*\d\.\d\dx", line) for line in lines[1:])
