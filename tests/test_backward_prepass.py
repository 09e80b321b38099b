"""The backward's pre-pass (kernels/bwd.py ``_preprocess_kernel``) on its own: the row statistics
the passes read and, with ZERO_DQ, the zeroed fp32 dQ accumulator the dK/dV pass sums into (it is
allocated uninitialised: here NaN-filled, so that a row or column left unzeroed shows)."""

import math

import pytest
import torch

from fusedattn.kernels import bwd
from fusedattn.kernels.launch import launch

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


@pytest.mark.parametrize("zero_dq", [True, False], ids=["zero-dq", "dq-untouched"])
def test_prepass_row_statistics_and_dq_accumulator(zero_dq):
    batch, heads, seqlen, head_dim_v, dq_cols, block_m = 2, 3, 37, 16, 12, 16
    padded_rows = 48
    gen = torch.Generator(device=DEVICE).manual_seed(0)
    out, dout = (torch.randn(batch, heads, seqlen, head_dim_v, device=DEVICE, generator=gen) for _ in range(2))
    lse = torch.randn(batch, heads, seqlen, device=DEVICE, generator=gen)
    lse[0, 1, 5] = float("-inf")  # a row that attends to nothing
    lse2, delta = (torch.full((batch * heads, padded_rows), 7.0, device=DEVICE) for _ in range(2))
    dq = torch.full((batch, heads, seqlen, dq_cols), float("nan"), device=DEVICE)
    launch(bwd._preprocess_kernel, (padded_rows // block_m, batch * heads),
           (out, dout, lse, lse, lse2, delta, dq, lse, *out.stride()[:3], *dout.stride()[:3], seqlen, heads,
            padded_rows, dq_cols, 0),
           HEAD_DIM_V=head_dim_v, BLOCK_DV=16, BLOCK_M=block_m, HAS_DLSE=False, ZERO_DQ=zero_dq, BLOCK_DQ=16,
           VARLEN=False)
    want_delta = (out.double() * dout.double()).sum(-1).reshape(batch * heads, seqlen)
    torch.testing.assert_close(delta[:, :seqlen].double(), want_delta, rtol=1e-5, atol=1e-5)
    want_lse2 = (lse.double() * math.log2(math.e)).reshape(batch * heads, seqlen)
    want_lse2[1, 5] = float("inf")  # p = exp2(s - inf) = 0 for the empty row
    torch.testing.assert_close(lse2[:, :seqlen].double(), want_lse2, rtol=1e-6, atol=1e-6)
    if zero_dq:
        assert torch.equal(dq, torch.zeros_like(dq))
    else:
        assert dq.isnan().all()
