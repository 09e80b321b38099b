"""The planner: which kernel runs each pass of a call, with which config, and why.

Every choice between the kernel families is made here and nowhere else: the Gluon kernels
(warp-specialised, sm_90 only, imported only where they run) where the problem and tensors fit
them, the Triton kernels otherwise. Kernel modules hold kernels and their launchers; they
decide nothing about which of them runs.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace

import torch

from .block_mask import BlockMask
from .kernels.shared.launch import MAX_PROBLEMS, SLOT, Launcher, cdiv, per_problem_dict
from .kernels.shared.tile_lists import rows_even, whole_and_even
from .kernels.triton.bwd import (DBIAS_ATOMIC, DBIAS_OFF, DBIAS_PASS, DBIAS_STORE, _bias_grad_pass, _dq_descriptor,
                                 _dq_from_sums, _kernel_flags, _preprocess_kernel, _triton_passes, column_list_args,
                                 sink_gradient, sink_gradient_from_outputs)
from .kernels.triton.fwd import (_forward_kernel, bhs_strides, broadcast_args, dot_precision, mask_args, mask_descriptor,
                                 padded_dim, padded_dims, row_list_args, score_constants, sequence_args, softcap_mode)
from .kernels.triton.memory import all_or_placeholders, loop_descriptors, score_tile_descriptor, score_tiles_addressable
from .kernels.shared.launch import launch
from .spec import AttentionSpec, Packing, bhsd_shape, gradient_like
from .tuning.configs import SHORT_KEYS, AttentionConfigs, KernelConfig


def triton_fallback(config: KernelConfig) -> KernelConfig:
    """The Triton kernel's tiles where a Gluon forward config cannot run (problem or tensors it
    does not take): its key tiles and depth, 128-row query tiles on 8 warps."""
    return KernelConfig(128, config.block_n, 8, config.num_stages, config.tma_loads)


# The tiles the Gluon kernels walk a mask's lists with: 128-row forward programs on two consumer
# warpgroups, 128-key dK/dV programs (two warpgroups of 64 keys). A mask is taken where none of its
# own tiles at this size is partial (tile_lists.tiles_whole): the kernels then never read it.
GLUON_MASK_TILE = 128


def gluon_mask_forward(config: KernelConfig) -> KernelConfig:
    """The Gluon forward where a mask's lists drive it (``GLUON_MASK_TILE``) or a bias is read:
    warp-specialised, two warpgroups of 64 rows taking turns, two stages (a bias's ring of 2 x 2
    tiles of 64 x 128 takes the shared memory a third warpgroup's Q would)."""
    return replace(config, block_m=2 * 64, block_n=GLUON_MASK_TILE, num_warps=4, num_stages=2, hopper_overlap=0,
                   hopper_split=2, hopper_pingpong=1)


def gluon_mask_dkdv(config: KernelConfig) -> KernelConfig:
    """The Gluon dK/dV pass where a mask's lists drive it: two warpgroups of 64 keys."""
    return replace(config, block_n=GLUON_MASK_TILE, hopper_split=2)


def gluon_reads_bias(bias: torch.Tensor | None) -> bool:
    """Whether the Gluon kernels can read a bias (the forward always; the dK/dV pass under the
    further terms of ``bwd.gluon_dkdv_takes_bias``): 16-bit, one value per query and key (a broadcast
    query or key dim reads a row or column: pointers), tiles TMA can address
    (``memory.score_tiles_addressable``). fp32 biases take the Triton kernel: their tiles would not
    fit beside K and V in shared memory."""
    return bias is not None and bias.dtype in (torch.float16, torch.bfloat16) and score_tiles_addressable(bias)


def hopper_supports(q, k, v, spec: AttentionSpec, sinks=None, mask=None, bias=None, reads_bias=False) -> bool:
    """Whether the Gluon kernels take the problem: no sinks; a bias only in a kernel that reads one
    (``reads_bias``: the forward, and the dK/dV pass in its 5-matmul form) and where it can
    (``gluon_reads_bias``); a mask only where none of its own tiles is partial (``GLUON_MASK_TILE``)."""
    if not q.is_cuda or sinks is not None or bias is not None and not (reads_bias and gluon_reads_bias(bias)):
        return False
    from .kernels.gluon import common as hopper  # Gluon: imported only where it runs (not under the interpreter)

    if not hopper.supports(q, k, v, spec):
        return False
    if mask is None:
        return True
    seqlen_q, seqlen_k = bhsd_shape(q, spec.layout)[2], bhsd_shape(k, spec.layout)[2]
    # whether the forward's lists are even is read in the same host sync (tile_lists.whole_and_even)
    return whole_and_even(mask, spec, seqlen_q, seqlen_k, GLUON_MASK_TILE, GLUON_MASK_TILE)[0]


def attention_forward(q, k, v, spec: AttentionSpec, config: KernelConfig, sinks: torch.Tensor | None = None,
                      mask: BlockMask | None = None, bias: torch.Tensor | None = None, packing: Packing | None = None):
    """Returns (out in the user layout, lse (B, Hq, Sq) float32). ``config.hopper_overlap`` set:
    the Gluon kernel of hopper_fwd.py where it supports the problem, else this Triton kernel.
    ``sinks`` (Hq,) float32: one extra logit per head in every row's denominator (SPEC 3.5).
    ``mask``: the user's boolean mask with its tile states (block_mask.BlockMask): empty tiles are
    skipped, full ones run without the mask (tile_lists.py).
    ``bias``: the user's additive bias, 4-D and broadcast the same way, any float dtype.
    ``packing``: q, k, v are (1, total, H, D) "bshd" views of packed sequences (spec.Packing; no
    mask or bias); lse is then (Hq, total_q). The Gluon forward runs them where it takes the
    problem (over the host's map of the blocks that exist, packed_tiles.py), else the Triton kernel
    with pointer loads."""
    batch, heads_q, seqlen_q, head_dim = bhsd_shape(q, spec.layout)
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
    if config.hopper_overlap is not None:
        if packing is not None and hopper_supports(q, k, v, spec, sinks):
            from .kernels.gluon import fwd as hopper_fwd  # Gluon: imported only where it runs (not under the interpreter)

            if hopper_fwd.attention_forward(q, k, v, out, lse, spec, config, packing=packing):
                return out, lse
        elif hopper_supports(q, k, v, spec, sinks, mask, bias, reads_bias=True):
            from .kernels.gluon import fwd as hopper_fwd  # Gluon: imported only where it runs (not under the interpreter)

            gluon_config, lists, even = config, None, False
            if mask is not None or bias is not None:
                gluon_config = gluon_mask_forward(config)
            if mask is not None:  # the lists at the Gluon tiles; the mask itself is never read
                tiles = (gluon_config.block_m, gluon_config.block_n)
                lists = row_list_args(mask, spec, seqlen_q, seqlen_k, *tiles, heads_q, heads_kv, lse)
                # (a cache hit: hopper_supports read it; the launcher adds the no-bias condition)
                even = rows_even(mask, spec, seqlen_q, seqlen_k, *tiles)
            if hopper_fwd.attention_forward(q, k, v, out, lse, spec, gluon_config, lists, bias, even_lists=even):
                return out, lse
        config = triton_fallback(config)
    if bias is not None and config.block_n > 64:
        # A 128x128 bias tile per stage on top of the K/V stages would overflow shared memory.
        config = replace(config, block_n=64)
    bias_desc = score_tile_descriptor(bias, config.block_m, config.block_n)
    mask_desc = mask_descriptor(mask, config.block_m, config.block_n)
    qk_scale, softcap_log2 = score_constants(spec)
    block_d, block_dv = padded_dims(head_dim, head_dim_v)
    descs = loop_descriptors(((k, block_d), (v, block_dv)), spec.layout, config.block_n,
                             config.tma_loads and packing is None)
    grid = (cdiv(seqlen_q, config.block_m), batch * heads_q)
    user_mask = mask_args(mask, heads_q, heads_kv, lse)
    tile_lists = row_list_args(mask, spec, seqlen_q, seqlen_k, config.block_m, config.block_n, heads_q, heads_kv, lse)
    launch(
        _forward_kernel, grid, (
            q, k, v, out, lse, sinks if sinks is not None else lse, user_mask[0], bias if bias is not None else lse,
            tile_lists[0], *sequence_args(packing, lse), *(descs or (k, v)),
            bias_desc if bias_desc is not None else lse, mask_desc if mask_desc is not None else lse,
            *bhs_strides(q, spec.layout, packing), *bhs_strides(k, spec.layout, packing),
            *bhs_strides(v, spec.layout, packing), *bhs_strides(out, spec.layout, packing), *user_mask[1:],
            *tile_lists[1:], *broadcast_args(bias, heads_q, heads_kv, lse)[1:],
            seqlen_q, seqlen_k, heads_q, heads_q // heads_kv, spec.window_left, spec.window_right,
            lse.shape[-1] if packing is not None else 0, qk_scale, softcap_log2,
        ),
        HEAD_DIM=head_dim, HEAD_DIM_V=head_dim_v, BLOCK_D=block_d, BLOCK_DV=block_dv,
        BLOCK_M=config.block_m, BLOCK_N=config.block_n, TMA_LOADS=descs is not None,
        HAS_LEFT=spec.has_window_left, HAS_RIGHT=spec.has_window_right,
        HAS_SOFTCAP=softcap_mode(spec, q.dtype, q.device), HAS_SINKS=sinks is not None, HAS_MASK=mask is not None,
        HAS_BIAS=bias is not None, BIAS_TMA=bias_desc is not None, MASK_TMA=mask_desc is not None,
        DOT_PRECISION=dot_precision(q.dtype), VARLEN=packing is not None,
        num_warps=config.num_warps, num_stages=config.num_stages,
    )
    return out, lse


def attention_backward(dout, dlse, q, k, v, out, lse, spec: AttentionSpec, configs: AttentionConfigs,
                       mask: BlockMask | None = None, bias: torch.Tensor | None = None, bias_grad: bool = False,
                       packing: Packing | None = None, sinks: torch.Tensor | None = None):
    """Returns (dq, dk, dv, dbias, dsinks), dq/dk/dv each in the layout and dtype of its input.
    ``mask``, ``bias``, ``packing``: as for ``fwd.attention_forward``. ``dbias`` (with ``bias_grad``,
    else None) has the bias's 4-D shape and dtype: the gradient summed over the bias's broadcast dims
    (SPEC 3.3). ``sinks`` (Hq,), whose gradient is wanted: ``dsinks`` (float32, else None), from the
    pre-pass's row statistics (``sink_gradient``).
    Packed sequences run the Gluon dK/dV pass where it takes the problem (over the host's map of the
    key blocks that exist, packed_tiles.py), else the Triton passes with pointer loads."""
    layout = spec.layout
    batch, heads_q, seqlen_q, head_dim = bhsd_shape(q, layout)
    heads_kv, seqlen_k, head_dim_v = bhsd_shape(v, layout)[1:]
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
    plan = backward_plan(q, k, v, out, dout, dlse, spec, configs, mask, bias, dbias_mode, packing)
    dkdv_cfg, dq_cfg, atomic_dq, padded_d = plan.dkdv, configs.dq, plan.atomic_dq, plan.padded_d
    if atomic_dq:
        # dQ is summed over key blocks in an fp32 (B, Hq, Sq, D) buffer -- packed sequences: (1, Hq,
        # total_q, D) --, rows padded to 16 bytes for TMA. The pre-pass zeroes it.
        rows = (batch, heads_q, seqlen_q) if packing is None else (1, heads_q, total_q)
        dq_buffer = torch.empty((*rows, padded_d), dtype=torch.float32, device=q.device)
    # Row statistics, rows padded to a multiple of every tile height (and of 16: aligned vectors).
    padded_rows = plan.padded_rows
    lse2, delta = torch.empty((2, batch * heads_q, padded_rows), dtype=torch.float32, device=q.device).unbind()
    plan.preprocess(out, dout, lse, dlse if dlse is not None else lse, lse2, delta,
                    dq_buffer if plan.zero_dq else lse, sequence_args(packing, lse)[0])
    dsinks = None if sinks is None else sink_gradient(sinks, lse2, delta, heads_q)

    # The Gluon pass, where the config names it and it takes the problem: dK, dV, and with atomic_dq
    # also dQ (5 matmuls, D=128), else the dQ pass below sums dQ.
    gluon_dkdv = hopper_dkdv_pass(q, k, v, dout, lse2, delta, dk, dv, spec, plan, dq_buffer if atomic_dq else None,
                                  mask, bias, dbias, packing)
    if gluon_dkdv and atomic_dq:  # the Gluon pass computed every gradient, the bias's too
        return _dq_from_sums(dq_buffer, q, layout), dk, dv, dbias, dsinks
    if gluon_dkdv and not atomic_dq:  # dQ by the Gluon dQ pass, where it takes the problem
        dq = gluon_dq_pass(q, k, v, dout, lse2, delta, spec, configs, mask, bias, packing)
        if dq is not None:
            return dq, dk, dv, dbias, dsinks
    if dkdv_cfg.hopper_overlap is not None:  # what the Triton kernel compiles with, from here on
        dkdv_cfg = triton_dkdv_fallback(dkdv_cfg)
    dq_tma = atomic_dq and configs.dq_tma and packing is None
    if atomic_dq:
        dq_target = _dq_descriptor(dq_buffer, padded_d, dkdv_cfg.block_m) if dq_tma else dq_buffer
    else:
        dq_buffer = gradient_like(q)
        dq_target = dq_buffer
    block_d, block_dv = padded_dims(head_dim, head_dim_v)
    # TMA descriptors for the tiles each pass walks: Q, dO (dK/dV pass, unless the Gluon pass ran it),
    # K, V (dQ pass, unless the dK/dV programs sum dQ by atomics).
    dkdv_descs = loop_descriptors(((q, block_d), (dout, block_dv)), layout, dkdv_cfg.block_m,
                                  dkdv_cfg.tma_loads and packing is None and not gluon_dkdv)
    dq_descs = loop_descriptors(((k, block_d), (v, block_dv)), layout, dq_cfg.block_n,
                                dq_cfg.tma_loads and packing is None and not atomic_dq)
    user_mask = mask_args(mask, heads_q, heads_kv, lse2)
    # With a mask, the tiles each program visits (tile_lists.py): per key block for dK/dV, per
    # query block for dQ, at each pass's own tile sizes.
    column_lists = column_list_args(None if gluon_dkdv else mask, spec, seqlen_q, seqlen_k, dkdv_cfg, heads_q,
                                    heads_kv, lse2)
    row_lists = row_list_args(None if atomic_dq else mask, spec, seqlen_q, seqlen_k, dq_cfg.block_m,
                              dq_cfg.block_n, heads_q, heads_kv, lse2)
    bias_args = broadcast_args(bias, heads_q, heads_kv, lse2)
    dbias_args = broadcast_args(dbias, heads_q, heads_kv, lse2)
    # The bias (and its gradient) through TMA where all three descriptors can be made; else pointers.
    writes_dbias = dbias_mode in (DBIAS_STORE, DBIAS_ATOMIC)
    bias_descs, bias_tma = all_or_placeholders(
        [score_tile_descriptor(bias, dkdv_cfg.block_m, dkdv_cfg.block_n),
         score_tile_descriptor(bias, dq_cfg.block_m, dq_cfg.block_n),
         score_tile_descriptor(dbias, dkdv_cfg.block_m, dkdv_cfg.block_n) if writes_dbias else lse2], lse2)
    # The mask's bytes through TMA likewise, at each pass's tiles (fwd.mask_descriptor).
    mask_descs, mask_tma = all_or_placeholders(
        [mask_descriptor(mask, dkdv_cfg.block_m, dkdv_cfg.block_n),
         mask_descriptor(mask, dq_cfg.block_m, dq_cfg.block_n)], lse2)
    tensors = (q, k, v, dout, lse2, delta, dk, dv, dq_buffer, user_mask[0], bias_args[0], dbias_args[0],
               column_lists[0], row_lists[0], *sequence_args(packing, lse2))

    def call_arguments(run_dkdv: bool, run_dq: bool) -> tuple:
        """The kernel's leading arguments, the call's tensors and descriptors (its others follow)."""
        dkdv_loads = run_dkdv and dkdv_descs is not None
        dq_loads = run_dq and dq_descs is not None
        return (*tensors, *(dkdv_descs if dkdv_loads else (q, dout)), *(dq_descs if dq_loads else (k, v)), dq_target,
                *bias_descs, *mask_descs)

    # The launches depend on the call's tensors only through these where no mask, bias or packing
    # takes part: kept with the plan (the scalars and constexprs below cost a short step ~100 us).
    plain = mask is None and bias is None and packing is None
    if plain:
        passes_key = (q.stride(), k.stride(), v.stride(), gluon_dkdv, dkdv_descs is None, dq_descs is None)
    passes = plan.triton_passes.get(passes_key) if plain else None
    if passes is None:
        passes = _triton_passes(q, k, v, dout, dk, dv, dq_buffer, spec, configs, plan, dkdv_cfg, dq_tma, gluon_dkdv,
                                mask, bias, dbias_mode, packing, user_mask, column_lists, row_lists, bias_args,
                                dbias_args, bias_tma, mask_tma, dkdv_descs is not None, dq_descs is not None,
                                call_arguments)
        if plain:
            if len(plan.triton_passes) >= 8:
                plan.triton_passes.clear()
            plan.triton_passes[passes_key] = passes
    for launcher, run_dkdv, run_dq in passes:
        launcher(*call_arguments(run_dkdv, run_dq))
    if dbias_mode == DBIAS_PASS:
        _bias_grad_pass(q, k, v, dout, lse2, delta, mask, user_mask, bias_args, dbias_args, spec, dq_cfg,
                        _kernel_flags(q, v, spec, mask, bias))
    elif dbias_mode == DBIAS_ATOMIC:
        dbias = dbias.to(bias.dtype)
    if atomic_dq:
        dq_buffer = _dq_from_sums(dq_buffer, q, layout)
    return dq_buffer, dk, dv, dbias, dsinks


@dataclass(frozen=True)
class BackwardPlan:
    """What ``attention_backward`` decides before launching anything: the dK/dV pass's config, dQ
    by atomics or by a pass of its own, the bias in the Gluon pass, the Triton dK/dV programs'
    order, the padded widths of dQ's accumulator and of the row statistics, and the pre-pass's
    launch (``backward_plan``)."""

    dkdv: KernelConfig
    atomic_dq: bool
    # Short causal GQA: the whole group walked by one program and dQ by the Gluon dQ pass, the
    # deterministic form, in every mode (``walks_group_with_dq_pass``).
    group_walk: bool
    bias_in_gluon: bool
    block_major: bool
    padded_d: int
    padded_rows: int
    zero_dq: bool
    preprocess: Launcher  # (out, dout, lse, dlse, lse2, delta, dQ accumulator, cu_seqlens_q)
    # The Gluon dK/dV pass takes the problem (``fwd.hopper_supports``: metadata only; the tensors' TMA
    # addresses are checked at launch).
    gluon_dkdv: bool
    # The Triton passes' launches of the problem (``_triton_passes``), by the inputs' strides and
    # what the call could run (the Gluon pass, TMA loads); filled by calls without mask, bias or packing.
    triton_passes: dict = field(default_factory=dict, compare=False, hash=False, repr=False)


_plain_plans = per_problem_dict()  # problem metadata -> BackwardPlan (``backward_plan``)


def backward_plan(q, k, v, out, dout, dlse, spec: AttentionSpec, configs: AttentionConfigs, mask, bias,
                  dbias_mode: int, packing: Packing | None) -> BackwardPlan:
    """The backward's decisions for one call, kept per problem where the problem's metadata alone
    decides them (no mask or bias, whose contents take part; packed sequences by their count and
    longest length, not their offsets): a short training step spends its host time on them
    otherwise (benchmarks/NOTES.md v38, v39)."""
    if mask is not None or bias is not None:
        return _decide_backward(q, k, v, out, dout, dlse, spec, configs, mask, bias, dbias_mode, packing)
    key = (q.shape, k.shape, v.shape, q.dtype, q.device, out.stride(), dout.stride(), dlse is not None, spec, configs,
           DKDV_BLOCK_MAJOR, None if packing is None else (packing.sequences, packing.max_seqlen_q))
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
    atomic_dq_config = configs.atomic_dq
    if mask is not None and dkdv_cfg.hopper_overlap is not None:  # the tiles a Gluon pass walks lists with
        dkdv_cfg = gluon_mask_dkdv(dkdv_cfg)
    group_walk = walks_group_with_dq_pass(q, k, spec, configs, mask, bias, packing)
    atomic_dq = atomic_dq_config and not spec.deterministic and not group_walk
    # The Gluon pass reads a bias (and stores its gradient) in its 5-matmul form only.
    bias_in_gluon = atomic_dq and gluon_dkdv_takes_bias(q, spec, bias, dbias_mode)
    if dkdv_cfg.hopper_overlap is not None and not gluon_pass_sums_dq(q, k, v, spec, dkdv_cfg, mask, bias,
                                                                      bias_in_gluon):
        atomic_dq = False  # chosen for the Gluon pass summing dQ itself; elsewhere dQ gets its own pass
    bias_in_gluon = bias_in_gluon and atomic_dq
    gluon_dkdv = dkdv_cfg.hopper_overlap is not None and hopper_supports(q, k, v, spec, mask=mask, bias=bias,
                                                                         reads_bias=bias_in_gluon)
    padded_d = cdiv(head_dim, 4) * 4 if atomic_dq else 0
    pre_block_m = configs.preprocess_block_m
    gluon_dq_rows = configs.gluon_dq.hopper_split * 64 if configs.gluon_dq is not None else 0
    # a common multiple, not the largest: a tuned Gluon dQ pass may take 192-row tiles beside 128-row ones
    row_multiple = math.lcm(pre_block_m, configs.dkdv.block_m, configs.dq.block_m, gluon_dq_rows or 16, 16)
    padded_rows = cdiv(seqlen_q, row_multiple) * row_multiple
    zero_dq = atomic_dq
    preprocess = Launcher(
        _preprocess_kernel, (padded_rows // pre_block_m, batch * heads_q),
        ((SLOT,) * 8 + (*bhs_strides(out, layout, packing), *bhs_strides(dout, layout, packing), seqlen_q, heads_q,
                        padded_rows, padded_d if zero_dq else 0, total_q if packing is not None else 0)),
        HEAD_DIM_V=head_dim_v, BLOCK_DV=padded_dims(head_dim, head_dim_v)[1], BLOCK_M=pre_block_m,
        HAS_DLSE=dlse is not None, ZERO_DQ=zero_dq, BLOCK_DQ=padded_dim(padded_d) if zero_dq else 16,
        VARLEN=packing is not None)
    return BackwardPlan(dkdv_cfg, atomic_dq, group_walk, bias_in_gluon, dkdv_block_major(spec, heads_q // heads_kv),
                        padded_d, padded_rows, zero_dq, preprocess, gluon_dkdv)


def bias_grad_plan(bias: torch.Tensor | None, full_shape: tuple, spec: AttentionSpec, skips_tiles: bool = False):
    """(how the dK/dV pass writes the bias gradient, the buffer it writes). A bias of the full
    (B, Hq, Sq, Sk) shape gets one value per entry from one program: stored, in the bias dtype.
    A broadcast bias sums over programs: fp32 atomics, or with ``deterministic`` a pass of its own
    that sums in a fixed order (``_bias_grad_kernel``). ``skips_tiles``: a mask empties tiles."""
    if bias is None:
        return DBIAS_OFF, None
    if tuple(bias.shape) == full_shape:
        # Tiles outside the window, or emptied by the mask, are never visited: they keep the zeros
        # they start with.
        skipped = spec.has_window_left or spec.has_window_right or skips_tiles
        allocate = torch.zeros_like if skipped else torch.empty_like
        return DBIAS_STORE, allocate(bias, memory_format=torch.contiguous_format)
    if spec.deterministic:
        return DBIAS_PASS, torch.empty_like(bias, memory_format=torch.contiguous_format)
    return DBIAS_ATOMIC, torch.zeros(bias.shape, dtype=torch.float32, device=bias.device)


def walks_group_with_dq_pass(q, k, spec: AttentionSpec, configs: AttentionConfigs, mask, bias,
                             packing: Packing | None) -> bool:
    """Causal GQA with short keys (<= SHORT_KEYS) where the Gluon dQ pass takes the problem: the
    deterministic form -- one dK/dV program per KV head's whole group, dQ by the Gluon dQ pass --
    runs in the default mode too. GQA 16/2 causal, GPU time a step (benchmarks/NOTES.md v45):
    S=1k -18% (H100; H200 -14%) against the 5-matmul pass with group sums, 2k -6.5% (-4%), 4k +2.5%
    (H200; so longer keys keep the 5-matmul form). Its gradients are then bitwise reproducible too."""
    if not takes_gluon_dq(configs.gluon_dq, spec, mask, bias, packing):
        return False
    heads_q = bhsd_shape(q, spec.layout)[1]
    heads_kv, seqlen_k = bhsd_shape(k, spec.layout)[1:3]
    return (heads_q > heads_kv and spec.window_right == 0 and not spec.has_window_left and not spec.has_softcap
            and seqlen_k <= SHORT_KEYS)


def takes_gluon_dq(config: KernelConfig | None, spec: AttentionSpec, mask, bias, packing: Packing | None) -> bool:
    """Whether ``config`` names a Gluon dQ pass (a warp-specialised forward config) for a problem
    of the kind it runs: no mask, bias or packed sequences (the tensors are checked at launch,
    ``hopper_fwd.dq_pass``)."""
    return (config is not None and config.hopper_split in (2, 3) and mask is None and bias is None
            and packing is None)


def gluon_dq_pass(q, k, v, dout, lse2, delta, spec: AttentionSpec, configs: AttentionConfigs, mask, bias,
                  packing: Packing | None) -> torch.Tensor | None:
    """dQ by the warp-specialised forward's kernel run as the dQ pass (``hopper_fwd.dq_pass``:
    same arithmetic as the Triton dQ programs, each row summed in a fixed order) where the configs
    name one (``gluon_dq``) and it takes the problem; else None, nothing launched."""
    config = configs.gluon_dq
    if not takes_gluon_dq(config, spec, mask, bias, packing) or not hopper_supports(q, k, v, spec):
        return None
    from .kernels.gluon import fwd as hopper_fwd  # Gluon: imported only where it runs (not under the interpreter)

    dq = gradient_like(q)
    return dq if hopper_fwd.dq_pass(q, k, v, dout, lse2, delta, dq, spec, config) else None


def triton_dkdv_fallback(config: KernelConfig) -> KernelConfig:
    """The Triton dK/dV programs' tiles where a Gluon dK/dV config cannot run (problem, tensors or
    dQ by atomics): its query step and depth, 64-key tiles on 4 warps (the Triton default)."""
    return KernelConfig(config.block_m, 64, 4, config.num_stages, config.tma_loads)


def gluon_dkdv_takes_bias(q, spec: AttentionSpec, bias: torch.Tensor | None, dbias_mode: int) -> bool:
    """Whether the Gluon dK/dV pass, in its 5-matmul form, can read ``bias`` and write its gradient:
    D=128 (dS is staged in shared memory there, split by key columns, and goes out as the gradient
    from there), no softcap (the gradient is dS before the cap's derivative), a bias of q's dtype
    that the Gluon forward can read (``fwd.gluon_reads_bias``), its gradient -- if wanted -- one
    value per entry (``DBIAS_STORE``; a broadcast bias's gradient sums over programs)."""
    return (bias is not None and gluon_reads_bias(bias) and bias.dtype == q.dtype and q.shape[-1] == 128
            and not spec.has_softcap and dbias_mode in (DBIAS_OFF, DBIAS_STORE))


def gluon_pass_sums_dq(q, k, v, spec: AttentionSpec, config: KernelConfig, mask=None, bias=None,
                       reads_bias: bool = False) -> bool:
    """Whether ``config`` names a Gluon dK/dV pass that takes this problem and can also sum dQ
    (hopper_bwd.computes_dq: D=128, 2 warpgroups, 64-row steps). Where a Gluon config's pass does
    not, dQ runs as its own pass: the fused Triton atomic programs are not what the Gluon config's
    tiles were chosen for (with 128-row steps they do not even fit shared memory). ``reads_bias``:
    it may take the bias (``gluon_dkdv_takes_bias``)."""
    if config.hopper_overlap is None or not hopper_supports(q, k, v, spec, mask=mask, bias=bias,
                                                            reads_bias=reads_bias):
        return False
    from .kernels.gluon import bwd as hopper_bwd

    return hopper_bwd.computes_dq(q.shape[-1], config)


def hopper_dkdv_pass(q, k, v, dout, lse2, delta, dk, dv, spec: AttentionSpec, plan: BackwardPlan,
                     dq_accum: torch.Tensor | None = None, mask=None, bias=None, dbias: torch.Tensor | None = None,
                     packing=None) -> bool:
    """Run the Gluon pass of hopper_bwd.py where the plan says it takes the problem
    (``BackwardPlan.gluon_dkdv``): dK, dV, and dQ into ``dq_accum`` (fp32, zeroed) when one is given
    (the plan's ``atomic_dq``); False, nothing launched, where not (or where TMA cannot address a
    tensor). With a mask the pass walks its column lists at the plan's tiles
    (``fwd.gluon_mask_dkdv``). With the plan's ``bias_in_gluon`` it reads ``bias`` and stores
    ``dbias``, its gradient, when one is given. ``packing``: packed sequences
    (``fwd.attention_forward``). One program per query head with dK/dV summed over each group where
    ``hopper_bwd.sums_over_group`` says so, unless the plan walks the group (``group_walk``)."""
    if not plan.gluon_dkdv:
        return False
    from .kernels.gluon import bwd as hopper_bwd  # Gluon: imported only where it runs (not under the interpreter)

    heads_q = bhsd_shape(q, spec.layout)[1]
    heads_kv = bhsd_shape(k, spec.layout)[1]
    lists = None
    if mask is not None:
        seqlen_q, seqlen_k = bhsd_shape(q, spec.layout)[2], bhsd_shape(k, spec.layout)[2]
        lists = column_list_args(mask, spec, seqlen_q, seqlen_k, plan.dkdv, heads_q, heads_kv, lse2)
    group_sum = not plan.group_walk and hopper_bwd.sums_over_group(spec, heads_q, heads_kv, plan.dkdv,
                                                                   lists is not None)
    return hopper_bwd.dkdv_pass(q, k, v, dout, lse2, delta, dk, dv, spec, plan.dkdv, dq_accum, lists, group_sum,
                                bias, dbias, packing)


DKDV_BLOCK_MAJOR: bool | None = None  # tests and experiments: force the dK/dV program order


def dkdv_block_major(spec: AttentionSpec, group_size: int) -> bool:
    """Launch the Triton dK/dV programs block-major (heaviest first across all heads) where their
    work is uneven (a right window bound: the first key blocks see the most queries) and few: with
    GQA each program walks its whole group, so the heaviest ones are long; launched head after head,
    the last head's heavy blocks start late and the pass ends on a tail (-15% backward time for GQA
    16/2 causal at S=1k and 4k, NOTES.md v14). MHA keeps head-major order, which keeps one head's
    Q and dO in L2 (block-major was +3.5% there). The Gluon pass orders its programs in chunks of
    heads instead (``hopper.chunk_head_rows``). The order changes no result."""
    if DKDV_BLOCK_MAJOR is not None:
        return DKDV_BLOCK_MAJOR
    return spec.has_window_right and group_size > 1
