"""launch.launch keys each compiled kernel by what Triton specialises it on (CPU: the keys only;
the GPU suite launches through the cache: test_hopper_forward.py)."""

import itertools

import pytest
import torch
from triton._C.libtriton import native_specialize_impl
from triton.backends.nvidia.compiler import CUDABackend

from fusedattn.kernels.launch import _specialisation

_storage = torch.empty(64, dtype=torch.float32)
ARGUMENTS = [0, 1, 2, 15, 16, 17, 32, -1, -16, 2**31 - 1, 2**31, -2**31, -2**31 - 1, 0.0, 1.5, 1e300, True, False,
             None, _storage, _storage[1:], _storage[4:], _storage.to(torch.bfloat16), _storage.to(torch.float16)]


def triton_specialisation(arg):
    """What Triton's JIT compiles a kernel argument as (type and divisibility), specialising it."""
    return native_specialize_impl(CUDABackend, arg, False, True, True)


def test_launch_keys_differ_where_triton_compiles_differently():
    """Two arguments Triton would compile differently never share a cached kernel."""
    shared = [(a, b) for a, b in itertools.combinations(ARGUMENTS, 2)
              if triton_specialisation(a) != triton_specialisation(b) and _specialisation(a) == _specialisation(b)]
    assert not shared


def test_launch_keys_refuse_arguments_they_have_no_rule_for():
    with pytest.raises(TypeError, match="no specialisation rule"):
        _specialisation("text")


def test_descriptors_key_by_block_and_dtype_and_become_triton_descriptors():
    """memory.Descriptor (built per call without Triton's checks) keys a launch by its block and
    dtype, and goes to Triton as the TensorDescriptor Triton would have built over the same tensor."""
    from triton.tools.tensor_descriptor import TensorDescriptor

    from fusedattn.kernels.memory import Descriptor

    t = torch.empty(2, 3, 40, 64, dtype=torch.float16)
    view = t.transpose(1, 2)  # strided: (2, 40, 3, 64) with the head dim still unit-stride
    keys = {_specialisation(Descriptor(x, block)) for x in (t, t.to(torch.bfloat16))
            for block in ((1, 1, 16, 64), (1, 1, 32, 64))}
    assert len(keys) == 4
    assert _specialisation(Descriptor(t, (1, 1, 16, 64))) == _specialisation(Descriptor(t[1:], (1, 1, 16, 64)))
    for x in (t, view):
        got, want = Descriptor(x, (1, 1, 16, 64)).for_triton(), TensorDescriptor.from_tensor(x, [1, 1, 16, 64])
        assert got.base is x and type(got) is TensorDescriptor
        assert (list(got.shape), list(got.strides), got.block_shape, got.padding) == \
            (list(want.shape), list(want.strides), want.block_shape, want.padding)


def test_host_grid_arithmetic_agrees_with_triton():
    import triton

    from fusedattn.kernels.launch import cdiv, next_power_of_2

    for a in (0, 1, 2, 15, 16, 17, 1000, 4096, 2**31 + 5):
        assert next_power_of_2(a) == triton.next_power_of_2(a), a
        for b in (1, 3, 16, 64, 128):
            assert cdiv(a, b) == triton.cdiv(a, b), (a, b)
