"""``fusedattn.sdpa``: torch's scaled_dot_product_attention semantics, checked against torch's own
function computed in float64 (its math path) as the reference and in the input dtype as the eager
baseline, outputs and gradients, by the correctness rule. Covers top-left ``is_causal`` with Sq
below, equal to and above Sk, bool and float masks of 2 to 4 dims (a row masked whole), GQA with
``enable_gqa``, MQA and batch broadcasting, 3-D inputs, ``scale``, the errors torch raises, and the
routing of ``F.scaled_dot_product_attention``.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import fusedattn
from fusedattn import routed_sdpa, sdpa
from numerics import assert_close_to_reference

ON_GPU = torch.cuda.is_available()
DEVICE = "cuda" if ON_GPU else "cpu"
DTYPE = torch.bfloat16 if ON_GPU else torch.float16
BACKENDS = ["triton"] if ON_GPU else ["torch", "triton"]
TORCH_SDPA = F.scaled_dot_product_attention  # taken before any routing


def torch_math_sdpa(*args, **kwargs):
    """torch's SDPA on its math backend: in float64, the reference (torch's semantics, exactly)."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    with sdpa_kernel(SDPBackend.MATH):
        return TORCH_SDPA(*args, **kwargs)


def plain_sdpa(query, key, value, attn_mask=None, is_causal=False, scale=None, enable_gqa=False):
    """SDPA's documented math in plain PyTorch ops, in the input dtype: the eager baseline of the
    correctness rule (torch's own kernels accumulate in fp32, a tighter baseline than that rule's)."""
    if enable_gqa:
        repeat = query.shape[-3] // key.shape[-3]
        key, value = key.repeat_interleave(repeat, dim=-3), value.repeat_interleave(repeat, dim=-3)
    scale = scale if scale is not None else query.shape[-1] ** -0.5
    scores = query @ key.transpose(-2, -1) * scale
    if is_causal:
        attn_mask = torch.ones(query.shape[-2], key.shape[-2], dtype=torch.bool, device=query.device).tril()
    if attn_mask is not None and attn_mask.dtype == torch.bool:
        scores = scores.masked_fill(~attn_mask, float("-inf"))
    elif attn_mask is not None:
        scores = scores + attn_mask
    dead = (scores == float("-inf")).all(dim=-1, keepdim=True)  # a row that keeps no key: zeros
    probs = torch.softmax(scores.masked_fill(dead, 0.0), dim=-1).masked_fill(dead, 0.0)
    return probs @ value


def _make(shape, gen, dtype=DTYPE):
    return torch.randn(shape, generator=gen).to(DEVICE, dtype)


def _case(name, gen):
    """(q, k, v, kwargs) of a named case."""
    q_shape, kv_shape, kwargs = (2, 4, 21, 16), (2, 4, 29, 16), {}
    if name == "causal-square":
        kv_shape, kwargs = (2, 4, 21, 16), dict(is_causal=True)
    elif name == "causal-fewer-queries":
        kwargs = dict(is_causal=True)
    elif name == "causal-more-queries":
        q_shape, kwargs = (2, 4, 35, 16), dict(is_causal=True)
    elif name == "bool-mask-2d":
        keep = torch.rand(21, 29, generator=gen) < 0.6
        keep[4] = False  # a row that keeps no key
        kwargs = dict(attn_mask=keep.to(DEVICE))
    elif name == "float-mask-4d":
        bias = torch.randn(2, 1, 21, 29, generator=gen)
        bias[1, 0, 7] = float("-inf")  # masked whole by the float mask
        kwargs = dict(attn_mask=bias.to(DEVICE, DTYPE))
    elif name == "gqa":
        kv_shape, kwargs = (2, 2, 29, 16), dict(enable_gqa=True, scale=0.2)
    elif name == "mqa-and-batch-broadcast":
        kv_shape = (1, 1, 29, 16)
    elif name == "3d":
        q_shape, kv_shape, kwargs = (3, 21, 16), (3, 29, 16), dict(is_causal=True)
    return _make(q_shape, gen), _make(kv_shape, gen), _make(kv_shape, gen), kwargs


CASES = ["plain", "causal-square", "causal-fewer-queries", "causal-more-queries", "bool-mask-2d", "float-mask-4d",
         "gqa", "mqa-and-batch-broadcast", "3d"]


def _run(fn, q, k, v, dout, kwargs, dtype):
    leaves = [t.detach().to(dtype).requires_grad_() for t in (q, k, v)]
    extra = dict(kwargs)
    if extra.get("attn_mask") is not None and extra["attn_mask"].is_floating_point():
        extra["attn_mask"] = extra["attn_mask"].to(dtype)
    out = fn(*leaves, **extra)
    return [out.detach(), *torch.autograd.grad(out, leaves, dout.to(dtype))]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("name", CASES)
