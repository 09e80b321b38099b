"""merge_attention (issue 5): partial results over disjoint key sets combine into the whole."""

from __future__ import annotations

import pytest
import torch

import fusedattn
from fusedattn.reference import reference_attention

from numerics import assert_close_to_reference

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _inputs(layout, dtype, seed=0, batch=2, heads=3, seqlen_q=17, seqlen_k=45, dim=16):
    gen = torch.Generator().manual_seed(seed)

    def randn(seqlen, heads_):
        size = (batch, seqlen, heads_, dim) if layout == "bshd" else (batch, heads_, seqlen, dim)
        return torch.randn(size, generator=gen).to(DEVICE, dtype)

    return randn(seqlen_q, heads), randn(seqlen_k, heads), randn(seqlen_k, heads), randn(seqlen_q, heads)


def _split_keys(t, layout, bounds):
    dim = 1 if layout == "bshd" else 2
    return [t.narrow(dim, a, b - a) for a, b in zip(bounds[:-1], bounds[1:])]


@pytest.mark.parametrize("layout", ["bshd", "bhsd"])
def test_merge_of_reference_parts_is_the_whole_in_float64(layout):
    """The rule itself, exact in float64: out, lse and every gradient (q, k, v through the parts)."""
    q, k, v, dout = (t.double().requires_grad_() for t in _inputs(layout, torch.float32))
    bounds = [0, 7, 20, 45]
    parts = [reference_attention(q, kp, vp, layout=layout, return_lse=True)
             for kp, vp in zip(_split_keys(k, layout, bounds), _split_keys(v, layout, bounds))]
    out, lse = fusedattn.merge_attention([p[0] for p in parts], [p[1] for p in parts], layout=layout)
    ref_out, ref_lse = reference_attention(q, k, v, layout=layout, return_lse=True)
    torch.testing.assert_close(out, ref_out, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(lse, ref_lse, rtol=1e-12, atol=1e-12)
    dlse = torch.randn_like(lse)
    grads = torch.autograd.grad((out * dout).sum() + (lse * dlse).sum(), (q, k, v))
    ref_grads = torch.autograd.grad((ref_out * dout).sum() + (ref_lse * dlse).sum(), (q, k, v))
    for g, r in zip(grads, ref_grads):
        torch.testing.assert_close(g, r, rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
def test_merge_of_fusedattn_parts_meets_the_bar(dtype):
    """Causal attention split into a cache part and a new-keys part (how decoding uses it), each
    part computed by fusedattn: the merged out and lse within SPEC 4 of the whole in float64."""
    layout = "bshd"
    q, k, v, _ = _inputs(layout, dtype, seed=1, seqlen_q=5, seqlen_k=40)
    cache = 33  # keys 0..32 in the cache, the rest new; bottom-right causal: the cache is all visible
    out_cache, lse_cache = fusedattn.attention(q, k[:, :cache], v[:, :cache], return_lse=True)
    # The new keys under causal, bottom-right aligned: query i sees new key j iff j <= i + 7 - 5,
    # the whole problem's rule (key 33 + j <= i + 40 - 5).
    out_new, lse_new = fusedattn.attention(q, k[:, cache:], v[:, cache:], causal=True, return_lse=True)
    out, lse = fusedattn.merge_attention([out_cache, out_new], [lse_cache, lse_new])
    ref_out, ref_lse = reference_attention(q.double(), k.double(), v.double(), causal=True, return_lse=True)
    low_out, low_lse = reference_attention(q, k, v, causal=True, return_lse=True)
    assert out.dtype == dtype and lse.dtype == torch.float32
    assert_close_to_reference("out", out, low_out, ref_out)
    assert_close_to_reference("lse", lse, low_lse.float(), ref_lse)


def test_merge_rows_no_part_saw_are_zero_with_zero_gradients():
    """A part with lse -inf weighs nothing; a row every part missed gives out 0, lse -inf and
    finite (zero) gradients -- never NaN (SPEC 3.1)."""
    gen = torch.Generator().manual_seed(3)
    outs = [torch.randn(1, 4, 2, 8, generator=gen, dtype=torch.float64) for _ in range(2)]
    lses = [torch.randn(1, 2, 4, generator=gen, dtype=torch.float64) for _ in range(2)]
    lses[0][0, 0, 1] = float("-inf")  # part 0 saw no key on row 1 of head 0
    outs[0][0, 1, 0] = 0.0
    lses[0][0, 1, 2] = lses[1][0, 1, 2] = float("-inf")  # no part saw row 2 of head 1
    outs[0][0, 2, 1] = outs[1][0, 2, 1] = 0.0
    outs = [o.requires_grad_() for o in outs]
    lses = [lse.requires_grad_() for lse in lses]
    out, lse = fusedattn.merge_attention(outs, lses)
    assert torch.equal(out[0, 1, 0], outs[1][0, 1, 0].detach())
    assert lse[0, 0, 1] == lses[1][0, 0, 1]
    assert torch.all(out[0, 2, 1] == 0) and lse[0, 1, 2] == float("-inf")
    finite = torch.isfinite(lse)
    grads = torch.autograd.grad(out.sum() + lse[finite].sum(), outs + lses)
    for g in grads:
        assert torch.isfinite(g).all()
    assert grads[0][0, 1, 0].abs().sum() == 0 and grads[2][0, 0, 1] == 0  # the empty part gets nothing
    assert grads[0][0, 2, 1].abs().sum() == 0 and grads[1][0, 2, 1].abs().sum() == 0


@pytest.mark.parametrize("outs, lses, error, match", [
    (torch.zeros(1, 2, 2, 4), [torch.zeros(1, 2, 2)], TypeError, "`outs` must be a non-empty list"),
    ([], [], TypeError, "`outs` must be a non-empty list"),
    ([torch.zeros(1, 2, 2, 4)], [torch.zeros(1, 2, 2), torch.zeros(1, 2, 2)], ValueError, "one lse per output"),
    ([torch.zeros(1, 3, 2, 4)], [torch.zeros(1, 3, 2)], ValueError, r"expected \(1, 2, 3\)"),
    ([torch.zeros(1, 3, 2, 4), torch.zeros(1, 4, 2, 4)], [torch.zeros(1, 2, 3)] * 2, ValueError, "like outs"),
    ([torch.zeros(1, 3, 2, 4)], [torch.zeros(1, 2, 3, dtype=torch.int32)], TypeError, "float tensor"),
])
def test_merge_bad_input_names_the_argument(outs, lses, error, match):
    with pytest.raises(error, match=match):
        fusedattn.merge_attention(outs, lses)
