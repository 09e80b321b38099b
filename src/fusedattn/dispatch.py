"""The planner: which backend and which kernel run each pass of a call, with which config, and why.

Every choice between implementations is made here and nowhere else:

- the backend: ``"triton"`` (the fused kernels: CUDA tensors, or CPU tensors under Triton's
  interpreter) or ``"torch"`` (``cpu.py``: plain PyTorch, torch's fused CPU kernel where it fits);
- within the kernels, the Gluon kernels (warp-specialised, sm_90 only, imported only where they
  run) where the problem, the tensors and the launch config allow, the Triton kernels otherwise;
- in the backward, how dQ is summed (by the dK/dV pass's atomics, by a pass of its own -- the Gluon
  dQ pass or the Triton dQ programs), and how the bias gradient is formed.

``plan_forward`` and ``plan_backward`` return frozen plans that name each pass's kernel, its config
and, for every faster path not taken, the reason (``Support``); ``forward`` and ``backward`` run
them. ``explain_plans`` gives the plans a call would run (``fusedattn.explain`` prints them).
Kernel modules hold kernels and launchers only: they decide nothing about which of them runs.
"""

from __future__ import annotations

import contextlib
import math
import os
from dataclasses import dataclass, field, replace

import torch

from . import cpu
from .block_mask import BlockMask
from .kernels import gluon
from .kernels.shared.knobs import knobs
from .kernels.shared.launch import MAX_PROBLEMS, Launcher, cdiv, per_problem_dict
from .kernels.shared.support import TAKEN, Support, refused
from .kernels.shared.tile_lists import rows_even, whole_and_even
from .kernels.triton import bwd as triton_bwd
from .kernels.triton import fwd as triton_fwd
from .kernels.triton.bwd import DBIAS_ATOMIC, DBIAS_OFF, DBIAS_PASS, DBIAS_STORE
from .kernels.shared.descriptors import score_tiles_addressable, tma_addressable
from .row_gradients import row_bias_gradient, sink_gradient, sink_gradient_from_outputs
from .spec import AttentionSpec, Packing, bhsd_shape, gradient_like
from .tuning.configs import SHORT_KEYS, AttentionConfigs, KernelConfig, band_window, select_configs

# ----------------------------------------------------------------------------- backend

BACKENDS = ("auto", "triton", "torch")
_backend = os.environ.get("FUSEDATTN_BACKEND", "auto")


@contextlib.contextmanager
def use_backend(name: str):
    """Choose the backend inside the block: ``"auto"`` (Triton on CUDA, PyTorch on CPU),
    ``"triton"`` (also CPU tensors, when the process was started with ``TRITON_INTERPRET=1``)
    or ``"torch"``. The environment variable ``FUSEDATTN_BACKEND`` sets the default."""
    global _backend
    if name not in BACKENDS:
        raise ValueError(f"fusedattn.use_backend: expected one of {BACKENDS}, got {name!r}")
    previous, _backend = _backend, name
    try:
        yield
    finally:
        _backend = previous


def kernels_interpreted() -> bool:
    from triton.runtime.interpreter import InterpretedFunction

    return isinstance(triton_fwd._forward_kernel, InterpretedFunction)


def resolve_backend(device: torch.device) -> str:
    """The backend a call on ``device`` runs: the one ``use_backend`` names, ``"auto"`` resolved."""
    if _backend not in BACKENDS:
        raise ValueError(f"FUSEDATTN_BACKEND must be one of {BACKENDS}, got {_backend!r}")
    if _backend == "auto":
        return "triton" if device.type == "cuda" else "torch"
    if _backend == "triton" and device.type == "cpu" and not kernels_interpreted():
        raise RuntimeError(
            "fusedattn: the Triton kernels run on CPU tensors only under Triton's interpreter; "
            "set TRITON_INTERPRET=1 before importing fusedattn"
        )
    return _backend


def configs_for(q, v, spec: AttentionSpec, seqlen_k: int) -> AttentionConfigs:
    """The launch configs of a problem (tuning/configs.py: tuned entries, else the heuristics)."""
    head_dim = q.shape[-1]
    return select_configs(q.device, q.dtype, head_dim, v.shape[-1], seqlen_k, band_window(spec, head_dim),
                          spec.has_window_right, spec.has_softcap)


def packed_configs(q, v, spec: AttentionSpec) -> AttentionConfigs:
    """The launch configs of packed sequences: one for every set of lengths (the long-keys class),
    since a new longest length must not switch configs, which would compile new kernels."""
    return select_configs(q.device, q.dtype, q.shape[-1], v.shape[-1], has_left=band_window(spec, q.shape[-1]),
                          has_right=spec.has_window_right, has_softcap=spec.has_softcap)


# ----------------------------------------------------------------------------- what the Gluon kernels take

# The tiles the Gluon kernels walk a mask's lists with: 128-row forward programs on two consumer
# warpgroups, 128-key dK/dV programs (two warpgroups of 64 keys). A mask is taken where none of its
# own tiles at this size is partial (tile_lists.tiles_whole): the kernels then never read it.
GLUON_MASK_TILE = 128


def gluon_reads_bias(bias: torch.Tensor | None) -> Support:
    """Whether the Gluon kernels can read a bias (the forward always; the dK/dV pass under the
    further terms of ``gluon_dkdv_takes_bias``): 16-bit, one value per query and key (a broadcast
    query or key dim reads a row or column: pointers), tiles TMA can address
    (``descriptors.score_tiles_addressable``). fp32 biases take the Triton kernel: their tiles would not
    fit beside K and V in shared memory."""
    if bias.dtype not in (torch.float16, torch.bfloat16):
        return refused(f"a {bias.dtype} bias; the Gluon kernels read 16-bit biases (fp32 tiles do not fit beside K, V)")
    if not score_tiles_addressable(bias):
        return refused("a bias broadcast over queries or keys, or not 16-byte aligned: its tiles cannot come "
                       "through TMA")
    return TAKEN


def gluon_support(q, k, v, spec: AttentionSpec, sinks=None, mask=None, bias=None, reads_bias=False,
                  alibi_form=False, dropout_form=False) -> Support:
    """Whether the Gluon kernels take the problem: no ALiBi, no chunk, no dropout, sinks only without
    ALiBi or dropout (the warp-specialised forward's sink term: ``plan_forward``); a bias only in a
    kernel that reads one (``reads_bias``: the forward, and the dK/dV pass in its 5-matmul form) and
    where it can (``gluon_reads_bias``); a mask only where none of its own tiles is partial (``GLUON_MASK_TILE``);
    q, k, v addressable by TMA (16-byte aligned). ``alibi_form``: the pass asked about has ALiBi's
    causal form for this call (``gluon_forward_takes_alibi``, ``gluon_dkdv_takes_alibi``);
    ``dropout_form``: it has dropout for this call (``gluon_forward_takes_dropout``,
    ``gluon_dkdv_takes_dropout``; the dQ pass: ``takes_gluon_dq``)."""
    if not q.is_cuda:
        return refused("not a CUDA tensor")
    if spec.alibi and not alibi_form:
        return refused("alibi_slopes: the Gluon forward and dK/dV pass have ALiBi's causal form only (no mask, "
                       "bias or packing; the forward's warp-specialised kernel); the dQ pass has none")
    if spec.has_chunk:
        return refused("chunk: the Gluon kernels have no chunked-attention rule")
    if spec.has_dropout and not dropout_form:
        return refused("dropout_p: the Gluon kernels have dropout without a mask, bias or packing (the forward "
                       "on its warp-specialised kernel)")
    if sinks is not None and (spec.alibi or spec.has_dropout):
        return refused("sinks with ALiBi or dropout: the Gluon forward's sink term has neither")
    if bias is not None:
        if not reads_bias:
            return refused("a bias, which this pass's Gluon form does not read")
        reads = gluon_reads_bias(bias)
        if not reads:
            return reads
    problem = gluon.problem_support(q, k, v, spec)
    if not problem:
        return problem
    if not (tma_addressable(q) and tma_addressable(k) and tma_addressable(v)):
        return refused("q, k or v is not 16-byte aligned (address or strides): TMA cannot address it")
    if mask is None:
        return TAKEN
    seqlen_q, seqlen_k = bhsd_shape(q, spec.layout)[2], bhsd_shape(k, spec.layout)[2]
    # whether the forward's lists are even is read in the same host sync (tile_lists.whole_and_even)
    if not whole_and_even(mask, spec, seqlen_q, seqlen_k, GLUON_MASK_TILE, GLUON_MASK_TILE)[0]:
        return refused(f"the mask leaves partial {GLUON_MASK_TILE}x{GLUON_MASK_TILE} tiles, which the Gluon "
                       "kernels would have to read")
    return TAKEN


