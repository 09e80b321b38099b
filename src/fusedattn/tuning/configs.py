"""Launch configurations: frozen dataclasses and a deterministic heuristic default.

One config per kernel. The heuristic depends only on what changes the best tiling
(device, dtype, head dims, and for the forward whether the key length is short);
sequence lengths are runtime arguments of the kernels, so a length never compiles a new
kernel by itself. A tuned entry of the on-disk cache (``tuning/cache.py``) whose key matches
takes precedence over the heuristic. Tests pin configs with ``pinned_configs``.
"""

from __future__ import annotations

import contextlib
import functools
from dataclasses import replace

import torch

from ..kernels.shared.config import SHORT_KEYS, AttentionConfigs, KernelConfig  # noqa: F401  (re-exported)
from .cache import TuningCache, cache_path, config_key

_pinned: AttentionConfigs | None = None  # tests: every call takes these configs (``pinned_configs``)

# Left windows at least this wide (keys a query sees before itself) take the configs of problems
# without one: a wide band's tiles walk enough key blocks that the forward's 3 warpgroups taking
# turns beat 2 (each warpgroup passes over the key blocks its rows never see, so a 192-row tile
# wastes no more than a 128-row one). Measured at S=4k and 16k (docs/PERFORMANCE.md 5d): D=128 3
# warpgroups faster from left 511 (-2%; left 1023 -3 to -5%, 2047 -11%), slower at 255 and 127
# (+3-4%); D=64 faster from 255 (level at 4k, -4% at 16k; left 511 -6%), slower at 127 (+3%).
WIDE_LEFT_WINDOW = {64: 255, 128: 511}


def band_window(spec, head_dim: int) -> bool:
    """``has_left`` of ``select_configs`` for an AttentionSpec: a left window narrower than
    WIDE_LEFT_WINDOW (the window configs), not any left window."""
    return spec.has_window_left and spec.window_left < WIDE_LEFT_WINDOW.get(head_dim, spec.window_left + 1)


@contextlib.contextmanager
def pinned_configs(configs: AttentionConfigs):
    """Use ``configs`` for every launch inside the block (tests, tuning runs)."""
    global _pinned
    previous, _pinned = _pinned, configs
    try:
        yield configs
    finally:
        _pinned = previous


# Under the interpreter tiles are small so that tests of short, odd lengths still cross
# several blocks, and cheap because every program runs serially on the CPU.
# Loads go through TMA descriptors as on Hopper (the interpreter emulates them; tests pin
# pointer loads too).
INTERPRETER_CONFIGS = AttentionConfigs(
    forward=KernelConfig(16, 16, 1, 1, tma_loads=True),
    dkdv=KernelConfig(16, 16, 1, 1, tma_loads=True),
    dq=KernelConfig(16, 16, 1, 1, tma_loads=True),
    preprocess_block_m=16,
    atomic_dq=True,  # no TMA reduce-add in the interpreter: pointer atomics, so both dQ paths stay tested
)


