"""torch.compile of a model that calls fusedattn.attention: no graph breaks
(fullgraph=True raises on one), forward and backward match the reference."""

import pytest
import torch

import fusedattn
from attention_runner import forward_backward, make_bias, make_inputs, make_mask, make_sinks
from cases import Case
from fusedattn.reference import reference_attention
from numerics import assert_close_to_reference


class TinyAttentionBlock(torch.nn.Module):
    def __init__(self, dim=32, heads=2, head_dim=16):
        super().__init__()
        self.heads, self.head_dim = heads, head_dim
        self.qkv = torch.nn.Linear(dim, 3 * heads * head_dim)
        self.proj = torch.nn.Linear(heads * head_dim, dim)

    def forward(self, x):
        b, s, _ = x.shape
        q, k, v = self.qkv(x).view(b, s, 3, self.heads, self.head_dim).unbind(dim=2)
        out, lse = fusedattn.attention(q, k, v, causal=True, softcap=10.0, return_lse=True)
        return self.proj(out.reshape(b, s, -1)) + lse.mean()


def test_compiled_model_has_no_graph_break_and_matches_eager():
    torch.manual_seed(0)
    model = TinyAttentionBlock()
    x = torch.randn(2, 23, 32, requires_grad=True)
    eager = model(x)
    (gx_eager,) = torch.autograd.grad(eager.square().sum(), x)
    torch._dynamo.reset()
    compiled = torch.compile(model, fullgraph=True)
    out = compiled(x)
    (gx,) = torch.autograd.grad(out.square().sum(), x)
    assert torch.allclose(out, eager, atol=1e-5, rtol=1e-5)
    assert torch.allclose(gx, gx_eager, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("features", [dict(), dict(sinks=True), dict(mask="kv-heads", sinks=True),
                                      dict(bias="heads", mask="keys")],
                         ids=["plain", "sinks", "mask-sinks", "bias-mask"])
def test_compiled_attention_matches_reference(features):
    case = Case(heads_q=4, heads_kv=2, seqlen_q=19, seqlen_k=26, head_dim=16, window=(5, 2), dtype=torch.float32,
                **features)
    q, k, v, dout, dlse = make_inputs(case, "cpu")
    sink_logits, mask, bias = make_sinks(case, "cpu"), make_mask(case, "cpu"), make_bias(case, "cpu")
    torch._dynamo.reset()
    compiled = torch.compile(
        lambda a, b, c, sinks_=None, bias_=None: fusedattn.attention(
            a, b, c, sinks=sinks_, mask=mask, bias=bias_, return_lse=True, **case.options()),
        fullgraph=True)
    extras = dict(lse_grad=True, sinks=sink_logits, bias=bias)
    got = forward_backward(compiled, q, k, v, dout, dlse, **extras)

    def reference(a, b, c, sinks_=None, bias_=None):
        as_4d = (lambda t: None if t is None else t.reshape((1,) * (4 - t.dim()) + tuple(t.shape)))
        return reference_attention(a, b, c, sinks=sinks_, mask=as_4d(mask), bias=as_4d(bias_), return_lse=True,
                                   **case.options())

    lowp = forward_backward(reference, q, k, v, dout, dlse, **extras)
    ref64 = forward_backward(reference, q, k, v, dout, dlse, dtype=torch.float64, **extras)
    names = ["out", "lse", "dq", "dk", "dv"] + ["dsinks"] * case.sinks + ["dbias"] * (case.bias is not None)
    assert len(got) == len(names)
    for name, a, b, c in zip(names, got, lowp, ref64):
        assert_close_to_reference(name, a, b, c)
