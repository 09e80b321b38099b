"""launch.launch keys each compiled kernel by what Triton specialises it on (CPU: the keys only;
the GPU suite launches through the cache: test_hopper_forward.py)."""

import itertools
import os

import pytest
import torch
import triton
import triton.language as tl
from triton._C.libtriton import native_specialize_impl
from triton.backends.nvidia.compiler import CUDABackend

from fusedattn.kernels.shared.launch import _specialisation

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
    """descriptors.Descriptor (built per call without Triton's checks) keys a launch by its block and
    dtype, and goes to Triton as the TensorDescriptor Triton would have built over the same tensor."""
    from triton.tools.tensor_descriptor import TensorDescriptor

    from fusedattn.kernels.shared.descriptors import Descriptor

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

    from fusedattn.kernels.shared.launch import cdiv, next_power_of_2

    for a in (0, 1, 2, 15, 16, 17, 1000, 4096, 2**31 + 5):
        assert next_power_of_2(a) == triton.next_power_of_2(a), a
        for b in (1, 3, 16, 64, 128):
            assert cdiv(a, b) == triton.cdiv(a, b), (a, b)


@triton.jit
def _scaled_sum(out, a, scale, b, n, BLOCK: tl.constexpr):
    offs = tl.arange(0, BLOCK)
    keep = offs < n
    tl.store(out + offs, tl.load(a + offs, mask=keep) * scale + tl.load(b + offs, mask=keep), mask=keep)


@pytest.mark.skipif(not (torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET") == "1"),
                    reason="runs a kernel: a GPU or Triton's interpreter")
def test_launcher_fills_its_slots_in_order_call_after_call():
    """A Launcher keeps the problem's arguments and takes each call's in the order of its SLOTs: a
    second call with other tensors (and another alignment: a new specialisation) computes with them."""
    from fusedattn.kernels.shared.launch import SLOT, Launcher

    device = "cuda" if torch.cuda.is_available() else "cpu"
    n = 37
    launcher = Launcher(_scaled_sum, (1,), (SLOT, SLOT, 3.0, SLOT, n), BLOCK=64)
    for offset in (0, 1, 0):  # 1: tensors 4 bytes past a 16-byte boundary
        a, b = (torch.randn(n + 1, device=device)[offset:offset + n] for _ in range(2))
        out = torch.zeros(n + 1, device=device)[offset:offset + n]
        launcher(out, a, b)
        torch.testing.assert_close(out, a * 3.0 + b)


@triton.jit
def _offset_copy(out, a, n, BLOCK: tl.constexpr, ADD_ONE: tl.constexpr = False):
    offs = tl.arange(0, BLOCK)
    keep = offs < n
    x = tl.load(a + offs, mask=keep)
    if ADD_ONE:
        x = x + 1.0
    tl.store(out + offs, x, mask=keep)


@pytest.mark.skipif(not (torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET") == "1"),
                    reason="runs a kernel: a GPU or Triton's interpreter")
@pytest.mark.parametrize("options", [dict(), dict(ADD_ONE=False), dict(ADD_ONE=True)], ids=["left-out", "off", "on"])
def test_launcher_gives_a_left_out_constexpr_its_default(options):
    """A trailing constexpr with a default may be left out of a Launcher's keywords, as of
    kernel[grid](...): the first call (which compiles) and the later ones (the kept launch) agree."""
    from fusedattn.kernels.shared.launch import SLOT, Launcher

    device = "cuda" if torch.cuda.is_available() else "cpu"
    launcher = Launcher(_offset_copy, (1,), (SLOT, SLOT, 20), BLOCK=32, **options)
    for _ in range(3):
        a = torch.randn(20, device=device)
        out = torch.zeros(20, device=device)
        launcher(out, a)
        torch.testing.assert_close(out, a + 1.0 if options.get("ADD_ONE") else a)


@triton.jit
def _doubled_rows(src_desc, out, BLOCK_ROWS: tl.constexpr, COLS: tl.constexpr):
    first = tl.program_id(0) * BLOCK_ROWS
    tile = src_desc.load([first, 0])
    rows, cols = first + tl.arange(0, BLOCK_ROWS), tl.arange(0, COLS)
    tl.store(out + rows[:, None] * COLS + cols[None, :], tile * 2)


@pytest.mark.skipif(not (torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET") == "1"),
                    reason="runs a kernel: a GPU or Triton's interpreter")
def test_launcher_reads_each_calls_descriptor():
    """A Launcher's descriptor argument, call after call: another tensor of the same geometry, one of
    another length (same specialisation, another tensor map), then the first again -- each call
    reads its own tensor (on the GPU: the kept argument list of the direct launch, _BoundLaunch)."""
    from fusedattn.kernels.shared.launch import SLOT, Launcher
    from fusedattn.kernels.shared.descriptors import Descriptor

    device = "cuda" if torch.cuda.is_available() else "cpu"
    launcher = Launcher(_doubled_rows, None, (SLOT, SLOT), BLOCK_ROWS=16, COLS=32)
    first = torch.randn(64, 32, device=device)
    for src in (first, torch.randn(64, 32, device=device), torch.randn(48, 32, device=device), first):
        out = torch.full_like(src, float("nan"))
        launcher(Descriptor(src, (16, 32)), out, grid=(src.shape[0] // 16,))
        torch.testing.assert_close(out, src * 2)
