"""Autograd beyond one backward: double backward (``create_graph=True``), forward-mode AD and the
``torch.func`` transforms, on every backend of ``attention``, ``varlen_attention`` and
``merge_attention`` -- each checked against the float64 reference under the same transform (SPEC 4's
rule) -- and a clear error from the forward-only ``kvcache_attention``.

The fused kernels are opaque to autograd: their backward is not differentiable and they carry no
tangent or batching rule, so these modes must run plain torch ops (``cpu.chunked_forward``) and never
return a silently wrong or missing derivative."""

from __future__ import annotations

import pytest
import torch
import torch.autograd.forward_ad as fwAD

import fusedattn
from fusedattn.reference import reference_attention
from numerics import assert_close_to_reference

BACKENDS = ["torch", "triton"]  # "triton": the kernels under the interpreter on the CPU, the GPU's kernels on CUDA
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
DTYPE = torch.float32 if DEVICE == "cpu" else torch.bfloat16

# (B, Hq, Hkv, Sq, Sk, D, options): the features a derivative must carry, on odd lengths.
FEATURES = [
    (1, 2, 2, 9, 9, 16, dict(causal=True)),
    (2, 4, 2, 11, 17, 16, dict(window=(5, 2), softcap=3.0)),
    (1, 4, 1, 13, 7, 24, dict(causal=True, sinks=True)),
    (1, 2, 2, 10, 12, 16, dict(bias=True, mask=True)),
]
FEATURE_IDS = ["causal", "gqa-window-softcap", "mqa-causal-sinks", "bias-mask"]


def _extras(hq, sq, sk, options, gen):
    """The case's tensors beyond q, k, v: sinks (Hq,), a (1, Hq, Sq, Sk) bias, a (Sq, Sk) mask."""
    options = dict(options)
    extras = {}
    if options.pop("sinks", False):
        extras["sinks"] = torch.randn(hq, generator=gen, dtype=torch.float64)
    if options.pop("bias", False):
        extras["bias"] = torch.randn(1, hq, sq, sk, generator=gen, dtype=torch.float64)
    if options.pop("mask", False):
        mask = torch.rand(sq, sk, generator=gen) < 0.7
        mask[1] = False  # a row with no key
        options["mask"] = mask.to(DEVICE)
    return options, extras


def _attention(backend):
    def run(q, k, v, **kwargs):
        with fusedattn.use_backend(backend):
            return fusedattn.attention(q, k, v, return_lse=True, **kwargs)
    return run


def _reference(q, k, v, mask=None, **kwargs):
    mask4 = None if mask is None else mask.reshape(1, 1, *mask.shape)
    return reference_attention(q, k, v, return_lse=True, mask=mask4, **kwargs)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("case", FEATURES, ids=FEATURE_IDS)
def test_double_backward_matches_reference(backend, case):
    b, hq, hkv, sq, sk, d, options = case
    gen = torch.Generator().manual_seed(sq * 31 + sk)
    options, extras = _extras(hq, sq, sk, options, gen)
    # q from the first Sq rows, k and v from the first Sk rows of one projection x @ W
    x = torch.randn(b, max(sq, sk), 12, generator=gen, dtype=torch.float64)
    weight = 0.4 * torch.randn(12, (hq + 2 * hkv) * d, generator=gen, dtype=torch.float64)

    def chain(fn, dtype):
        xx = x.to(DEVICE, dtype).requires_grad_()
        ww = weight.to(DEVICE, dtype).requires_grad_()
        extra = {name: t.to(DEVICE, dtype).requires_grad_() for name, t in extras.items()}
        proj = xx @ ww
        q = proj[:, :sq, :hq * d].reshape(b, sq, hq, d)
        k = proj[:, :sk, hq * d:(hq + hkv) * d].reshape(b, sk, hkv, d)
        v = proj[:, :sk, (hq + hkv) * d:].reshape(b, sk, hkv, d)
        out, lse = fn(q, k, v, **options, **extra)
        finite_lse = torch.where(torch.isfinite(lse), lse, torch.zeros_like(lse))
        loss = out.float().square().sum() + finite_lse.float().sin().sum()
        leaves = [xx, *extra.values()]
        first = torch.autograd.grad(loss, leaves, create_graph=True)
        penalty = sum(g.float().square().sum() for g in first)
        return torch.autograd.grad(penalty, [ww, *extra.values()])

    got = chain(_attention(backend), DTYPE)
    lowp = chain(_reference, DTYPE)
    ref64 = chain(_reference, torch.float64)
    for name, a, l, r in zip(["dW", *extras], got, lowp, ref64):
        assert_close_to_reference(f"second order {name}", a, l, r)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("case", FEATURES, ids=FEATURE_IDS)
