"""Attention dropout (``dropout_p``): the random bits, the kept fraction, reproducibility, both
backends and the varlen entry point. The grid (cases.py) checks outputs and every gradient
against the float64 reference given each call's own mask, feature by feature."""

from __future__ import annotations

import math

import pytest
import torch
import triton
import triton.language as tl

import fusedattn
from fusedattn import dropout
from fusedattn.kernels.triton.dropout import dropout_keep
from fusedattn.reference import reference_attention

from attention_runner import capture_graph
from numerics import assert_close_to_reference

ON_GPU = torch.cuda.is_available()
DEVICE = "cuda" if ON_GPU else "cpu"
BACKENDS = ["torch", "triton"]


# ----------------------------------------------------------------------------- the random bits


def test_philox_matches_random123_known_answers():
    """The PyTorch Philox4x32 against Random123's published test vectors (10 rounds), so the
    counter-based generator is the standard one, not merely self-consistent."""
    vectors = [
        ((0, 0, 0, 0), (0, 0), (0x6627E8D5, 0xE169C58D, 0xBC57AC4C, 0x9B00DBD8)),
        ((0xFFFFFFFF,) * 4, (0xFFFFFFFF,) * 2, (0x408F276D, 0x41C83B0E, 0xA20BC7C6, 0x6D5451FD)),
        ((0x243F6A88, 0x85A308D3, 0x13198A2E, 0x03707344), (0xA4093822, 0x299F31D0),
         (0xD16CFE09, 0x94FDCCEB, 0x5001E420, 0x24126EA1)),
    ]
    for counter, (k0, k1), expected in vectors:
        words = dropout._philox(k0 | (k1 << 32), *(torch.tensor([c], dtype=torch.int64) for c in counter), rounds=10)
        assert tuple(int(w) for w in words) == expected


@triton.jit
def keep_tile(Seed, Out, batch_head, first_row, start_k, threshold, ROWS: tl.constexpr, KEYS: tl.constexpr,
              TRANSPOSED: tl.constexpr):
    """The keep tile of rows first_row ... as 0/1 bytes, (ROWS, KEYS) or transposed."""
    rows = first_row + tl.arange(0, ROWS)
    keep = dropout_keep(tl.load(Seed), batch_head, rows, start_k, threshold, KEYS, TRANSPOSED)
    if TRANSPOSED:
        ptrs = Out + tl.arange(0, KEYS)[:, None] * ROWS + tl.arange(0, ROWS)[None, :]
    else:
        ptrs = Out + tl.arange(0, ROWS)[:, None] * KEYS + tl.arange(0, KEYS)[None, :]
    tl.store(ptrs, keep.to(tl.int8))


@pytest.mark.parametrize("transposed", [False, True])
@pytest.mark.parametrize("block_k,start_k", [(16, 0), (64, 48), (128, 256)])
def test_kernel_bits_equal_the_pytorch_mask(transposed, block_k, start_k):
    """The kernels' keep tile (kernels/triton/dropout.py: interleaved Philox words) is bit for bit
    the mask ``dropout.keep_mask`` defines, plain and transposed (the dK/dV pass's tiles)."""
    rows, p, batch_head, first_row = 16, 0.3, 5, 7
    for seed_value in (0x123456789ABCDEF, 2**62 - 1, 3):
        seed = torch.tensor([seed_value], dtype=torch.int64, device=DEVICE)
        out = torch.zeros(rows * block_k, dtype=torch.int8, device=DEVICE)
        keep_tile[(1,)](seed, out, batch_head, first_row, start_k, dropout.threshold(p), rows, block_k, transposed)
        got = (out.view(block_k, rows).T if transposed else out.view(rows, block_k)).bool().cpu()
        expected = dropout.random_bytes(seed_value, torch.tensor(batch_head),
                                        torch.arange(first_row, first_row + rows)[:, None],
                                        torch.arange(start_k, start_k + block_k)[None, :]) >= dropout.threshold(p)
        assert torch.equal(got, expected)


@pytest.mark.skipif(not (ON_GPU and torch.cuda.get_device_capability()[0] == 9),
                    reason="the Gluon kernels' keep tiles: sm_90 GPUs")
