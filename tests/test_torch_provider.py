"""``fusedattn.torch_provider``: fusedattn as a provider of torch's flash-attention registry.

The reference is torch's flash kernel's semantics (FlashAttention 2, flash_api.cpp) written out
here in plain torch ops: softmax(q k^T * scale + mask) v with the window bottom-right aligned
(query i sees keys [i + Sk - Sq - left, i + Sk - Sq + right]; sizes None / negative / >= Sk
unbounded; ``is_causal`` sets right = 0; a left size with an unbounded right one bounds the right
at Sk), lse the natural-log logsumexp, +inf and out 0 on a row that sees no key. Every output and
gradient meets the correctness rule (tests/numerics.py) against it in float64.

- Without a GPU: the op implementations called directly with the aten signatures (both fusedattn
  backends, the Triton kernels under the interpreter), and the whole dispatcher path -- the aten
  ops, their autograd formulas and ``torch.nn.attention.varlen.varlen_attn`` -- with the
  implementations registered for the CPU dispatch key for the length of a test.
- The registry: ``register()`` adds the name without activating it, twice is harmless, activation
  puts the kernels on the CUDA key and ``restore_flash_attention_impl()`` takes them off.
- On a GPU only: torch's own flash kernel and the provider against the same reference on the same
  calls (the semantics are torch's, not only documented ones), and ``F.scaled_dot_product_attention``
  under ``sdpa_kernel(FLASH_ATTENTION)`` and ``varlen_attn`` in bf16, forward and backward, running
  fusedattn's functions while active and torch's after ``restore_flash_attention_impl()``.
"""

from __future__ import annotations

import inspect
import math

import pytest
import torch
import torch.nn.functional as F

import fusedattn
from fusedattn import dispatch, interface
from fusedattn import torch_provider as tp
from fusedattn import varlen as varlen_module
from numerics import assert_close_to_reference

ON_GPU = torch.cuda.is_available()
DEVICE = "cuda" if ON_GPU else "cpu"
DTYPE = torch.bfloat16 if ON_GPU else torch.float32
BACKENDS = ["triton"] if ON_GPU else ["torch", "triton"]
HAS_REGISTRY = hasattr(torch.nn.attention, "register_flash_attention_impl")
INF = math.inf

try:
    from torch.nn.attention import varlen as torch_varlen
except ImportError:  # a torch without varlen_attn
    torch_varlen = None


# ----------------------------------------------------------------------------- the reference


def fa2_window(is_causal, left, right, seqlen_k):
    """FlashAttention 2's window sizes (mha_fwd, then set_params_fprop) as (left, right), -1 unbounded."""
    left = -1 if left is None or left < 0 else left
    right = -1 if right is None or right < 0 else right
    left = -1 if left >= seqlen_k else left
    right = -1 if right >= seqlen_k else right
    if is_causal:
        right = 0
    if left >= 0 and right < 0:
        right = seqlen_k
    return left, right


