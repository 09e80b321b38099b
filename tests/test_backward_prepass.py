"""The backward's pre-pass (kernels/bwd.py ``_preprocess_kernel``) on its own: the row statistics
the passes read and, with ZERO_DQ, the zeroed fp32 dQ accumulator the dK/dV pass sums into (it is
allocated uninitialised: here NaN-filled, so that a row or column left unzeroed shows)."""

import math

import pytest
import torch

from fusedattn import dispatch
from fusedattn.kernels.triton import bwd
from fusedattn.kernels.shared.launch import launch

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


def test_prepass_packed_sequences_zero_every_row_of_the_dq_accumulator():
    """VARLEN: per (sequence, head) program the statistics of its rows (padding rows: lse2 +inf,
    delta 0) and, with ZERO_DQ, its rows of the head-major (1, Hq, total_q, dq_cols) accumulator --
    together every row, including those of a one-token sequence (an empty one has none)."""
    lengths, heads, head_dim_v, dq_cols, block_m = (5, 0, 20, 1, 12), 3, 16, 12, 16
    total, max_len, padded_rows = sum(lengths), max(lengths), 32
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32, device=DEVICE)
    gen = torch.Generator(device=DEVICE).manual_seed(1)
    out, dout = (torch.randn(total, heads, head_dim_v, device=DEVICE, generator=gen) for _ in range(2))
    lse = torch.randn(heads, total, device=DEVICE, generator=gen)
    lse2, delta = (torch.full((len(lengths) * heads, padded_rows), 7.0, device=DEVICE) for _ in range(2))
    dq = torch.full((1, heads, total, dq_cols), float("nan"), device=DEVICE)
    row = heads * head_dim_v  # the packed tensors' row stride stands for the batch stride
    launch(bwd._preprocess_kernel, (padded_rows // block_m, len(lengths) * heads),
           (out, dout, lse, lse, lse2, delta, dq, cu, row, head_dim_v, row, row, head_dim_v, row, max_len, heads,
            padded_rows, dq_cols, total),
           HEAD_DIM_V=head_dim_v, BLOCK_DV=16, BLOCK_M=block_m, HAS_DLSE=False, ZERO_DQ=True, BLOCK_DQ=16,
           VARLEN=True)
    assert torch.equal(dq, torch.zeros_like(dq))
    want_delta = (out.double() * dout.double()).sum(-1)  # (total, heads)
    for seq, (start, n) in enumerate(zip(cu.tolist(), lengths)):
        rows = slice(seq * heads, (seq + 1) * heads)
        torch.testing.assert_close(delta[rows, :n].double(), want_delta[start:start + n].t(), rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(lse2[rows, :n].double(), lse[:, start:start + n].double() * math.log2(math.e),
                                   rtol=1e-6, atol=1e-6)
        assert torch.all(lse2[rows, n:] == float("inf")) and torch.all(delta[rows, n:] == 0)


@pytest.mark.parametrize("gluon_rows", [0, 128, 192], ids=["no-gluon-dq", "gluon-dq-2wg", "gluon-dq-3wg"])
def test_statistics_rows_are_padded_to_every_tile_height(gluon_rows):
    """The row statistics are padded to a multiple of every pass's tile height -- the pre-pass's, the
    dK/dV pass's, the Triton dQ pass's and a Gluon dQ pass's (a tuned one may take 192-row tiles beside
    the Triton pass's 128) -- since any of them may read them by whole tiles."""
    from dataclasses import replace

    from fusedattn.spec import resolve_spec
    from fusedattn.tuning.configs import INTERPRETER_CONFIGS, KernelConfig

    gluon = KernelConfig(gluon_rows, 64, 4, 3, True, 0, gluon_rows // 64, 1) if gluon_rows else None
    configs = replace(INTERPRETER_CONFIGS, dq=KernelConfig(128, 64, 8, 3), gluon_dq=gluon)
    q, k, v, out, dout = (torch.randn(1, 2, 100, 16) for _ in range(5))  # one 192-row tile: not 128-divisible
    spec = resolve_spec(16, layout="bhsd", causal=False, window=None, scale=None, softcap=None, deterministic=True)
    plan = dispatch._decide_backward(q, k, v, out, dout, None, spec, configs, None, None, bwd.DBIAS_OFF, None)
    heights = [configs.preprocess_block_m, configs.dkdv.block_m, configs.dq.block_m] + [gluon_rows] * bool(gluon_rows)
    assert plan.padded_rows >= 100 and all(plan.padded_rows % h == 0 for h in heights), (plan.padded_rows, heights)
