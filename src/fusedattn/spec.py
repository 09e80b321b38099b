"""User options resolved once, on the host, into a frozen spec.

Everything downstream (kernels, CPU path, reference, autograd context) reads the
spec instead of re-deriving rules: ``causal`` is folded into the window here, so
no code path has a separate causal branch.
"""

from __future__ import annotations

import math
import numbers
from dataclasses import dataclass, field

import torch

LAYOUTS = ("bshd", "bhsd")
UNBOUNDED = -1


@dataclass(frozen=True)
class AttentionSpec:
    """Resolved options of one attention call.

    ``window_left`` / ``window_right`` bound the keys a query may see around the
    bottom-right aligned diagonal; ``UNBOUNDED`` (-1) means no bound.
    ``softcap`` is 0.0 when off. ``alibi``: the call has ALiBi slopes (the tensor travels beside
    the spec, as the sinks do); part of the spec so that every plan and launch cache keys on it.
    ``dropout_p``: attention dropout's probability, 0.0 when off (dropout.py; the seed travels
    beside the spec).
    """

    layout: str
    window_left: int
    window_right: int
    scale: float
    softcap: float
    deterministic: bool
    alibi: bool = False
    chunk: int = 0
    dropout_p: float = 0.0

    def op_args(self) -> tuple:
        """The spec as plain values, the way the custom ops carry it."""
        return (self.layout, self.window_left, self.window_right, self.scale, self.softcap, self.deterministic,
                self.chunk, self.dropout_p)

    @property
    def has_dropout(self) -> bool:
        return self.dropout_p != 0.0

    @property
    def has_chunk(self) -> bool:
        return self.chunk != 0

    @property
    def has_window_left(self) -> bool:
        return self.window_left != UNBOUNDED

    @property
    def has_window_right(self) -> bool:
        return self.window_right != UNBOUNDED

    @property
    def has_softcap(self) -> bool:
        return self.softcap != 0.0


@dataclass(frozen=True)
class Packing:
    """Packed variable-length sequences (``varlen_attention``): sequence i is rows
    ``cu_seqlens_q[i]:cu_seqlens_q[i + 1]`` of q (and of k, v by ``cu_seqlens_k``), each an attention
    problem of its own. The kernels see q as one batch of ``total_q`` rows, with a grid for
    ``sequences`` sequences of up to ``max_seqlen_q`` rows. Validated by the interface."""

    cu_seqlens_q: torch.Tensor
    cu_seqlens_k: torch.Tensor
    max_seqlen_q: int
    max_seqlen_k: int
    # The offsets as the host read them (``varlen.check_packing``), and the Gluon kernels' maps of
    # (sequence, block) entries built from them (kernels/packed_tiles.py), kept for the backward.
    offsets_q: tuple | None = field(default=None, compare=False, repr=False)
    offsets_k: tuple | None = field(default=None, compare=False, repr=False)
    tile_maps: dict = field(default_factory=dict, compare=False, repr=False)
    # Where the host cannot read the offsets (CUDA-graph capture): a 0-d bool on the device saying
    # whether they were valid, the offsets above then being clamped copies that keep every access in
    # bounds; the results of an invalid packing are NaN (``varlen.device_checked_packing``).
    valid: torch.Tensor | None = field(default=None, compare=False, repr=False)

    @property
    def sequences(self) -> int:
        return self.cu_seqlens_q.numel() - 1


def fold_window(causal: bool, window: tuple[int, int] | None) -> tuple[int, int]:
    """``causal=True`` is ``window=(-1, 0)``; both given means their intersection."""
    left, right = (UNBOUNDED, UNBOUNDED) if window is None else (int(window[0]), int(window[1]))
    if causal:
        right = 0 if right == UNBOUNDED else min(right, 0)
    return left, right


def resolve_spec(
    head_dim: int,
    *,
    layout: str,
    causal: bool,
    window: tuple[int, int] | None,
    scale: float | None,
    softcap: float | None,
    deterministic: bool,
    alibi: bool = False,
    chunk: int | None = None,
    dropout_p: float = 0.0,
) -> AttentionSpec:
    left, right = fold_window(causal, window)
    return AttentionSpec(
        layout=layout,
        window_left=left,
        window_right=right,
        scale=float(scale) if scale is not None else 1.0 / math.sqrt(head_dim),
        softcap=float(softcap) if softcap is not None else 0.0,
        deterministic=bool(deterministic),
        alibi=bool(alibi),
        chunk=int(chunk) if chunk is not None else 0,
        dropout_p=float(dropout_p),
    )


