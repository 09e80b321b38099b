"""Kernel launches with less host time than ``kernel[grid](...)``: the launch a short step spends
most of its host time on.

``kernel[grid](*args)`` binds and specialises every argument on every call (host time that grows
with the argument count; the kernels here take dozens). ``launch`` keeps each compiled kernel under
the key Triton itself would specialise it on and launches it directly; the first launch of a key
goes through Triton (and compiles, or finds Triton's own cache). Under the interpreter nothing is
compiled and every launch goes through Triton.

A compiled kernel's own runner still costs host time a launch in Python (a closure per grid, the
stream query, scratch checks, and one ``cuTensorMapEncodeTiled`` per TMA descriptor argument, 9 for
the dK/dV pass). ``_DirectLaunch`` calls Triton's C launcher itself, with the descriptors' tensor
maps kept by what they encode (address, shape, strides, block: a map holds no reference to the
memory, so a reused address with the same geometry gives the same map). It is used where nothing
else runs at launch: no global or profiling scratch, no launch hooks (Triton's profilers set them:
those launches go through Triton's runner, as before).
"""

from __future__ import annotations

import functools

import torch
from triton import knobs
from triton.runtime.interpreter import InterpretedFunction

from .descriptors import Descriptor
from .knobs import knobs as switches

_compiled: dict = {}


def launch(kernel, grid, args: tuple, **constexprs_and_options):
    """``kernel[grid](*args, **constexprs_and_options)``: ``args`` the leading arguments, in order
    (tensors, ints, floats, None, descriptors, and any constexpr among them), the keywords every
    constexpr the kernel takes after them and the launch options (num_warps, num_stages, maxnreg).
    Returns the cache entry of the compiled kernel (None under the interpreter)."""
    if isinstance(kernel, InterpretedFunction):  # runs on the CPU: nothing compiled to keep
        kernel[grid](*_for_triton(args), **constexprs_and_options)
        return None
    positional_constexprs = _positional_constexprs(kernel, len(args))
    device = torch.cuda.current_device()
    # id(kernel): hashing a JITFunction goes through its cache_key property on every lookup; the
    # entry holds the kernel, so its id is not reused while the entry lives.
    key = (id(kernel), device, tuple(constexprs_and_options.items()),
           *map(_specialisation, args), *(args[i] for i in positional_constexprs))
    entry = _compiled.get(key)
    if entry is None:
        entry = _compiled[key] = _first_launch(kernel, grid, args, constexprs_and_options)
    else:
        _run(entry, grid, args, device)
    return entry


def _first_launch(kernel, grid, args: tuple, constexprs_and_options: dict) -> tuple:
    """Launch through Triton (which compiles, or finds its own cache) and return what a later
    launch of the same specialisation needs: (compiled kernel, trailing constexprs, direct launch,
    the kernel)."""
    compiled = kernel[grid](*_for_triton(args), **constexprs_and_options)
    # a trailing constexpr the caller leaves out takes its declared default, as in kernel[grid](...)
    constexprs = tuple(constexprs_and_options[param.name] if param.name in constexprs_and_options else param.default
                       for param in kernel.params[len(args):])
    return compiled, constexprs, _DirectLaunch.of(compiled), kernel


def _run(entry: tuple, grid, args: tuple, device: int) -> None:
    compiled, constexprs, direct, _ = entry
    grid3 = (*grid, 1, 1)[:3]  # a compiled kernel's runner takes a 3-D grid
    if direct is not None and switches().direct_launch and _no_launch_hooks():
        direct(grid3, args + constexprs, device)
    else:
        compiled[grid3](*args, *constexprs)


class Launcher:
    """One kernel launch as a problem decides it -- kernel, grid, constexprs, options, and every
    argument that depends only on the problem (shapes, strides, scalars) -- kept by the caller per
    problem; each call passes the arguments that change between calls (its tensors and
    descriptors), in the order of the ``SLOT`` markers in ``args``. What it saves over ``launch``:
    the per-call key over every argument (host time that grows with their count); the compiled kernel is
    found by the specialisation of the call's own arguments, the rest being fixed with the
    launcher, and launched from the argument list the C launcher takes, made once per
    specialisation with the fixed arguments in place (``_BoundLaunch``). Under the interpreter
    every call goes through ``launch``."""

    __slots__ = ("kernel", "grid", "grid3", "template", "slots", "options", "device", "entries")

    def __init__(self, kernel, grid, args: tuple, **constexprs_and_options):
        self.kernel, self.grid, self.options = kernel, grid, constexprs_and_options
        self.grid3 = None if grid is None else (*grid, 1, 1)[:3]
        self.template = list(args)
        self.slots = tuple(i for i, arg in enumerate(args) if arg is SLOT)
        self.device = None if isinstance(kernel, InterpretedFunction) else torch.cuda.current_device()
        self.entries = {}

    def __call__(self, *values, grid=None):
        """``grid``: this call's grid, where the problem leaves it to the call's data (packed
        sequences: the number of blocks that exist); else the launcher's."""
        assert len(values) == len(self.slots)
        key = tuple(map(_specialisation, values)) if self.device is not None else None
        bound = self.entries.get(key)
        if bound is not None:
            bound(values, self.grid3 if grid is None else (*grid, 1, 1)[:3], self.device)
            return
        entry = launch(self.kernel, self.grid if grid is None else grid,
                       tuple(_filled(self.template, self.slots, values)), **self.options)
        if entry is not None:
            self.entries[key] = _BoundLaunch(entry, self.template, self.slots, values)