def _cuda_configs(dtype: torch.dtype, head_dim: int, head_dim_v: int, seqlen_k: int = 4096,
                  capability: tuple[int, int] = (9, 0), has_left: bool = False, has_right: bool = False,
                  has_softcap: bool = False) -> AttentionConfigs:
    width = max(head_dim, head_dim_v)  # padded to a power of two by the kernels
    wide = dtype == torch.float32  # 4-byte tiles need half the rows to fit shared memory
    hopper = capability[0] >= 9  # TMA: descriptor loads and bulk reduce-adds
    # 16-bit winners of benchmarks/tune.py and benchmarks/variants.py over the standard shapes; fp32
    # halves the tiles. The Triton defaults sum dQ in a separate pass: once ptxas pipelined the
    # dK/dV pass's wgmmas, dQ by TMA reduce-adds from the Triton dK/dV programs stopped paying (it
    # still is an option: AttentionConfigs.atomic_dq).
    # Only the Gluon pass at D=128 below sums dQ itself by default.
    if width <= 64:
        fwd = KernelConfig(64, 32, 4, 3) if wide else KernelConfig(64, 64, 4, 3)
        dkdv = KernelConfig(32, 64, 4, 2) if wide else KernelConfig(64, 64, 4, 3)
        dq = KernelConfig(64, 32, 4, 2) if wide else KernelConfig(128, 64, 4, 3)
    elif width <= 128:
        fwd = KernelConfig(64, 32, 4, 2) if wide else KernelConfig(128, 128, 8, 3)
        if not wide and seqlen_k <= SHORT_KEYS:  # few key tiles per program: smaller tiles, shorter prologue
            fwd = KernelConfig(64, 64, 4, 3)  # measured faster at S=1k, full and more so causal
        # Two 4-warp dK/dV programs per SM: with the wgmmas pipelined the fastest at
        # every length (benchmarks/tune.py, S=4k and 16k; variants.py, S=1k).
        dkdv = KernelConfig(32, 64, 8, 2) if wide else KernelConfig(64, 64, 4, 2)
        dq = KernelConfig(64, 32, 8, 2) if wide else KernelConfig(128, 64, 8, 3)
    else:
        fwd = KernelConfig(32 if wide else 64, 32 if wide else 64, 4, 2)
        dkdv = KernelConfig(16 if wide else 32, 32 if wide else 64, 4 if wide else 8, 1 if wide else 2)
        dq = KernelConfig(32 if wide else 64, 16 if wide else 32, 4 if wide else 8, 1 if wide else 2)
    if hopper:
        fwd, dkdv, dq = (replace(c, tma_loads=True) for c in (fwd, dkdv, dq))
    if capability[0] == 9 and not wide and head_dim == head_dim_v and head_dim in (64, 128):
        # The Gluon forwards: warp-specialised with three consumer
        # warpgroups taking turns (192-row tiles) wherever it won; at D=128 with short causal keys
        # two warpgroups (fewer rows wasted on the diagonal); at D=64 with short keys the 8-warp
        # kernel, plain schedule (two programs per SM), 64-key tiles if causal.
        short = seqlen_k <= SHORT_KEYS
        if head_dim == 64 and short:
            fwd = KernelConfig(128, 64 if has_right else 128, 8, 2, tma_loads=True, hopper_overlap=0)
        elif head_dim == 128 and short and has_right:
            fwd = KernelConfig(128, 128, 4, 2, tma_loads=True, hopper_overlap=0, hopper_split=2)
        elif has_softcap and has_right and dtype == torch.float16:
            # fp16 causal softcap at long keys (the exact tanh: three MUFU ops a score): 2 warpgroups
            # without turns (persistent up to 4096 keys) ran the forward faster than 3 taking
            # turns at S=4k. bf16 (tanh.approx, two) takes the default below: level at 4k, much
            # faster at 16k.
            fwd = KernelConfig(128, 128, 4, 2, tma_loads=True, hopper_overlap=0, hopper_split=2)
        elif has_left:
            # A left window's band of keys: 128-row tiles visit fewer pairs it does not keep than
            # 192-row ones: measured faster at S=4k (a 1024-key band), more so at D=128 than at D=64.
            fwd = KernelConfig(128, 128, 4, 2, tma_loads=True, hopper_overlap=0, hopper_split=2, hopper_pingpong=1)
        else:
            fwd = KernelConfig(192, 128, 4, 2, tma_loads=True, hopper_overlap=0, hopper_split=3, hopper_pingpong=1)
        # The warp-specialised Gluon dK/dV pass, faster than the Triton pass (the pass alone, at S=4k
        # and 16k): warpgroups of 64 keys taking turns over S^T.
        if head_dim == 128:
            # 2 warpgroups (3 cannot hold D=128's accumulators), 64-row steps; the pass also
            # computes dQ (5 matmuls), split by keys, and a drain warp sums it with TMA reduce-adds:
            # the whole backward measured faster than with the dQ pass. No turns: the warpgroups
            # run in lockstep as at D=64 (S^T and dP^T back to back, dQ issued before dK); softcap
            # keeps turns over S^T. Deterministic calls (the dQ pass) take turns over S^T
            # (dispatch.dkdv_without_dq).
            dkdv = KernelConfig(64, 128, 4, 2, tma_loads=True, hopper_overlap=0, hopper_split=2,
                                hopper_pingpong=1 if has_softcap else 0)
            dq_by_atomics = True
        elif has_softcap:
            # Softcap: its derivative's registers spill the row split's 128-row steps (with or
            # without dQ); 3 warpgroups over 64-row steps keep every value in registers.
            dkdv = KernelConfig(64, 192, 4, 2, tma_loads=True, hopper_overlap=0, hopper_split=3, hopper_pingpong=1)
            dq_by_atomics = False
        else:
            # D=64: FlashAttention-4's split. 128-row steps over 2 warpgroups of 64 keys; each warpgroup
            # sums dQ for 64 of the step's rows over both warpgroups' keys (2 bytes reduce-added per
            # query-key pair). No turns: the warpgroups run in lockstep, S^T and dP^T issued back to
            # back, dQ issued before dK (kernels/gluon/bwd.py). Measured faster than 3 warpgroups plus
            # the dQ pass at every length (short causal keys included), and than turns over S^T and
            # dP^T. Deterministic calls (which keep the dQ pass) run these steps with turns
            # (dispatch.dkdv_without_dq): level with 3 warpgroups or faster.
            dkdv = KernelConfig(128, 128, 4, 2, tma_loads=True, hopper_overlap=0, hopper_split=2, hopper_pingpong=0)
            dq_by_atomics = True
        # Deterministic calls: the pass sums dQ in a fixed order of its programs (they take turns on
        # each query block's reduce-adds) -- measured faster than the dK/dV pass without dQ plus the
        # dQ pass at D=64 and 128, causal or not, S=1k to 16k, once the programs are launched in
        # chunks of about a wave (gluon/bwd.py, dkdv_programs). D=128 causal at short keys keeps the
        # Gluon dQ pass (S=1k: 5% faster than the order; S=2k: 3% slower, one rule for both).
        # Where dQ has a pass of its own at D=128 (deterministic mode): the forward's warp-specialised
        # kernel as the dQ pass, 2 warpgroups of 64 rows taking turns over S and dP, 64-key steps:
        # measured faster than the Triton dQ pass. At D=64 (the dQ pass of deterministic calls and
        # softcap) the Triton pass stays: the Gluon one was slower a step in every schedule.
        gluon_dq = (KernelConfig(128, 64, 4, 3, tma_loads=True, hopper_overlap=0, hopper_split=2, hopper_pingpong=1)
                    if head_dim == 128 else None)
        return AttentionConfigs(forward=fwd, dkdv=dkdv, dq=dq, preprocess_block_m=64,
                                atomic_dq=dq_by_atomics, dq_tma=dq_by_atomics, gluon_dq=gluon_dq,
                                ordered_dq=dq_by_atomics and not (short and has_right and head_dim == 128))
    return AttentionConfigs(forward=fwd, dkdv=dkdv, dq=dq, preprocess_block_m=64)