@pytest.mark.parametrize("transposed", [False, True], ids=["queries-along-rows", "keys-along-rows"])
@pytest.mark.parametrize("cols", [64, 128])
def test_gluon_keep_tiles_equal_the_pytorch_mask(transposed, cols):
    """The Gluon kernels' keep tiles (kernels/gluon/common: Philox in the kernels' own rounds, the
    calls' kept bits traded between lanes into the wgmma accumulator's layout) are bit for bit the
    mask ``dropout.keep_mask`` defines: the forward's (``dropout_zero``: a dropped entry of a tile
    of ones becomes 0) over 64 queries and ``cols`` keys, the dK/dV pass's (``dropout_mark_t``: a
    dropped entry becomes -1) over 64 keys and ``cols`` queries."""
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl

    from fusedattn.kernels.gluon.common import dropout_mark_t, dropout_zero

    @gluon.jit
    def tile(seed_ptr, out, batch_head, first_key, first_row, threshold, COLS: gl.constexpr,
             TRANSPOSED: gl.constexpr):
        s_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                           instr_shape=[16, COLS, 16])
        ones = gl.full([64, COLS], 1.0, gl.float32, layout=s_layout)
        if TRANSPOSED:
            marked = dropout_mark_t(ones, gl.load(seed_ptr), batch_head, first_key, first_row, threshold, s_layout)
        else:
            marked = dropout_zero(ones, gl.load(seed_ptr), batch_head, first_row, first_key, threshold, s_layout)
        r = gl.arange(0, 64, layout=gl.SliceLayout(1, s_layout))
        c = gl.arange(0, COLS, layout=gl.SliceLayout(0, s_layout))
        gl.store(out + gl.expand_dims(r, 1) * COLS + gl.expand_dims(c, 0), marked)

    p, batch_head, first_key, first_row = 0.3, 5, 192, 37
    for seed_value in (0x123456789ABCDEF, 2**62 - 1, 3):
        seed = torch.tensor([seed_value], dtype=torch.int64, device=DEVICE)
        out = torch.zeros(64 * cols, dtype=torch.float32, device=DEVICE)
        tile[(1,)](seed, out, batch_head, first_key, first_row, dropout.threshold(p), cols, transposed, num_warps=4)
        got = out.view(64, cols).cpu()
        queries, keys = (cols, 64) if transposed else (64, cols)
        expected = dropout.random_bytes(seed_value, torch.tensor(batch_head),
                                        torch.arange(first_row, first_row + queries)[:, None],
                                        torch.arange(first_key, first_key + keys)[None, :]) >= dropout.threshold(p)
        if transposed:
            assert torch.equal(got, torch.where(expected.T, 1.0, -1.0))
        else:
            assert torch.equal(got, expected.float())


@pytest.mark.parametrize("p", [0.1, 0.5, 0.9])
def test_kept_fraction_is_binomial(p):
    """Over 2 x 4 x 256 x 256 probabilities the dropped fraction is threshold / 256 within five
    standard deviations, overall and at each of the 16 byte positions of a Philox call; rows,
    heads and seeds get different masks."""
    keep = dropout.keep_mask(11, 2, 4, 256, 256, p)
    drop_rate = dropout.threshold(p) / dropout.LEVELS
    assert abs(drop_rate - p) <= 0.5 / dropout.LEVELS
    n = keep.numel()
    assert abs((~keep).float().mean().item() - drop_rate) < 5 * math.sqrt(drop_rate * (1 - drop_rate) / n)
    per_position = (~keep).view(-1, 16).float().mean(0)
    assert (per_position - drop_rate).abs().max() < 5 * math.sqrt(drop_rate * (1 - drop_rate) / (n / 16))
    assert not torch.equal(keep[0, 0], keep[0, 1]) and not torch.equal(keep[0, 0], keep[1, 0])
    assert not torch.equal(keep[0, 0, 0], keep[0, 0, 1])
    assert not torch.equal(keep, dropout.keep_mask(12, 2, 4, 256, 256, p))


def test_keep_scale_makes_the_expectation_exact():
    for p in (0.0, 0.1, 0.33, 0.9, 0.999):
        kept = 1 - dropout.threshold(p) / dropout.LEVELS
        assert dropout.keep_scale(p) * kept == pytest.approx(1.0)


