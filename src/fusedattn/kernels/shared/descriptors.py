"""TMA descriptors as the host builds them for every kernel family, and whether the copy engine can
address a tensor at all (16-byte aligned base and outer strides, unit last stride)."""

from __future__ import annotations

import functools

import torch

from ...spec import bhsd_shape, bhsd_stride


def tma_addressable(t: torch.Tensor) -> bool:
    """Whether the copy engine can address ``t``: 16-byte aligned base and outer strides, unit last stride."""
    return _addressable(t.data_ptr(), t.stride(), t.element_size())


def _addressable(address: int, strides: tuple, element_size: int) -> bool:
    return address % 16 == 0 and _strides_addressable(strides, element_size)


@functools.lru_cache(maxsize=1024)
def _strides_addressable(strides: tuple, element_size: int) -> bool:
    """Unit last stride, the others multiples of 16 bytes: kept per strides (a short step checks
    ~15 tensors)."""
    return strides[-1] == 1 and all(s * element_size % 16 == 0 for s in strides[:-1])


class Descriptor:
    """A TMA descriptor over a whole tensor as a compiled kernel's launcher reads it (base, shape,
    strides, padding) with the key ``launch.launch`` specialises on, and its ``geometry`` (address,
    shape, strides), by which the launcher keeps the tensor maps it encodes. Triton's
    TensorDescriptor checks its fields on every construction (host time paid on each, a dozen a
    training step); the one check that can fail here is TMA's addressing (``if_addressable``), and a
    real TensorDescriptor is built only for a launch through Triton (``for_triton``: a first launch,
    the interpreter)."""

    __slots__ = ("base", "shape", "strides", "block_shape", "padding", "key", "geometry")

    def __init__(self, base: torch.Tensor, block_shape: tuple, address: int | None = None,
                 strides: tuple | None = None, shape: tuple | None = None):
        self.base, self.shape = base, base.shape if shape is None else shape
        self.strides = base.stride() if strides is None else strides
        self.block_shape, self.padding = block_shape, "zero"
        self.key = (type(self), block_shape, base.dtype)
        self.geometry = (base.data_ptr() if address is None else address, self.shape, self.strides)

    @classmethod
    def if_addressable(cls, base: torch.Tensor, block_shape: tuple, layout: str = "bhsd"):
        """The descriptor, or None where TMA cannot address ``base`` (``tma_addressable``): the
        address and strides read once for both (a short step makes ~15 descriptors). ``layout``
        "bshd": over the 4-D ``base`` in (B, H, S, D) order, as over ``spec.to_bhsd(base, "bshd")``
        but without making that view (each view costs host time)."""
        address, strides = base.data_ptr(), base.stride()
        if not _addressable(address, strides, base.element_size()):  # the same in either order
            return None
        if layout == "bshd":
            return cls(base, block_shape, address, bhsd_stride(base, layout), bhsd_shape(base, layout))
        return cls(base, block_shape, address, strides, base.shape)

    def for_triton(self):
        from triton.tools.tensor_descriptor import TensorDescriptor

        return TensorDescriptor(self.base, list(self.shape), list(self.strides), list(self.block_shape))


def score_tiles_addressable(t: torch.Tensor | None) -> bool:
    """Whether TMA can read (queries x keys) tiles of a 4-D score-shaped tensor in its own shape:
    ``score_tile_descriptor``'s rule."""
    if t is None or not t.is_cuda or t.shape[2] == 1 or t.shape[3] == 1 or not tma_addressable(t):
        return False
    return not any(stride == 0 and size > 1 for size, stride in zip(t.shape, t.stride()))

