"""The reference against torch SDPA (math backend, float64) where their semantics overlap:
SDPA's causal is top-left aligned, so bottom-right causal is checked through
torch.nn.attention.bias.causal_lower_right; SDPA returns NaN on rows with no key, so such
rows are compared with our convention (0) separately."""

import math

import pytest
import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.nn.attention.bias import causal_lower_right

from fusedattn.reference import reference_attention


def _rand(*shape):
    return torch.randn(*shape, dtype=torch.float64)


def sdpa(q, k, v, **kw):
    with sdpa_kernel(SDPBackend.MATH):
        return F.scaled_dot_product_attention(q, k, v, **kw)


@pytest.mark.parametrize("sq,sk", [(17, 17), (13, 29), (29, 13), (1, 7)])
@pytest.mark.parametrize("hq,hkv", [(4, 4), (4, 2), (4, 1)])
def test_plain_and_gqa_match_sdpa(sq, sk, hq, hkv):
    q, k, v = _rand(2, hq, sq, 24), _rand(2, hkv, sk, 24), _rand(2, hkv, sk, 40)
    ours = reference_attention(q, k, v, layout="bhsd", scale=0.3)
    theirs = sdpa(q, k, v, scale=0.3, enable_gqa=hq != hkv)
    torch.testing.assert_close(ours, theirs, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("sq,sk", [(17, 17), (13, 29), (29, 13)])
def test_causal_is_bottom_right_aligned(sq, sk):
    q, k, v = _rand(1, 2, sq, 16), _rand(1, 2, sk, 16), _rand(1, 2, sk, 16)
    ours = reference_attention(q, k, v, layout="bhsd", causal=True)
    theirs = sdpa(q, k, v, attn_mask=causal_lower_right(sq, sk))
    empty_rows = torch.arange(sq) < sq - sk  # query i keeps keys j <= i + (sk - sq)
    torch.testing.assert_close(ours[:, :, ~empty_rows], theirs[:, :, ~empty_rows], rtol=1e-12, atol=1e-12)
    assert torch.equal(ours[:, :, empty_rows], torch.zeros_like(ours[:, :, empty_rows]))  # SDPA: NaN or 0
    if sq == sk:
        torch.testing.assert_close(ours, sdpa(q, k, v, is_causal=True), rtol=1e-12, atol=1e-12)


def test_window_bias_mask_and_sinks_match_explicit_masks():
    sq, sk, left, right = 21, 30, 4, 2
    q, k, v = _rand(1, 2, sq, 16), _rand(1, 2, sk, 16), _rand(1, 2, sk, 16)
    bias, mask = _rand(1, 2, sq, sk), torch.rand(1, 1, sq, sk) > 0.3
    i, j = torch.arange(sq)[:, None], torch.arange(sk)[None, :]
    offset = j - i - (sk - sq)
    window_keep = (offset >= -left) & (offset <= right)
    ours = reference_attention(q, k, v, layout="bhsd", window=(left, right), bias=bias, mask=mask)
    keep = window_keep & mask
    theirs = sdpa(q, k, v, attn_mask=bias.masked_fill(~keep, float("-inf")))
    rows = keep.any(dim=-1).expand(1, 2, sq)
    torch.testing.assert_close(ours[rows], theirs[rows], rtol=1e-12, atol=1e-12)
    assert torch.equal(ours[~rows], torch.zeros_like(ours[~rows]))
    # A sink is a key with logit sinks[h] and a zero value.
    sinks = _rand(2)
    ours = reference_attention(q, k, v, layout="bhsd", sinks=sinks)
    k_sink = torch.cat([k, torch.zeros(1, 2, 1, 16, dtype=k.dtype)], dim=2)
    v_sink = torch.cat([v, torch.zeros(1, 2, 1, 16, dtype=v.dtype)], dim=2)
    sink_bias = torch.zeros(1, 2, sq, sk + 1, dtype=q.dtype)
    sink_bias[..., -1] = sinks.view(2, 1) - (q @ k_sink[..., -1:, :].transpose(-1, -2)).squeeze(-1) / math.sqrt(16)
    torch.testing.assert_close(ours, sdpa(q, k_sink, v_sink, attn_mask=sink_bias), rtol=1e-12, atol=1e-12)


def test_softcap_formula_and_lse():
    q, k, v = _rand(1, 1, 9, 8), _rand(1, 1, 11, 8), _rand(1, 1, 11, 8)
    out, lse = reference_attention(q, k, v, layout="bhsd", softcap=2.5, return_lse=True)
    s = q @ k.transpose(-1, -2) / math.sqrt(8)
    s = 2.5 * torch.tanh(s / 2.5)  # softcap * tanh(s / softcap), not s * tanh(s)
    torch.testing.assert_close(out, torch.softmax(s, -1) @ v, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(lse, torch.logsumexp(s, -1), rtol=1e-12, atol=1e-12)
