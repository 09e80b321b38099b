"""ALiBi (``alibi_slopes``, SPEC 10) beyond the grid of cases.py: what the option means, against an
explicit bias; the two slope shapes; no gradient for the slopes; torch.compile; the routing (the Gluon
kernels decline it but for the causal forward and dK/dV pass -- tests/test_hopper_forward.py,
tests/test_hopper_backward.py -- and torch's fused CPU
kernel declines it, and ``explain`` says so)."""

import types
from dataclasses import replace

import pytest
import torch

import fusedattn
from attention_runner import forward_backward, make_inputs
from cases import Case
from fusedattn import dispatch
from fusedattn.reference import reference_attention
from fusedattn.spec import AttentionSpec, UNBOUNDED
from numerics import assert_close_to_reference

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"  # the Triton kernels: the GPU, else the interpreter
BACKENDS = ["torch", "triton"]


def alibi_as_bias(slopes: torch.Tensor, batch: int, heads: int, seqlen_q: int, seqlen_k: int) -> torch.Tensor:
    """FlashAttention 2's ALiBi written out: -slope[b, h] * |i + Sk - Sq - j|, a (B, H, Sq, Sk) bias."""
    i = torch.arange(seqlen_q, device=slopes.device)[:, None]
    j = torch.arange(seqlen_k, device=slopes.device)[None, :]
    distance = (i + seqlen_k - seqlen_q - j).abs().float()
    return -slopes.expand(batch, heads)[:, :, None, None] * distance


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("seqlen_q,seqlen_k,options", [(19, 40, dict(causal=True)), (40, 19, dict(window=(7, 3))),
                                                       (23, 23, dict(softcap=3.0))], ids=["causal", "window", "cap"])
def test_alibi_is_the_bias_it_stands_for(backend, seqlen_q, seqlen_k, options):
    """Slopes give what the written-out bias gives (bottom-right aligned, after softcap)."""
    torch.manual_seed(0)
    q = torch.randn(2, seqlen_q, 4, 16, device=DEVICE)
    k, v = torch.randn(2, seqlen_k, 2, 16, device=DEVICE), torch.randn(2, seqlen_k, 2, 16, device=DEVICE)
    slopes = 0.05 + torch.rand(2, 4, device=DEVICE)
    with fusedattn.use_backend(backend):
        out, lse = fusedattn.attention(q, k, v, alibi_slopes=slopes, return_lse=True, **options)
        out_b, lse_b = fusedattn.attention(q, k, v, bias=alibi_as_bias(slopes, 2, 4, seqlen_q, seqlen_k),
                                           return_lse=True, **options)
    torch.testing.assert_close(out, out_b, atol=2e-5, rtol=1e-5)
    torch.testing.assert_close(lse, lse_b, atol=2e-5, rtol=1e-5)
    # and it changes the result: slopes of 0 are no ALiBi
    with fusedattn.use_backend(backend):
        plain = fusedattn.attention(q, k, v, **options)
        zero = fusedattn.attention(q, k, v, alibi_slopes=torch.zeros(4, device=DEVICE), **options)
    torch.testing.assert_close(zero, plain, atol=2e-6, rtol=1e-5)
    assert (out - plain).abs().max() > 1e-2


@pytest.mark.parametrize("backend", BACKENDS)
def test_per_head_slopes_are_per_batch_slopes_repeated(backend):
    torch.manual_seed(1)
    q, k, v = (torch.randn(3, s, 2, 16, device=DEVICE) for s in (17, 29, 29))
    slopes = torch.tensor([0.25, 0.0625], device=DEVICE)
    with fusedattn.use_backend(backend):
        a = fusedattn.attention(q, k, v, causal=True, alibi_slopes=slopes)
        b = fusedattn.attention(q, k, v, causal=True, alibi_slopes=slopes.expand(3, 2).clone())
    assert torch.equal(a, b)