def test_a_p_just_under_one_keeps_one_byte_value():
    """round(256 p) is 256 from p = 511/512 on: the threshold stops at 255 (the kernels compare
    bytes), so one byte value in 256 is kept and its scale is 256, not a division by zero."""
    assert dropout.threshold(0.998) == 255 and dropout.threshold(0.9999) == 255
    assert dropout.keep_scale(0.9999) == 256.0
    keep = dropout.keep_mask(5, 2, 2, 64, 64, 0.9999)
    assert 0 < keep.sum() < keep.numel() / 64


# ----------------------------------------------------------------------------- calls


def _inputs(batch=2, heads=3, seqlen_q=37, seqlen_k=45, head_dim=32, dtype=torch.float32, seed=0):
    gen = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(batch, s, heads, head_dim, generator=gen).to(DEVICE, dtype).requires_grad_()
               for s in (seqlen_q, seqlen_k, seqlen_k))
    return q, k, v


def _call(backend, q, k, v, rng_seed, **options):
    with fusedattn.use_backend(backend):
        torch.manual_seed(rng_seed)
        return fusedattn.attention(q, k, v, **options)


@pytest.mark.parametrize("backend", BACKENDS)
def test_manual_seed_reproduces_and_each_call_draws_anew(backend):
    q, k, v = _inputs()
    first = _call(backend, q, k, v, 5, dropout_p=0.2, causal=True)
    again = _call(backend, q, k, v, 5, dropout_p=0.2, causal=True)
    assert torch.equal(first, again)
    with fusedattn.use_backend(backend):
        torch.manual_seed(5)
        a = fusedattn.attention(q, k, v, dropout_p=0.2, causal=True)
        b = fusedattn.attention(q, k, v, dropout_p=0.2, causal=True)  # the generator has moved on
    assert torch.equal(a, first) and not torch.equal(a, b)
    plain = _call(backend, q, k, v, 5, causal=True)
    assert not torch.equal(first, plain)


def test_backends_draw_the_same_mask():
    """The mask depends on (seed, batch * Hq + head, row, key) only: the PyTorch backend and the
    kernels drop the same probabilities, so their outputs and gradients agree."""
    q, k, v = _inputs(dtype=torch.float32)
    outs = {}
    for backend in BACKENDS:
        out = _call(backend, q, k, v, 9, dropout_p=0.3, window=(7, 3))
        outs[backend] = (out, *torch.autograd.grad(out, (q, k, v), torch.ones_like(out)))
    for a, b in zip(outs["torch"], outs["triton"]):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)


def test_values_reveal_the_mask():
    """With V the identity (Sk = Dv) the output's entry (i, j) is p_ij * kept_ij * scale: the mask
    read back from the kernel's output is the documented one (where p > 0)."""
    seqlen = 32
    q = torch.randn(1, seqlen, 2, 16, device=DEVICE)
    k = torch.randn(1, seqlen, 2, 16, device=DEVICE)
    v = torch.eye(seqlen, device=DEVICE).view(1, seqlen, 1, seqlen).expand(1, seqlen, 2, seqlen).contiguous()
    for backend in BACKENDS:
        out = _call(backend, q, k, v, 3, dropout_p=0.4)
        torch.manual_seed(3)
        keep = dropout.keep_mask(dropout.draw_seed(DEVICE), 1, 2, seqlen, seqlen, 0.4, DEVICE)
        assert torch.equal(out.transpose(1, 2) != 0, keep)


@pytest.mark.skipif(not ON_GPU, reason="bitwise reproducibility of the GPU kernels' sums")
def test_deterministic_gradients_are_bitwise_identical():
    q, k, v = _inputs(batch=2, heads=4, seqlen_q=300, seqlen_k=300, head_dim=64, dtype=torch.bfloat16)
    runs = []
    for _ in range(2):
        out = _call("triton", q, k, v, 21, dropout_p=0.1, causal=True, deterministic=True)
        runs.append((out, *torch.autograd.grad(out, (q, k, v), torch.ones_like(out))))
    for a, b in zip(*runs):
        assert torch.equal(a, b)