def triton_fallback(config: KernelConfig) -> KernelConfig:
    """The Triton kernel's tiles where a Gluon forward config cannot run (problem or tensors it
    does not take): its key tiles and depth, 128-row query tiles on 8 warps."""
    return KernelConfig(128, config.block_n, 8, config.num_stages, config.tma_loads)


def triton_forward_config(config: KernelConfig, bias: torch.Tensor | None) -> KernelConfig:
    """The config the Triton forward runs: a Gluon config's fallback tiles, and with a bias at most
    64 keys a tile (a 128x128 bias tile per stage on top of the K/V stages would overflow shared memory)."""
    if config.family == "gluon":
        config = triton_fallback(config)
    if bias is not None and config.block_n > 64:
        config = replace(config, block_n=64)
    return config


def gluon_mask_forward(config: KernelConfig) -> KernelConfig:
    """The Gluon forward where a mask's lists drive it (``GLUON_MASK_TILE``) or a bias is read:
    warp-specialised, two warpgroups of 64 rows taking turns, two stages (a bias's ring of 2 x 2
    tiles of 64 x 128 takes the shared memory a third warpgroup's Q would)."""
    return replace(config, block_m=2 * 64, block_n=GLUON_MASK_TILE, num_warps=4, num_stages=2, hopper_overlap=0,
                   hopper_split=2, hopper_pingpong=1)


def gluon_mask_dkdv(config: KernelConfig) -> KernelConfig:
    """The Gluon dK/dV pass where a mask's lists drive it: two warpgroups of 64 keys."""
    return replace(config, block_n=GLUON_MASK_TILE, hopper_split=2)


def dkdv_without_dq(config: KernelConfig) -> KernelConfig:
    """The Gluon dK/dV config where the pass does not sum dQ (deterministic mode, or a problem it
    cannot sum dQ for). Without turns (ping-pong 0) the warpgroups run in lockstep because they
    meet at dQ's barrier anyway; without dQ they take turns instead: over S^T and dP^T with
    128-row steps (ping-pong 2, the form measured as the D=64 deterministic dK/dV pass; the
    lockstep form without dQ spilled registers in its dropout, ALiBi and tile-list variants), over
    S^T with 64-row steps (ping-pong 1, the D=128 deterministic dK/dV pass)."""
    if config.family == "gluon" and config.hopper_pingpong == 0:
        return replace(config, hopper_pingpong=2 if config.block_m == 128 else 1)
    return config


def triton_dkdv_fallback(config: KernelConfig) -> KernelConfig:
    """The Triton dK/dV programs' tiles where a Gluon dK/dV config cannot run (problem, tensors or
    dQ by atomics): its depth, 64-row query steps and 64-key tiles on 4 warps (the Triton default;
    a Gluon pass's 128-row steps would spill the Triton program's registers)."""
    return KernelConfig(64, 64, 4, config.num_stages, config.tma_loads)


def _config_names(config: KernelConfig, q, k, v, spec: AttentionSpec) -> Support:
    """Whether a launch config names a Gluon kernel; where it does not, why: the problem itself
    where the Gluon kernels cannot compute it (no mask is read here: no host sync), else the config."""
    if config.family == "gluon":
        return TAKEN
    problem = gluon.problem_support(q, k, v, spec)
    if not problem:
        return problem
    return refused("the launch config for this problem names the Triton kernel (tuning/configs.py)")


# ----------------------------------------------------------------------------- forward


@dataclass(frozen=True)
class ForwardPlan:
    """The forward's kernel and config, and why (``plan_forward``)."""

    kernel: str  # "gluon" or "triton"
    config: KernelConfig  # what the kernel compiles with
    why: str  # for the Triton kernel: why not the Gluon one
    fallback: KernelConfig  # the Triton config, should a tensor turn out not to be TMA-addressable at launch


def plan_forward(q, k, v, spec: AttentionSpec, config: KernelConfig, sinks=None, mask=None, bias=None,
                 packing: Packing | None = None) -> ForwardPlan:
    fallback = triton_forward_config(config, bias)
    named = _config_names(config, q, k, v, spec)
    if not named:  # decided without looking at the mask: no host sync where no Gluon kernel could run
        return ForwardPlan("triton", fallback, named.reason, fallback)
    if packing is not None:
        support = gluon_support(q, k, v, spec, sinks)  # (refuses ALiBi: packed sequences have none here)
        if support and not config.hopper_split:
            support = refused("packed sequences run the warp-specialised Gluon forward only; the config names "
                              "the 8-warp one")
        if support and packing.offsets_q is None:
            support = refused("the packing's offsets cannot be read on the host (CUDA-graph capture): no map of "
                              "the blocks can be made")
        if not support:
            return ForwardPlan("triton", fallback, support.reason, fallback)
        return ForwardPlan("gluon", config, "", fallback)
    support = gluon_support(q, k, v, spec, sinks, mask, bias, reads_bias=True, alibi_form=spec.alibi,
                            dropout_form=spec.has_dropout)
    if support and spec.alibi:
        support = gluon_forward_takes_alibi(spec, config, mask, bias)
    if support and spec.has_dropout:
        support = gluon_forward_takes_dropout(config, mask, bias)
    if support and (spec.alibi or spec.has_dropout):
        config = gluon_alibi_forward(config, q.shape[-1])
    if support and sinks is not None and not config.hopper_split:
        support = refused("sinks: the sink term is in the warp-specialised Gluon forward; the config names the "
                          "8-warp one")
    if not support:
        return ForwardPlan("triton", fallback, support.reason, fallback)
    gluon_config = gluon_mask_forward(config) if mask is not None or bias is not None else config
    return ForwardPlan("gluon", gluon_config, "", fallback)