class _BoundLaunch:
    """A ``Launcher``'s compiled kernel for one specialisation of its call arguments, with the list
    the C launcher takes (``_DirectLaunch``: each descriptor expanded into tensor map, shape and
    strides) made once with the fixed arguments in place; a call writes its own arguments into
    their places. Where the kernel has no direct launch, or a launch hook is set, a call goes
    through ``_run`` (Triton's runner) with the arguments filled into the launcher's template."""

    __slots__ = ("entry", "template", "slots", "expanded", "places")

    def __init__(self, entry: tuple, template: list, slots: tuple, first_values: tuple):
        self.entry, self.template, self.slots, self.expanded, self.places = entry, template, slots, None, None
        direct = entry[2]
        if direct is None:
            return
        args = _filled(template, slots, first_values) + list(entry[1])
        metas = dict(direct.descriptors)
        starts, widths, expanded = [], [], []
        for position, arg in enumerate(args):
            starts.append(len(expanded))
            expanded += direct.tensor_map(position, arg, metas[position]) if position in metas else [arg]
            widths.append(len(expanded) - starts[-1])
        for position in slots:  # none of the first call's own arguments is kept
            expanded[starts[position]:starts[position] + widths[position]] = [None] * widths[position]
        # (start, width, position, meta) of each slot; width 0: an argument passed as it is
        self.places = tuple((starts[p], widths[p] if p in metas else 0, p, metas.get(p)) for p in slots)
        self.expanded = expanded

    def __call__(self, values: tuple, grid3: tuple, device: int) -> None:
        if self.expanded is None or not switches().direct_launch or not _no_launch_hooks():
            _run(self.entry, grid3, tuple(_filled(self.template, self.slots, values)), device)
            return
        direct, args = self.entry[2], self.expanded.copy()
        for (start, width, position, meta), value in zip(self.places, values):
            if width:
                args[start:start + width] = direct.tensor_map(position, value, meta)
            else:
                args[start] = value
        direct.launch_expanded(grid3, args, device)


def _filled(template: list, slots: tuple, values: tuple) -> list:
    args = template.copy()
    for position, value in zip(slots, values):
        args[position] = value
    return args


SLOT = object()  # marks a ``Launcher`` argument that each call passes

_problem_caches: list = []  # the cache_clear of every per-problem cache of launchers
MAX_PROBLEMS = 256  # problems each per-problem cache keeps


def per_problem(build):
    """Keep what ``build`` returns (a ``Launcher``, a plan holding some) per argument tuple -- the
    problem's metadata, never its tensors -- and per setting of the experiment switches
    (``knobs.Knobs``), which ``build`` may read: a launch built under one is never reused under another."""

    @functools.lru_cache(maxsize=MAX_PROBLEMS)
    def under(switches, *args, **kwargs):
        return build(*args, **kwargs)

    @functools.wraps(build)
    def cached(*args, **kwargs):
        return under(switches(), *args, **kwargs)

    _problem_caches.append(under.cache_clear)
    return cached


def per_problem_dict() -> dict:
    """A dict for per-problem values its owner keys by the problem's metadata itself (where the
    decision needs the tensors at hand, which ``per_problem`` cannot take); the owner empties it
    past ``MAX_PROBLEMS`` entries."""
    kept: dict = {}
    _problem_caches.append(kept.clear)
    return kept


def forget_compiled() -> None:
    """Drop every kept compiled kernel and per-problem launcher (tests: count what a step compiles)."""
    _compiled.clear()
    for clear in _problem_caches:
        clear()