@pytest.mark.parametrize("backend", BACKENDS)
def test_varlen_sequence_s_is_batch_s_of_the_mask(backend):
    """varlen_attention with dropout: each sequence against the float64 reference with its rows of
    the call's mask (batch index = the sequence's), causal and GQA, empty and one-token sequences."""
    lengths_q, lengths_k = [9, 0, 1, 23], [9, 4, 1, 30]
    heads_q, heads_kv, dim, p = 4, 2, 32, 0.25
    gen = torch.Generator().manual_seed(4)
    dtype = torch.float16
    q = torch.randn(sum(lengths_q), heads_q, dim, generator=gen).to(DEVICE, dtype).requires_grad_()
    k = torch.randn(sum(lengths_k), heads_kv, dim, generator=gen).to(DEVICE, dtype).requires_grad_()
    v = torch.randn(sum(lengths_k), heads_kv, dim, generator=gen).to(DEVICE, dtype).requires_grad_()
    dout = torch.randn(q.shape, generator=gen).to(DEVICE, dtype)
    cu_q = torch.tensor([0, *torch.tensor(lengths_q).cumsum(0).tolist()], dtype=torch.int32, device=DEVICE)
    cu_k = torch.tensor([0, *torch.tensor(lengths_k).cumsum(0).tolist()], dtype=torch.int32, device=DEVICE)
    with fusedattn.use_backend(backend):
        torch.manual_seed(8)
        out = fusedattn.varlen_attention(q, k, v, cu_q, cu_k, max(lengths_q), max(lengths_k), causal=True, dropout_p=p)
    grads = torch.autograd.grad(out, (q, k, v), dout)
    torch.manual_seed(8)
    seed = dropout.draw_seed(DEVICE)

    def reference(dtype_):
        leaves = [t.detach().to(dtype_).requires_grad_() for t in (q, k, v)]
        outs = []
        q0 = k0 = 0
        for s, (lq, lk) in enumerate(zip(lengths_q, lengths_k)):
            keep = dropout.keep_mask(seed, 1, heads_q, lq, lk, p, DEVICE, batch_start=s)
            outs.append(reference_attention(leaves[0][None, q0:q0 + lq], leaves[1][None, k0:k0 + lk],
                                            leaves[2][None, k0:k0 + lk], causal=True, dropout_keep=keep,
                                            dropout_p=p)[0])
            q0, k0 = q0 + lq, k0 + lk
        o = torch.cat(outs)
        return (o, *torch.autograd.grad(o, leaves, dout.to(dtype_)))

    ref64, lowp = reference(torch.float64), reference(dtype)
    for name, ours, low, ref in zip(("out", "dq", "dk", "dv"), (out, *grads), lowp, ref64):
        assert_close_to_reference(f"varlen dropout {backend} {name}", ours, low, ref)


def _check_create_graph_matches(out, q, k, v) -> None:
    """A ``create_graph`` backward of ``out`` (the recomputed plain-torch forward, with the call's
    seed) gives the fused backward's gradients, and they are differentiable."""
    plain = torch.autograd.grad(out.square().sum(), (q, k, v), retain_graph=True)
    graph = torch.autograd.grad(out.square().sum(), (q, k, v), create_graph=True)
    for a, b in zip(plain, graph):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)
    graph[0].sum().backward()
    assert q.grad is not None


