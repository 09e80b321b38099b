"""One pass over a boolean mask: the state of each (cell_q x cell_k) cell (block_mask.py).

Torch reductions over 16-byte groups of a (B, H, S, S) bool mask were slow (several
passes, narrow rows): here each program reads a (CELL_Q, CELLS * CELL_K) strip of the mask once
and writes CELLS states, so the cost is one read of the mask at memory speed.
"""

import torch
import triton
import triton.language as tl

from ..shared.launch import cdiv, next_power_of_2

# As block_mask.py; tl.constexpr so that compiled kernels may read them (the interpreter reads any global).
EMPTY, FULL, PARTIAL = tl.constexpr(0), tl.constexpr(1), tl.constexpr(2)
CELLS_PER_PROGRAM = 32


@triton.jit
def _classify_kernel(
    Mask, States, heads, stride_b, stride_h, stride_q, stride_k, seqlen_q, seqlen_k, cells_q, cells_k,
    CELL_Q: tl.constexpr, CELL_K: tl.constexpr, CELLS: tl.constexpr,
):
    cell_row = tl.program_id(0)
    first_cell = tl.program_id(1) * CELLS
    batch_head = tl.program_id(2)
    rows = cell_row * CELL_Q + tl.arange(0, CELL_Q)
    cols = first_cell * CELL_K + tl.arange(0, CELLS * CELL_K)
    inside = (rows[:, None] < seqlen_q) & (cols[None, :] < seqlen_k)
    base = Mask + (batch_head // heads).to(tl.int64) * stride_b + (batch_head % heads).to(tl.int64) * stride_h
    offsets = rows[:, None].to(tl.int64) * stride_q + cols[None, :].to(tl.int64) * stride_k
    kept = (tl.load(base + offsets, mask=inside, other=0) != 0).to(tl.int32)
    kept_per_cell = tl.sum(tl.reshape(tl.sum(kept, axis=0), (CELLS, CELL_K)), axis=1)
    entries_per_cell = tl.sum(tl.reshape(tl.sum(inside.to(tl.int32), axis=0), (CELLS, CELL_K)), axis=1)
    state = tl.where(kept_per_cell == entries_per_cell, FULL, tl.where(kept_per_cell > 0, PARTIAL, EMPTY))
    cells = first_cell + tl.arange(0, CELLS)
    out = States + (batch_head.to(tl.int64) * cells_q + cell_row) * cells_k + cells
    tl.store(out, state.to(tl.int8), mask=cells < cells_k)


def classify_cells(mask: torch.Tensor, cell_q: int, cell_k: int) -> torch.Tensor:
    """int8 (B, H, cells along Sq, cells along Sk) states of a 4-D bool mask (any strides); a size-1
    dim is one cell of one entry."""
    batch, heads, seqlen_q, seqlen_k = mask.shape
    cell_q, cell_k = (cell_q if seqlen_q > 1 else 1), (cell_k if seqlen_k > 1 else 1)
    cells_q, cells_k = cdiv(seqlen_q, cell_q), cdiv(seqlen_k, cell_k)
    states = torch.empty((batch, heads, cells_q, cells_k), dtype=torch.int8, device=mask.device)
    per_program = min(CELLS_PER_PROGRAM, next_power_of_2(cells_k))
    grid = (cells_q, cdiv(cells_k, per_program), batch * heads)
    _classify_kernel[grid](mask.view(torch.uint8), states, heads, *mask.stride(), seqlen_q, seqlen_k, cells_q,
                           cells_k, CELL_Q=cell_q, CELL_K=cell_k, CELLS=per_program)
    return states
