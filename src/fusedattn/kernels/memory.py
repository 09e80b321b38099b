"""Tile addressing and bounds-checked loads/stores.

Tensors arrive as (B, H, S, D) strides over the user's layout (the head dim has unit
stride). Batch/head and row offsets are formed in int64, so a slice larger than 2**31
elements still addresses correctly; in-tile offsets stay int32. Every store is masked.
"""

import triton
import triton.language as tl


@triton.jit
def head_base(ptr, batch, head, stride_b, stride_h):
    return ptr + batch.to(tl.int64) * stride_b + head.to(tl.int64) * stride_h


@triton.jit
def tile_ptrs(base, start_row, stride_row, offs_row, offs_col):
    return base + start_row.to(tl.int64) * stride_row + offs_row[:, None] * stride_row + offs_col[None, :]


@triton.jit
def load_tile(ptrs, rows, n_rows, cols, n_cols, CHECK_ROWS: tl.constexpr, CHECK_COLS: tl.constexpr):
    if CHECK_ROWS and CHECK_COLS:
        return tl.load(ptrs, mask=(rows[:, None] < n_rows) & (cols[None, :] < n_cols), other=0.0)
    elif CHECK_ROWS:
        return tl.load(ptrs, mask=rows[:, None] < n_rows, other=0.0)
    elif CHECK_COLS:
        return tl.load(ptrs, mask=cols[None, :] < n_cols, other=0.0)
    else:
        return tl.load(ptrs)


@triton.jit
def store_tile(ptrs, value, rows, n_rows, cols, n_cols):
    tl.store(ptrs, value.to(ptrs.dtype.element_ty), mask=(rows[:, None] < n_rows) & (cols[None, :] < n_cols))