def test_varlen_double_backward_and_forward_ad_regenerate_the_mask():
    """create_graph=True and forward-mode AD on varlen_attention with dropout: the per-sequence plain-torch
    form (sequence s as batch s of the call's mask) gives the fused backward's gradients and the
    fused forward's output."""
    gen = torch.Generator().manual_seed(6)
    q, k, v = (torch.randn(8, 2, 16, generator=gen).to(DEVICE).requires_grad_() for _ in range(3))
    cu = torch.tensor([0, 3, 8], dtype=torch.int32, device=DEVICE)
    torch.manual_seed(5)
    out = fusedattn.varlen_attention(q, k, v, cu, cu, 5, 5, dropout_p=0.3, causal=True)
    _check_create_graph_matches(out, q, k, v)
    import torch.autograd.forward_ad as fwAD
    tangent = torch.randn(q.shape, generator=gen).to(DEVICE)
    with fwAD.dual_level():
        torch.manual_seed(5)
        dual = fusedattn.varlen_attention(fwAD.make_dual(q.detach(), tangent), k.detach(), v.detach(), cu, cu, 5, 5,
                                          dropout_p=0.3, causal=True)
        primal, jvp = fwAD.unpack_dual(dual)
    torch.testing.assert_close(primal, out.detach(), rtol=1e-4, atol=1e-5)
    torch.manual_seed(5)
    seed = dropout.draw_seed(DEVICE)
    with fwAD.dual_level():  # the same tangent through the float64 reference, each sequence with its mask rows
        q64 = fwAD.make_dual(q.detach().double(), tangent.double())
        parts = []
        for s, (a, b) in enumerate(((0, 3), (3, 8))):
            keep = dropout.keep_mask(seed, 1, 2, b - a, b - a, 0.3, DEVICE, batch_start=s)
            parts.append(reference_attention(q64[None, a:b], k.detach().double()[None, a:b],
                                             v.detach().double()[None, a:b], causal=True, dropout_keep=keep,
                                             dropout_p=0.3)[0])
        want = fwAD.unpack_dual(torch.cat(parts)).tangent
    torch.testing.assert_close(jvp.double(), want, rtol=1e-4, atol=1e-5)


def test_double_backward_regenerates_the_mask():
    """create_graph=True on attention: the recomputed forward (plain torch ops) uses the call's seed,
    so the first-order gradients equal the fused backward's."""
    q, k, v = _inputs(dtype=torch.float32)
    out = _call("torch", q, k, v, 2, dropout_p=0.3, causal=True)
    _check_create_graph_matches(out, q, k, v)


@pytest.mark.parametrize("bad,error", [(1.0, ValueError), (-0.1, ValueError), ("0.1", TypeError), (True, TypeError)])
def test_bad_dropout_p_is_refused(bad, error):
    q, k, v = _inputs()
    with pytest.raises(error, match="dropout_p"):
        fusedattn.attention(q, k, v, dropout_p=bad)


def test_torch_compile_regenerates_the_mask_in_the_backward():
    """Compiled (fullgraph): the seed is drawn inside the graph; the gradients are those of the
    output's own mask, read back through an identity V."""
    seqlen = 32
    q = torch.randn(1, seqlen, 2, 16, device=DEVICE, requires_grad=True)
    k = torch.randn(1, seqlen, 2, 16, device=DEVICE, requires_grad=True)
    v = torch.eye(seqlen, device=DEVICE).view(1, seqlen, 1, seqlen).expand(1, seqlen, 2, seqlen).contiguous()
    v.requires_grad_()
    compiled = torch.compile(lambda q, k, v: fusedattn.attention(q, k, v, dropout_p=0.3), fullgraph=True,
                             backend="aot_eager")
    out = compiled(q, k, v)
    keep = out.detach().transpose(1, 2) != 0
    dout = torch.randn(out.shape, device=DEVICE)
    grads = torch.autograd.grad(out, (q, k, v), dout)
    leaves = [t.detach().double().requires_grad_() for t in (q, k, v)]
    ref = reference_attention(*leaves, dropout_keep=keep, dropout_p=0.3)
    torch.testing.assert_close(out.double(), ref, rtol=1e-4, atol=1e-5)
    for ours, theirs in zip(grads, torch.autograd.grad(ref, leaves, dout.double())):
        torch.testing.assert_close(ours.double(), theirs, rtol=1e-4, atol=1e-5)


