"""Tile addressing and bounds-checked loads/stores.

Tensors arrive as (B, H, S, D) strides over the user's layout (the head dim has unit
stride). Batch/head and row offsets are formed in int64, so a slice larger than 2**31
elements still addresses correctly; in-tile offsets stay int32. Every store is masked.

The tiles loaded inside the loops can instead come through TMA descriptors over the
same (B, H, S, D) view (``load_block`` with ``USE_DESC``): the copy engine does the
addressing and the zero fill past S and D, so the loop holds no pointer tensors.
"""

import functools

import torch
import triton
import triton.language as tl

from ..shared.descriptors import Descriptor, score_tiles_addressable, tma_addressable  # noqa: F401


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


@triton.jit
def load_block(desc, base, batch, head, start_row, stride_row, n_rows, n_cols: tl.constexpr,
               BLOCK_ROWS: tl.constexpr, BLOCK_COLS: tl.constexpr, CHECK_ROWS: tl.constexpr, USE_DESC: tl.constexpr):
    """Rows ``[start_row, start_row + BLOCK_ROWS)`` of one head, zero past ``n_rows`` and ``n_cols``.

    ``USE_DESC``: ``desc`` is a TMA descriptor over (B, H, S, D) with block (1, 1, BLOCK_ROWS,
    BLOCK_COLS); otherwise pointers from ``base``, the head's base pointer.
    """
    if USE_DESC:
        return desc.load([batch, head, start_row, 0]).reshape(BLOCK_ROWS, BLOCK_COLS)
    else:
        offs_row = tl.arange(0, BLOCK_ROWS)
        offs_col = tl.arange(0, BLOCK_COLS)
        return load_tile(tile_ptrs(base, start_row, stride_row, offs_row, offs_col), start_row + offs_row, n_rows,
                         offs_col, n_cols, CHECK_ROWS, n_cols != BLOCK_COLS)


@triton.jit
def sequence_rows(cu_seqlens, seq, seqlen, VARLEN: tl.constexpr):
    """(index, length) of sequence ``seq`` as the kernels address it. Packed sequences (``VARLEN``,
    varlen_attention): the index is the sequence's first row of the packed tensors -- the host
    passes their row stride as the batch stride, so ``head_base(t, index, ...)`` lands on that
    row -- and the length comes from ``cu_seqlens``. Otherwise the batch index and the one length."""
    if VARLEN:
        first = tl.load(cu_seqlens + seq)
        return first, tl.load(cu_seqlens + seq + 1) - first
    else:
        return seq, seqlen


@triton.jit
def sequence_pair(cu_seqlens_q, cu_seqlens_k, seq, seqlen_q, seqlen_k, VARLEN: tl.constexpr):
    """``sequence_rows`` of one sequence's queries and keys: (q index, Sq, k index, Sk)."""
    q_index, seqlen_q = sequence_rows(cu_seqlens_q, seq, seqlen_q, VARLEN)
    k_index, seqlen_k = sequence_rows(cu_seqlens_k, seq, seqlen_k, VARLEN)
    return q_index, seqlen_q, k_index, seqlen_k


@triton.jit
def lse_offset(seq, head, heads_q, seqlen_q, first_row, stride_lse_head, VARLEN: tl.constexpr):
    """Where a sequence's first row of one head lies in lse: (B, Hq, Sq) contiguous, or packed
    (``VARLEN``) (Hq, total_q) with ``first_row`` from ``sequence_rows``."""
    if VARLEN:
        return head.to(tl.int64) * stride_lse_head + first_row
    else:
        return (seq * heads_q + head).to(tl.int64) * seqlen_q


def block_descriptor(t: torch.Tensor, block_rows: int, block_cols: int, layout: str = "bhsd"):
    """A TMA descriptor over ``t`` in (B, H, S, D) order (``layout``: its user layout) with block
    (1, 1, block_rows, block_cols), or None where the copy engine cannot address it."""
    return Descriptor.if_addressable(t, (1, 1, block_rows, block_cols), layout)


def loop_descriptors(pairs, layout: str, block_rows: int, use: bool):
    """Descriptors for the tensors a kernel loop walks (``pairs``: (tensor, block_cols)), or None
    when ``use`` is off or any of them cannot go through TMA (then every load uses pointers)."""
    if not use:
        return None
    descs = [block_descriptor(t, block_rows, cols, layout) for t, cols in pairs]
    return None if any(d is None for d in descs) else descs


def score_tile_descriptor(t: torch.Tensor | None, block_q: int, block_k: int):
    """A TMA descriptor over a 4-D tensor laid out like the score matrix -- a bias, its gradient,
    a mask's bytes -- in its own (B|1, H|1, Sq, Sk) shape with block (1, 1, block_q, block_k), or
    None where tiles cannot come through TMA: on CPU, a broadcast query or key dim (those read one
    row or column, by pointers), an expanded dim (stride 0, size > 1), or an unaligned tensor."""
    if not score_tiles_addressable(t):
        return None
    return Descriptor(t, (1, 1, block_q, block_k))


def all_or_placeholders(descs: list, placeholder: torch.Tensor) -> tuple[list, bool]:
    """(descs, True) where every one of a kernel's descriptors could be made, else (placeholders,
    False): the kernel then reads all of those tensors by pointers (one constexpr switches them)."""
    if all(d is not None for d in descs):
        return descs, True
    return [placeholder] * len(descs), False