def keep_mask(
    seqlen_q: int,
    seqlen_k: int,
    window_left: int,
    window_right: int,
    device=None,
    key_start: int = 0,
    key_end: int | None = None,
    query_start: int = 0,
    query_end: int | None = None,
    chunk: int = 0,
) -> torch.Tensor:
    """(query_end - query_start, key_end - key_start) bool, by default (Sq, Sk): query i may
    attend key j (bottom-right aligned). ``chunk`` (> 0): also only keys in the query's chunk
    (``chunk_of``); a row whose aligned position i + Sk - Sq is negative then keeps none.

    The host-side statement of the rule, used by the reference, the CPU path and the dynamic
    masks; the kernels' ``masking.apply_mask`` computes the same predicate per tile.
    """
    key_end = seqlen_k if key_end is None else key_end
    query_end = seqlen_q if query_end is None else query_end
    rows = torch.arange(query_start, query_end, device=device)[:, None]
    cols = torch.arange(key_start, key_end, device=device)[None, :]
    offset_from_diagonal = cols - rows - (seqlen_k - seqlen_q)
    keep = torch.ones(query_end - query_start, key_end - key_start, dtype=torch.bool, device=device)
    if window_right != UNBOUNDED:
        keep &= offset_from_diagonal <= window_right
    if window_left != UNBOUNDED:
        keep &= offset_from_diagonal >= -window_left
    if chunk:
        keep &= chunk_of(rows + (seqlen_k - seqlen_q), chunk) == chunk_of(cols, chunk)
    return keep


def chunk_of(position, chunk: int):
    """The chunk index of an aligned position: floor(position / chunk), flooring for negative
    positions too (torch's ``//`` on tensors and Python's on ints floor), so a query whose aligned
    position i + Sk - Sq is negative lies in a chunk below 0 that holds no key."""
    return position // chunk


def alibi_distances(seqlen_q: int, seqlen_k: int, device=None, key_start: int = 0, key_end: int | None = None,
                    query_start: int = 0, query_end: int | None = None) -> torch.Tensor:
    """(query_end - query_start, key_end - key_start) int64 ``|i + Sk - Sq - j|``: the distance of key j
    from query i's bottom-right aligned diagonal, which ALiBi multiplies by ``-slope`` (the kernels'
    ``masking.alibi_scores`` computes the same per tile)."""
    key_end = seqlen_k if key_end is None else key_end
    query_end = seqlen_q if query_end is None else query_end
    rows = torch.arange(query_start, query_end, device=device)[:, None]
    cols = torch.arange(key_start, key_end, device=device)[None, :]
    return (rows + (seqlen_k - seqlen_q) - cols).abs()


def to_bhsd(t: torch.Tensor, layout: str) -> torch.Tensor:
    """A view of ``t`` in (B, H, S, D) order, whatever the user layout."""
    return t.transpose(1, 2) if layout == "bshd" else t


def bhsd_shape(t: torch.Tensor, layout: str) -> tuple:
    """``to_bhsd(t, layout).shape`` without making the view (a host-time matter: a short training
    step asks for shapes and strides dozens of times, and every view costs host time)."""
    shape = t.shape
    return (shape[0], shape[2], shape[1], shape[3]) if layout == "bshd" else tuple(shape)


def bhsd_stride(t: torch.Tensor, layout: str) -> tuple:
    """``to_bhsd(t, layout).stride()`` without making the view."""
    stride = t.stride()
    return (stride[0], stride[2], stride[1], stride[3]) if layout == "bshd" else stride


def is_integer(value) -> bool:
    """A Python or NumPy integer, not a bool: what a user means by an int (``np.int64`` from an array's
    ``.max()``, a config loaded with NumPy)."""
    return type(value) is int or (isinstance(value, numbers.Integral) and not isinstance(value, bool))


def gradient_like(t: torch.Tensor) -> torch.Tensor:
    """An uninitialised gradient for ``t``: in ``t``'s strides where ``t`` is dense (what
    ``torch.empty_like`` keeps, and AccumulateGrad keeps without a copy), else contiguous. For an
    overlapping view (a stride-0 or stride-1 sequence dim) ``empty_like`` picks a permutation that
    can move the head dim off unit stride, which every kernel needs; the custom op's fake allocates
    through here too, so both agree."""
    grad = torch.empty_like(t)
    return grad if grad.stride(-1) == 1 or t.shape[-1] == 1 else torch.empty(t.shape, dtype=t.dtype, device=t.device)


def from_bhsd(t: torch.Tensor, layout: str) -> torch.Tensor:
    return t.transpose(1, 2) if layout == "bshd" else t
