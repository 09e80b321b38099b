"""Kernel launches with less host time than ``kernel[grid](...)``: the launch a short step spends
most of its host time on (benchmarks/NOTES.md v26, v27).

``kernel[grid](*args)`` binds and specialises every argument on every call (~50 us of host time
for a 30-argument kernel on the GPU machine's host). ``launch`` keeps each compiled kernel under
the key Triton itself would specialise it on and launches it directly; the first launch of a key
goes through Triton (and compiles, or finds Triton's own cache). Under the interpreter nothing is
compiled and every launch goes through Triton.
"""

from __future__ import annotations

import torch
from triton.runtime.interpreter import InterpretedFunction

_compiled: dict = {}


def launch(kernel, grid, args: tuple, **constexprs_and_options):
    """``kernel[grid](*args, **constexprs_and_options)``: ``args`` the leading arguments, in order
    (tensors, ints, floats, None, descriptors, and any constexpr among them), the keywords every
    constexpr the kernel takes after them and the launch options (num_warps, num_stages, maxnreg)."""
    if isinstance(kernel, InterpretedFunction):  # runs on the CPU: nothing compiled to keep
        kernel[grid](*args, **constexprs_and_options)
        return
    positional_constexprs = _positional_constexprs(kernel, len(args))
    key = (kernel, torch.cuda.current_device(), tuple(constexprs_and_options.items()),
           *map(_specialisation, args), *(args[i] for i in positional_constexprs))
    entry = _compiled.get(key)
    if entry is None:
        compiled = kernel[grid](*(a.for_triton() if hasattr(a, "for_triton") else a for a in args),
                                **constexprs_and_options)
        constexprs = tuple(constexprs_and_options[name] for name in kernel.arg_names[len(args):])
        _compiled[key] = (compiled, constexprs)
        return
    compiled, constexprs = entry
    compiled[(*grid, 1, 1)[:3]](*args, *constexprs)  # a compiled kernel's runner takes a 3-D grid


_constexpr_positions: dict = {}


def _positional_constexprs(kernel, count: int) -> tuple:
    """The positions of the constexprs among a kernel's first ``count`` parameters: keyed by their
    exact value (``_specialisation`` of an int is coarser)."""
    positions = _constexpr_positions.get((kernel, count))
    if positions is None:
        positions = tuple(i for i, param in enumerate(kernel.params[:count]) if param.is_constexpr)
        _constexpr_positions[(kernel, count)] = positions
    return positions


def _specialisation(arg):
    """What Triton specialises a kernel on for one argument (a superset where that is cheaper to
    compute: every int by its value 1, its 16-divisibility and its 32-bit range, whether or not the
    kernel specialises that parameter; the cache then holds a few more entries, compiles nothing
    more)."""
    kind = type(arg)
    if kind is int:
        return (arg == 1, arg % 16 == 0, -2**31 <= arg < 2**31)
    if kind is float:
        return float
    if arg is None or kind is bool:
        return arg
    if isinstance(arg, torch.Tensor):
        return (arg.dtype, arg.data_ptr() % 16 == 0)
    key = getattr(arg, "key", None)
    if key is not None:  # hopper.Descriptor: its block, dtype and layout class, computed once
        return key
    if hasattr(arg, "block_shape"):  # Triton's TensorDescriptor: its block and dtype
        return (kind, tuple(arg.block_shape), arg.base.dtype)
    raise TypeError(f"launch: no specialisation rule for {kind.__name__}")