def attention_forward(q, k, v, spec: AttentionSpec, config: KernelConfig, sinks: torch.Tensor | None = None,
                      mask: BlockMask | None = None, bias: torch.Tensor | None = None, packing: Packing | None = None,
                      alibi: torch.Tensor | None = None, dropout_seed: torch.Tensor | None = None):
    """(out in the user layout, lse (B, Hq, Sq) float32; packed sequences: (Hq, total_q)) by the
    kernels ``plan_forward`` picks. ``sinks``, ``mask``, ``bias``, ``packing``, ``alibi``,
    ``dropout_seed``: as ``kernels.triton.fwd.forward`` takes them (``alibi`` with ``spec.alibi``,
    ``dropout_seed`` with ``spec.dropout_p``)."""
    batch, heads_q, seqlen_q, _ = bhsd_shape(q, spec.layout)
    heads_kv, seqlen_k, head_dim_v = bhsd_shape(v, spec.layout)[1:]
    out_shape = (batch, seqlen_q, heads_q, head_dim_v) if spec.layout == "bshd" else (batch, heads_q, seqlen_q, head_dim_v)
    out = torch.empty(out_shape, dtype=q.dtype, device=q.device)
    lse_shape = (batch, heads_q, seqlen_q) if packing is None else (heads_q, seqlen_q)
    lse = torch.empty(lse_shape, dtype=torch.float32, device=q.device)
    if packing is not None:
        batch, seqlen_q, seqlen_k = packing.sequences, packing.max_seqlen_q, packing.max_seqlen_k
    if out.numel() == 0:
        return out, lse
    if seqlen_k == 0 or k.numel() == 0:  # no row sees a key: only the sink, if any, is in the softmax
        return out.zero_(), lse.copy_(sinks.view(heads_q, 1).expand_as(lse)) if sinks is not None \
            else lse.fill_(float("-inf"))
    plan = plan_forward(q, k, v, spec, config, sinks, mask, bias, packing)
    if plan.kernel == "gluon" and _gluon_forward(q, k, v, out, lse, spec, plan.config, mask, bias, packing, alibi,
                                                 dropout_seed, sinks):
        return out, lse
    triton_fwd.forward(q, k, v, out, lse, spec, plan.fallback, sinks, mask, bias, packing, alibi, dropout_seed)
    return out, lse


def gluon_forward_takes_alibi(spec: AttentionSpec, config: KernelConfig, mask, bias) -> Support:
    """Whether the Gluon forward computes ALiBi for this call: its key-term form (kernels/triton/masking.alibi_mode),
    causal (a right bound of 0), on the warp-specialised kernel without a mask's lists or a bias."""
    if spec.window_right != 0:
        return refused("alibi_slopes without causal: the Gluon forward has ALiBi's causal (key-term) form only")
    if not config.hopper_split:
        return refused("alibi_slopes: the config names the 8-warp Gluon forward, which has no ALiBi term")
    if mask is not None or bias is not None:
        return refused("alibi_slopes with a mask or bias: the Gluon forward's ALiBi term is the plain walk's")
    return TAKEN


def gluon_forward_takes_dropout(config: KernelConfig, mask, bias) -> Support:
    """Whether the Gluon forward computes dropout for this call: the warp-specialised kernel without
    a mask's lists or a bias (``gluon.fwd._ws_step``)."""
    if not config.hopper_split:
        return refused("dropout_p: the config names the 8-warp Gluon forward, which has no dropout")
    if mask is not None or bias is not None:
        return refused("dropout_p with a mask or bias: the Gluon forward's dropout is the plain walk's")
    return TAKEN


def gluon_alibi_forward(config: KernelConfig, head_dim: int) -> KernelConfig:
    """The warp-specialised forward's config with ALiBi or dropout: above D=64, two consumer
    warpgroups taking turns instead of three (three, at 128 registers a thread, spilled 240 bytes
    with ALiBi's key vector; two with ping-pong spill none)."""
    if config.hopper_split == 3 and head_dim > 64:
        return replace(config, block_m=2 * 64, hopper_split=2, hopper_pingpong=1)
    return config


def _gluon_forward(q, k, v, out, lse, spec: AttentionSpec, config: KernelConfig, mask, bias, packing,
                   alibi=None, dropout_seed=None, sinks=None) -> bool:
    """The Gluon forward into ``out``, ``lse``; False, nothing launched, where TMA cannot address a
    tensor after all (the Triton kernel then runs)."""
    from .kernels.gluon import fwd as gluon_fwd  # Gluon: imported only where it runs (not under the interpreter)

    if packing is not None:
        return gluon_fwd.attention_forward(q, k, v, out, lse, spec, config, packing=packing, sinks=sinks)
    lists, even = None, False
    if mask is not None:  # the lists at the Gluon tiles; the mask itself is never read
        batch, heads_q, seqlen_q, _ = bhsd_shape(q, spec.layout)
        heads_kv, seqlen_k = bhsd_shape(k, spec.layout)[1:3]
        tiles = (config.block_m, config.block_n)
        lists = triton_fwd.row_list_args(mask, spec, seqlen_q, seqlen_k, *tiles, heads_q, heads_kv, lse)
        # (a cache hit: gluon_support read it; the launcher adds the no-bias condition)
        even = rows_even(mask, spec, seqlen_q, seqlen_k, *tiles)
    dropout = (dropout_seed, *triton_fwd.dropout_args(spec)) if spec.has_dropout else None
    return gluon_fwd.attention_forward(q, k, v, out, lse, spec, config, lists, bias, even_lists=even, alibi=alibi,
                                       dropout=dropout, sinks=sinks)


# ----------------------------------------------------------------------------- backward


@dataclass(frozen=True)
class BackwardPlan:
    """What ``attention_backward`` decides before launching anything: the dK/dV pass's kernel and
    config, how dQ is summed, the bias in the Gluon pass, the Triton dK/dV programs' order, the
    padded widths of dQ's accumulator and of the row statistics, the pre-pass's launch, and the
    reasons (``plan_backward``)."""

    dkdv: KernelConfig
    atomic_dq: bool
    # Deterministic mode with dQ summed by the Gluon dK/dV pass: in a fixed order of its programs
    # (``ordered_dq_form``).
    ordered_dq: bool
    # Short causal GQA: the whole group walked by one program and dQ by the Gluon dQ pass, the
    # deterministic form, in every mode (``walks_group_with_dq_pass``).
    group_walk: bool
    bias_in_gluon: bool
    block_major: bool
    padded_d: int
    padded_rows: int
    zero_dq: bool
    preprocess: Launcher  # (out, dout, lse, dlse, lse2, delta, dQ accumulator, cu_seqlens_q)
    # The Gluon dK/dV pass takes the problem (``gluon_support``); the tensors' TMA addresses are
    # checked again at launch.
    gluon_dkdv: bool
    # dQ by the Gluon dQ pass (the warp-specialised forward's kernel in its dQ mode).
    gluon_dq: bool
    # dQ summed by the Gluon dK/dV pass in register order (``gluon.bwd.RUN_BOX``): whole 64-row
    # tiles (Sq a multiple of 64), no packing. Else, and wherever the Triton programs sum it after all,
    # the accumulator's plain layout.
    dq_register_order: bool
    # Why the dK/dV pass is not the Gluon one ("" where it is), and how dQ is summed and why.
    dkdv_why: str
    dq_why: str
    # The Triton passes' launches of the problem (``triton_bwd.run_passes``), by the inputs' strides and
    # what the call could run (the Gluon pass, TMA loads); filled by calls without mask, bias or packing.
    triton_passes: dict = field(default_factory=dict, compare=False, hash=False, repr=False)


_plain_plans = per_problem_dict()  # problem metadata -> BackwardPlan (``plan_backward``)


def plan_backward(q, k, v, out, dout, dlse, spec: AttentionSpec, configs: AttentionConfigs, mask, bias,
                  dbias_mode: int, packing: Packing | None) -> BackwardPlan:
    """The backward's decisions for one call, kept per problem where the problem's metadata alone
    decides them (no mask or bias, whose contents take part; packed sequences by their count and
    longest length, not their offsets): a short training step would spend its host time on them
    otherwise. The experiment switches (``knobs``) are part of the key."""
    if mask is not None or bias is not None:
        return _decide_backward(q, k, v, out, dout, dlse, spec, configs, mask, bias, dbias_mode, packing)
    key = (q.shape, k.shape, v.shape, q.dtype, q.device, out.stride(), dout.stride(), dlse is not None, spec, configs,
           knobs(), None if packing is None else (packing.sequences, packing.max_seqlen_q),
           tma_addressable(q) and tma_addressable(k) and tma_addressable(v))
    plan = _plain_plans.get(key)
    if plan is None:
        if len(_plain_plans) >= MAX_PROBLEMS:
            _plain_plans.clear()
        plan = _plain_plans[key] = _decide_backward(q, k, v, out, dout, dlse, spec, configs, None, None, dbias_mode,
                                                    packing)
    return plan