def cdiv(a: int, b: int) -> int:
    """Host arithmetic for grids and tile counts: ``triton.cdiv`` and ``triton.next_power_of_2`` are
    constexpr functions, slow to call on the host."""
    return -(-a // b)


def next_power_of_2(n: int) -> int:
    return 1 << (n - 1).bit_length() if n > 0 else 0


def _for_triton(args: tuple) -> list:
    """The arguments as Triton's own launch takes them: descriptors as Triton's TensorDescriptors."""
    return [a.for_triton() if hasattr(a, "for_triton") else a for a in args]


def _no_launch_hooks() -> bool:
    """Whether no launch hook is set: Triton 3.6 keeps them as (empty) chains, earlier ones as None."""
    enter, leave = knobs.runtime.launch_enter_hook, knobs.runtime.launch_exit_hook
    return not getattr(enter, "calls", enter) and not getattr(leave, "calls", leave)


class _DirectLaunch:
    """One compiled kernel launched through Triton's C launcher directly (module docstring): its
    launch function, the kernel's handle and packed metadata, and the positions (among the kernel's
    arguments) of the TMA descriptors with the metadata each one's tensor map is encoded with."""

    __slots__ = ("launch", "function", "metadata", "cooperative", "pdl", "descriptors", "maps", "encode")
    _MAX_MAPS = 512  # tensor maps kept per kernel; the cache restarts beyond it (new shapes each call)

    def __init__(self, launch_fn, compiled, runner, descriptors):
        self.launch, self.function, self.metadata = launch_fn, compiled.function, compiled.packed_metadata
        self.cooperative, self.pdl = runner.launch_cooperative_grid, runner.launch_pdl
        self.descriptors, self.maps = descriptors, {}
        from triton.backends.nvidia.driver import make_tensordesc_arg

        self.encode = make_tensordesc_arg

    @classmethod
    def of(cls, compiled):
        """The direct launch of a compiled kernel, or None where its runner is not the plain CUDA
        launcher of Triton 3.6 (another backend or version, scratch memory to allocate)."""
        try:
            from triton.backends.nvidia.driver import CudaLauncher

            runner = compiled.run
            if not isinstance(runner, CudaLauncher) or runner.global_scratch_size or runner.profile_scratch_size:
                return None
            signature = list(compiled.src.signature.values())
            positions = [i for i, sig in enumerate(signature) if isinstance(sig, str) and sig.startswith("tensordesc")]
            if not positions:
                return cls(runner.launch, compiled, runner, ())
            # Triton wraps its C launcher in a closure that encodes the descriptors: take the C one.
            cells = dict(zip(runner.launch.__code__.co_freevars, (c.cell_contents for c in runner.launch.__closure__)))
            metas = getattr(compiled.metadata, "tensordesc_meta", None) or [None] * len(positions)
            if len(metas) != len(positions) or not callable(cells.get("launcher")):
                return None
            return cls(cells["launcher"], compiled, runner, tuple(zip(positions, metas)))
        except (AttributeError, TypeError, ValueError, ImportError):
            return None

    def __call__(self, grid3, args: tuple, device: int):
        if self.descriptors:
            expanded, done = [], 0
            for position, meta in self.descriptors:
                expanded += args[done:position]
                expanded += self.tensor_map(position, args[position], meta)
                done = position + 1
            expanded += args[done:]
            args = expanded
        self.launch_expanded(grid3, args, device)

    def launch_expanded(self, grid3, args, device: int) -> None:
        """Launch with the arguments as the C launcher takes them (descriptors expanded)."""
        stream = torch._C._cuda_getCurrentRawStream(device)
        self.launch(*grid3, stream, self.function, self.cooperative, self.pdl, None, None, self.metadata, None, None,
                    None, *args)

    def tensor_map(self, position: int, desc, meta) -> list:
        """What Triton's launcher takes for a descriptor argument: the encoded tensor map, then the
        shape and strides (``make_tensordesc_arg``), kept by address and geometry."""
        if meta is None:  # a kernel that takes the descriptor's fields, not a map
            return self.encode(desc, None)
        geometry = getattr(desc, "geometry", None)  # descriptors.Descriptor's (address, shape, strides)
        if geometry is None:
            geometry = (desc.base.data_ptr(), tuple(desc.shape), tuple(desc.strides))
        key = (position, geometry, desc.padding)
        entry = self.maps.get(key)
        if entry is None:
            if len(self.maps) >= self._MAX_MAPS:
                self.maps.clear()
            entry = self.maps[key] = self.encode(desc, meta)
        return entry


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
    if isinstance(arg, Descriptor):  # its class, block and dtype, computed once
        return arg.key
    if kind is float:
        return float
    if arg is None or kind is bool:
        return arg
    if isinstance(arg, torch.Tensor):
        return (arg.dtype, arg.data_ptr() % 16 == 0)
    if hasattr(arg, "block_shape"):  # Triton's TensorDescriptor: its block and dtype
        return (kind, tuple(arg.block_shape), arg.base.dtype)
    raise TypeError(f"launch: no specialisation rule for {kind.__name__}")