def test_forward_mode_ad_matches_reference(backend, case):
    """The tangent of (out, lse) under forward-mode AD (dual tensors and torch.func.jvp)."""
    b, hq, hkv, sq, sk, d, options = case
    gen = torch.Generator().manual_seed(7 * sq + sk)
    options, extras = _extras(hq, sq, sk, options, gen)
    primals = [torch.randn(b, sq, hq, d, generator=gen, dtype=torch.float64),
               torch.randn(b, sk, hkv, d, generator=gen, dtype=torch.float64),
               torch.randn(b, sk, hkv, d, generator=gen, dtype=torch.float64), *extras.values()]
    tangents = [torch.randn(p.shape, generator=gen, dtype=torch.float64) for p in primals]
    names = ["q", "k", "v", *extras]

    def call(fn, *tensors):
        out, lse = fn(*tensors[:3], **options, **dict(zip(names[3:], tensors[3:])))
        return out, torch.where(torch.isfinite(lse), lse, torch.zeros_like(lse))

    def jvp(fn, dtype):
        cast = [t.to(DEVICE, dtype) for t in primals]
        return torch.func.jvp(lambda *ts: call(fn, *ts), tuple(cast), tuple(t.to(DEVICE, dtype) for t in tangents))[1]

    def dual(fn, dtype):
        with fwAD.dual_level():
            duals = [fwAD.make_dual(p.to(DEVICE, dtype), t.to(DEVICE, dtype)) for p, t in zip(primals, tangents)]
            outputs = call(fn, *duals)
            found = [fwAD.unpack_dual(o).tangent for o in outputs]
        assert all(t is not None for t in found), "forward-mode AD lost the tangent"
        return found

    ref64, lowp = jvp(_reference, torch.float64), jvp(_reference, DTYPE)
    for way in (jvp, dual):
        got = way(_attention(backend), DTYPE)
        for name, a, l, r in zip(["d out", "d lse"], got, lowp, ref64):
            assert_close_to_reference(f"{way.__name__} {name}", a, l, r)


@pytest.mark.parametrize("backend", BACKENDS)
def test_func_grad_and_vmap_match_reference(backend):
    """torch.func.grad of a loss, and torch.func.vmap over a stack of problems (GQA, causal, sinks)."""
    gen = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(3, 1, 11, h, 16, generator=gen, dtype=torch.float64) for h in (4, 2, 2))
    k, v = k[:, :, :9], v[:, :, :9]
    sinks = torch.randn(4, generator=gen, dtype=torch.float64)

    def loss(fn, q_, k_, v_):
        out, lse = fn(q_, k_, v_, causal=True, sinks=sinks.to(q_.device, q_.dtype))
        return out.square().sum() + lse.sum()

    def per_problem(fn, dtype):
        args = [t.to(DEVICE, dtype) for t in (q, k, v)]
        grads = torch.func.vmap(torch.func.grad(lambda a, b_, c: loss(fn, a, b_, c), argnums=(0, 1, 2)))(*args)
        outs = torch.func.vmap(lambda a, b_, c: fn(a, b_, c, causal=True, sinks=sinks.to(DEVICE, dtype))[0])(*args)
        return (outs, *grads)

    got, lowp, ref64 = per_problem(_attention(backend), DTYPE), per_problem(_reference, DTYPE), \
        per_problem(_reference, torch.float64)
    for name, a, l, r in zip(["out", "dq", "dk", "dv"], got, lowp, ref64):
        assert_close_to_reference(f"vmap(grad) {name}", a, l, r)