@pytest.mark.skipif(not ON_GPU, reason="CUDA graphs")
def test_cuda_graph_replays_draw_new_masks():
    """A captured forward+backward: each replay draws a new seed (torch's graph-safe generator
    advances its offset per replay), and each replay's gradients are those of its own mask."""
    seqlen = 64
    q = torch.randn(1, seqlen, 2, 16, device="cuda", requires_grad=True)
    k = torch.randn(1, seqlen, 2, 16, device="cuda", requires_grad=True)
    v = torch.eye(seqlen, device="cuda").view(1, seqlen, 1, seqlen).expand(1, seqlen, 2, seqlen).contiguous()
    v.requires_grad_()
    dout = torch.randn(1, seqlen, 2, seqlen, device="cuda")

    def step():
        out = fusedattn.attention(q, k, v, dropout_p=0.3)
        return (out, *torch.autograd.grad(out, (q, k), dout))

    graph, captured = capture_graph(step)
    results = []
    for _ in range(2):
        graph.replay()
        torch.cuda.synchronize()
        results.append([t.clone() for t in captured])
    keeps = [r[0].transpose(1, 2) != 0 for r in results]
    assert not torch.equal(keeps[0], keeps[1])
    for (out, dq, dk), keep in zip(results, keeps):
        leaves = [t.detach().double().requires_grad_() for t in (q, k)]
        ref = reference_attention(*leaves, v.detach().double(), dropout_keep=keep, dropout_p=0.3)
        torch.testing.assert_close(out.double(), ref, rtol=1e-4, atol=1e-5)
        for ours, theirs in zip((dq, dk), torch.autograd.grad(ref, leaves, dout.double())):
            torch.testing.assert_close(ours.double(), theirs, rtol=1e-4, atol=1e-5)


def test_gluon_and_fused_cpu_kernels_refuse_dropout_in_explain():
    q, k, v = _inputs(dtype=torch.bfloat16 if ON_GPU else torch.float32, head_dim=128)
    plans = fusedattn.explain(q, k, v, dropout_p=0.1, show=False)
    text = str(plans)
    if ON_GPU and torch.cuda.get_device_capability()[0] == 9:
        # the warp-specialised Gluon forward and the Gluon dK/dV pass take dropout
        assert {step.name: step for step in plans.forward}["forward"].kernel.startswith("Gluon forward, warp"), text
        assert {step.name: step for step in plans.backward}["dK/dV"].kernel.startswith("Gluon"), text
    with fusedattn.use_backend("torch"):
        from fusedattn import cpu
        spec = fusedattn.spec.resolve_spec(32, layout="bshd", causal=False, window=None, scale=None, softcap=None,
                                           deterministic=False, dropout_p=0.1)
        assert not cpu.uses_fused_kernel(spec, None, None)


def test_the_planner_gives_dropout_to_the_gluon_kernels_without_mask_bias_or_packing():
    """The Gluon dK/dV pass takes dropout without a mask, bias or packed sequences
    (dispatch.gluon_dkdv_takes_dropout), the Gluon forward on its warp-specialised kernel without a
    mask or bias (gluon_forward_takes_dropout, on the ALiBi form's config), the Gluon dQ pass as well."""
    import types

    from fusedattn import dispatch
    from fusedattn.spec import UNBOUNDED, AttentionSpec
    from fusedattn.tuning.configs import KernelConfig

    causal = AttentionSpec("bshd", UNBOUNDED, 0, 0.25, 0.0, False, dropout_p=0.1)
    plain = AttentionSpec("bshd", UNBOUNDED, 0, 0.25, 0.0, False)
    assert dispatch.gluon_dkdv_takes_dropout(causal, None, None, None)
    for mask, bias, packing in ((object(), None, None), (None, object(), None), (None, None, object())):
        assert not dispatch.gluon_dkdv_takes_dropout(causal, mask, bias, packing)
    assert not dispatch.gluon_dkdv_takes_dropout(plain, None, None, None)
    cuda = types.SimpleNamespace(is_cuda=True)
    refusal = dispatch.gluon_support(cuda, None, None, causal)  # a pass without dropout
    assert not refusal and "without a mask, bias or packing" in refusal.reason
    eight_warps = KernelConfig(128, 128, 8, 2, True, 1)
    assert dispatch.gluon_forward_takes_dropout(KernelConfig(192, 128, 4, 2, True, 0, 3, 1), None, None)
    for config, mask, bias in ((eight_warps, None, None), (KernelConfig(192, 128, 4, 2, True, 0, 3, 1), object(), None)):
        assert not dispatch.gluon_forward_takes_dropout(config, mask, bias)
    ws3 = KernelConfig(192, 128, 4, 2, True, 0, 3, 1)
    assert dispatch.takes_gluon_dq(ws3, causal, None, None, None)  # the dQ pass takes dropout too
    assert not dispatch.takes_gluon_dq(ws3, causal, object(), None, None)
