"""A forward+backward step captured in a CUDA graph and replayed on new inputs (GPU only).

Serving loops and torch.compile's "reduce-overhead" mode replay captured graphs; the benchmark
times every system's graph too (`python -m fusedattn.bench`, "graph" columns). A capture holds
whatever the host decided at capture time, so a replay is only right if no decision depended on
the data: each case is captured once, then replayed on two sets of fresh random inputs copied
into the captured tensors, and every result is compared with the float64 reference of those
inputs (SPEC 4). A mask goes in as a BlockMask built before the capture (a bool tensor is
classified into tiles on each call, which reads the tile states back on the host)."""

from __future__ import annotations

import pytest
import torch

import fusedattn

from attention_runner import (capture_graph, dense_mask, forward_backward, make_bias, make_inputs, make_mask,
                              make_sinks)
from cases import Case
from fusedattn.reference import reference_attention
from numerics import assert_close_to_reference

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a CUDA device")

CASES = [
    Case(2, 4, 4, 1000, 1000, 128, causal=True, dtype=torch.bfloat16),  # the Gluon kernels on sm_90
    Case(1, 8, 2, 777, 777, 64, causal=True, window=(200, 0), softcap=20.0, dtype=torch.bfloat16, layout="bhsd"),
    Case(1, 4, 2, 333, 517, 96, deterministic=True, sinks=True, lse_grad=True),  # Triton kernels, fp16
    Case(1, 4, 4, 512, 512, 128, causal=True, bias="full", dtype=torch.bfloat16),
    Case(1, 4, 4, 640, 640, 128, mask="heads", mask_blocks=(128, 128), dtype=torch.bfloat16),
]


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.id)
def test_a_captured_step_replays_on_new_inputs(case: Case):
    q, k, v, dout, dlse = make_inputs(case, "cuda", seed=1)
    sinks, mask, bias = make_sinks(case, "cuda"), make_mask(case, "cuda"), make_bias(case, "cuda")
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    extras = [t.clone().requires_grad_() for t in (sinks, bias) if t is not None]
    static_sinks = extras[0] if sinks is not None else None
    static_bias = extras[-1] if bias is not None else None

    def step():
        out, lse = fusedattn.attention(*leaves, sinks=static_sinks, bias=static_bias, mask=mask, return_lse=True,
                                       deterministic=case.deterministic, **case.options())
        outputs, grads = (out, lse), (dout, dlse)
        if not case.lse_grad:
            outputs, grads = (out,), (dout,)
        return (out, lse, *torch.autograd.grad(outputs, leaves + extras, grads))

    graph, captured = capture_graph(step)

    def reference(q_, k_, v_, sinks_=None, bias_=None):
        return reference_attention(q_, k_, v_, sinks=sinks_, mask=dense_mask(mask), return_lse=True,
                                   bias=None if bias_ is None else bias_.reshape((1,) * (4 - bias_.dim()) + bias_.shape),
                                   **case.options())

    names = ["out", "lse", "dq", "dk", "dv"] + ["dsinks"] * (sinks is not None) + ["dbias"] * (bias is not None)
    for seed in (2, 3):
        fresh = make_inputs(case, "cuda", seed=seed)
        with torch.no_grad():
            for static, new in zip((*leaves, dout, dlse), fresh):
                static.copy_(new)
            for static in extras:  # new sinks / bias values too
                static.add_(0.5 * torch.randn_like(static))
        graph.replay()
        torch.cuda.synchronize()
        kw = dict(lse_grad=case.lse_grad, sinks=static_sinks, bias=static_bias)
        lowp = forward_backward(reference, *fresh, **kw)
        ref64 = forward_backward(reference, *fresh, dtype=torch.float64, **kw)
        for name, ours, lowp_t, ref_t in zip(names, captured, lowp, ref64):
            assert_close_to_reference(f"{case.id} replay {seed} {name}", ours, lowp_t, ref_t)


