"""chunk=C (chunked local attention, SPEC 3.10) beyond the case grid (tests/cases.py runs it against
the float64 reference on both backends): the rule written out independently of ``spec.keep_mask``,
rows at negative aligned positions, C >= Sk equal to no chunk, the torch.compile path (the custom ops
carry the chunk), and the routing (the Gluon kernels and torch's fused CPU kernel decline it, and
``explain`` says so)."""

import types

import pytest
import torch

import fusedattn
from fusedattn import dispatch
from fusedattn.reference import reference_attention
from fusedattn.spec import UNBOUNDED, AttentionSpec, keep_mask

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _qkv(sq, sk, heads=2, d=16, dtype=torch.float32, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(1, s, heads, d, generator=gen).to(DEVICE, dtype) for s in (sq, sk, sk)]


@pytest.mark.parametrize("sq,sk,chunk", [(12, 12, 4), (12, 20, 8), (20, 12, 8), (7, 7, 3), (9, 5, 2)])
def test_keep_rule_written_out(sq, sk, chunk):
    """Llama 4's rule on aligned positions, element by element: query i (aligned position
    p = i + Sk - Sq) keeps key j iff p >= 0 and p // C == j // C (Python's floor division)."""
    expected = torch.tensor([[i + sk - sq >= 0 and (i + sk - sq) // chunk == j // chunk for j in range(sk)]
                             for i in range(sq)])
    assert torch.equal(keep_mask(sq, sk, UNBOUNDED, UNBOUNDED, chunk=chunk), expected)


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_rows_before_the_keys_see_nothing(backend):
    """Sq > Sk: rows at negative aligned positions lie in no key's chunk: output 0, lse -inf (as
    causal gives them), even with a chunk longer than everything."""
    q, k, v = _qkv(9, 5)
    with fusedattn.use_backend(backend):
        out, lse = fusedattn.attention(q, k, v, chunk=100, return_lse=True)
        plain_out, plain_lse = fusedattn.attention(q, k, v, return_lse=True)
    assert torch.all(out[:, :4] == 0) and torch.all(lse[..., :4] == float("-inf"))
    torch.testing.assert_close(out[:, 4:], plain_out[:, 4:])
    torch.testing.assert_close(lse[..., 4:], plain_lse[..., 4:])


@pytest.mark.parametrize("backend", ["torch", "triton"])
@pytest.mark.parametrize("causal", [False, True])
def test_chunk_of_all_keys_is_no_chunk(backend, causal):
    """Sq <= Sk and C >= Sk: every pair in chunk 0, the same result as no chunk."""
    q, k, v = _qkv(7, 19)
    with fusedattn.use_backend(backend):
        ours = fusedattn.attention(q, k, v, causal=causal, chunk=19, return_lse=True)
        longer = fusedattn.attention(q, k, v, causal=causal, chunk=1 << 40, return_lse=True)
        plain = fusedattn.attention(q, k, v, causal=causal, return_lse=True)
    for a, b, c in zip(ours, longer, plain):
        torch.testing.assert_close(a, c)
        torch.testing.assert_close(b, c)


def test_chunk_changes_the_result():
    """A chunk that cuts the keys changes the output (the option is not ignored anywhere)."""
    q, k, v = _qkv(16, 16)
    for backend in ("torch", "triton"):
        with fusedattn.use_backend(backend):
            out = fusedattn.attention(q, k, v, chunk=4)
        plain = fusedattn.attention(q, k, v)
        assert (out - plain).abs().max() > 1e-2, backend
        expected = reference_attention(*(t.double() for t in (q, k, v)), chunk=4)
        torch.testing.assert_close(out.double(), expected, atol=1e-5, rtol=1e-5)


def test_compiled_call_carries_the_chunk():
    q, k, v = (t.requires_grad_() for t in _qkv(13, 13))
    compiled = torch.compile(lambda a, b, c: fusedattn.attention(a, b, c, chunk=5, causal=True), fullgraph=True)
    with fusedattn.use_backend("torch"):
        out = compiled(q, k, v)
    out.sum().backward()
    grads = [t.grad.clone() for t in (q, k, v)]
    leaves = [t.detach().double().requires_grad_() for t in (q, k, v)]
    expected = reference_attention(*leaves, chunk=5, causal=True)
    expected.sum().backward()
    torch.testing.assert_close(out.double(), expected, atol=1e-5, rtol=1e-5)
    for got, leaf in zip(grads, leaves):
        torch.testing.assert_close(got.double(), leaf.grad, atol=1e-5, rtol=1e-5)


def test_double_backward_through_chunk():
    """create_graph=True recomputes through cpu.chunked_forward, which applies the chunk too."""
    q, k, v = (t.double().requires_grad_() for t in _qkv(11, 11, dtype=torch.float32))
    qf, kf, vf = (t.detach().float().requires_grad_() for t in (q, k, v))
    out = fusedattn.attention(qf, kf, vf, chunk=4)
    (gq,) = torch.autograd.grad(out.square().sum(), qf, create_graph=True)
    (hq,) = torch.autograd.grad(gq.sum(), kf)
    ref = reference_attention(q, k, v, chunk=4)
    (rgq,) = torch.autograd.grad(ref.square().sum(), q, create_graph=True)
    (rhq,) = torch.autograd.grad(rgq.sum(), k)
    torch.testing.assert_close(hq.double(), rhq, atol=1e-4, rtol=1e-4)


def test_gluon_kernels_and_torch_fused_kernel_decline_chunk():
    spec = AttentionSpec("bshd", UNBOUNDED, 0, 0.25, 0.0, False, chunk=8)
    support = dispatch.gluon_support(types.SimpleNamespace(is_cuda=True), None, None, spec)
    assert not support and "chunk" in support.reason
    q, k, v = torch.randn(1, 9, 2, 16), torch.randn(1, 9, 2, 16), torch.randn(1, 9, 2, 16)
    with fusedattn.use_backend("torch"):
        plan = fusedattn.explain(q, k, v, chunk=4, show=False)
    assert "ALiBi or chunk: torch" in str(plan)