@pytest.mark.parametrize("backend", BACKENDS)
def test_slopes_get_no_gradient(backend):
    """The slopes are constants (as in FlashAttention): a slopes tensor that requires grad gets none, the
    inputs' gradients are right, and slopes alone requiring grad build no graph."""
    torch.manual_seed(2)
    q, k, v = (torch.randn(1, 13, 2, 16, device=DEVICE, requires_grad=True) for _ in range(3))
    slopes = torch.tensor([0.3, 0.1], device=DEVICE, requires_grad=True)
    with fusedattn.use_backend(backend):
        out = fusedattn.attention(q, k, v, causal=True, alibi_slopes=slopes)
        out.sum().backward()
        assert slopes.grad is None
        assert not fusedattn.attention(q.detach(), k.detach(), v.detach(), alibi_slopes=slopes).requires_grad
    ref = reference_attention(q, k, v, causal=True, alibi_slopes=slopes.detach())
    grads = torch.autograd.grad(ref.sum(), (q, k, v))
    for got, want in zip((q.grad, k.grad, v.grad), grads):
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-4)


@pytest.mark.parametrize("backend", BACKENDS)
def test_compiled_attention_with_alibi_matches_reference(backend):
    case = Case(heads_q=4, heads_kv=2, seqlen_q=19, seqlen_k=26, head_dim=16, window=(5, 2), dtype=torch.float32,
                bias="heads")
    q, k, v, dout, dlse = make_inputs(case, DEVICE)
    slopes = torch.tensor([[0.5, 0.25, 0.125, 0.0625]], device=DEVICE)
    bias = torch.randn(1, 4, 19, 26, device=DEVICE)
    torch._dynamo.reset()
    with fusedattn.use_backend(backend):
        compiled = torch.compile(
            lambda a, b, c, bias_=None: fusedattn.attention(a, b, c, bias=bias_, alibi_slopes=slopes, return_lse=True,
                                                             **case.options()), fullgraph=True)
        got = forward_backward(compiled, q, k, v, dout, dlse, lse_grad=True, bias=bias)

    def reference(a, b, c, bias_=None):
        return reference_attention(a, b, c, bias=bias_, alibi_slopes=slopes, return_lse=True, **case.options())

    lowp = forward_backward(reference, q, k, v, dout, dlse, lse_grad=True, bias=bias)
    ref64 = forward_backward(reference, q, k, v, dout, dlse, dtype=torch.float64, lse_grad=True, bias=bias)
    for name, a, b, c in zip(["out", "lse", "dq", "dk", "dv", "dbias"], got, lowp, ref64):
        assert_close_to_reference(name, a, b, c)


def test_double_backward_with_alibi_matches_reference():
    """create_graph=True recomputes through cpu.chunked_forward, which takes the slopes too."""
    torch.manual_seed(3)
    q, k, v = (torch.randn(1, 11, 2, 8, dtype=torch.float64, requires_grad=True) for _ in range(3))
    slopes = torch.tensor([0.4, 0.2])

    def penalty(fn, **extra):
        (dq,) = torch.autograd.grad(fn(q, k, v, causal=True, alibi_slopes=slopes, **extra).square().sum(), q,
                                    create_graph=True)
        return torch.autograd.grad(dq.square().sum(), (q, k, v))

    with fusedattn.use_backend("torch"):
        ours = penalty(lambda *a, **kw: fusedattn.attention(*(t.float() for t in a), **kw).double())
    want = penalty(reference_attention)
    for got, ref in zip(ours, want):
        torch.testing.assert_close(got, ref, atol=1e-3, rtol=1e-3)


def test_gluon_kernels_and_torch_fused_kernel_decline_alibi():
    spec = AttentionSpec("bshd", UNBOUNDED, 0, 0.25, 0.0, False, alibi=True)
    support = dispatch.gluon_support(types.SimpleNamespace(is_cuda=True), None, None, spec)
    assert not support and "alibi_slopes" in support.reason
    q, k, v = torch.randn(1, 9, 2, 16), torch.randn(1, 9, 2, 16), torch.randn(1, 9, 2, 16)
    with fusedattn.use_backend("torch"):
        plan = fusedattn.explain(q, k, v, alibi_slopes=torch.ones(2), show=False)
        plain = fusedattn.explain(q, k, v, show=False)
    assert "ALiBi" in str(plan) and "chunks of keys" in str(plan)
    assert "fused CPU attention kernel" in str(plain)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="a long sequence: the GPU kernels")
