"""dQ's conversion (kernels/triton/bwd.py ``dq_from_sums``): the fp32 sums the backward accumulated
into dQ in the input's dtype and strides, from the plain (B, Hq, Sq, D) layout and from the register
order the Gluon dK/dV pass stages dQ in (``constants.REGISTER_ORDER_BASES``: runs of 64 x 64 tiles)
-- the expected run layout built here from the bases alone, element by element. And the bases'
reason to exist: with them a warpgroup's wgmma accumulator is stored in 16-byte vectors without a
bank conflict."""

import pytest
import torch

from fusedattn.kernels.shared.constants import REGISTER_ORDER_BASES
from fusedattn.kernels.triton import bwd

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def in_register_order(plain: torch.Tensor) -> torch.Tensor:
    """The (B, H, S, D) sums laid out as the Gluon pass leaves them: run r of a head (64 x 64 tile
    r // (D / 64), r % (D / 64)) at offset 4096 r, its element at offset o the tile's (row, column)
    sum of the bases of o's set bits."""
    batch, heads, rows, cols = plain.shape
    offsets = torch.arange(4096)
    row = sum(((offsets >> i) & 1) * b[0] for i, b in enumerate(REGISTER_ORDER_BASES))
    col = sum(((offsets >> i) & 1) * b[1] for i, b in enumerate(REGISTER_ORDER_BASES))
    tiles = plain.reshape(batch, heads, rows // 64, 64, cols // 64, 64).permute(0, 1, 2, 4, 3, 5)
    return tiles[..., row, col].reshape(batch, heads, rows, cols).contiguous()


@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("layout", ["bhsd", "bshd"])
def test_register_order_sums_convert_to_the_plain_ones(head_dim, layout):
    gen = torch.Generator(device=DEVICE).manual_seed(0)
    plain = torch.randn(2, 3, 128, head_dim, device=DEVICE, generator=gen)
    q = torch.empty(2, 3, 128, head_dim, device=DEVICE, dtype=torch.float16)
    if layout == "bshd":
        q = q.transpose(1, 2)
    want = plain.to(torch.float16)
    got = bwd.dq_from_sums(in_register_order(plain.cpu()).to(DEVICE), q, layout, register_order=True)
    assert got.dtype == torch.float16 and got.stride() == q.stride()
    torch.testing.assert_close(got if layout == "bhsd" else got.transpose(1, 2), want, rtol=0, atol=0)


def test_plain_sums_convert_rows_past_a_tile():
    gen = torch.Generator(device=DEVICE).manual_seed(1)
    plain = torch.randn(1, 2, 37, 64, device=DEVICE, generator=gen)
    q = torch.empty(1, 2, 37, 64, device=DEVICE, dtype=torch.float16)  # the interpreter rounds bf16 its own way
    torch.testing.assert_close(bwd.dq_from_sums(plain, q, "bhsd"), plain.to(torch.float16), rtol=0, atol=0)


def test_register_order_stores_whole_16_byte_vectors_without_bank_conflicts():
    """A Hopper wgmma accumulator (m64nNk16, 4 warps x 16 rows): lane l of warp w holds rows 16 w + l //
    4 (+ 8) and columns 2 (l % 4) (+ 1) + 8 j, register 4 j + 2 h + e holding (row + 8 h, column + e).
    Under the bases each thread's registers 4j..4j+3 are 4 consecutive floats, and in every 8-lane
    phase of a 16-byte store the 8 vectors fall on 8 different 16-byte chunks of a 128-byte line."""
    def offset(row, col):
        bits = {b: i for i, b in enumerate(REGISTER_ORDER_BASES)}
        return sum(1 << bits[(1 << k, 0)] for k in range(6) if row >> k & 1) + \
            sum(1 << bits[(0, 1 << k)] for k in range(6) if col >> k & 1)

    for warp in range(4):
        for j in range(8):
            chunks = []
            for lane in range(32):
                row, col = 16 * warp + lane // 4, 2 * (lane % 4) + 8 * j
                vector = [offset(row + 8 * h, col + e) for h in (0, 1) for e in (0, 1)]
                assert vector == list(range(vector[0], vector[0] + 4)) and vector[0] % 4 == 0
                chunks.append(vector[0] // 4 % 8)
            for phase in range(4):
                assert sorted(chunks[8 * phase:8 * phase + 8]) == list(range(8))