def select_configs(device: torch.device, dtype: torch.dtype, head_dim: int, head_dim_v: int,
                   seqlen_k: int = 4096, has_left: bool = False, has_right: bool = False,
                   has_softcap: bool = False) -> AttentionConfigs:
    """Pinned configs, else a tuned entry of the on-disk cache (tuning/cache.py) whose key matches,
    else the heuristic. ``has_left``: a left window of the band class (``band_window``)."""
    if _pinned is not None:
        return _pinned
    if device.type != "cuda":
        return INTERPRETER_CONFIGS
    index = device.index if device.index is not None else torch.cuda.current_device()
    return _cuda_select(index, dtype, head_dim, head_dim_v, seqlen_k <= SHORT_KEYS, has_left, has_right, has_softcap)


@functools.lru_cache(maxsize=1024)
def _cuda_select(device_index: int, dtype: torch.dtype, head_dim: int, head_dim_v: int, short_keys: bool,
                 has_left: bool, has_right: bool, has_softcap: bool) -> AttentionConfigs:
    seqlen_k = SHORT_KEYS if short_keys else 2 * SHORT_KEYS  # a representative of the length class
    capability = torch.cuda.get_device_capability(device_index)
    key = config_key(torch.cuda.get_device_name(device_index), capability, dtype, head_dim, head_dim_v, seqlen_k,
                     has_left, has_right, has_softcap)
    tuned = TuningCache(cache_path()).get(key)
    return tuned if tuned is not None else _cuda_configs(dtype, head_dim, head_dim_v, seqlen_k, capability,
                                                         has_left, has_right, has_softcap)


def reload_tuning_cache() -> None:
    """Forget the configs chosen so far (after a tuning run wrote new cache entries)."""
    _cuda_select.cache_clear()
