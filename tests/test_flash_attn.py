"""``fusedattn.flash_attn``: FlashAttention 2's functions, held to FlashAttention's documented
behaviour, written out here independently of fusedattn: a query at i sees the keys
[i + Sk - Sq - window_size[0], i + Sk - Sq + window_size[1]] (-1: unbounded; ``causal`` sets the
right bound to 0), ``softcap`` 0 is none, ``softmax_lse`` is (B, H, Sq) -- (H, total_q) for varlen
--, packed qkv / kv are views whose gradient lands in the packed tensor, rotary embeddings rotate q
and the new k at their cache positions. Each output and gradient meets the correctness rule against
that math in float64. Without a GPU: the PyTorch backend, and the Triton kernels under the
interpreter; on a GPU, the kernels.
"""

from __future__ import annotations

import math

import pytest
import torch

import fusedattn
from fusedattn import flash_attn as fa
from numerics import assert_close_to_reference

ON_GPU = torch.cuda.is_available()
DEVICE = "cuda" if ON_GPU else "cpu"
DTYPE = torch.bfloat16 if ON_GPU else torch.float16
BACKENDS = ["triton"] if ON_GPU else ["torch", "triton"]


def documented_attention(q, k, v, softmax_scale=None, causal=False, window_size=(-1, -1), softcap=0.0):
    """FlashAttention's semantics in plain torch, any dtype (B, S, H, D): (out, lse (B, H, Sq))."""
    batch, seqlen_q, heads_q, head_dim = q.shape
    seqlen_k, heads_kv = k.shape[1], k.shape[2]
    k, v = (t.repeat_interleave(heads_q // heads_kv, dim=2) for t in (k, v))
    scale = softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(head_dim)
    scores = torch.einsum("bqhd,bkhd->bhqk", q, k) * scale
    if softcap:
        scores = softcap * torch.tanh(scores / softcap)
    left, right = window_size
    if causal:
        right = 0
    i = torch.arange(seqlen_q, device=q.device)[:, None] + seqlen_k - seqlen_q
    j = torch.arange(seqlen_k, device=q.device)[None, :]
    keep = torch.ones(seqlen_q, seqlen_k, dtype=torch.bool, device=q.device)
    if left >= 0:
        keep &= j >= i - left
    if right >= 0:
        keep &= j <= i + right
    scores = scores.masked_fill(~keep, float("-inf"))
    lse = torch.logsumexp(scores, dim=-1)
    probs = torch.exp(scores - lse[..., None]).nan_to_num(0.0)  # a row with no key: zeros
    return torch.einsum("bhqk,bkhd->bqhd", probs, v), lse


def _inputs(shape_q, shape_k, seed=0, dtype=DTYPE):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(shape_q, generator=gen)
    k, v = (torch.randn(shape_k, generator=gen) for _ in range(2))
    dout = torch.randn(shape_q[:-1] + (shape_k[-1],), generator=gen)
    return [t.to(DEVICE, dtype) for t in (q, k, v)], dout.to(DEVICE, dtype)


def _grads(fn, leaves, dout):
    leaves = [t.detach().clone().requires_grad_() for t in leaves]
    out = fn(*leaves)
    out = out[0] if isinstance(out, tuple) else out
    grads = torch.autograd.grad(out, leaves, dout)
    return [out.detach(), *grads]


OPTIONS = {
    "plain": {},
    "causal": dict(causal=True),
    "window": dict(window_size=(7, 3)),
    "causal-window": dict(causal=True, window_size=(9, 4)),  # causal overrides the right bound
    "softcap-scale": dict(softcap=4.0, softmax_scale=0.3),
}


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("name", list(OPTIONS))
def test_flash_attn_func_matches_the_documented_semantics(backend, name):
    (q, k, v), dout = _inputs((2, 37, 4, 16), (2, 45, 2, 16))
    options = OPTIONS[name]
    with fusedattn.use_backend(backend):
        ours = _grads(lambda *t: fa.flash_attn_func(*t, **options), (q, k, v), dout)
    lowp = _grads(lambda *t: documented_attention(*t, **options)[0], (q, k, v), dout)
    ref64 = _grads(lambda *t: documented_attention(*t, **options)[0], [t.double() for t in (q, k, v)], dout.double())
    for label, a, b, c in zip(("out", "dq", "dk", "dv"), ours, lowp, ref64):
        assert_close_to_reference(f"{name} {label}", a, b, c)


def test_return_attn_probs_gives_out_lse_and_none():
    (q, k, v), _ = _inputs((2, 20, 4, 16), (2, 30, 4, 16))
    out, lse, probs = fa.flash_attn_func(q, k, v, causal=True, return_attn_probs=True)
    assert probs is None and lse.shape == (2, 4, 20) and lse.dtype == torch.float32
    _, ref_lse = documented_attention(q.double(), k.double(), v.double(), causal=True)
    assert torch.allclose(lse.double(), ref_lse, atol=2e-2)
    assert torch.equal(out, fa.flash_attn_func(q, k, v, causal=True))


def test_packed_functions_are_the_unpacked_ones_and_grad_lands_in_the_packed_tensor():
    gen = torch.Generator().manual_seed(3)
    qkv = torch.randn(2, 33, 3, 4, 16, generator=gen).to(DEVICE, DTYPE).requires_grad_()
    out = fa.flash_attn_qkvpacked_func(qkv, causal=True)
    q, k, v = (qkv[:, :, i].detach() for i in range(3))
    assert torch.equal(out, fa.flash_attn_func(q, k, v, causal=True))
    out.float().sum().backward()
    assert qkv.grad.shape == qkv.shape and qkv.grad.abs().sum() > 0
    kv = torch.stack((k, v), dim=2)
    assert torch.equal(fa.flash_attn_kvpacked_func(q, kv, window_size=(5, 5)),
                       fa.flash_attn_func(q, k, v, window_size=(5, 5)))


@pytest.mark.parametrize("backend", BACKENDS)
def test_varlen_matches_each_sequence_and_lse_is_heads_by_tokens(backend):
    lengths_q, lengths_k = [5, 17, 0, 9], [8, 17, 3, 12]
    cu_q = torch.tensor([0, *torch.tensor(lengths_q).cumsum(0).tolist()], dtype=torch.int32)
    cu_k = torch.tensor([0, *torch.tensor(lengths_k).cumsum(0).tolist()], dtype=torch.int32)
    (q, k, v), _ = _inputs((sum(lengths_q), 4, 16), (sum(lengths_k), 2, 16), seed=5)
    with fusedattn.use_backend(backend):
        out, lse, probs = fa.flash_attn_varlen_func(q, k, v, cu_q.to(DEVICE), cu_k.to(DEVICE), max(lengths_q),
                                                    max(lengths_k), causal=True, window_size=(6, -1),
                                                    return_attn_probs=True)
    assert probs is None and lse.shape == (4, sum(lengths_q))
    for b in range(len(lengths_q)):
        qs, ks = slice(cu_q[b], cu_q[b + 1]), slice(cu_k[b], cu_k[b + 1])
        if lengths_q[b] == 0:
            continue
        args = [t[None].double() for t in (q[qs], k[ks], v[ks])]
        ref_out, ref_lse = documented_attention(*args, causal=True, window_size=(6, -1))
        low_out, _ = documented_attention(*[t[None] for t in (q[qs], k[ks], v[ks])], causal=True, window_size=(6, -1))
        assert_close_to_reference(f"sequence {b} out", out[qs][None], low_out, ref_out)
        assert torch.allclose(lse[:, qs].double(), ref_lse[0], atol=2e-2)


def test_varlen_packed_functions_are_the_unpacked_ones():
    lengths = [7, 12, 4]
    cu = torch.tensor([0, 7, 19, 23], dtype=torch.int32, device=DEVICE)
    gen = torch.Generator().manual_seed(4)
    qkv = torch.randn(sum(lengths), 3, 2, 16, generator=gen).to(DEVICE, DTYPE)
    want = fa.flash_attn_varlen_func(qkv[:, 0], qkv[:, 1], qkv[:, 2], cu, cu, 12, 12, causal=True)
    assert torch.equal(fa.flash_attn_varlen_qkvpacked_func(qkv, cu, 12, causal=True), want)
    assert torch.equal(fa.flash_attn_varlen_kvpacked_func(qkv[:, 0], qkv[:, 1:], cu, cu, 12, 12, causal=True), want)


def _rotate_by_complex(x, cos, sin, positions, interleaved):
    """Rotary embedding as complex multiplication, pairs as FlashAttention documents them."""
    half = cos.shape[1]
    x = x.double()
    if interleaved:
        pairs = torch.complex(x[..., 0:2 * half:2], x[..., 1:2 * half:2])
    else:
        pairs = torch.complex(x[..., :half], x[..., half:2 * half])
    angle = torch.complex(cos[positions].double(), sin[positions].double()).unsqueeze(2)
    turned = pairs * angle
    if interleaved:
        rotated = torch.stack((turned.real, turned.imag), dim=-1).flatten(-2)
    else:
        rotated = torch.cat((turned.real, turned.imag), dim=-1)
    return torch.cat((rotated, x[..., 2 * half:]), dim=-1)


@pytest.mark.parametrize("interleaved", [True, False], ids=["interleaved", "halves"])
@pytest.mark.parametrize("causal", [True, False], ids=["causal", "full"])
def test_with_kvcache_appends_rotates_and_attends(interleaved, causal):
    batch, capacity, heads_q, heads_kv, dim, new = 2, 64, 4, 2, 32, 3
    gen = torch.Generator().manual_seed(6)
    make = lambda *shape: torch.randn(*shape, generator=gen).to(DEVICE, DTYPE)  # noqa: E731
    k_cache, v_cache = make(batch, capacity, heads_kv, dim), make(batch, capacity, heads_kv, dim)
    q, k_new, v_new = make(batch, new, heads_q, dim), make(batch, new, heads_kv, dim), make(batch, new, heads_kv, dim)
    angles = torch.rand(capacity, dim // 4, generator=gen) * 6.0  # rotary_dim = dim / 2: half the dims rotate
    cos, sin = angles.cos().to(DEVICE, DTYPE), angles.sin().to(DEVICE, DTYPE)
    lengths = torch.tensor([10, 33], dtype=torch.int32, device=DEVICE)
    k_before, v_before = k_cache.clone(), v_cache.clone()
    out, lse = fa.flash_attn_with_kvcache(q, k_cache, v_cache, k_new, v_new, rotary_cos=cos, rotary_sin=sin,
                                         cache_seqlens=lengths, causal=causal, rotary_interleaved=interleaved,
                                         return_softmax_lse=True)
    assert lse.shape == (batch, heads_q, new)
    steps = torch.arange(new, device=DEVICE)
    positions = lengths.long()[:, None] + steps
    k_rot = _rotate_by_complex(k_new, cos, sin, positions, interleaved)
    q_positions = positions if causal else lengths.long()[:, None].expand(batch, new)
    q_rot = _rotate_by_complex(q, cos, sin, q_positions, interleaved)
    for b in range(batch):
        n = int(lengths[b])
        written = slice(n, n + new)
        assert torch.allclose(k_cache[b, written].double(), k_rot[b], atol=3e-2), "the new k, rotated, in the cache"
        assert torch.equal(v_cache[b, written], v_new[b])
        assert torch.equal(k_cache[b, :n], k_before[b, :n]) and torch.equal(v_cache[b, n + new:], v_before[b, n + new:])
        keys = torch.cat((k_before[b, :n].double(), k_rot[b]))[None]
        values = torch.cat((v_before[b, :n], v_new[b])).double()[None]
        ref_out, ref_lse = documented_attention(q_rot[b][None], keys, values, causal=causal)
        assert torch.allclose(out[b].double(), ref_out[0], atol=3e-2), b
        assert torch.allclose(lse[b].double(), ref_lse[0], atol=3e-2), b


def test_unsupported_features_raise_naming_them():
    (q, k, v), _ = _inputs((1, 8, 2, 16), (1, 8, 2, 16))
    with pytest.raises(NotImplementedError, match="alibi_slopes"):
        fa.flash_attn_func(q, k, v, alibi_slopes=torch.ones(2, device=DEVICE))
    with pytest.raises(NotImplementedError, match="dropout"):
        fa.flash_attn_func(q, k, v, dropout_p=0.1)
    cache = torch.zeros(1, 16, 2, 16, device=DEVICE, dtype=DTYPE)
    for name in ("cache_batch_idx", "cache_leftpad"):
        with pytest.raises(NotImplementedError, match=name):
            fa.flash_attn_with_kvcache(q[:, :1], cache, cache.clone(), cache_seqlens=4,
                                       **{name: torch.zeros(1, dtype=torch.int32, device=DEVICE)})
    cu = torch.tensor([0, 8], dtype=torch.int32, device=DEVICE)
    with pytest.raises(NotImplementedError, match="block_table"):
        fa.flash_attn_varlen_func(q[0], k[0], v[0], cu, cu, 8, 8, block_table=cu[None])
    assert fa.flash_attn_func(q, k, v, dropout_p=0.0).shape == q.shape  # dropout_p=0.0 is plain attention