@pytest.mark.parametrize("causal", [True, False])
def test_long_rows_keep_their_precision(causal):
    """S = 4096 with slopes up to 0.5: the causal kernels' key-term form keeps its numbers small near
    the diagonal (where the row maxima are) whatever the position; outputs, lse and gradients
    against float64 within the rule (bf16)."""
    case = Case(batch=1, heads_q=4, heads_kv=2, seqlen_q=4096, seqlen_k=4096, head_dim=64, causal=causal,
                alibi="heads", lse_grad=True, dtype=torch.bfloat16)
    q, k, v, dout, dlse = make_inputs(case, DEVICE)
    slopes = torch.tensor([0.5, 0.25, 0.0625, 2.0 ** -8], device=DEVICE)

    def ours(q_, k_, v_):
        return fusedattn.attention(q_, k_, v_, causal=causal, alibi_slopes=slopes, return_lse=True)

    def reference(q_, k_, v_):
        return reference_attention(q_, k_, v_, causal=causal, alibi_slopes=slopes, return_lse=True)

    got = forward_backward(ours, q, k, v, dout, dlse, lse_grad=True)
    lowp = forward_backward(reference, q, k, v, dout, dlse, lse_grad=True)
    ref64 = forward_backward(reference, q, k, v, dout, dlse, dtype=torch.float64, lse_grad=True)
    for name, a, b, c in zip(("out", "lse", "dq", "dk", "dv"), got, lowp, ref64):
        assert_close_to_reference(f"alibi S=4096 causal={causal} {name}", a, b, c)


def test_the_planner_gives_the_gluon_forward_causal_alibi_only():
    """The rule behind the Gluon forward's ALiBi (dispatch.gluon_forward_takes_alibi): causal, the
    warp-specialised kernel, no mask or bias; above D=64 two consumer warpgroups taking turns. The
    Gluon dK/dV pass takes the same causal form (gluon_dkdv_takes_alibi); the Gluon dQ pass has no
    ALiBi term (takes_gluon_dq)."""
    from fusedattn.tuning.configs import KernelConfig

    causal = AttentionSpec("bshd", UNBOUNDED, 0, 0.25, 0.0, False, alibi=True)
    full = AttentionSpec("bshd", UNBOUNDED, UNBOUNDED, 0.25, 0.0, False, alibi=True)
    ws3 = KernelConfig(192, 128, 4, 2, True, 0, 3, 1)
    eight_warps = KernelConfig(128, 128, 8, 2, True, 1)
    assert dispatch.gluon_forward_takes_alibi(causal, ws3, None, None)
    for spec, config, mask, why in ((full, ws3, None, "without causal"), (causal, eight_warps, None, "8-warp"),
                                    (causal, ws3, object(), "mask or bias")):
        support = dispatch.gluon_forward_takes_alibi(spec, config, mask, None)
        assert not support and why in support.reason
    two = dispatch.gluon_alibi_forward(ws3, 128)
    assert (two.hopper_split, two.hopper_pingpong, two.block_m) == (2, 1, 128)
    assert dispatch.gluon_alibi_forward(ws3, 64) == ws3
    cuda = types.SimpleNamespace(is_cuda=True)
    assert not dispatch.gluon_support(cuda, None, None, causal)  # a pass without ALiBi's form
    assert dispatch.gluon_dkdv_takes_alibi(causal, None, None, None)
    assert not dispatch.gluon_dkdv_takes_alibi(full, None, None, None)
    assert not dispatch.gluon_dkdv_takes_alibi(causal, object(), None, None)
    assert not dispatch.takes_gluon_dq(ws3, causal, None, None, None)
    assert dispatch.takes_gluon_dq(ws3, replace(causal, alibi=False), None, None, None)