def _packed(gen, dtype, lengths_q=(5, 0, 9), lengths_k=(7, 3, 9), heads=(4, 2), d=16):
    cu_q = torch.tensor([0, *torch.tensor(lengths_q).cumsum(0).tolist()], dtype=torch.int32)
    cu_k = torch.tensor([0, *torch.tensor(lengths_k).cumsum(0).tolist()], dtype=torch.int32)
    q = torch.randn(sum(lengths_q), heads[0], d, generator=gen, dtype=torch.float64)
    k, v = (torch.randn(sum(lengths_k), heads[1], d, generator=gen, dtype=torch.float64) for _ in range(2))
    return q, k, v, cu_q, cu_k, max(lengths_q), max(lengths_k)


def _varlen_reference(q, k, v, cu_q, cu_k, *_, causal=False, **__):
    outs, lses = [], []
    bounds_q, bounds_k = cu_q.tolist(), cu_k.tolist()
    for (q0, q1), (k0, k1) in zip(zip(bounds_q, bounds_q[1:]), zip(bounds_k, bounds_k[1:])):
        out, lse = reference_attention(q[None, q0:q1], k[None, k0:k1], v[None, k0:k1], causal=causal, return_lse=True)
        outs.append(out[0])
        lses.append(lse[0])
    return torch.cat(outs), torch.cat(lses, dim=1)


@pytest.mark.parametrize("backend", BACKENDS)
def test_varlen_double_backward_and_jvp(backend):
    gen = torch.Generator().manual_seed(5)
    q, k, v, cu_q, cu_k, max_q, max_k = _packed(gen, torch.float64)

    def ours(*tensors):
        with fusedattn.use_backend(backend):
            return fusedattn.varlen_attention(*tensors, cu_q.to(DEVICE), cu_k.to(DEVICE), max_q, max_k, causal=True,
                                              return_lse=True)

    def reference(*tensors):
        return _varlen_reference(*tensors, cu_q, cu_k, causal=True)

    def second_order(fn, dtype):
        leaves = [t.to(DEVICE, dtype).requires_grad_() for t in (q, k, v)]
        out, lse = fn(*leaves)
        finite = torch.where(torch.isfinite(lse), lse, torch.zeros_like(lse))
        first = torch.autograd.grad(out.float().square().sum() + finite.float().cos().sum(), leaves,
                                    create_graph=True)
        return torch.autograd.grad(sum((g.float() * g.float().roll(1, 0)).sum() for g in first), leaves)

    def jvp(fn, dtype):
        primals = tuple(t.to(DEVICE, dtype) for t in (q, k, v))
        tangents = tuple(torch.ones_like(t).mul_(0.5).add_(t.flip(0)) for t in primals)
        return torch.func.jvp(lambda *ts: fn(*ts)[0], primals, tangents)[1]

    for name, way in (("second order", second_order), ("jvp", lambda fn, dt: (jvp(fn, dt),))):
        got, lowp, ref64 = way(ours, DTYPE), way(reference, DTYPE), way(reference, torch.float64)
        for i, (a, l, r) in enumerate(zip(got, lowp, ref64)):
            assert_close_to_reference(f"varlen {name} {i}", a, l, r)


def test_merge_attention_double_backward_and_jvp():
    """merge_attention is plain torch ops: every mode differentiates through it."""
    gen = torch.Generator().manual_seed(9)
    outs = [torch.randn(1, 7, 2, 8, generator=gen, dtype=torch.float64) for _ in range(2)]
    lses = [torch.randn(1, 2, 7, generator=gen, dtype=torch.float64) for _ in range(2)]
    lses[1][0, 0, 3] = float("-inf")  # a part that saw no key in one row

    def merged(o0, o1, l0, l1):
        return fusedattn.merge_attention([o0, o1], [l0, l1])

    def by_hand(o0, o1, l0, l1):
        # a part with lse -inf weighs exactly 0, and so do all its derivatives: exp underflows to 0 at -1e4
        l0, l1 = (torch.where(torch.isinf(l), torch.full_like(l, -1e4), l) for l in (l0, l1))
        shift = torch.maximum(l0, l1).detach()
        lse = shift + torch.log(torch.exp(l0 - shift) + torch.exp(l1 - shift))
        w0, w1 = (torch.exp(l - lse).transpose(-1, -2).unsqueeze(-1) for l in (l0, l1))
        return w0 * o0 + w1 * o1, lse

    def second_order(fn, dtype):
        leaves = [t.to(dtype).requires_grad_() for t in (*outs, *lses)]
        out, lse = fn(*leaves)
        first = torch.autograd.grad(out.square().sum() + lse.sin().sum(), leaves, create_graph=True)
        return torch.autograd.grad(sum(g.square().sum() for g in first), leaves)

    def jvp(fn, dtype):
        primals = tuple(t.to(dtype) for t in (*outs, *lses))
        return torch.func.jvp(fn, primals, tuple(torch.full_like(t, 0.25) for t in primals))[1]

    for way in (second_order, jvp):
        got, lowp, ref64 = way(merged, torch.float32), way(by_hand, torch.float32), way(by_hand, torch.float64)
        for a, l, r in zip(got, lowp, ref64):
            assert_close_to_reference(way.__name__, a, l, r)