def test_sdpa_matches_torch(backend, name):
    gen = torch.Generator().manual_seed(CASES.index(name))
    q, k, v, kwargs = _case(name, gen)
    dout = torch.randn(q.shape[:-1] + (v.shape[-1],), generator=gen).to(DEVICE, DTYPE)
    with fusedattn.use_backend(backend):
        ours = _run(sdpa, q, k, v, dout, kwargs, DTYPE)
    lowp = _run(plain_sdpa, q, k, v, dout, kwargs, DTYPE)
    ref64 = _run(torch_math_sdpa, q, k, v, dout, kwargs, torch.float64)
    for label, a, b, c in zip(("out", "dq", "dk", "dv"), ours, lowp, ref64):
        assert a.shape == c.shape, label
        assert_close_to_reference(f"{name} {label}", a, b, c)


def test_a_fully_masked_row_is_zero_as_in_torchs_math_backend():
    """torch's math backend (its definition), its CPU kernel and its CUDA memory-efficient kernel
    give zeros for a row that keeps no key; its cuDNN backend -- what torch 2.11 picks for a bool
    mask on an H200 -- gives other values. fusedattn.sdpa gives the zeros on every device."""
    gen = torch.Generator().manual_seed(11)
    q, k, v, kwargs = _case("bool-mask-2d", gen)
    ours, theirs = sdpa(q, k, v, **kwargs), torch_math_sdpa(q, k, v, **kwargs)
    assert torch.equal(ours[:, :, 4], torch.zeros_like(ours[:, :, 4]))
    assert torch.equal(theirs[:, :, 4], torch.zeros_like(theirs[:, :, 4]))


def test_float_mask_gets_its_gradient():
    gen = torch.Generator().manual_seed(12)
    q, k, v, _ = _case("plain", gen)
    bias = torch.randn(1, 4, 21, 29, generator=gen).to(DEVICE, DTYPE).requires_grad_()
    ref = bias.detach().double().requires_grad_()
    sdpa(q, k, v, attn_mask=bias).float().sum().backward()
    torch_math_sdpa(q.double(), k.double(), v.double(), attn_mask=ref).sum().backward()
    assert torch.allclose(bias.grad.double(), ref.grad, atol=5e-2, rtol=5e-2)


def test_errors_as_torch_raises_them():
    gen = torch.Generator().manual_seed(13)
    q, k, v, _ = _case("plain", gen)
    with pytest.raises(RuntimeError, match="is_causal"):
        sdpa(q, k, v, attn_mask=torch.ones(21, 29, dtype=torch.bool, device=DEVICE), is_causal=True)
    with pytest.raises(RuntimeError, match="enable_gqa"):
        sdpa(q, k[:, :2], v[:, :2])


def test_dropout_is_the_documented_mask():
    """dropout_p > 0: the probabilities of the call's mask (fusedattn.dropout.keep_mask) kept and
    scaled, against the float64 math; the same seed reproduces it."""
    from fusedattn import dropout

    gen = torch.Generator().manual_seed(14)
    q, k, v, _ = _case("plain", gen)
    torch.manual_seed(6)
    out = sdpa(q, k, v, dropout_p=0.25, is_causal=True)
    torch.manual_seed(6)
    keep = dropout.keep_mask(dropout.draw_seed(q.device), q.shape[0], q.shape[1], q.shape[2], k.shape[2], 0.25,
                             q.device)
    qd, kd, vd = (t.double() for t in (q, k, v))
    scores = qd @ kd.transpose(-1, -2) / q.shape[-1] ** 0.5
    causal = torch.ones(q.shape[2], k.shape[2], dtype=torch.bool, device=q.device).tril()
    probs = torch.softmax(scores.masked_fill(~causal, float("-inf")), -1)
    expected = (probs * keep * dropout.keep_scale(0.25)) @ vd
    assert (out.double() - expected).abs().max() < 2e-2
    torch.manual_seed(6)
    assert torch.equal(out, sdpa(q, k, v, dropout_p=0.25, is_causal=True))


def test_routing_swaps_torch_sdpa_inside_the_block_only():
    gen = torch.Generator().manual_seed(14)
    q, k, v, kwargs = _case("causal-fewer-queries", gen)
    with routed_sdpa():
        assert F.scaled_dot_product_attention is sdpa
        routed = torch.nn.functional.scaled_dot_product_attention(q, k, v, **kwargs)
    assert F.scaled_dot_product_attention is TORCH_SDPA
    assert torch.equal(routed, sdpa(q, k, v, **kwargs))
    with pytest.raises(ValueError):
        with routed_sdpa():
            raise ValueError("an error inside the block")
    assert F.scaled_dot_product_attention is TORCH_SDPA  # restored on errors too
