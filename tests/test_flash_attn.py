"""``fusedattn.flash_attn``: FlashAttention 2's functions, held to FlashAttention's documented
behaviour, written out here independently of fusedattn: a query at i sees the keys
[i + Sk - Sq - window_size[0], i + Sk - Sq + window_size[1]] (-1: unbounded; ``causal`` sets the
right bound to 0), ``softcap`` 0 is none, ``softmax_lse`` is (B, H, Sq) -- (H, total_q) for varlen
--, packed qkv / kv are views whose gradient lands in the packed tensor, rotary embeddings rotate q
and the new k at their cache positions (the cache rows, whatever ``cache_leftpad``),
``cache_batch_idx`` picks each sequence's cache row and ``cache_leftpad`` the row its keys start
at, and a varlen ``block_table`` holds sequence i's first cu_seqlens_k[i + 1] - cu_seqlens_k[i]
keys in its pages, and ``alibi_slopes`` (nheads,) or (batch, nheads) -- batch: sequences for varlen --
add ``-alibi_slope * |i + seqlen_k - seqlen_q - j|`` to the score (after softcap). Each output and gradient meets the correctness rule against that math in
float64. Without a GPU: the PyTorch backend, and the Triton kernels under the interpreter; on a
GPU, the kernels.
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


def documented_attention(q, k, v, softmax_scale=None, causal=False, window_size=(-1, -1), softcap=0.0,
                         alibi_slopes=None):
    """FlashAttention's semantics in plain torch, any dtype (B, S, H, D): (out, lse (B, H, Sq)).
    ``alibi_slopes``: (H,) or (B, H)."""
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
    if alibi_slopes is not None:  # FlashAttention: -alibi_slope * |i + seqlen_k - seqlen_q - j| (i is shifted above)
        slopes = alibi_slopes.to(scores.dtype).expand(batch, heads_q)[:, :, None, None]
        scores = scores - slopes * (i - j).abs().to(scores.dtype)
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


def _slopes(shape, seed=7):
    """ALiBi slopes as FlashAttention takes them: float32, on the device."""
    return (0.05 + 0.5 * torch.rand(shape, generator=torch.Generator().manual_seed(seed))).to(DEVICE)


ALIBI_OPTIONS = {
    "heads-causal": ((4,), dict(causal=True)),
    "batch-heads-window": ((2, 4), dict(window_size=(7, 3))),
    "batch-heads-softcap": ((2, 4), dict(softcap=4.0, softmax_scale=0.3)),
    "heads-plain": ((4,), {}),
}


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("name", list(ALIBI_OPTIONS))
def test_flash_attn_func_alibi_matches_the_documented_semantics(backend, name):
    (q, k, v), dout = _inputs((2, 37, 4, 16), (2, 45, 2, 16), seed=11)
    shape, options = ALIBI_OPTIONS[name]
    options = dict(options, alibi_slopes=_slopes(shape))
    with fusedattn.use_backend(backend):
        ours = _grads(lambda *t: fa.flash_attn_func(*t, **options), (q, k, v), dout)
    lowp = _grads(lambda *t: documented_attention(*t, **options)[0], (q, k, v), dout)
    ref64 = _grads(lambda *t: documented_attention(*t, **options)[0], [t.double() for t in (q, k, v)], dout.double())
    for label, a, b, c in zip(("out", "dq", "dk", "dv"), ours, lowp, ref64):
        assert_close_to_reference(f"alibi {name} {label}", a, b, c)
    plain = fa.flash_attn_func(q, k, v, **{key: val for key, val in options.items() if key != "alibi_slopes"})
    assert (ours[0] - plain).abs().max() > 1e-2  # the slopes change the result


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
    slopes = _slopes((2, 4))
    assert torch.equal(fa.flash_attn_qkvpacked_func(qkv.detach(), causal=True, alibi_slopes=slopes),
                       fa.flash_attn_func(q, k, v, causal=True, alibi_slopes=slopes))
    assert torch.equal(fa.flash_attn_kvpacked_func(q, kv, alibi_slopes=slopes[0]),
                       fa.flash_attn_func(q, k, v, alibi_slopes=slopes[0]))


@pytest.mark.parametrize("alibi", [None, (4,), (4, 4)], ids=["no-alibi", "alibi-heads", "alibi-batch-heads"])
@pytest.mark.parametrize("backend", BACKENDS)
def test_varlen_matches_each_sequence_and_lse_is_heads_by_tokens(backend, alibi):
    lengths_q, lengths_k = [5, 17, 0, 9], [8, 17, 3, 12]
    slopes = None if alibi is None else _slopes(alibi)  # (batch, nheads): a row per sequence
    cu_q = torch.tensor([0, *torch.tensor(lengths_q).cumsum(0).tolist()], dtype=torch.int32)
    cu_k = torch.tensor([0, *torch.tensor(lengths_k).cumsum(0).tolist()], dtype=torch.int32)
    (q, k, v), _ = _inputs((sum(lengths_q), 4, 16), (sum(lengths_k), 2, 16), seed=5)
    with fusedattn.use_backend(backend):
        out, lse, probs = fa.flash_attn_varlen_func(q, k, v, cu_q.to(DEVICE), cu_k.to(DEVICE), max(lengths_q),
                                                    max(lengths_k), causal=True, window_size=(6, -1),
                                                    alibi_slopes=slopes, return_attn_probs=True)
    assert probs is None and lse.shape == (4, sum(lengths_q))
    for b in range(len(lengths_q)):
        qs, ks = slice(cu_q[b], cu_q[b + 1]), slice(cu_k[b], cu_k[b + 1])
        if lengths_q[b] == 0:
            continue
        args = [t[None].double() for t in (q[qs], k[ks], v[ks])]
        options = dict(causal=True, window_size=(6, -1),
                       alibi_slopes=None if slopes is None else slopes if slopes.dim() == 1 else slopes[b])
        ref_out, ref_lse = documented_attention(*args, **options)
        low_out, _ = documented_attention(*[t[None] for t in (q[qs], k[ks], v[ks])], **options)
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
    slopes = _slopes((3, 2))
    want = fa.flash_attn_varlen_func(qkv[:, 0], qkv[:, 1], qkv[:, 2], cu, cu, 12, 12, alibi_slopes=slopes)
    assert torch.equal(fa.flash_attn_varlen_qkvpacked_func(qkv, cu, 12, alibi_slopes=slopes), want)
    assert torch.equal(fa.flash_attn_varlen_kvpacked_func(qkv[:, 0], qkv[:, 1:], cu, cu, 12, 12, alibi_slopes=slopes),
                       want)


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


def test_dropout_is_passed_through():
    """dropout_p reaches fusedattn's dropout (SEMANTICS 3.11), with the other options: the same seed
    gives the output of ``fusedattn.attention`` with the same arguments, the varlen and packed forms
    too; dropout_p=0.0 is plain attention."""
    import fusedattn

    (q, k, v), _ = _inputs((2, 24, 4, 16), (2, 40, 2, 16))
    slopes = torch.rand(4, device=DEVICE)
    torch.manual_seed(1)
    ours = fa.flash_attn_func(q, k, v, dropout_p=0.2, causal=True, alibi_slopes=slopes, window_size=(9, 0))
    torch.manual_seed(1)
    direct = fusedattn.attention(q, k, v, dropout_p=0.2, causal=True, alibi_slopes=slopes, window=(9, 0))
    assert torch.equal(ours, direct)
    assert not torch.equal(ours, fa.flash_attn_func(q, k, v, causal=True, alibi_slopes=slopes, window_size=(9, 0)))
    cu_q = torch.tensor([0, 24, 48], dtype=torch.int32, device=DEVICE)
    cu_k = torch.tensor([0, 40, 80], dtype=torch.int32, device=DEVICE)
    torch.manual_seed(2)
    varlen = fa.flash_attn_varlen_func(q.flatten(0, 1), k.flatten(0, 1), v.flatten(0, 1), cu_q, cu_k, 24, 40,
                                       dropout_p=0.3)
    torch.manual_seed(2)
    assert torch.equal(varlen, fusedattn.varlen_attention(q.flatten(0, 1), k.flatten(0, 1), v.flatten(0, 1), cu_q,
                                                          cu_k, 24, 40, dropout_p=0.3))
    torch.manual_seed(2)  # sequence s is batch s of the mask: the batched call drops the same entries
    assert torch.allclose(varlen.view(q.shape), fa.flash_attn_func(q, k, v, dropout_p=0.3), atol=1e-3)
    assert fa.flash_attn_func(q, k, v, dropout_p=0.0).shape == q.shape  # dropout_p=0.0 is plain attention


# ----------------------------------------------------------------------------- cache_batch_idx, cache_leftpad
# Sequence b of q reads cache row cache_batch_idx[b] (default b); its keys are rows
# [cache_leftpad[b], cache_seqlens[b]) of that row, then the new tokens, which are written into the row
# at cache_seqlens[b] ...; causal / window align bottom-right over those keys. Rotary positions are the
# cache rows (cache_seqlens + i), the padding notwithstanding (FlashAttention's kernel and tests); q is
# rotated per position when causal or local, where a window side of S_cache or more counts as none.
# "rows": the cache's rows (B_cache); "capacity": S_cache (a multiple of 16 or not: both ways of running
# cache_batch_idx); "seqlens": a list, an int, or None (the whole cache); "alibi": the shape of ALiBi slopes,
# (H,) or (B, H) (row b: sequence b of q, whatever its cache row), distances aligned as causal is.

KVCACHE_CASES = {
    "batch-idx": dict(rows=5, capacity=48, batch_idx=[3, 0], seqlens=[10, 29], new=3, causal=True),
    "batch-idx-odd-capacity": dict(rows=3, capacity=45, batch_idx=[2, 0], seqlens=[17, 30], new=2, seqlen_q=2,
                                   window_size=(6, 2)),
    "batch-idx-rotary-mqa": dict(rows=4, capacity=32, batch_idx=[1, 2], seqlens=[4, 21], new=5, heads_kv=1,
                                 rotary="halves", causal=True),
    "batch-idx-shared-row-int-seqlens": dict(rows=3, capacity=37, batch_idx=[2, 2], seqlens=19, new=0, seqlen_q=3,
                                             causal=True),
    "leftpad": dict(rows=2, capacity=48, leftpad=[3, 0], seqlens=[17, 9], new=2, rotary="halves", causal=True),
    "leftpad-batch-idx-rotary-window": dict(rows=4, capacity=48, batch_idx=[3, 1], leftpad=[5, 11],
                                            seqlens=[20, 11], new=3, rotary="interleaved", window_size=(4, 0)),
    "leftpad-batch-idx-odd-capacity-causal-window": dict(rows=3, capacity=39, batch_idx=[0, 2], leftpad=[7, 2],
                                                         seqlens=[30, 12], new=4, causal=True, window_size=(5, 3),
                                                         rotary="interleaved"),
    "leftpad-no-new-softcap": dict(rows=2, capacity=40, leftpad=[6, 1], seqlens=[27, 13], new=0, seqlen_q=4,
                                   window_size=(5, 3), softcap=5.0, softmax_scale=0.2),
    "leftpad-whole-cache": dict(rows=3, capacity=33, batch_idx=[1, 0], leftpad=[7, 29], seqlens=None, new=0,
                                seqlen_q=3, causal=True),
    "leftpad-zeros-batch-idx": dict(rows=3, capacity=32, batch_idx=[2, 1], leftpad=[0, 0], seqlens=[9, 14], new=2,
                                    rotary="halves", causal=True),
    "leftpad-zeros-batch-idx-odd-capacity": dict(rows=4, capacity=27, batch_idx=[0, 3], leftpad=[0, 0],
                                                 seqlens=[20, 6], new=2, window_size=(3, -1)),
    "decode-leftpad-batch-idx": dict(rows=5, capacity=48, batch_idx=[4, 0], leftpad=[13, 2], seqlens=[31, 2], new=1,
                                     seqlen_q=1, heads_q=8, rotary="interleaved"),
    "wide-window-rotary": dict(rows=3, capacity=32, batch_idx=[2, 0], seqlens=[8, 12], new=3, window_size=(100, -1),
                               rotary="interleaved"),
    "batch-idx-alibi": dict(rows=5, capacity=48, batch_idx=[3, 0], seqlens=[10, 29], new=3, causal=True,
                            alibi=(2, 4)),
    "leftpad-batch-idx-rotary-window-alibi": dict(rows=4, capacity=48, batch_idx=[3, 1], leftpad=[5, 11],
                                                  seqlens=[20, 11], new=3, rotary="interleaved", window_size=(4, 0),
                                                  alibi=(2, 4)),
    "decode-alibi-heads": dict(rows=2, capacity=32, seqlens=[9, 30], new=1, seqlen_q=1, alibi=(4,)),
}


def _cache_reference(q, k_before, v_before, k_new, v_new, cos, sin, lengths, pads, rows, options, interleaved,
                     alibi=None):
    """Per sequence: the keys and values FlashAttention attends over (float64), the rotated new k, and
    (out, lse) of the rotated q over them, in float64 and in q's dtype (the eager error's yardstick).
    ``alibi``: slopes (H,) or (B, H), row b for sequence b."""
    batch, seqlen_q = q.shape[:2]
    capacity, new = k_before.shape[1], (0 if k_new is None else k_new.shape[1])
    left, right = options.get("window_size", (-1, -1))
    local = options.get("causal", False) or 0 <= left < capacity or 0 <= right < capacity
    k_rot, q_rot = k_new, q.double()
    if cos is not None:
        steps = torch.arange(max(new, seqlen_q), device=q.device)
        positions = torch.tensor(lengths, device=q.device)[:, None] + steps
        k_rot = _rotate_by_complex(k_new, cos, sin, positions[:, :new], interleaved)
        q_positions = positions[:, :seqlen_q] if local else positions[:, :1].expand(batch, seqlen_q)
        q_rot = _rotate_by_complex(q, cos, sin, q_positions, interleaved)
    results = []
    for b in range(batch):
        n, pad, row = lengths[b], pads[b], rows[b]
        keys, values = k_before[row, pad:n].double(), v_before[row, pad:n].double()
        if new:
            keys, values = torch.cat((keys, k_rot[b].double())), torch.cat((values, v_new[b].double()))
        sequence_options = options if alibi is None else \
            dict(options, alibi_slopes=alibi if alibi.dim() == 1 else alibi[b])
        ref = documented_attention(q_rot[b][None], keys[None], values[None], **sequence_options)
        low = documented_attention(q_rot[b][None].to(q.dtype), keys[None].to(q.dtype), values[None].to(q.dtype),
                                   **sequence_options)
        results.append((ref, low))
    return k_rot, results


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("name", list(KVCACHE_CASES))
def test_with_kvcache_batch_idx_and_leftpad_match_the_documented_semantics(backend, name):
    case = dict(KVCACHE_CASES[name])
    batch, heads_q, heads_kv, dim = 2, case.pop("heads_q", 4), case.pop("heads_kv", 2), 32
    rows, capacity, new = case.pop("rows"), case.pop("capacity"), case.pop("new")
    seqlen_q = case.pop("seqlen_q", new)
    batch_idx, leftpad, seqlens = case.pop("batch_idx", None), case.pop("leftpad", None), case.pop("seqlens")
    rotary = case.pop("rotary", None)
    alibi_shape = case.pop("alibi", None)
    options = case  # causal, window_size, softcap, softmax_scale
    gen = torch.Generator().manual_seed(sum(map(ord, name)))
    make = lambda *shape: torch.randn(*shape, generator=gen).to(DEVICE, DTYPE)  # noqa: E731
    k_cache, v_cache = make(rows, capacity, heads_kv, dim), make(rows, capacity, heads_kv, dim)
    q = make(batch, seqlen_q, heads_q, dim)
    k_new, v_new = (make(batch, new, heads_kv, dim), make(batch, new, heads_kv, dim)) if new else (None, None)
    cos = sin = None
    if rotary:
        angles = torch.rand(capacity, dim // 4, generator=gen) * 6.0  # rotary_dim 16 of 32
        cos, sin = angles.cos().to(DEVICE, DTYPE), angles.sin().to(DEVICE, DTYPE)
    int32 = lambda values: torch.tensor(values, dtype=torch.int32, device=DEVICE)  # noqa: E731
    lengths = [capacity] * batch if seqlens is None else [seqlens] * batch if isinstance(seqlens, int) else seqlens
    pads, cache_rows = leftpad or [0] * batch, batch_idx or list(range(batch))
    k_before, v_before = k_cache.clone(), v_cache.clone()
    slopes = None if alibi_shape is None else _slopes(alibi_shape, seed=len(name))
    with fusedattn.use_backend(backend):
        out, lse = fa.flash_attn_with_kvcache(
            q, k_cache, v_cache, k_new, v_new, rotary_cos=cos, rotary_sin=sin,
            cache_seqlens=int32(seqlens) if isinstance(seqlens, list) else seqlens,
            cache_batch_idx=None if batch_idx is None else int32(batch_idx),
            cache_leftpad=None if leftpad is None else int32(leftpad), rotary_interleaved=rotary == "interleaved",
            alibi_slopes=slopes, return_softmax_lse=True, **options)
    assert out.shape == (batch, seqlen_q, heads_q, dim) and lse.shape == (batch, heads_q, seqlen_q)
    k_rot, results = _cache_reference(q, k_before, v_before, k_new, v_new, cos, sin, lengths, pads, cache_rows,
                                      options, rotary == "interleaved", slopes)
    for b, ((ref_out, ref_lse), (low_out, _)) in enumerate(results):
        assert_close_to_reference(f"{name} sequence {b} out", out[b][None], low_out, ref_out)
        assert torch.allclose(lse[b].double(), ref_lse[0], atol=2e-2), (name, b)
    # the cache: the new tokens in place at the right rows, everything else untouched
    written = torch.zeros(rows, capacity, dtype=torch.bool, device=DEVICE)
    for b in range(batch if new else 0):
        row, n = cache_rows[b], lengths[b]
        written[row, n:n + new] = True
        assert torch.allclose(k_cache[row, n:n + new].double(), k_rot[b].double(), atol=3e-2), "the new k, rotated"
        if rotary is None:
            assert torch.equal(k_cache[row, n:n + new], k_new[b])
        assert torch.equal(v_cache[row, n:n + new], v_new[b])
    assert torch.equal(k_cache[~written], k_before[~written]) and torch.equal(v_cache[~written], v_before[~written])


def _cache_call(**changes):
    """A flash_attn_with_kvcache call on 2 sequences of a 3-row cache (S_cache 32, or `capacity`),
    with `changes` to its arguments; returns (the call, the caches, their contents before)."""
    capacity = changes.pop("capacity", 32)
    gen = torch.Generator().manual_seed(11)
    make = lambda *shape: torch.randn(*shape, generator=gen).to(DEVICE, DTYPE)  # noqa: E731
    k_cache, v_cache = make(3, capacity, 2, 16), make(3, capacity, 2, 16)
    int32 = lambda values: torch.tensor(values, dtype=torch.int32, device=DEVICE)  # noqa: E731
    args = dict(q=make(2, 2, 4, 16), k_cache=k_cache, v_cache=v_cache, k=make(2, 2, 2, 16), v=make(2, 2, 2, 16),
                cache_seqlens=int32([5, 9]), cache_batch_idx=int32([2, 0]), cache_leftpad=int32([1, 3]))
    args.update(changes)
    return (lambda: fa.flash_attn_with_kvcache(**args)), (k_cache, v_cache), (k_cache.clone(), v_cache.clone())


_I32 = dict(dtype=torch.int32, device=DEVICE)
KVCACHE_ERRORS = {
    "batch-idx-with-block-table": (dict(cache_leftpad=None, block_table=torch.zeros(2, 2, **_I32)), ValueError,
                                   "cache_batch_idx.*block_table"),
    "leftpad-with-block-table": (dict(cache_batch_idx=None, block_table=torch.zeros(2, 2, **_I32)), ValueError,
                                 "cache_leftpad.*block_table"),
    "batch-idx-int64": (dict(cache_batch_idx=torch.tensor([2, 0], device=DEVICE)), TypeError, "cache_batch_idx"),
    "batch-idx-one-too-many": (dict(cache_batch_idx=torch.tensor([2, 0, 1], **_I32)), ValueError, "cache_batch_idx"),
    "batch-idx-out-of-range": (dict(cache_batch_idx=torch.tensor([3, 0], **_I32)), ValueError, "cache_batch_idx"),
    "batch-idx-out-of-range-paged-way": (dict(cache_leftpad=None, cache_batch_idx=torch.tensor([0, -1], **_I32)),
                                         ValueError, "cache_batch_idx"),
    "batch-idx-out-of-range-odd-capacity": (dict(cache_leftpad=None, capacity=29,
                                                 cache_batch_idx=torch.tensor([0, 3], **_I32)),
                                            ValueError, "cache_batch_idx"),
    "leftpad-int64": (dict(cache_leftpad=torch.tensor([1, 3], device=DEVICE)), TypeError, "cache_leftpad"),
    "leftpad-2d": (dict(cache_leftpad=torch.tensor([[1, 3]], **_I32)), ValueError, "cache_leftpad"),
    "leftpad-past-seqlens": (dict(cache_leftpad=torch.tensor([1, 10], **_I32)), ValueError, "cache_leftpad"),
    "leftpad-negative": (dict(cache_leftpad=torch.tensor([-1, 3], **_I32)), ValueError, "cache_leftpad"),
    "leftpad-new-past-capacity": (dict(cache_seqlens=torch.tensor([5, 31], **_I32)), ValueError, "cache rows"),
    "leftpad-new-k-batch": (dict(k=torch.zeros(1, 2, 2, 16, device=DEVICE, dtype=DTYPE)), ValueError, "`k`"),
}


@pytest.mark.parametrize("name", list(KVCACHE_ERRORS))
def test_with_kvcache_batch_idx_and_leftpad_errors_write_nothing(name):
    changes, error, match = KVCACHE_ERRORS[name]
    call, caches, before = _cache_call(**changes)
    with pytest.raises(error, match=match):
        call()
    for cache, old in zip(caches, before):
        assert torch.equal(cache, old), "nothing is written before an error"


# ----------------------------------------------------------------------------- varlen with a paged block_table
# k, v are pages (num_blocks, page_block_size, Hkv, D); sequence i's keys are its first
# cu_seqlens_k[i + 1] - cu_seqlens_k[i] tokens, token t in page block_table[i, t // page_block_size] at
# row t % page_block_size. Only the differences of cu_seqlens_k count; table entries past a sequence's
# pages are never read.

PAGED_VARLEN_CASES = {
    "pages-of-16-causal-window": dict(page=16, options=dict(causal=True, window_size=(6, -1))),
    "odd-pages-gqa-softcap": dict(page=5, options=dict(softcap=3.0, softmax_scale=0.4)),
    "pages-of-7-plain-shifted-offsets": dict(page=7, options={}, offset=13),
    "shared-pages-window": dict(page=8, options=dict(window_size=(4, 9)), shared=True),
    "pages-of-16-causal-alibi": dict(page=16, options=dict(causal=True, alibi_slopes=_slopes((4,)))),
}


def _paged_problem(page, offset=0, shared=False, seed=21):
    """Four sequences (one without queries or keys) in shuffled pages, with spare table columns that
    hold pages that do not exist; ``shared``: the first two sequences start in the same page."""
    lengths_q, lengths_k = [5, 0, 11, 4], [13, 0, 29, 7]
    gen = torch.Generator().manual_seed(seed)
    per_seq = [-(-n // page) for n in lengths_k]
    columns = max(per_seq) + 2
    num_blocks = sum(per_seq) + 3
    order = torch.randperm(num_blocks, generator=gen).tolist()
    table = torch.full((4, columns), 10_000, dtype=torch.int32)  # never read: past each sequence's pages
    for i, count in enumerate(per_seq):
        table[i, :count] = torch.tensor([order.pop() for _ in range(count)], dtype=torch.int32)
    if shared:
        table[1, 0] = table[0, 0]
        lengths_k[1], lengths_q[1] = 3, 2
    cu_q = torch.tensor([0, *torch.tensor(lengths_q).cumsum(0).tolist()], dtype=torch.int32)
    cu_k = torch.tensor([offset, *(offset + torch.tensor(lengths_k).cumsum(0)).tolist()], dtype=torch.int32)
    (q, k_pages, v_pages), _ = _inputs((sum(lengths_q), 4, 16), (num_blocks, page, 2, 16), seed=seed)
    dout = torch.randn(q.shape, generator=gen).to(DEVICE, DTYPE)
    return q, k_pages, v_pages, dout, table.to(DEVICE), cu_q.to(DEVICE), cu_k.to(DEVICE), lengths_q, lengths_k


def _documented_paged_varlen(q, k_pages, v_pages, table, lengths_q, lengths_k, options):
    """out (total_q, H, D): each sequence's keys read page by page, then documented_attention."""
    outs, start = [], 0
    page = k_pages.shape[1]
    for i, (nq, nk) in enumerate(zip(lengths_q, lengths_k)):
        pages = [int(table[i, j]) for j in range(-(-nk // page))]
        keys = torch.cat([k_pages[p] for p in pages] or [k_pages[:0, 0]])[:nk]
        values = torch.cat([v_pages[p] for p in pages] or [v_pages[:0, 0]])[:nk]
        if nq:
            outs.append(documented_attention(q[start:start + nq][None], keys[None], values[None], **options)[0][0])
        start += nq
    return torch.cat(outs)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("name", list(PAGED_VARLEN_CASES))
def test_varlen_block_table_matches_the_documented_semantics(backend, name):
    case = PAGED_VARLEN_CASES[name]
    options = case["options"]
    q, k_pages, v_pages, dout, table, cu_q, cu_k, lengths_q, lengths_k = _paged_problem(
        case["page"], case.get("offset", 0), case.get("shared", False))

    def ours(*t):
        return fa.flash_attn_varlen_func(t[0], t[1], t[2], cu_q, cu_k, max(lengths_q), max(lengths_k), **options,
                                         block_table=table)

    with fusedattn.use_backend(backend):
        got = _grads(ours, (q, k_pages, v_pages), dout)
        out, lse, probs = fa.flash_attn_varlen_func(q, k_pages, v_pages, cu_q, cu_k, max(lengths_q), max(lengths_k),
                                                    **options, block_table=table, return_attn_probs=True)
    assert probs is None and lse.shape == (4, sum(lengths_q)) and torch.equal(out, got[0])
    reference = lambda *t: _documented_paged_varlen(*t, table, lengths_q, lengths_k, options)  # noqa: E731
    lowp = _grads(reference, (q, k_pages, v_pages), dout)
    ref64 = _grads(reference, [t.double() for t in (q, k_pages, v_pages)], dout.double())
    for label, a, b, c in zip(("out", "dq", "dk pages", "dv pages"), got, lowp, ref64):
        assert_close_to_reference(f"{name} {label}", a, b, c)
    start = 0
    for i, nq in enumerate(lengths_q):
        if nq:
            rows = slice(start, start + nq)
            page = k_pages.shape[1]
            pages = [int(table[i, j]) for j in range(-(-lengths_k[i] // page))]
            keys = torch.cat([k_pages[p] for p in pages])[:lengths_k[i]].double()
            values = torch.cat([v_pages[p] for p in pages])[:lengths_k[i]].double()
            _, ref_lse = documented_attention(q[rows][None].double(), keys[None], values[None], **options)
            assert torch.allclose(lse[:, rows].double(), ref_lse[0], atol=2e-2), (name, i)
        start += nq


def _paged_varlen_call(**changes):
    q, k_pages, v_pages, _, table, cu_q, cu_k, lengths_q, lengths_k = _paged_problem(16)
    args = dict(q=q, k=k_pages, v=v_pages, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, max_seqlen_q=max(lengths_q),
                max_seqlen_k=max(lengths_k), block_table=table)
    for key, change in changes.items():
        args[key] = change(args[key])
    return lambda: fa.flash_attn_varlen_func(**args)


def _set(index, value):
    def change(t):
        t = t.clone()
        t[index] = value
        return t
    return change


PAGED_VARLEN_ERRORS = {
    "table-int64": (dict(block_table=lambda t: t.long()), TypeError, "block_table"),
    "table-1d": (dict(block_table=lambda t: t[0]), ValueError, "block_table"),
    "table-rows": (dict(block_table=lambda t: t[:3]), ValueError, "block_table"),
    "k-not-paged": (dict(k=lambda t: t[0]), ValueError, "paged"),
    "v-pages-differ": (dict(v=lambda t: t[:, :8]), ValueError, "`v`"),
    "page-outside-cache": (dict(block_table=_set((2, 1), 10_000)), ValueError, "outside"),
    "negative-page": (dict(block_table=_set((0, 0), -1)), ValueError, "outside"),
    "longer-than-table-row": (dict(cu_seqlens_k=_set(slice(3, None), 100), max_seqlen_k=lambda n: 100), ValueError,
                              "addresses"),
    "cu-seqlens-k-decreasing": (dict(cu_seqlens_k=_set(2, 0)), ValueError, "never decrease"),
    "cu-seqlens-k-count": (dict(cu_seqlens_k=lambda t: t[:-1]), ValueError, "B \\+ 1"),
    "cu-seqlens-k-int64": (dict(cu_seqlens_k=lambda t: t.long()), TypeError, "cu_seqlens_k"),
}


@pytest.mark.parametrize("name", list(PAGED_VARLEN_ERRORS))
def test_varlen_block_table_errors(name):
    changes, error, match = PAGED_VARLEN_ERRORS[name]
    with pytest.raises(error, match=match):
        _paged_varlen_call(**changes)()