def dense_reference(q, k, v, left, right, scale):
    """(B, S, H, D) attention with window sizes already normalised: (out, lse (B, H, Sq))."""
    seqlen_q, heads_q = q.shape[1], q.shape[2]
    seqlen_k, heads_kv = k.shape[1], k.shape[2]
    k, v = (t.repeat_interleave(heads_q // heads_kv, dim=2) for t in (k, v))
    scores = torch.einsum("bqhd,bkhd->bhqk", q, k) * scale
    i = torch.arange(seqlen_q, device=q.device)[:, None] + (seqlen_k - seqlen_q)  # the diagonal's key
    j = torch.arange(seqlen_k, device=q.device)[None, :]
    keep = torch.ones(seqlen_q, seqlen_k, dtype=torch.bool, device=q.device)
    if left >= 0:
        keep &= j >= i - left
    if right >= 0:
        keep &= j <= i + right
    empty = ~keep.any(dim=-1)  # rows that see no key
    scores = scores.masked_fill(~keep, -INF).masked_fill(empty[:, None], 0.0)
    probs = torch.softmax(scores, dim=-1).masked_fill(empty[:, None], 0.0)
    lse = torch.logsumexp(scores, dim=-1).masked_fill(empty, INF)
    return torch.einsum("bhqk,bkhd->bqhd", probs.to(v.dtype), v), lse


def flash_reference(q, k, v, is_causal=False, left=None, right=None, scale=None):
    """torch's ``_flash_attention_forward`` on dense (B, S, H, D) tensors."""
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    return dense_reference(q, k, v, *fa2_window(is_causal, left, right, k.shape[1]), scale)


def varlen_reference(q, k, v, lengths_q, lengths_k, max_k, is_causal=False, left=None, right=None, scale=None):
    """The ragged form: each sequence alone, window sizes normalised against ``max_k`` as
    mha_varlen_fwd does; (out (total_q, H, D), lse (H, total_q))."""
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    window = fa2_window(is_causal, left, right, max_k)
    outs, lses, q0, k0 = [], [], 0, 0
    for lq, lk in zip(lengths_q, lengths_k):
        out, lse = dense_reference(q[None, q0:q0 + lq], k[None, k0:k0 + lk], v[None, k0:k0 + lk], *window, scale)
        outs.append(out[0])
        lses.append(lse[0])
        q0, k0 = q0 + lq, k0 + lk
    return torch.cat(outs), torch.cat(lses, dim=1)


def reference_with_grads(fn, inputs, dout, dtype):
    """(out, lse, dq, dk, dv) of ``fn(q, k, v)`` computed in ``dtype`` through autograd."""
    leaves = [t.detach().to(dtype).requires_grad_() for t in inputs]
    out, lse = fn(*leaves)
    grads = torch.autograd.grad(out, leaves, dout.to(dtype))
    return (out, lse, *grads)


def check_all(name, ours, fn, inputs, dout):
    """Each of ours (out, lse[, dq, dk, dv]) against fn's float64 and eager low-precision values."""
    ref64 = reference_with_grads(fn, inputs, dout, torch.float64)
    lowp = reference_with_grads(fn, inputs, dout, inputs[0].dtype)
    for label, got, low, ref in zip(("out", "lse", "dq", "dk", "dv"), ours, lowp, ref64):
        assert_close_to_reference(f"{name} {label}", got, low.float() if label == "lse" else low, ref)


def make(shape, gen, dtype=DTYPE, device=DEVICE):
    return torch.randn(shape, generator=gen).to(device, dtype)


def offsets(lengths, device=DEVICE):
    return torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32, device=device)


# ----------------------------------------------------------------------------- cases

# (name, Sq, Sk, Hq, Hkv, is_causal, window_size_left, window_size_right, scale)
DENSE_CASES = [
    ("full", 7, 11, 2, 2, False, None, None, None),
    ("causal-fewer-queries", 7, 11, 2, 2, True, None, None, None),
    ("causal-more-queries", 12, 9, 2, 2, True, None, None, None),  # the first 3 rows see no key
    ("window", 10, 10, 2, 2, False, 3, 1, None),
    ("left-window-more-queries", 15, 6, 2, 2, False, 2, None, None),  # right bounded at Sk: early rows empty
    ("windows-wider-than-keys", 6, 8, 2, 2, True, 20, 30, None),  # left unbounded, causal right 0
    ("left-as-wide-as-keys-more-queries", 15, 6, 2, 2, False, 6, None, None),  # left >= Sk: full attention
    ("wide-right-more-queries", 15, 6, 2, 2, False, 2, 30, None),  # right >= Sk: unbounded, then Sk
    ("negative-sizes", 5, 9, 2, 2, False, -3, -1, None),  # any negative size is unbounded
    ("gqa-scale-causal", 9, 13, 6, 2, True, None, None, 0.3),
]
DENSE_IDS = [case[0] for case in DENSE_CASES]


def dense_inputs(case, seed=0, dtype=DTYPE, device=DEVICE, head_dim=16):
    _, seqlen_q, seqlen_k, heads_q, heads_kv, *_ = case
    gen = torch.Generator().manual_seed(seed)
    q = make((2, seqlen_q, heads_q, head_dim), gen, dtype, device)
    k, v = (make((2, seqlen_k, heads_kv, head_dim), gen, dtype, device) for _ in range(2))
    return q, k, v, make(q.shape, gen, dtype, device)


# (lengths_q, lengths_k, Hq, Hkv, is_causal, left, right): sequence 2 has no query; sequence 3 has
# queries but no key (out 0, lse +inf there)
VARLEN_CASES = [
    ((3, 0, 6, 4), (5, 2, 3, 0), 2, 2, False, None, None),
    ((3, 0, 6, 4), (5, 2, 3, 0), 4, 2, True, None, None),
    ((5, 1, 7), (5, 4, 7), 2, 2, True, 2, None),
    ((5, 1, 7), (8, 4, 3), 2, 1, False, 1, 2),
]


def varlen_inputs(case, seed=0, dtype=DTYPE, device=DEVICE, head_dim=16):
    lengths_q, lengths_k, heads_q, heads_kv, *_ = case
    gen = torch.Generator().manual_seed(seed)
    q = make((sum(lengths_q), heads_q, head_dim), gen, dtype, device)
    k, v = (make((sum(lengths_k), heads_kv, head_dim), gen, dtype, device) for _ in range(2))
    return q, k, v, make(q.shape, gen, dtype, device)


# ----------------------------------------------------------------------------- spies


class Spy:
    """Counts the calls of the fusedattn functions the provider computes with."""

    TARGETS = ((interface, "attention"), (varlen_module, "varlen_attention"), (dispatch, "backward"),
               (varlen_module, "_backward"))

    def __init__(self, monkeypatch):
        self.counts = {name: 0 for _, name in self.TARGETS}
        for module, name in self.TARGETS:
            monkeypatch.setattr(module, name, self._counting(name, getattr(module, name)))

    def _counting(self, name, fn):
        def wrapper(*args, **kwargs):
            self.counts[name] += 1
            return fn(*args, **kwargs)
        return wrapper


@pytest.fixture
def spy(monkeypatch):
    return Spy(monkeypatch)


# ----------------------------------------------------------------------------- (a) the implementations


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("case", DENSE_CASES, ids=DENSE_IDS)
def test_flash_attention_forward_and_backward(case, backend, spy):
    name, seqlen_q, seqlen_k, _, _, is_causal, left, right, scale = case
    q, k, v, dout = dense_inputs(case)
    kwargs = dict(scale=scale, window_size_left=left, window_size_right=right)
    with fusedattn.use_backend(backend):
        out, lse, rng_state, unused, debug = tp.flash_attention_forward(q, k, v, None, None, seqlen_q, seqlen_k, 0.0,
                                                                        is_causal, False, **kwargs)
        assert spy.counts["attention"] == 1
        grads = tp.flash_attention_backward(dout, q, k, v, out, lse, None, None, seqlen_q, seqlen_k, 0.0, is_causal,
                                            rng_state, unused, **kwargs)
    assert spy.counts == {"attention": 1, "varlen_attention": 0, "backward": 1, "_backward": 0}  # no forward re-run
    assert lse.dtype == torch.float32 and lse.shape == (2, q.shape[2], seqlen_q) and lse.is_contiguous()
    assert out.stride() == torch.empty_like(q).stride()
    assert rng_state.shape == (2,) and rng_state.dtype == torch.uint64 and unused.shape == () and debug.numel() == 0
    check_all(name, (out, lse, *grads), lambda q, k, v: flash_reference(q, k, v, is_causal, left, right, scale),
              (q, k, v), dout)


def test_empty_rows_are_zero_with_lse_plus_inf():
    """FlashAttention 2's convention (fusedattn's own functions write -inf): checked by value."""
    q, k, v, _ = dense_inputs(DENSE_CASES[2])  # causal, Sq 12 > Sk 9
    out, lse, *_ = tp.flash_attention_forward(q, k, v, None, None, 12, 9, 0.0, True, False)
    assert torch.all(lse[:, :, :3] == INF) and torch.isfinite(lse[:, :, 3:]).all()
    assert torch.all(out[:, :3] == 0) and out[:, 3:].abs().sum() > 0


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("case", VARLEN_CASES, ids=lambda c: f"q{c[0]}-k{c[1]}-h{c[2]}-{c[3]}-c{int(c[4])}-w{c[5]}_{c[6]}")
def test_varlen_forward_and_backward(case, backend, spy):
    lengths_q, lengths_k, _, _, is_causal, left, right = case
    q, k, v, dout = varlen_inputs(case)
    cu_q, cu_k = offsets(lengths_q), offsets(lengths_k)
    max_q, max_k = max(lengths_q), max(lengths_k)
    kwargs = dict(window_size_left=left, window_size_right=right)
    with fusedattn.use_backend(backend):
        out, lse, rng_state, unused, _ = tp.flash_attention_forward(q, k, v, cu_q, cu_k, max_q, max_k, 0.0, is_causal,
                                                                    False, **kwargs)
        grads = tp.flash_attention_backward(dout, q, k, v, out, lse, cu_q, cu_k, max_q, max_k, 0.0, is_causal,
                                            rng_state, unused, **kwargs)
    # (fusedattn's PyTorch path runs the varlen backward sequence by sequence through dispatch.backward)
    assert spy.counts["varlen_attention"] == 1 and spy.counts["_backward"] == 1 and spy.counts["attention"] == 0
    assert lse.shape == (q.shape[1], q.shape[0])  # (H, total_q)
    check_all(f"varlen {case}", (out, lse, *grads),
              lambda q, k, v: varlen_reference(q, k, v, lengths_q, lengths_k, max_k, is_causal, left, right),
              (q, k, v), dout)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("query_memory", ["bhsd", "bshd"])
@pytest.mark.parametrize("is_causal", [False, True], ids=["full", "causal"])
def test_scaled_dot_product_flash_attention(is_causal, query_memory, backend, spy):
    """The SDPA ops take (B, H, S, D) tensors; the output and gradients have the strides torch's
    meta kernels give (empty_like), whether q's memory is (B, H, S, D) or (B, S, H, D)."""
    case = ("sdpa", 9, 9 if is_causal else 14, 4, 2, is_causal, None, None, 0.35)
    q, k, v, dout = dense_inputs(case)  # (B, S, H, D) memory
    if query_memory == "bhsd":
        q, k, v, dout = (t.transpose(1, 2).contiguous().transpose(1, 2) for t in (q, k, v, dout))
    qh, kh, vh, douth = (t.transpose(1, 2) for t in (q, k, v, dout))
    with fusedattn.use_backend(backend):
        out, lse, cum_q, cum_k, max_q, max_k, seed, offset, _ = tp.scaled_dot_product_flash_attention(
            qh, kh, vh, 0.0, is_causal, scale=0.35)
        grads = tp.scaled_dot_product_flash_attention_backward(douth, qh, kh, vh, out, lse, cum_q, cum_k, max_q,
                                                               max_k, 0.0, is_causal, seed, offset, scale=0.35)
    assert spy.counts["attention"] == 1 and spy.counts["backward"] == 1
    assert (cum_q, cum_k, max_q, max_k) == (None, None, 9, kh.shape[2])
    for x, g in ((qh, out), *zip((qh, kh, vh), grads)):
        assert g.stride() == torch.empty_like(x).stride()
    ours = (out.transpose(1, 2), lse, *(g.transpose(1, 2) for g in grads))
    check_all(f"sdpa {query_memory}", ours, lambda q, k, v: flash_reference(q, k, v, is_causal, scale=0.35),
              (q, k, v), dout)


def _views(q, k, v, dout, memory):
    """(B, S, H, D) tensors with the values of q, k, v, dout in another memory order: "bhsd" (each a
    transposed contiguous (B, H, S, D) tensor) or "fused" (q, k, v slices of one (B, S, Hq + 2 Hkv, D)
    tensor, as a fused QKV projection gives them: not dense)."""
    if memory == "bhsd":
        return [t.transpose(1, 2).contiguous().transpose(1, 2) for t in (q, k, v, dout)]
    heads_q, heads_kv = q.shape[2], k.shape[2]
    fused = torch.cat([q, k, v], dim=2)
    return [fused[:, :, :heads_q], fused[:, :, heads_q:heads_q + heads_kv], fused[:, :, heads_q + heads_kv:], dout]


@pytest.mark.parametrize("memory", ["bhsd", "fused"])
def test_outputs_and_gradients_have_the_meta_kernels_strides(memory):
    """torch's meta kernels give every output and gradient empty_like's strides of its input, and
    torch.compile checks an extern kernel's strides against them: q, k, v in other memory orders get
    those strides, with the values of contiguous inputs."""
    case = ("strides", 11, 11, 4, 2, True, None, None, None)  # one length: q, k, v may share a buffer
    q, k, v, dout = dense_inputs(case)
    out, lse, *_ = tp.flash_attention_forward(q, k, v, None, None, 11, 11, 0.0, True, False)
    grads = tp.flash_attention_backward(dout, q, k, v, out, lse, None, None, 11, 11, 0.0, True)
    vq, vk, vv, vdout = _views(q, k, v, dout, memory)
    vout, vlse, *_ = tp.flash_attention_forward(vq, vk, vv, None, None, 11, 11, 0.0, True, False)
    vgrads = tp.flash_attention_backward(vdout, vq, vk, vv, vout, vlse, None, None, 11, 11, 0.0, True)
    hq, hk, hv, hdout, hout = (t.transpose(1, 2) for t in (vq, vk, vv, vdout, vout))
    sdpa_out, sdpa_lse, *rest = tp.scaled_dot_product_flash_attention(hq, hk, hv, 0.0, True)
    sdpa_grads = tp.scaled_dot_product_flash_attention_backward(hdout, hq, hk, hv, sdpa_out, sdpa_lse, None, None,
                                                                11, 11, 0.0, True)
    for inputs, outs, label in (((vq, vq, vk, vv), (vout, *vgrads), "flash"),
                                ((hq, hq, hk, hv), (sdpa_out, *sdpa_grads), "sdpa")):
        for x, t in zip(inputs, outs):
            assert t.stride() == torch.empty_like(x).stride(), label
    tols = dict(rtol=1e-5, atol=1e-5) if DTYPE == torch.float32 else dict(rtol=1e-2, atol=1e-2)
    for a, b in zip((out, lse, *grads), (vout, vlse, *vgrads)):
        torch.testing.assert_close(b, a, **tols)
    for a, b in zip((out, lse, *grads), (sdpa_out.transpose(1, 2), sdpa_lse, *(g.transpose(1, 2) for g in sdpa_grads))):
        torch.testing.assert_close(b, a, **tols)


@pytest.mark.parametrize("memory", ["bhsd", "bshd"])
def test_sdpa_forward_computes_in_the_query_memory_order(memory, monkeypatch):
    """No copy to reach the output's strides when q is (B, H, S, D) memory or a (B, S, H, D) buffer
    seen as (B, H, S, D): fusedattn runs in that layout."""
    copies = []
    strided_like = tp._strided_like

    def recording(reference, t):
        result = strided_like(reference, t)
        copies.append(result is not t)
        return result

    monkeypatch.setattr(tp, "_strided_like", recording)
    q, k, v, _ = dense_inputs(("copies", 9, 13, 4, 2, False, None, None, None))
    if memory == "bhsd":
        q, k, v, _ = _views(q, k, v, q, "bhsd")
    out = tp.scaled_dot_product_flash_attention(*(t.transpose(1, 2) for t in (q, k, v)))[0]
    assert copies == [False] and out.stride() == torch.empty_like(q.transpose(1, 2)).stride()


def test_forward_into_a_given_output():
    """``_flash_attention_forward_no_dropout_inplace``: the output written into ``out``, lse returned."""
    case = VARLEN_CASES[2]
    q, k, v, _ = varlen_inputs(case)
    cu_q, cu_k = offsets(case[0]), offsets(case[1])
    expected_out, expected_lse, *_ = tp.flash_attention_forward(q, k, v, cu_q, cu_k, 7, 7, 0.0, True, False,
                                                                window_size_left=2)
    out = torch.full_like(q, float("nan"))
    pointer = out.data_ptr()
    lse = tp.flash_attention_forward_no_dropout_inplace(out, q, k, v, cu_q, cu_k, 7, 7, 0.0, True, False,
                                                        window_size_left=2)
    assert out.data_ptr() == pointer
    torch.testing.assert_close(out, expected_out, rtol=0, atol=0)
    torch.testing.assert_close(lse, expected_lse, rtol=0, atol=0)


def test_backward_takes_either_infinity_on_rows_without_keys():
    """The backward ops take lse with +inf (torch's kernel) or -inf (fusedattn's functions) there."""
    q, k, v, dout = dense_inputs(DENSE_CASES[2])
    out, lse, *_ = tp.flash_attention_forward(q, k, v, None, None, 12, 9, 0.0, True, False)
    assert (lse == INF).any()
    plus = tp.flash_attention_backward(dout, q, k, v, out, lse, None, None, 12, 9, 0.0, True)
    minus = tp.flash_attention_backward(dout, q, k, v, out, lse.masked_fill(lse == INF, -INF), None, None, 12, 9,
                                        0.0, True)
    for a, b in zip(plus, minus):
        assert torch.isfinite(a).all()
        torch.testing.assert_close(a, b, rtol=0, atol=0)


@pytest.mark.parametrize("argument,value", [
    ("dropout_p", 0.1), ("return_debug_mask", True), ("alibi_slopes", "slopes"), ("seqused_k", "lengths"),
    ("block_table", "table"), ("a_future_option", 3),
])
def test_what_fusedattn_does_not_compute_raises_not_implemented(argument, value):
    """NotImplementedError (a RuntimeError, as torch's FA4 provider raises), naming the argument."""
    q, k, v, _ = dense_inputs(DENSE_CASES[0])
    tensors = dict(slopes=torch.ones(2, device=DEVICE), lengths=torch.full((2,), 11, dtype=torch.int32, device=DEVICE),
                   table=torch.zeros(2, 1, dtype=torch.int32, device=DEVICE))
    args = dict(dropout_p=0.0, return_debug_mask=False)
    kwargs = {}
    if argument in args:
        args[argument] = value
    else:
        kwargs[argument] = tensors.get(value, value)
    with pytest.raises(NotImplementedError, match=argument) as raised:
        tp.flash_attention_forward(q, k, v, None, None, 7, 11, args["dropout_p"], False, args["return_debug_mask"],
                                   **kwargs)
    assert isinstance(raised.value, RuntimeError)
    if argument in args:
        qh, kh, vh = (t.transpose(1, 2) for t in (q, k, v))
        with pytest.raises(NotImplementedError, match=argument):
            tp.scaled_dot_product_flash_attention(qh, kh, vh, args["dropout_p"], False, args["return_debug_mask"])


def test_backward_with_dropout_raises():
    q, k, v, dout = dense_inputs(DENSE_CASES[0])
    out, lse, *_ = tp.flash_attention_forward(q, k, v, None, None, 7, 11, 0.0, False, False)
    with pytest.raises(NotImplementedError, match="dropout_p"):
        tp.flash_attention_backward(dout, q, k, v, out, lse, None, None, 7, 11, 0.2, False)
    with pytest.raises(NotImplementedError, match="dropout_p"):
        tp.scaled_dot_product_flash_attention_backward(*(t.transpose(1, 2) for t in (dout, q, k, v, out)), lse, None,
                                                       None, 7, 11, 0.2, False)


# ----------------------------------------------------------------------------- (a) the dispatcher path, on the CPU


@pytest.fixture
def cpu_kernels():
    """The provider's implementations on the CPU dispatch key (torch has no CPU flash kernel), so the
    aten ops, their autograd formulas and varlen_attn run them on CPU tensors."""
    library = tp._register_kernels("CPU")
    try:
        yield
    finally:
        library._destroy()


def test_aten_sdpa_op_through_autograd_on_cpu(cpu_kernels, spy):
    case = ("aten-sdpa", 10, 10, 4, 2, True, None, None, None)
    q, k, v, dout = dense_inputs(case, device="cpu", dtype=torch.float32)
    leaves = [t.transpose(1, 2).detach().requires_grad_() for t in (q, k, v)]
    out, lse = torch.ops.aten._scaled_dot_product_flash_attention(*leaves, 0.0, True)[:2]
    out.backward(dout.transpose(1, 2))
    assert spy.counts["attention"] == 1 and spy.counts["backward"] == 1
    ours = (out.transpose(1, 2), lse, *(t.grad.transpose(1, 2) for t in leaves))
    check_all("aten sdpa", ours, lambda q, k, v: flash_reference(q, k, v, True), (q, k, v), dout)


def test_aten_flash_forward_through_autograd_on_cpu(cpu_kernels, spy):
    case = DENSE_CASES[4]  # a left window, Sq > Sk + 1
    _, seqlen_q, seqlen_k, *_ = case
    q, k, v, dout = dense_inputs(case, device="cpu", dtype=torch.float32)
    leaves = [t.detach().requires_grad_() for t in (q, k, v)]
    out, lse = torch.ops.aten._flash_attention_forward(*leaves, None, None, seqlen_q, seqlen_k, 0.0, False, False,
                                                       window_size_left=2)[:2]
    out.backward(dout)
    assert spy.counts["attention"] == 1 and spy.counts["backward"] == 1
    check_all("aten flash", (out, lse, *(t.grad for t in leaves)), lambda q, k, v: flash_reference(q, k, v, left=2),
              (q, k, v), dout)


def _varlen_attn_kwargs(window, heads_q, heads_kv):
    """varlen_attn's keywords for a window (its signature changed between torch versions); None if
    this torch's varlen_attn cannot express the case."""
    params = inspect.signature(torch_varlen.varlen_attn).parameters
    kwargs = {}
    if "window_size" in params:
        kwargs["window_size"] = window
    elif window == (-1, 0) and "is_causal" in params:
        kwargs["is_causal"] = True
    elif window != (-1, -1):
        return None
    if heads_q != heads_kv:
        if "enable_gqa" not in params:
            return None
        kwargs["enable_gqa"] = True
    if "return_aux" in params:
        kwargs["return_aux"] = torch_varlen.AuxRequest(lse=True)
    return kwargs


def run_varlen_attn(case, window, device, dtype):
    """varlen_attn forward and backward on ``case``: ((out, lse or None, dq, dk, dv), inputs, dout)."""
    lengths_q, lengths_k, heads_q, heads_kv = case[:4]
    kwargs = _varlen_attn_kwargs(window, heads_q, heads_kv)
    if kwargs is None:
        pytest.skip("this torch's varlen_attn does not take the case's window or GQA")
    q, k, v, dout = varlen_inputs(case, device=device, dtype=dtype)
    leaves = [t.detach().requires_grad_() for t in (q, k, v)]
    result = torch_varlen.varlen_attn(*leaves, offsets(lengths_q, device), offsets(lengths_k, device),
                                      max(lengths_q), max(lengths_k), **kwargs)
    out, lse = result if isinstance(result, tuple) else (result, None)
    out.backward(dout)
    if lse is not None and lse.shape != (heads_q, q.shape[0]):
        lse = lse.transpose(0, 1)  # a torch returning (total_q, H)
    return (out, lse, *(t.grad for t in leaves)), (q, k, v), dout


def check_varlen_attn(results, inputs, dout, case, window):
    lengths_q, lengths_k = case[:2]
    left, right = window

    def reference(q, k, v):
        return varlen_reference(q, k, v, lengths_q, lengths_k, max(lengths_k), False, left, right)

    if results[1] is None:  # no lse from this torch's varlen_attn: check the rest
        ref64 = reference_with_grads(reference, inputs, dout, torch.float64)
        lowp = reference_with_grads(reference, inputs, dout, inputs[0].dtype)
        for index, label in ((0, "out"), (2, "dq"), (3, "dk"), (4, "dv")):
            assert_close_to_reference(f"varlen_attn {label}", results[index], lowp[index], ref64[index])
    else:
        check_all("varlen_attn", results, reference, inputs, dout)


@pytest.mark.skipif(torch_varlen is None, reason="this torch has no torch.nn.attention.varlen")
@pytest.mark.parametrize("heads", [(4, 4), (4, 2)], ids=["mha", "gqa"])
@pytest.mark.parametrize("window", [(-1, 0), (2, 0), (-1, -1)], ids=["causal", "sliding", "full"])
def test_torch_varlen_attn_on_cpu(cpu_kernels, spy, window, heads):
    case = ((3, 0, 6, 4), (5, 2, 3, 0), *heads)
    results, inputs, dout = run_varlen_attn(case, window, "cpu", torch.float32)
    assert spy.counts["varlen_attention"] == 1 and spy.counts["_backward"] == 1
    check_varlen_attn(results, inputs, dout, case, window)


# ----------------------------------------------------------------------------- (b) the registry


@pytest.mark.skipif(not HAS_REGISTRY, reason="this torch has no flash-attention registry")
def test_register_adds_the_name_without_activating_and_twice_is_harmless():
    from torch.nn.attention import current_flash_attention_impl, list_flash_attention_impls

    active = current_flash_attention_impl()
    assert tp.register() is True
    assert tp.register() is True
    assert list_flash_attention_impls().count(tp.PROVIDER) == 1
    assert current_flash_attention_impl() == active


def test_register_is_a_no_op_without_the_registry(monkeypatch):
    monkeypatch.delattr(torch.nn.attention, "register_flash_attention_impl", raising=False)
    assert tp.register() is False


def _cuda_kernel_line(op: str) -> str:
    return "".join(line for line in torch._C._dispatch_dump(op).splitlines() if line.startswith("CUDA:"))


@pytest.mark.skipif(not HAS_REGISTRY, reason="this torch has no flash-attention registry")
def test_activation_puts_the_kernels_on_the_cuda_key_and_restore_removes_them():
    from torch.nn.attention import activate_flash_attention_impl, current_flash_attention_impl
    from torch.nn.attention import restore_flash_attention_impl

    ops = [f"aten::{name}" for name in tp._IMPLS if hasattr(torch.ops.aten, name)]
    before = {op: _cuda_kernel_line(op) for op in ops}
    assert not any("torch_provider.py" in line for line in before.values())
    tp.register()
    activate_flash_attention_impl(tp.PROVIDER)
    try:
        assert current_flash_attention_impl() == tp.PROVIDER
        for op in ops:
            assert "torch_provider.py" in _cuda_kernel_line(op), op
    finally:
        restore_flash_attention_impl()
    assert current_flash_attention_impl() is None
    assert {op: _cuda_kernel_line(op) for op in ops} == before


# ----------------------------------------------------------------------------- (c) on a GPU

gpu = pytest.mark.skipif(not ON_GPU, reason="needs CUDA")
needs_registry = pytest.mark.skipif(not HAS_REGISTRY, reason="this torch has no flash-attention registry")


@pytest.fixture
def active():
    """The provider active for the test, torch's kernels restored after it."""
    from torch.nn.attention import activate_flash_attention_impl, restore_flash_attention_impl

    tp.register()
    activate_flash_attention_impl(tp.PROVIDER)
    try:
        yield
    finally:
        restore_flash_attention_impl()


def _torch_flash_forward(q, k, v, case):
    """``aten::_flash_attention_forward`` on (B, S, H, D) tensors for a DENSE_CASES entry: (out, lse)."""
    _, seqlen_q, seqlen_k, _, _, is_causal, left, right, scale = case
    return torch.ops.aten._flash_attention_forward(q, k, v, None, None, seqlen_q, seqlen_k, 0.0, is_causal, False,
                                                   scale=scale, window_size_left=left,
                                                   window_size_right=right)[:2]


@gpu
@needs_registry
@pytest.mark.parametrize("case", DENSE_CASES, ids=DENSE_IDS)
def test_gpu_provider_and_torch_flash_kernel_agree_with_the_reference(case, spy):
    """torch's own kernel and the provider on the same call, both against the reference: the
    reference's window and empty-row rules are torch's, and ours follow them."""
    from torch.nn.attention import activate_flash_attention_impl, restore_flash_attention_impl

    q, k, v, _ = dense_inputs(case, head_dim=64)
    _, _, _, _, _, is_causal, left, right, scale = case
    theirs = _torch_flash_forward(q, k, v, case)
    assert spy.counts["attention"] == 0
    tp.register()
    activate_flash_attention_impl(tp.PROVIDER)
    try:
        ours = _torch_flash_forward(q, k, v, case)
    finally:
        restore_flash_attention_impl()
    assert spy.counts["attention"] == 1

    def reference(q, k, v):
        return flash_reference(q, k, v, is_causal, left, right, scale)

    ref64 = [t.double() for t in reference(*(t.double() for t in (q, k, v)))]
    lowp = reference(q, k, v)
    for who, (out, lse) in (("torch's kernel", theirs), ("fusedattn", ours)):
        assert_close_to_reference(f"{case[0]} {who} out", out, lowp[0], ref64[0])
        assert_close_to_reference(f"{case[0]} {who} lse", lse, lowp[1].float(), ref64[1])


@gpu
@needs_registry
@pytest.mark.parametrize("case", VARLEN_CASES, ids=lambda c: f"q{c[0]}-k{c[1]}-h{c[2]}-{c[3]}-c{int(c[4])}-w{c[5]}_{c[6]}")
def test_gpu_varlen_provider_and_torch_flash_kernel_agree(case):
    from torch.nn.attention import activate_flash_attention_impl, restore_flash_attention_impl

    lengths_q, lengths_k, _, _, is_causal, left, right = case
    q, k, v, _ = varlen_inputs(case, head_dim=64)
    args = (offsets(lengths_q), offsets(lengths_k), max(lengths_q), max(lengths_k), 0.0, is_causal, False)
    kwargs = dict(window_size_left=left, window_size_right=right)
    theirs = torch.ops.aten._flash_attention_forward(q, k, v, *args, **kwargs)[:2]
    tp.register()
    activate_flash_attention_impl(tp.PROVIDER)
    try:
        ours = torch.ops.aten._flash_attention_forward(q, k, v, *args, **kwargs)[:2]
    finally:
        restore_flash_attention_impl()
    window = (is_causal, left, right)
    ref64 = varlen_reference(*(t.double() for t in (q, k, v)), lengths_q, lengths_k, max(lengths_k), *window)
    lowp = varlen_reference(q, k, v, lengths_q, lengths_k, max(lengths_k), *window)
    for who, (out, lse) in (("torch's kernel", theirs), ("fusedattn", ours)):
        assert_close_to_reference(f"varlen {who} out", out, lowp[0], ref64[0])
        assert_close_to_reference(f"varlen {who} lse", lse, lowp[1].float(), ref64[1])


SDPA_CASES = {  # name: (Sq, Sk, Hq, Hkv, is_causal) -- SDPA's flash backend takes causal only with Sq == Sk
    "full": (100, 130, 4, 4, False),
    "causal": (128, 128, 4, 4, True),
    "gqa-causal": (77, 77, 8, 2, True),
}


@gpu
@needs_registry
@pytest.mark.parametrize("name", list(SDPA_CASES))
def test_gpu_sdpa_runs_on_fusedattn_while_active_and_on_torch_after_restore(name, monkeypatch):
    from torch.nn.attention import SDPBackend, restore_flash_attention_impl, sdpa_kernel

    seqlen_q, seqlen_k, heads_q, heads_kv, is_causal = SDPA_CASES[name]
    case = (name, seqlen_q, seqlen_k, heads_q, heads_kv, is_causal, None, None, None)
    q, k, v, dout = dense_inputs(case, head_dim=64)  # (B, S, H, D) memory, seen as (B, H, S, D) below

    def run():
        leaves = [t.detach().requires_grad_() for t in (q, k, v)]
        with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
            out = F.scaled_dot_product_attention(*(t.transpose(1, 2) for t in leaves), is_causal=is_causal,
                                                 enable_gqa=heads_q != heads_kv)
        out.transpose(1, 2).backward(dout)
        return out.transpose(1, 2), *(t.grad for t in leaves)

    def check(results, who):  # results: (out, dq, dk, dv); the reference's: (out, lse, dq, dk, dv)
        def reference(q, k, v):
            return flash_reference(q, k, v, is_causal)

        ref64 = reference_with_grads(reference, (q, k, v), dout, torch.float64)
        lowp = reference_with_grads(reference, (q, k, v), dout, q.dtype)
        for got, low, ref, label in zip(results, lowp[:1] + lowp[2:], ref64[:1] + ref64[2:], ("out", "dq", "dk", "dv")):
            assert_close_to_reference(f"{name} {who} {label}", got, low, ref)

    from torch.nn.attention import activate_flash_attention_impl

    tp.register()
    spy = Spy(monkeypatch)
    activate_flash_attention_impl(tp.PROVIDER)
    try:
        ours = run()
    finally:
        restore_flash_attention_impl()
    assert spy.counts["attention"] == 1 and spy.counts["backward"] == 1
    check(ours, "fusedattn")
    theirs = run()  # torch's flash kernel again
    assert spy.counts["attention"] == 1 and spy.counts["backward"] == 1
    check(theirs, "torch after restore")


@gpu
@needs_registry
@pytest.mark.skipif(torch_varlen is None, reason="this torch has no torch.nn.attention.varlen")
@pytest.mark.parametrize("heads", [(8, 8), (8, 2)], ids=["mha", "gqa"])
@pytest.mark.parametrize("window", [(-1, 0), (32, 0), (-1, -1)], ids=["causal", "sliding", "full"])
def test_gpu_varlen_attn_runs_on_fusedattn(window, heads, active, spy):
    case = ((100, 0, 37, 64), (100, 20, 50, 0), *heads)
    results, inputs, dout = run_varlen_attn(case, window, DEVICE, DTYPE)
    assert spy.counts["varlen_attention"] == 1 and spy.counts["_backward"] == 1
    check_varlen_attn(results, inputs, dout, case, window)


@gpu
@needs_registry
def test_gpu_compiled_sdpa_on_fused_qkv_views_runs_on_fusedattn(active, spy):
    """torch.compile (inductor) checks an extern kernel's output strides against torch's meta
    kernels: q, k, v as views of one fused projection, compiled forward and backward, equal eager."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    def layer(x, w):
        batch, seqlen, _ = x.shape
        qkv = (x @ w).view(batch, seqlen, 3, 4, 64)
        q, k, v = (qkv[:, :, i].transpose(1, 2) for i in range(3))
        with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
            out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return out.transpose(1, 2).reshape(batch, seqlen, -1)

    gen = torch.Generator().manual_seed(0)
    x = make((2, 200, 256), gen).requires_grad_()
    w = (make((256, 768), gen) / 16).requires_grad_()
    results = []
    for fn in (layer, torch.compile(layer, fullgraph=True)):
        out = fn(x, w)
        x.grad = w.grad = None
        out.float().square().sum().backward()
        results.append((out.detach(), x.grad, w.grad))
    assert spy.counts["attention"] == 2 and spy.counts["backward"] == 2
    for eager, compiled in zip(*results):  # (a wrong stride would scramble rows, far beyond rounding)
        torch.testing.assert_close(compiled, eager, rtol=1.6e-2, atol=1e-2)
