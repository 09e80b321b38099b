"""Boolean masks classified by tile, built once and shared (docs/SEMANTICS.md, "`BlockMask`").

A ``BlockMask`` holds, for a boolean attention mask broadcastable to (B, Hq, Sq, Sk), the
state of every (query tile, key tile) of a fine grid -- ``EMPTY`` (no entry kept), ``FULL``
(every in-bounds entry kept) or ``PARTIAL`` -- next to the mask the kernels read on partial
tiles. The launchers turn those states into per-program tile lists at their own tile sizes
(``kernels/tile_lists.py``): the forward and both backward passes skip empty tiles without
loading anything and run full tiles without loading the mask.

``attention(mask=bool_tensor)`` builds one per call (one pass over the mask, shared by the
forward and the backward); ``BlockMask.from_mask`` builds it once for callers who pass the
same mask to every layer of a step. ``BlockMask.from_blocks`` describes a mask by whole
blocks (block-sparse attention): no (Sq, Sk) tensor exists at all; the kernels read the
(query block, key block) keep map, addressing it by shifting element indices.
"""

from __future__ import annotations

import torch

from .spec import is_integer

# Tile states (int8), as tile_lists.py and the kernels' tile lists use them.
EMPTY, FULL, PARTIAL = 0, 1, 2
# The grid of a mask given by elements: the smallest tile any kernel uses, so that every kernel
# tile is a whole number of grid cells and the classification never has to be refined.
ELEMENT_GRID = 16


def _is_power_of_two(n: int) -> bool:
    return n > 0 and n & (n - 1) == 0