def test_varlen_with_offsets_on_the_gpu_captures_and_replays_new_lengths():
    """varlen_attention with GPU offsets captures into a graph (no host read: the offsets are checked on
    the device) and each replay takes the lengths then in the offsets tensor -- new lengths, same total
    -- with results matching the per-sequence reference; bad offsets copied in give NaN, not a crash."""
    gen = torch.Generator().manual_seed(0)
    total, heads, dim = 1000, 4, 128
    q, k, v, dout = (torch.randn(total, heads, dim, generator=gen).to("cuda", torch.bfloat16) for _ in range(4))
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    cu = torch.tensor([0, 300, 301, 1000], dtype=torch.int32, device="cuda")

    def step():
        out = fusedattn.varlen_attention(*leaves, cu, cu, 800, 800, causal=True)
        return (out, *torch.autograd.grad(out, leaves, dout))

    graph, captured = capture_graph(step)
    for lengths in ((0, 250, 999, 1000), (0, 800, 800, 1000)):
        cu.copy_(torch.tensor(lengths, dtype=torch.int32))
        graph.replay()
        torch.cuda.synchronize()

        def reference(q_, k_, v_, sinks_=None):
            outs = [reference_attention(q_[None, a:b], k_[None, a:b], v_[None, a:b], causal=True)[0]
                    for a, b in zip(lengths, lengths[1:]) if b > a]  # (an empty sequence has no rows)
            out = torch.cat(outs)
            return out, out.new_zeros(1)

        lowp = forward_backward(reference, q, k, v, dout, None)
        ref64 = forward_backward(reference, q, k, v, dout, None, dtype=torch.float64)
        for name, ours, lowp_t, ref_t in zip(["out", "dq", "dk", "dv"], captured, lowp[:1] + lowp[2:],
                                              ref64[:1] + ref64[2:]):
            assert_close_to_reference(f"replay {lengths} {name}", ours, lowp_t, ref_t)
    cu.copy_(torch.tensor([0, 300, 1001, 1000], dtype=torch.int32))  # decreasing, past the tokens
    graph.replay()
    torch.cuda.synchronize()
    assert all(torch.isnan(t).all() for t in captured)


def test_kvcache_and_varlen_compile_with_cuda_graphs():
    """torch.compile(mode="reduce-overhead") captures both (no graph break, no host read under capture)
    and replays them right."""
    gen = torch.Generator().manual_seed(1)
    cache = [torch.randn(2, 256, 2, 64, generator=gen).to("cuda", torch.bfloat16) for _ in range(2)]
    q = torch.randn(2, 1, 4, 64, generator=gen).to("cuda", torch.bfloat16)
    lengths = torch.tensor([100, 37], dtype=torch.int32, device="cuda")
    packed = torch.randn(300, 4, 64, generator=gen).to("cuda", torch.bfloat16)
    cu = torch.tensor([0, 120, 300], dtype=torch.int32, device="cuda")
    torch._dynamo.reset()

    @torch.compile(mode="reduce-overhead", fullgraph=True)
    def both(q_, lengths_, packed_, cu_):
        decoded = fusedattn.kvcache_attention(q_, cache[0], cache[1], lengths_, causal=True)
        return decoded, fusedattn.varlen_attention(packed_, packed_, packed_, cu_, cu_, 180, 180, causal=True)

    for _ in range(3):  # warm-up runs, then replays
        decoded, varlen_out = both(q, lengths, packed, cu)
    torch.cuda.synchronize()
    for b, n in enumerate((100, 37)):
        lowp, ref64 = (reference_attention(q[b:b + 1].to(t), cache[0][b:b + 1, :n].to(t), cache[1][b:b + 1, :n].to(t),
                                           causal=True) for t in (torch.bfloat16, torch.float64))
        assert_close_to_reference(f"decoded {b}", decoded[b:b + 1], lowp, ref64)
    for a, b in ((0, 120), (120, 300)):
        lowp, ref64 = (reference_attention(*(packed[None, a:b].to(t),) * 3, causal=True)[0]
                       for t in (torch.bfloat16, torch.float64))
        assert_close_to_reference(f"packed {a}:{b}", varlen_out[a:b], lowp, ref64)