def _decide_backward(q, k, v, out, dout, dlse, spec: AttentionSpec, configs: AttentionConfigs, mask, bias,
                     dbias_mode: int, packing: Packing | None) -> BackwardPlan:
    layout = spec.layout
    batch, heads_q, seqlen_q, head_dim = bhsd_shape(q, layout)
    heads_kv, _, head_dim_v = bhsd_shape(v, layout)[1:]
    total_q = seqlen_q
    if packing is not None:
        batch, seqlen_q = packing.sequences, packing.max_seqlen_q
    dkdv_cfg = configs.dkdv
    named = _config_names(dkdv_cfg, q, k, v, spec)
    if mask is not None and named:  # the tiles a Gluon pass walks lists with
        dkdv_cfg = gluon_mask_dkdv(dkdv_cfg)
    group_walk = walks_group_with_dq_pass(q, k, spec, configs, mask, bias, packing)
    atomic_dq = configs.atomic_dq and not group_walk
    ordered_form = bool(spec.deterministic and configs.ordered_dq and atomic_dq and named
                        and ordered_dq_form(spec, mask, bias, packing))
    ordered_dq = ordered_form and ordered_dq_balances(
        spec, dkdv_cfg, batch * heads_kv * cdiv(bhsd_shape(k, layout)[2], gluon.dkdv_key_block(dkdv_cfg)),
        gluon.multiprocessors(q.device.index))
    if spec.deterministic and not ordered_dq:
        atomic_dq = False  # adds in arrival order: dQ gets a pass of its own
    # The Gluon pass reads a bias (and stores its gradient) in its 5-matmul form only.
    bias_in_gluon = atomic_dq and gluon_dkdv_takes_bias(q, spec, bias, dbias_mode)
    if named and not gluon_pass_sums_dq(q, k, v, spec, dkdv_cfg, mask, bias, bias_in_gluon):
        atomic_dq = ordered_dq = False  # chosen for the Gluon pass summing dQ itself; elsewhere dQ gets its own pass
    bias_in_gluon = bias_in_gluon and atomic_dq
    support = named and gluon_support(q, k, v, spec, mask=mask, bias=bias, reads_bias=bias_in_gluon,
                                      alibi_form=gluon_dkdv_takes_alibi(spec, mask, bias, packing),
                                      dropout_form=gluon_dkdv_takes_dropout(spec, mask, bias, packing))
    if ordered_dq and not support.ok:  # the Triton programs' atomics would add in arrival order
        atomic_dq = ordered_dq = False
    if named and not atomic_dq:
        dkdv_cfg = dkdv_without_dq(dkdv_cfg)
    gluon_dkdv = support.ok
    gluon_dq = gluon_dkdv and not atomic_dq and takes_gluon_dq(configs.gluon_dq, spec, mask, bias, packing)
    dq_why = _dq_route(spec, configs, atomic_dq, gluon_dkdv, gluon_dq, group_walk, mask, bias, packing,
                       unbalanced=ordered_form and not ordered_dq)
    # Where the Gluon pass sums dQ it stages it in register order (16-byte stores without bank
    # conflicts, one reduce-add a tile): its runs are whole 64 x 64 tiles of a sequence's rows
    dq_register_order = (gluon_dkdv and atomic_dq and packing is None and seqlen_q % 64 == 0
                         and head_dim % 64 == 0)
    padded_d = cdiv(head_dim, 4) * 4 if atomic_dq else 0
    pre_block_m = configs.preprocess_block_m
    gluon_dq_rows = configs.gluon_dq.hopper_split * 64 if configs.gluon_dq is not None else 0
    # a common multiple, not the largest: a tuned Gluon dQ pass may take 192-row tiles beside 128-row ones
    row_multiple = math.lcm(pre_block_m, configs.dkdv.block_m, configs.dq.block_m, gluon_dq_rows or 16, 16)
    padded_rows = cdiv(seqlen_q, row_multiple) * row_multiple
    zero_dq = atomic_dq
    preprocess = triton_bwd.preprocess_launcher(out, dout, dlse, spec, head_dim, head_dim_v, batch, heads_q, seqlen_q,
                                                total_q, pre_block_m, padded_rows, padded_d, zero_dq, packing)
    return BackwardPlan(dkdv_cfg, atomic_dq, ordered_dq, group_walk, bias_in_gluon,
                        dkdv_block_major(spec, heads_q // heads_kv),
                        padded_d, padded_rows, zero_dq, preprocess, gluon_dkdv, gluon_dq, dq_register_order,
                        "" if gluon_dkdv else support.reason, dq_why)


def _dq_route(spec, configs, atomic_dq, gluon_dkdv, gluon_dq, group_walk, mask, bias, packing,
              unbalanced: bool = False) -> str:
    """Why dQ is summed the way the plan says, in words (``explain``). ``unbalanced``: the fixed order
    was possible but refused for its launch (``ordered_dq_balances``)."""
    if atomic_dq and spec.deterministic:
        # under a causal bound the order's launch depends on the shape: the dK/dV step names it
        causal_order = ", launched as the dK/dV step says" if spec.window_right == 0 else ""
        return ("every row summed in a fixed order (deterministic mode: the dK/dV pass's programs take turns "
                f"on each query block's fp32 reduce-adds{causal_order}; 5 matmuls a tile, not 7)")
    if atomic_dq:
        return "the launch config asks for dQ by fp32 atomics from the dK/dV pass (5 matmuls a tile, not 7)"
    unbalanced_why = ("deterministic mode: no atomics, and the dK/dV pass's fixed order would launch too few "
                      "programs an SM under the causal bound (its heaviest would start last)")
    if gluon_dq:
        reason = "short causal GQA: one dK/dV program walks the whole group" if group_walk else \
            unbalanced_why if unbalanced else \
            "deterministic mode: no atomics" if spec.deterministic else "the launch config names no atomics here"
        return f"every row summed in a fixed order ({reason})"
    if spec.deterministic:
        reason = unbalanced_why if unbalanced else "deterministic mode: no atomics"
    elif configs.atomic_dq:
        reason = "the dK/dV pass that would sum it cannot (head dim, tiles or problem)"
    else:
        reason = "the launch config names no atomics"
    if configs.gluon_dq is not None and not takes_gluon_dq(configs.gluon_dq, spec, mask, bias, packing):
        reason += "; the Gluon dQ pass takes no mask, bias or packed sequences"
    elif configs.gluon_dq is None:
        reason += "; the launch config names no Gluon dQ pass"
    return f"every row summed in a fixed order ({reason})"


def bias_grad_plan(bias: torch.Tensor | None, full_shape: tuple, spec: AttentionSpec, skips_tiles: bool = False):
    """(how the dK/dV pass writes the bias gradient, the buffer it writes). A bias of the full
    (B, Hq, Sq, Sk) shape gets one value per entry from one program: stored, in the bias dtype.
    A broadcast bias sums over programs: fp32 atomics, or with ``deterministic`` a pass of its own
    that sums in a fixed order (``_bias_grad_kernel``). ``skips_tiles``: a mask empties tiles."""
    if bias is None:
        return DBIAS_OFF, None
    if tuple(bias.shape) == full_shape:
        # Tiles outside the window or the chunks, or emptied by the mask, are never visited: they keep
        # the zeros they start with.
        skipped = spec.has_window_left or spec.has_window_right or spec.has_chunk or skips_tiles
        allocate = torch.zeros_like if skipped else torch.empty_like
        return DBIAS_STORE, allocate(bias, memory_format=torch.contiguous_format)
    if spec.deterministic:
        return DBIAS_PASS, torch.empty_like(bias, memory_format=torch.contiguous_format)
    return DBIAS_ATOMIC, torch.zeros(bias.shape, dtype=torch.float32, device=bias.device)


BIAS_GRAD_ROUTES = {
    DBIAS_STORE: "stored by the dK/dV pass, one value per entry (a bias of the full shape)",
    DBIAS_ATOMIC: "summed over its broadcast dims by fp32 atomics in the dK/dV pass",
    DBIAS_PASS: "summed over its broadcast dims by a pass of its own, in a fixed order (deterministic mode)",
}


def ordered_dq_form(spec: AttentionSpec, mask, bias, packing: Packing | None) -> bool:
    """Whether the Gluon dK/dV pass can sum dQ in a fixed order (deterministic mode): its programs take
    turns on each query block's reduce-adds, counted by the rule of a causal bound or none (no mask
    lists, left window, bias or packed sequences, whose visiting programs that rule does not count)."""
    return mask is None and bias is None and packing is None and not spec.has_window_left


ORDERED_CAUSAL_PROGRAMS_PER_SM = 8  # the fewest dK/dV programs an SM for the fixed order under a causal bound


def ordered_dq_balances(spec: AttentionSpec, config: KernelConfig, programs: int, sms: int) -> bool:
    """Whether the fixed dQ order's launch ends evenly. Under a causal bound, where the order launches
    the dK/dV pass's ``programs`` lightest first (``gluon.ordered_heaviest_first``: 128-row steps), the
    heaviest start last, and with few programs an SM the pass ends on them: measured at D=128, 4k keys
    (the backward, one H200, when that order ran there), GQA 16/2 -- 256 programs, each walking a KV
    head's group, on 132 SMs -- 1.5x the backward with the dQ pass; 16 heads (2048 programs) 6% faster
    than it. Such launches keep the dQ pass below ORDERED_CAUSAL_PROGRAMS_PER_SM programs an SM. Launched
    heaviest first (64-row steps), GQA 16/2 runs 3% faster than with the dQ pass; without a causal
    bound the programs are even. The rule keys on the order without the interleave: 128-row launches
    that the interleave takes heaviest first (``gluon.bwd.fixed_order_launch``) were measured only with
    more programs an SM than that, and keep the refusal below it."""
    return (spec.window_right != 0 or gluon.ordered_heaviest_first(config)
            or programs >= ORDERED_CAUSAL_PROGRAMS_PER_SM * sms)


def walks_group_with_dq_pass(q, k, spec: AttentionSpec, configs: AttentionConfigs, mask, bias,
                             packing: Packing | None) -> bool:
    """Causal GQA with short keys (<= SHORT_KEYS) where the Gluon dQ pass takes the problem: the
    deterministic form -- one dK/dV program per KV head's whole group, dQ by the Gluon dQ pass --
    runs in the default mode too: measured faster than the 5-matmul pass with group sums at short
    keys, not at long ones (docs/PERFORMANCE.md). Its gradients are then bitwise reproducible too."""
    if not takes_gluon_dq(configs.gluon_dq, spec, mask, bias, packing):
        return False
    heads_q = bhsd_shape(q, spec.layout)[1]
    heads_kv, seqlen_k = bhsd_shape(k, spec.layout)[1:3]
    return (heads_q > heads_kv and spec.window_right == 0 and not spec.has_window_left and not spec.has_softcap
            and seqlen_k <= SHORT_KEYS)


def takes_gluon_dq(config: KernelConfig | None, spec: AttentionSpec, mask, bias, packing: Packing | None) -> bool:
    """Whether ``config`` names a Gluon dQ pass (a warp-specialised forward config) for a problem
    of the kind it runs: no mask, bias, packed sequences or ALiBi (its steps have no ALiBi term; dropout
    they take; the tensors are checked at launch, ``gluon.fwd.dq_pass``)."""
    return (config is not None and config.hopper_split in (2, 3) and mask is None and bias is None
            and packing is None and not spec.alibi)


def gluon_dkdv_takes_bias(q, spec: AttentionSpec, bias: torch.Tensor | None, dbias_mode: int) -> bool:
    """Whether the Gluon dK/dV pass, in its 5-matmul form, can read ``bias`` and write its gradient:
    D=128 (dS is staged in shared memory there, split by key columns, and goes out as the gradient
    from there), no softcap (the gradient is dS before the cap's derivative), a bias of q's dtype
    that the Gluon forward can read (``gluon_reads_bias``), its gradient -- if wanted -- one
    value per entry (``DBIAS_STORE``; a broadcast bias's gradient sums over programs)."""
    return (bias is not None and gluon_reads_bias(bias).ok and bias.dtype == q.dtype and q.shape[-1] == 128
            and not spec.has_softcap and dbias_mode in (DBIAS_OFF, DBIAS_STORE))


def gluon_dkdv_takes_alibi(spec: AttentionSpec, mask, bias, packing) -> bool:
    """Whether the Gluon dK/dV pass computes ALiBi for this call: causal (a right bound of 0), no
    mask's lists, bias or packing (its key-term form, ``_step``)."""
    return spec.alibi and spec.window_right == 0 and mask is None and bias is None and packing is None


def gluon_dkdv_takes_dropout(spec: AttentionSpec, mask, bias, packing) -> bool:
    """Whether the Gluon dK/dV pass computes dropout for this call: no mask's lists, bias or packing
    (``gluon.bwd._dropout_step``)."""
    return spec.has_dropout and mask is None and bias is None and packing is None


def gluon_pass_sums_dq(q, k, v, spec: AttentionSpec, config: KernelConfig, mask=None, bias=None,
                       reads_bias: bool = False) -> bool:
    """Whether ``config`` names a Gluon dK/dV pass that takes this problem and can also sum dQ
    (``gluon.bwd.computes_dq``). Where a Gluon config's pass does not, dQ runs as its own pass:
    the fused Triton atomic programs are not what the Gluon config's tiles were chosen for (with
    128-row steps they do not even fit shared memory). ``reads_bias``: it may take the bias
    (``gluon_dkdv_takes_bias``)."""
    if config.family != "gluon" or not gluon_support(q, k, v, spec, mask=mask, bias=bias, reads_bias=reads_bias,
                                                     alibi_form=gluon_dkdv_takes_alibi(spec, mask, bias, None),
                                                     dropout_form=gluon_dkdv_takes_dropout(spec, mask, bias, None)):
        return False
    from .kernels.gluon import bwd as gluon_bwd  # Gluon: imported only where it runs (not under the interpreter)

    return gluon_bwd.computes_dq(q.shape[-1], config)


def sums_over_group(spec: AttentionSpec, heads_q: int, heads_kv: int, config: KernelConfig, lists: bool) -> bool:
    """Whether the Gluon dK/dV pass runs one program per query head and sums dK/dV over each KV
    head's group by fp32 reduce-adds (GROUP_SUM), rather than walking the whole group in one
    program: with GQA and a right window bound (causal: the programs' lengths differ, and the
    walk's long programs end the pass on a tail), outside deterministic mode (the adds land in no
    fixed order), where the fp32 tiles can be staged (two warpgroups; the ring of >= 2 x 64 rows
    always holds them) and no mask list is walked (a list covers a whole group). Without a causal
    bound the walk's even programs measured faster: the group's adds meet at once."""
    possible = (heads_q > heads_kv and spec.has_window_right and not spec.deterministic and not lists
                and config.hopper_split == 2)
    return possible and knobs().group_sums


def dkdv_block_major(spec: AttentionSpec, group_size: int) -> bool:
    """Launch the Triton dK/dV programs block-major (heaviest first across all heads) where their
    work is uneven (a right window bound: the first key blocks see the most queries) and few: with
    GQA each program walks its whole group, so the heaviest ones are long; launched head after head,
    the last head's heavy blocks start late and the pass ends on a tail. MHA keeps head-major order,
    which keeps one head's Q and dO in L2 (block-major measured slower there). The Gluon pass orders
    its programs in chunks of heads instead (``gluon.common.chunk_head_rows``). The order changes no
    result."""
    forced = knobs().dkdv_block_major
    if forced is not None:
        return forced
    return spec.has_window_right and group_size > 1


def attention_backward(dout, dlse, q, k, v, out, lse, spec: AttentionSpec, configs: AttentionConfigs,
                       mask: BlockMask | None = None, bias: torch.Tensor | None = None, bias_grad: bool = False,
                       packing: Packing | None = None, sinks: torch.Tensor | None = None,
                       alibi: torch.Tensor | None = None, dropout_seed: torch.Tensor | None = None):
    """Returns (dq, dk, dv, dbias, dsinks), dq/dk/dv each in the layout and dtype of its input, by
    the kernels ``plan_backward`` picks. ``mask``, ``bias``, ``packing``: as for
    ``attention_forward``. ``dbias`` (with ``bias_grad``, else None) has the bias's 4-D shape and
    dtype: the gradient summed over the bias's broadcast dims. ``sinks`` (Hq,), whose gradient is
    wanted: ``dsinks`` (float32, else None), from the pre-pass's row statistics (``row_gradients.sink_gradient``)."""
    layout = spec.layout
    batch, heads_q, seqlen_q, _ = bhsd_shape(q, layout)
    seqlen_k = bhsd_shape(v, layout)[2]
    total_q = seqlen_q
    if packing is not None:
        batch, seqlen_q, seqlen_k = packing.sequences, packing.max_seqlen_q, packing.max_seqlen_k
    # Gradients in their inputs' strides where those are dense (``empty_like``), else contiguous:
    # what AccumulateGrad keeps without a copy, and what the custom op's fake declares.
    dk = gradient_like(k)
    dv = gradient_like(v)
    # nothing attends (packed sequences: no query or no key at all, whatever the longest lengths say)
    if batch * heads_q * seqlen_q * seqlen_k == 0 or q.numel() == 0 or k.numel() == 0:
        dbias = torch.zeros_like(bias) if bias_grad else None
        dsinks = None if sinks is None else sink_gradient_from_outputs(sinks, out, dout, lse, dlse, layout)
        return gradient_like(q).zero_(), dk.zero_(), dv.zero_(), dbias, dsinks
    dbias_mode, dbias = bias_grad_plan(bias if bias_grad else None, (batch, heads_q, seqlen_q, seqlen_k), spec,
                                       skips_tiles=mask is not None)
    plan = plan_backward(q, k, v, out, dout, dlse, spec, configs, mask, bias, dbias_mode, packing)
    dq_buffer = None
    if plan.atomic_dq:
        # dQ is summed over key blocks in an fp32 (B, Hq, Sq, D) buffer -- packed sequences: (1, Hq,
        # total_q, D) --, rows padded to 16 bytes for TMA. The pre-pass zeroes it.
        rows = (batch, heads_q, seqlen_q) if packing is None else (1, heads_q, total_q)
        dq_buffer = torch.empty((*rows, plan.padded_d), dtype=torch.float32, device=q.device)
    # Row statistics, rows padded to a multiple of every tile height (and of 16: aligned vectors).
    lse2, delta = torch.empty((2, batch * heads_q, plan.padded_rows), dtype=torch.float32, device=q.device).unbind()
    plan.preprocess(out, dout, lse, dlse if dlse is not None else lse, lse2, delta,
                    dq_buffer if plan.zero_dq else lse, triton_fwd.sequence_args(packing, lse)[0])
    dsinks = None if sinks is None else sink_gradient(sinks, lse2, delta, heads_q)

    gluon_dkdv = plan.gluon_dkdv and _gluon_dkdv_pass(q, k, v, dout, lse2, delta, dk, dv, spec, plan, dq_buffer,
                                                      mask, bias, dbias, packing, alibi, dropout_seed)
    if gluon_dkdv and plan.atomic_dq:  # the Gluon pass computed every gradient, the bias's too
        return triton_bwd.dq_from_sums(dq_buffer, q, layout, plan.dq_register_order), dk, dv, dbias, dsinks
    if plan.ordered_dq:  # TMA could not address a tensor after all: the Triton programs' atomics add in no order
        plan = replace(plan, atomic_dq=False, ordered_dq=False)
    if gluon_dkdv and plan.gluon_dq:
        dq = _gluon_dq_pass(q, k, v, dout, lse2, delta, spec, configs.gluon_dq, dropout_seed)
        if dq is not None:
            return dq, dk, dv, dbias, dsinks
    dkdv_cfg = triton_dkdv_fallback(plan.dkdv) if plan.dkdv.family == "gluon" else plan.dkdv
    dq, dbias = triton_bwd.run_passes(q, k, v, dout, lse2, delta, dk, dv, dq_buffer, dbias, spec, configs, plan,
                                      dkdv_cfg, gluon_dkdv, mask, bias, dbias_mode, packing, alibi, dropout_seed)
    return dq, dk, dv, dbias, dsinks


def _gluon_dq_pass(q, k, v, dout, lse2, delta, spec: AttentionSpec, config: KernelConfig,
                   dropout_seed: torch.Tensor | None = None) -> torch.Tensor | None:
    """dQ by the warp-specialised forward's kernel run as the dQ pass (same arithmetic as the
    Triton dQ programs, each row summed in a fixed order); None, nothing launched, where TMA cannot
    address a tensor after all."""
    from .kernels.gluon import fwd as gluon_fwd  # Gluon: imported only where it runs (not under the interpreter)

    dq = gradient_like(q)
    dropout = (dropout_seed, *triton_fwd.dropout_args(spec)) if spec.has_dropout else None
    return dq if gluon_fwd.dq_pass(q, k, v, dout, lse2, delta, dq, spec, config, dropout) else None


def _sums_group_in_pass(plan: BackwardPlan, spec: AttentionSpec, heads_q: int, heads_kv: int, lists: bool) -> bool:
    """Whether the Gluon dK/dV pass runs one program per query head, dK/dV summed over each group
    (``sums_over_group``), unless the plan walks the group (``group_walk``)."""
    return not plan.group_walk and sums_over_group(spec, heads_q, heads_kv, plan.dkdv, lists)


def _gluon_dkdv_pass(q, k, v, dout, lse2, delta, dk, dv, spec: AttentionSpec, plan: BackwardPlan,
                     dq_accum: torch.Tensor | None, mask, bias, dbias: torch.Tensor | None, packing,
                     alibi: torch.Tensor | None = None, dropout_seed: torch.Tensor | None = None) -> bool:
    """The Gluon dK/dV pass: dK, dV, and dQ into ``dq_accum`` (fp32, zeroed) when one is given (the
    plan's ``atomic_dq``); False, nothing launched, where TMA cannot address a tensor after all.
    With a mask the pass walks its column lists at the plan's tiles (``gluon_mask_dkdv``). With the
    plan's ``bias_in_gluon`` it reads ``bias`` and stores ``dbias``, its gradient, when one is given.
    One program per query head with dK/dV summed over each group where ``sums_over_group`` says
    so, unless the plan walks the group (``group_walk``)."""
    from .kernels.gluon import bwd as gluon_bwd  # Gluon: imported only where it runs (not under the interpreter)

    heads_q = bhsd_shape(q, spec.layout)[1]
    heads_kv = bhsd_shape(k, spec.layout)[1]
    lists = None
    if mask is not None:
        seqlen_q, seqlen_k = bhsd_shape(q, spec.layout)[2], bhsd_shape(k, spec.layout)[2]
        lists = triton_bwd.column_list_args(mask, spec, seqlen_q, seqlen_k, plan.dkdv, heads_q, heads_kv, lse2)
    group_sum = _sums_group_in_pass(plan, spec, heads_q, heads_kv, lists is not None)
    dq_lock = None
    if plan.ordered_dq:  # the turn counters of dQ's fixed order, zeroed
        dq_lock = torch.zeros(gluon_bwd.dq_lock_size(bhsd_shape(q, spec.layout), plan.dkdv), dtype=torch.int32,
                              device=q.device)
    return gluon_bwd.dkdv_pass(q, k, v, dout, lse2, delta, dk, dv, spec, plan.dkdv,
                               dq_accum if plan.atomic_dq else None, lists, group_sum, bias, dbias, packing,
                               alibi=alibi,
                               dropout=(dropout_seed, *triton_fwd.dropout_args(spec)) if spec.has_dropout else None,
                               dq_lock=dq_lock, dq_register_order=plan.dq_register_order)


def prepare_packed_maps(q4, k4, v4, sinks, packing: Packing, spec: AttentionSpec, configs: AttentionConfigs) -> None:
    """Where the Gluon kernels take packed sequences, the backward's map of key blocks is made with
    the forward's map of query blocks: one copy to the device, and the backward's host time (which
    the GPU waits on in a short step) spends nothing on it (kernels/shared/packed_tiles.py)."""
    if packing.offsets_q is None or not gluon_support(q4, k4, v4, spec, sinks):
        return
    from .kernels.shared import packed_tiles

    forward, dkdv = configs.forward, configs.dkdv
    query_block = gluon.WG_ROWS * forward.hopper_split if forward.family == "gluon" and forward.hopper_split \
        else None
    key_block = gluon.dkdv_key_block(dkdv) if dkdv.family == "gluon" and dkdv.hopper_split else None
    packed_tiles.prepare(packing, spec, q4.device, query_block, key_block)


# ----------------------------------------------------------------------------- one call, either backend


def forward(q, k, v, spec: AttentionSpec, sinks, mask: BlockMask | None, bias, backend: str, alibi=None,
            dropout_seed=None, dropout_first_batch=0):
    """(out, lse) of one call on ``backend`` (``resolve_backend``). ``alibi``: the ALiBi slopes as a
    contiguous float32 (B, Hq) tensor (``checks.check_alibi``), with ``spec.alibi``. ``dropout_seed``:
    the call's (1,) int64 seed on q's device (dropout.py), with ``spec.dropout_p``;
    ``dropout_first_batch`` (the PyTorch backend's per-sequence calls of packed sequences): the batch
    index the mask gives q's first batch."""
    if backend == "torch":
        return cpu.forward(q, k, v, spec, sinks, mask, bias, alibi=alibi, dropout_seed=dropout_seed,
                           dropout_first_batch=dropout_first_batch)
    assert dropout_first_batch == 0, "the kernels index packed sequences themselves"
    configs = configs_for(q, v, spec, bhsd_shape(k, spec.layout)[2])
    return attention_forward(q, k, v, spec, configs.forward, sinks, mask, bias, alibi=alibi,
                             dropout_seed=dropout_seed)


def backward(dout, dlse, q, k, v, out, lse, spec: AttentionSpec, sinks, sinks_grad: bool, mask, bias,
             bias_grad: bool, backend: str, alibi=None, dropout_seed=None, dropout_first_batch=0):
    """(dq, dk, dv, dbias, dsinks) of one call on ``backend``; dbias None unless ``bias_grad``,
    dsinks (float32) None unless ``sinks_grad``. ``alibi``: as for ``forward`` (no gradient).
    ``dropout_seed``, ``dropout_first_batch``: the forward's, which regenerate its mask."""
    # A bias constant along the keys gets its gradient from row statistics (``row_bias_gradient``), on
    # every backend alike: summed from the softmax gradient it would be mostly rounding noise.
    row_bias_grad = bias_grad and bias.shape[3] == 1
    bias_grad = bias_grad and not row_bias_grad
    all_sinks, sinks = sinks, sinks if sinks_grad else None
    if backend == "torch":
        dq, dk, dv, dbias = cpu.backward(dout, dlse, q, k, v, out, lse, spec, mask, bias, bias_grad, alibi=alibi,
                                         dropout_seed=dropout_seed, dropout_first_batch=dropout_first_batch)
        dq, dk, dv = (_in_strides_of(x, grad) for x, grad in ((q, dq), (k, dk), (v, dv)))
        dsinks = None if sinks is None else sink_gradient_from_outputs(sinks, out, dout, lse, dlse, spec.layout)
    else:
        configs = configs_for(q, v, spec, bhsd_shape(k, spec.layout)[2])
        dq, dk, dv, dbias, dsinks = attention_backward(dout, dlse, q, k, v, out, lse, spec, configs, mask, bias,
                                                       bias_grad, sinks=sinks, alibi=alibi, dropout_seed=dropout_seed)
    if row_bias_grad:
        dbias = row_bias_gradient(bias, out, dout, lse, dlse, all_sinks, spec.layout)
    return dq, dk, dv, dbias, dsinks


def _in_strides_of(x: torch.Tensor, grad: torch.Tensor) -> torch.Tensor:
    """``grad`` with the strides ``gradient_like(x)`` gives (the fake's, the Triton backend's)."""
    like = gradient_like(x)
    return grad if grad.stride() == like.stride() else like.copy_(grad)


# ----------------------------------------------------------------------------- explain


@dataclass(frozen=True)
class Step:
    """One pass of a call: what runs it, with which config, and why."""

    name: str  # "forward", "pre-pass", "dK/dV", "dQ", "bias gradient", "sinks gradient"
    kernel: str
    why: str = ""
    config: KernelConfig | None = None
    launch: str = ""  # a Gluon launch's programs: one a tile or persistent

    def __str__(self) -> str:
        text = f"  {self.name:<15} {self.kernel}"
        if self.config is not None:
            text += f"\n  {'':<15} config: {_describe(self.config)}"
        if self.launch:
            text += f"\n  {'':<15} launch: {self.launch}"
        if self.why:
            text += f"\n  {'':<15} why: {self.why}"
        return text


@dataclass(frozen=True)
class Explanation:
    """The plan a call would run (``fusedattn.explain``): the backend, then each pass in order."""

    backend: str
    forward: tuple
    backward: tuple

    def __str__(self) -> str:
        lines = [f"backend: {self.backend}", "forward:", *map(str, self.forward), "backward:",
                 *map(str, self.backward)]
        return "\n".join(lines)

    def __repr__(self) -> str:
        return f"Explanation(backend={self.backend!r}, forward={[s.kernel for s in self.forward]}, " \
               f"backward={[s.kernel for s in self.backward]})"

    def kernels(self) -> dict:
        """{pass name: kernel} of both directions (the backward's under "backward ...")."""
        return {**{s.name: s.kernel for s in self.forward}, **{f"backward {s.name}": s.kernel for s in self.backward}}


def _describe(config: KernelConfig) -> str:
    text = f"{config.block_m}x{config.block_n} tiles, {config.num_stages} stages"
    if config.family == "gluon":
        if config.hopper_split:
            turns = f", ping-pong {config.hopper_pingpong}" if config.hopper_pingpong else ""
            return f"{text}, warp-specialised: {config.hopper_split} consumer warpgroups{turns}"
        return f"{text}, 8 warps, schedule {config.hopper_overlap}"
    return f"{text}, {config.num_warps} warps" + (", TMA loads" if config.tma_loads else "")


def _launch_form(programs: int, tiles: int, fixed_order: tuple | None = None) -> str:
    """A Gluon launch's form, from the launcher's decision (programs 0: one a tile); ``fixed_order``:
    the dK/dV pass's launch for dQ in a fixed order under a causal bound (``gluon.bwd.fixed_order_launch``:
    heaviest first or not, head rows per chunk, interleaved or not)."""
    if programs:
        return f"persistent: {programs} programs walk {tiles} tiles in rounds"
    form = f"one program per tile ({tiles} tiles)"
    if fixed_order is None:
        return form
    heaviest, rows, interleaved = fixed_order
    form += (f", {'heaviest' if heaviest else 'lightest'} programs first (dQ's fixed order under the causal "
             f"bound) in chunks of {rows} head rows")
    if interleaved:
        form += ", each chunk's lighter half launched among the next chunk's heavier half"
    return form


def _gluon_forward_name(config: KernelConfig) -> str:
    if config.hopper_split:
        return f"Gluon forward, warp-specialised ({config.hopper_split} consumer warpgroups)"
    return "Gluon forward, 8 warps"


def explain_plans(q, k, v, spec: AttentionSpec, sinks, mask: BlockMask | None, bias, backend: str,
                  bias_grad: bool, sinks_grad: bool) -> Explanation:
    """The plans ``forward`` and ``backward`` would run for these inputs, without running anything."""
    if backend == "torch":
        fused = q.is_cpu and cpu.uses_fused_kernel(spec, mask, bias)
        kernel = "torch's fused CPU attention kernel, by parts of the key range" if fused else \
            "PyTorch ops over chunks of keys (cpu.py), O(Sq x chunk) memory"
        why = "" if fused else "softcap, a bias, a mask, ALiBi or chunk: torch's fused CPU kernel takes none of them" \
            if q.is_cpu else "the PyTorch backend on a CUDA tensor (use_backend or FUSEDATTN_BACKEND)"
        steps = (Step("forward", kernel, why),)
        return Explanation(backend, steps, (Step("all gradients", kernel.replace("attention kernel", "backward"),
                                                 why),))
    seqlen_k = bhsd_shape(k, spec.layout)[2]
    configs = configs_for(q, v, spec, seqlen_k)
    plan = plan_forward(q, k, v, spec, configs.forward, sinks, mask, bias)
    batch, heads_q, seqlen_q, head_dim = bhsd_shape(q, spec.layout)
    heads_kv = bhsd_shape(k, spec.layout)[1]
    if plan.kernel == "gluon":
        from .kernels.gluon import fwd as gluon_fwd  # Gluon: imported only where it runs

        even = mask is not None and bias is None and \
            rows_even(mask, spec, seqlen_q, seqlen_k, plan.config.block_m, plan.config.block_n)
        launch = _launch_form(*gluon_fwd.forward_programs((batch, heads_q, seqlen_q, head_dim), heads_kv, seqlen_k,
                                                          spec, plan.config, mask is None and bias is None, even,
                                                          q.device)[:2])
        forward_step = Step("forward", _gluon_forward_name(plan.config),
                            "mask by its tile lists (no partial tile)" if mask is not None else "", plan.config,
                            launch)
    else:
        forward_step = Step("forward", "Triton forward", plan.why, plan.config)
    out_shape = (batch, seqlen_q, heads_q, v.shape[-1]) if spec.layout == "bshd" else \
        (batch, heads_q, seqlen_q, v.shape[-1])
    out = torch.empty(out_shape, dtype=q.dtype, device="meta")  # the plan reads its shape and strides only
    row_bias = bias_grad and bias.shape[3] == 1
    dbias_mode, _ = bias_grad_plan(bias if bias_grad and not row_bias else None, (batch, heads_q, seqlen_q, seqlen_k),
                                   spec, skips_tiles=mask is not None)
    bplan = _decide_backward(q, k, v, out, out, None, spec, configs, mask, bias, dbias_mode, None)
    steps = [Step("pre-pass", "Triton pre-pass (row statistics lse2, delta)")]
    if bplan.gluon_dkdv:
        from .kernels.gluon import bwd as gluon_bwd  # Gluon: imported only where it runs

        summed = " and dQ (5 matmuls)" if bplan.atomic_dq else ""
        group_sum = _sums_group_in_pass(bplan, spec, heads_q, heads_kv, mask is not None)
        programs, tiles, _ = gluon_bwd.dkdv_programs((batch, heads_q, seqlen_q, head_dim), heads_kv, seqlen_k, spec,
                                                     bplan.dkdv, bplan.atomic_dq, mask is not None, group_sum,
                                                     bplan.ordered_dq, bias is not None, q.device)
        fixed_order = None
        if bplan.ordered_dq and spec.window_right == 0:
            walk, rows, interleaved = gluon_bwd.fixed_order_launch((batch, heads_q, seqlen_q, head_dim), heads_kv,
                                                                   seqlen_k, bplan.dkdv, q.device)
            fixed_order = (walk == int(gluon_bwd.WALK_DESCENDING), rows, interleaved)
        steps.append(Step("dK/dV", f"Gluon dK/dV pass, warp-specialised{summed}",
                          "mask by its tile lists (no partial tile)" if mask is not None else "", bplan.dkdv,
                          _launch_form(programs, tiles, fixed_order)))
    else:
        dkdv_cfg = triton_dkdv_fallback(bplan.dkdv) if bplan.dkdv.family == "gluon" else bplan.dkdv
        order = "block-major" if bplan.block_major else "head-major"
        steps.append(Step("dK/dV", f"Triton dK/dV programs ({order})", bplan.dkdv_why, dkdv_cfg))
    if bplan.gluon_dq:
        steps.append(Step("dQ", "Gluon dQ pass, warp-specialised", bplan.dq_why, configs.gluon_dq))
    elif bplan.atomic_dq:
        where = "the Gluon dK/dV pass" if bplan.gluon_dkdv else "the Triton dK/dV programs"
        how = "fp32 reduce-adds in a fixed order" if bplan.ordered_dq else "fp32 atomics"
        steps.append(Step("dQ", f"summed by {where} ({how})", bplan.dq_why))
    else:
        steps.append(Step("dQ", "Triton dQ programs", bplan.dq_why, configs.dq))
    if bias is not None and bias_grad:
        if row_bias:
            steps.append(Step("bias gradient", "closed form from row statistics (row_gradients.py)",
                              "a bias constant along the keys: its softmax gradient sums to rounding noise"))
        elif bplan.bias_in_gluon:
            steps.append(Step("bias gradient", "stored by the Gluon dK/dV pass"))
        else:
            steps.append(Step("bias gradient", BIAS_GRAD_ROUTES[dbias_mode]))
    if sinks is not None and sinks_grad:
        steps.append(Step("sinks gradient", "closed form from the pre-pass's row statistics (row_gradients.py)"))
    return Explanation(backend, (forward_step,), tuple(steps))