@pytest.mark.parametrize("backend", BACKENDS)
def test_kvcache_refuses_forward_mode_and_transforms(backend):
    """kvcache_attention is forward-only: a tangent or a torch.func transform is a clear error on every
    path, never a dropped tangent."""
    q = torch.randn(1, 1, 2, 16, device=DEVICE, dtype=DTYPE)
    cache = torch.randn(1, 32, 2, 16, device=DEVICE, dtype=DTYPE)
    with fusedattn.use_backend(backend):
        with fwAD.dual_level():
            dual = fwAD.make_dual(q, torch.ones_like(q))
            with pytest.raises(NotImplementedError, match="forward-only"):
                fusedattn.kvcache_attention(dual, cache, cache, 5)
        with pytest.raises(NotImplementedError, match="forward-only"):
            torch.func.vmap(lambda q_: fusedattn.kvcache_attention(q_, cache, cache, 5))(q[None])


@pytest.mark.parametrize("backend", BACKENDS)
def test_compiled_double_backward_is_a_clear_error(backend):
    """Under torch.compile the custom ops' backward is not differentiable and torch says so (AOTAutograd
    does not support double backward); never a silently wrong second derivative."""
    q, k, v = (torch.randn(1, 9, 2, 16, device=DEVICE, dtype=DTYPE, requires_grad=True) for _ in range(3))
    torch._dynamo.reset()
    with fusedattn.use_backend(backend):
        compiled = torch.compile(lambda a, b, c: fusedattn.attention(a, b, c, causal=True), fullgraph=True,
                                 backend="aot_eager")
        out = compiled(q, k, v)
        (dq,) = torch.autograd.grad(out.float().square().sum(), q, create_graph=True)
        with pytest.raises(RuntimeError, match="double backward"):
            torch.autograd.grad(dq.float().sum(), k)


@pytest.mark.parametrize("backend", BACKENDS)
def test_varlen_under_vmap_and_func_grad(backend):
    """torch.func.vmap over a stack of packed batches and torch.func.grad through varlen_attention."""
    gen = torch.Generator().manual_seed(6)
    stacks = [torch.randn(3, *t.shape, generator=gen, dtype=torch.float64) for t in _packed(gen, torch.float64)[:3]]
    _, _, _, cu_q, cu_k, max_q, max_k = _packed(gen, torch.float64)

    def ours(q_, k_, v_):
        with fusedattn.use_backend(backend):
            return fusedattn.varlen_attention(q_, k_, v_, cu_q.to(DEVICE), cu_k.to(DEVICE), max_q, max_k, causal=True)

    def reference(q_, k_, v_):
        return _varlen_reference(q_, k_, v_, cu_q, cu_k, causal=True)[0]

    def both(fn, dtype):
        args = [t.to(DEVICE, dtype) for t in stacks]
        outs = torch.func.vmap(fn)(*args)
        grads = torch.func.vmap(torch.func.grad(lambda a, b, c: fn(a, b, c).float().square().sum(),
                                                argnums=(0, 1, 2)))(*args)
        return (outs, *grads)

    for name, a, l, r in zip(["out", "dq", "dk", "dv"], both(ours, DTYPE), both(reference, DTYPE),
                             both(reference, torch.float64)):
        assert_close_to_reference(f"varlen vmap {name}", a, l, r)