def reduce_chunks(t: torch.Tensor, dim: int, cell: int, reducer) -> torch.Tensor:
    """``reducer(chunk, dim)`` over consecutive chunks of ``cell`` entries of ``dim`` (the last one
    may be shorter), without copying ``t``: the whole chunks through a view, the tail apart."""
    size = t.shape[dim]
    whole = size // cell * cell
    parts = []
    if whole:
        parts.append(reducer(t.narrow(dim, 0, whole).unflatten(dim, (whole // cell, cell)), dim + 1))
    if whole < size:
        parts.append(reducer(t.narrow(dim, whole, size - whole), dim).unsqueeze(dim))
    return parts[0] if len(parts) == 1 else torch.cat(parts, dim)


def classify(mask: torch.Tensor, cell_q: int, cell_k: int) -> torch.Tensor:
    """int8 states of a 4-D bool mask on a (cell_q, cell_k) grid; a size-1 (broadcast) query or key
    dim stays size 1. FULL: every entry of the cell kept; EMPTY: none. On a GPU one Triton kernel
    reads the mask once (kernels/classify.py); elsewhere torch reductions do."""
    # (Under a torch.func transform the tensors have no storage a kernel could read: torch reductions.)
    if mask.is_cuda and mask.numel() and not torch._C._are_functorch_transforms_active():
        from .kernels.triton.classify import classify_cells

        return classify_cells(mask, cell_q, cell_k)
    return classify_with_torch(mask, cell_q, cell_k)


def classify_with_torch(mask: torch.Tensor, cell_q: int, cell_k: int) -> torch.Tensor:
    """``classify`` by torch reductions (CPU tensors: the PyTorch path needs no Triton)."""
    grid_q = 1 if mask.shape[2] == 1 else cell_q
    grid_k = 1 if mask.shape[3] == 1 else cell_k

    def cells(reducer):
        per_row = reduce_chunks(mask, 3, grid_k, reducer)
        return reduce_chunks(per_row, 2, grid_q, reducer)

    any_kept = cells(lambda t, d: t.any(dim=d))
    all_kept = cells(lambda t, d: t.all(dim=d))
    return torch.where(all_kept, FULL, torch.where(any_kept, PARTIAL, EMPTY)).to(torch.int8)


def block_sizes(block_size, caller: str) -> tuple[int, int]:
    """(block_q, block_k) from an int (square blocks) or a pair of ints, each a power of two >= 16."""
    pair = (block_size, block_size) if is_integer(block_size) else block_size
    if not isinstance(pair, (tuple, list)) or len(pair) != 2 or not all(is_integer(b) for b in pair):
        raise TypeError(f"{caller}: `block_size` must be an int or a (block_q, block_k) pair of ints, got "
                        f"{block_size!r}")
    for name, b in zip(("block_q", "block_k"), pair):
        if not (_is_power_of_two(int(b)) and b >= ELEMENT_GRID):
            raise ValueError(f"{caller}: {name} must be a power of two >= {ELEMENT_GRID}, got {b}")
    return int(pair[0]), int(pair[1])


class BlockMask:
    """A boolean attention mask with its tile classification (see the module doc).

    ``shape``: the (B|1, H|1, Sq|1, Sk|1) shape the mask broadcasts from, as for a tensor mask
    (H may be Hq, Hkv or 1). Pass it as ``attention(..., mask=block_mask)``; one object serves
    the forward, the backward and every layer that shares the mask.
    """

    def __init__(self, shape, states: torch.Tensor, cell: tuple[int, int], source: torch.Tensor,
                 source_shift: tuple[int, int]):
        self.shape = tuple(int(s) for s in shape)
        self.states = states  # int8 (B|1, H|1, cells along queries|1, cells along keys|1)
        self.cell = cell  # (rows, keys) per state
        self.source = source  # bool, what partial tiles read: source[b, h, i >> shift_q, j >> shift_k]
        self.source_shift = source_shift
        # The source is the caller's tensor (a view of it), not a copy: a mask of every layer of a step
        # is not duplicated. Its version counter, which every in-place edit of it or of a view of it
        # bumps, tells when the tile states no longer describe it (``check_current``).
        self.source_version = None if torch.compiler.is_compiling() else source._version

    def check_current(self, caller: str = "fusedattn.attention") -> None:
        """Raise if the mask tensor was edited in place after this object classified it: the tile
        states would skip or keep tiles by the old mask while partial tiles read the new one.
        (Not while torch.compile traces: a mask made inside the compiled code is current by construction.)"""
        if self.source_version is not None and not torch.compiler.is_compiling() \
                and self.source._version != self.source_version:
            raise ValueError(f"{caller}: the tensor this BlockMask was built from was modified in place after "
                             f"BlockMask.from_mask / from_blocks classified it; its tile states describe the old "
                             f"mask. Build a new BlockMask after editing the mask (or edit a copy)")

    # ------------------------------------------------------------------ constructors

    @classmethod
    def from_mask(cls, mask: torch.Tensor) -> "BlockMask":
        """From a bool tensor broadcastable to (B, Hq, Sq, Sk) (True = attend), with at most 4 dims,
        fewer dims being leading 1s as in torch broadcasting -- every shape ``attention`` takes as a
        mask. Reads the mask once; the kernels read it again only on tiles that are partly kept.
        The object refers to ``mask`` without copying it: edit ``mask`` in place afterwards and every
        call given this object raises (build a new one instead)."""
        if not isinstance(mask, torch.Tensor) or mask.dtype != torch.bool:
            raise TypeError("fusedattn.BlockMask.from_mask: `mask` must be a bool tensor (True = attend), got "
                            + (str(mask.dtype) if isinstance(mask, torch.Tensor) else type(mask).__name__))
        if mask.dim() > 4:
            raise ValueError(f"fusedattn.BlockMask.from_mask: `mask` must have at most 4 dims (B, H, Sq, Sk), got "
                             f"shape {tuple(mask.shape)}")
        mask4 = mask.reshape((1,) * (4 - mask.dim()) + tuple(mask.shape))
        states = classify(mask4, ELEMENT_GRID, ELEMENT_GRID)
        return cls(mask4.shape, states, (ELEMENT_GRID, ELEMENT_GRID), mask4, (0, 0))

    @classmethod
    def from_blocks(cls, keep: torch.Tensor, block_size: tuple[int, int], seqlen_q: int,
                    seqlen_k: int) -> "BlockMask":
        """From a bool keep map of whole blocks: ``keep[b, h, m, n]`` says whether query block m
        (rows ``[m * block_q, (m + 1) * block_q)``) attends key block n; (nQ, nK) =
        (ceil(Sq / block_q), ceil(Sk / block_k)); 2-4 dims as for a mask. Block sizes are powers
        of two, at least 16. Like ``from_mask``, the object refers to ``keep`` without copying it."""
        if not isinstance(keep, torch.Tensor) or keep.dtype != torch.bool:
            raise TypeError("fusedattn.BlockMask.from_blocks: `keep` must be a bool tensor")
        block_q, block_k = block_sizes(block_size, "fusedattn.BlockMask.from_blocks")
        for name, n in (("seqlen_q", seqlen_q), ("seqlen_k", seqlen_k)):
            if not is_integer(n) or n < 1:
                raise ValueError(f"fusedattn.BlockMask.from_blocks: `{name}` must be an int >= 1, got {n!r}")
        seqlen_q, seqlen_k = int(seqlen_q), int(seqlen_k)
        if not 2 <= keep.dim() <= 4:
            raise ValueError(f"fusedattn.BlockMask.from_blocks: `keep` must have 2 to 4 dims, got {tuple(keep.shape)}")
        keep4 = keep.reshape((1,) * (4 - keep.dim()) + tuple(keep.shape))
        blocks = (-(-seqlen_q // block_q), -(-seqlen_k // block_k))
        if tuple(keep4.shape[2:]) != blocks:
            raise ValueError(f"fusedattn.BlockMask.from_blocks: `keep` must have (query blocks, key blocks) = {blocks} "
                             f"for Sq={seqlen_q}, Sk={seqlen_k} and blocks {block_q}x{block_k}, got "
                             f"{tuple(keep4.shape[2:])}")
        states = torch.where(keep4, FULL, EMPTY).to(torch.int8)
        shifts = (block_q.bit_length() - 1, block_k.bit_length() - 1)
        shape = (keep4.shape[0], keep4.shape[1], seqlen_q, seqlen_k)
        return cls(shape, states, (block_q, block_k), keep4, shifts)

    # ------------------------------------------------------------------ views

    @property
    def device(self) -> torch.device:
        return self.states.device

    def to_dense(self) -> torch.Tensor:
        """The mask as a bool tensor of ``shape`` (tests, the reference, small problems)."""
        source = self.source
        shift_q, shift_k = self.source_shift
        if shift_q:
            source = source.repeat_interleave(1 << shift_q, dim=2)[:, :, : self.shape[2]]
        if shift_k:
            source = source.repeat_interleave(1 << shift_k, dim=3)[:, :, :, : self.shape[3]]
        return source

    def density(self) -> float:
        """The fraction of grid cells that are not EMPTY (what tile skipping can save)."""
        return float((self.states != EMPTY).float().mean())

    def __repr__(self) -> str:
        return (f"BlockMask(shape={self.shape}, cell={self.cell}, "
                f"{'by blocks' if any(self.source_shift) else 'by elements'}, density={self.density():.3f})")
