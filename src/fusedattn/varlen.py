"""``varlen_attention``: packed batches of variable-length sequences (FlashAttention's varlen API).

Sequence i is rows ``cu_seqlens_q[i]:cu_seqlens_q[i + 1]`` of q and rows
``cu_seqlens_k[i]:cu_seqlens_k[i + 1]`` of k and v; each is an attention problem of its own (its
causal / window rule aligned bottom-right within the sequence, SPEC 3.2), so no token attends
across a sequence boundary and no padding is computed. The kernels take the packing as data
(``spec.Packing``): a new set of lengths compiles nothing new.
"""

from __future__ import annotations

import torch

from .checks import check_options, check_qkv, check_sinks, is_integer
from .interface import _resolve_backend, _unit_stride_head_dim, attention, beyond_first_order
from .kernels.bwd import attention_backward
from .kernels import packed_tiles
from .kernels.fwd import attention_forward, hopper_supports
from .spec import AttentionSpec, Packing, resolve_spec
from .tuning.configs import band_window, select_configs

_NAME = "fusedattn.varlen_attention"


def check_packing(cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, q, k) -> Packing:
    """The packing, checked (issue 5: bad offsets are errors, never a wrong result or a bad access).
    Offsets on q's device are read back for that: a small device-to-host copy a call, which waits
    for the GPU. Offsets on the CPU (with q on a GPU) are read where they are and copied to the GPU
    without waiting: the call then never stalls the host on the GPU."""
    cus = (("cu_seqlens_q", cu_seqlens_q), ("cu_seqlens_k", cu_seqlens_k))
    for name, cu in cus:
        if not isinstance(cu, torch.Tensor):
            raise TypeError(f"{_NAME}: `{name}` must be an int32 torch.Tensor, got {type(cu).__name__}")
        if cu.dtype != torch.int32:
            raise TypeError(f"{_NAME}: `{name}` must be int32 (the kernels read 32-bit offsets), got {cu.dtype}")
        if cu.dim() != 1 or cu.numel() < 2:
            raise ValueError(f"{_NAME}: `{name}` must be 1-D with (sequences + 1) >= 2 entries, got shape "
                             f"{tuple(cu.shape)}")
        if cu.device != q.device and cu.device.type != "cpu":
            raise ValueError(f"{_NAME}: `{name}` is on {cu.device} but q is on {q.device}; expected q's device "
                             f"or the CPU")
    if cu_seqlens_q.numel() != cu_seqlens_k.numel():
        raise ValueError(f"{_NAME}: `cu_seqlens_q` has {cu_seqlens_q.numel()} entries and `cu_seqlens_k` "
                         f"{cu_seqlens_k.numel()}; expected one per sequence boundary in both")
    for name, value in (("max_seqlen_q", max_seqlen_q), ("max_seqlen_k", max_seqlen_k)):
        if not is_integer(value) or value < 0:
            raise TypeError(f"{_NAME}: `{name}` must be an int >= 0, got {type(value).__name__} {value!r}")
    # The offsets read on the host (one small copy each; one when q and k share them), checked there,
    # and kept: the Gluon kernels' maps of the blocks that exist are built from them (packed_tiles.py).
    offsets_q = cu_seqlens_q.tolist()
    offsets_k = offsets_q if cu_seqlens_k is cu_seqlens_q else cu_seqlens_k.tolist()
    for (name, _), offsets, total, max_name, max_given in zip(
            cus, (offsets_q, offsets_k), (q.shape[0], k.shape[0]), ("max_seqlen_q", "max_seqlen_k"),
            (max_seqlen_q, max_seqlen_k)):
        lengths = [b - a for a, b in zip(offsets, offsets[1:])]
        first, last, shortest, longest = offsets[0], offsets[-1], min(lengths), max(lengths)
        if first != 0 or shortest < 0:
            raise ValueError(f"{_NAME}: `{name}` must start at 0 and never decrease (offsets of consecutive "
                             f"sequences), got {offsets}")
        if last != total:
            raise ValueError(f"{_NAME}: `{name}` ends at {last} but the packed tensor has {total} tokens; "
                             f"expected the last offset to equal the token count")
        if longest > max_given:
            raise ValueError(f"{_NAME}: `{max_name}` is {max_given} but a sequence has {longest} tokens; "
                             f"expected at least the longest length")
    if cu_seqlens_q.device != q.device:  # host offsets: the kernels read a copy on q's device
        on_device = cu_seqlens_q.to(q.device, non_blocking=True)
        cu_seqlens_k = on_device if cu_seqlens_k is cu_seqlens_q else cu_seqlens_k.to(q.device, non_blocking=True)
        cu_seqlens_q = on_device
    elif cu_seqlens_k.device != q.device:
        cu_seqlens_k = cu_seqlens_k.to(q.device, non_blocking=True)
    return Packing(cu_seqlens_q, cu_seqlens_k, int(max_seqlen_q), int(max_seqlen_k), tuple(offsets_q), tuple(offsets_k))


class _VarlenAttention(torch.autograd.Function):
    """The kernels over packed sequences (the Gluon ones on Hopper where they take the problem, else
    the Triton ones): q, k, v as one batch of (1, total, H, D), the packing as data."""

    @staticmethod
    def forward(ctx, q, k, v, sinks, packing: Packing, spec: AttentionSpec):
        q4, k4, v4 = (t.unsqueeze(0) for t in (q, k, v))
        # One config for every set of lengths (the long-keys class): a new longest length must not
        # switch configs, which would compile new kernels.
        configs = select_configs(q.device, q.dtype, q.shape[-1], v.shape[-1], has_left=band_window(spec, q.shape[-1]),
                                 has_right=spec.has_window_right, has_softcap=spec.has_softcap)
        if any(ctx.needs_input_grad[:4]):
            _prepare_maps(q4, k4, v4, sinks, packing, spec, configs)
        kernel_sinks = sinks.detach().float().contiguous() if sinks is not None else None
        out, lse = attention_forward(q4, k4, v4, spec, configs.forward, kernel_sinks, packing=packing)
        # the inputs themselves, not the views made here: a backward with create_graph differentiates through them
        ctx.save_for_backward(q, k, v, out, lse, sinks)
        ctx.packing, ctx.spec, ctx.configs = packing, spec, configs
        ctx.set_materialize_grads(False)
        return out[0], lse

    @staticmethod
    def backward(ctx, dout, dlse):
        q, k, v, out, lse, sinks = ctx.saved_tensors
        if torch.is_grad_enabled():  # create_graph=True: differentiable gradients (interface._differentiable_backward)
            return (*_differentiable_backward(ctx, q, k, v, sinks, dout, dlse), None, None)
        q4, k4, v4 = (t.unsqueeze(0) for t in (q, k, v))
        dout = torch.zeros_like(out) if dout is None else _unit_stride_head_dim(dout).unsqueeze(0)
        if dlse is not None:
            dlse = dlse.float().contiguous()
        wanted = sinks if sinks is not None and ctx.needs_input_grad[3] else None
        dq, dk, dv, _, dsinks = attention_backward(dout, dlse, q4, k4, v4, out, lse, ctx.spec, ctx.configs,
                                                   packing=ctx.packing, sinks=wanted)
        return dq[0], dk[0], dv[0], dsinks.to(sinks.dtype) if dsinks is not None else None, None, None


def _differentiable_backward(ctx, q, k, v, sinks, dout, dlse) -> tuple:
    """(dq, dk, dv, dsinks) as differentiable functions of the inputs and of (dout, dlse), for a
    backward with ``create_graph=True``: the sequences recomputed through ``attention``, whose own
    backward is differentiable in that mode."""
    spec = ctx.spec
    options = dict(window=(spec.window_left, spec.window_right), scale=spec.scale,
                   softcap=spec.softcap if spec.has_softcap else None)
    inputs = (q, k, v, sinks)
    wanted = [t for t, need in zip(inputs, ctx.needs_input_grad[:4]) if need]
    with torch.enable_grad():
        out, lse = _per_sequence(q, k, v, ctx.packing, sinks, options, q.shape[1])
    pairs = [(o, g) for o, g in ((out, dout), (lse, dlse)) if g is not None]
    if not pairs or not wanted:
        return (None,) * 4
    grads = iter(torch.autograd.grad([o for o, _ in pairs], wanted, [g for _, g in pairs], create_graph=True,
                                     allow_unused=True))
    return tuple(next(grads) if need else None for need in ctx.needs_input_grad[:4])


class _NoQueries(torch.autograd.Function):
    """A packing with no query at all: empty outputs that still take part in autograd, so a loss
    over them back-propagates zero gradients into q, k, v and the sinks (as the kernels would)."""

    @staticmethod
    def forward(ctx, q, k, v, sinks):
        ctx.set_materialize_grads(False)
        ctx.shapes = [(t.shape, t.dtype) if t is not None else None for t in (q, k, v, sinks)]
        ctx.device = q.device
        return (q.new_empty((0, q.shape[1], v.shape[-1])), q.new_empty((q.shape[1], 0), dtype=torch.float32))

    @staticmethod
    def backward(ctx, dout, dlse):
        return tuple(None if s is None else torch.zeros(s[0], dtype=s[1], device=ctx.device) for s in ctx.shapes)


def _prepare_maps(q4, k4, v4, sinks, packing: Packing, spec: AttentionSpec, configs) -> None:
    """Where the Gluon kernels take the problem, the backward's map of key blocks is made with the
    forward's map of query blocks: one copy to the device, and the backward's host time (which the
    GPU waits on in a short step) spends nothing on it (kernels/packed_tiles.py)."""
    if not hopper_supports(q4, k4, v4, spec, sinks):
        return
    from .kernels.hopper import WG_ROWS  # Gluon: imported only where it runs (not under the interpreter)

    forward, dkdv = configs.forward, configs.dkdv
    query_block = WG_ROWS * forward.hopper_split if forward.hopper_overlap is not None and forward.hopper_split \
        else None
    key_block = WG_ROWS * dkdv.hopper_split if dkdv.hopper_overlap is not None and dkdv.hopper_split else None
    packed_tiles.prepare(packing, spec, q4.device, query_block, key_block)


def _per_sequence(q, k, v, packing: Packing, sinks, options: dict, heads_q: int):
    """The "torch" backend: ``attention`` on each sequence (its chunked PyTorch path and autograd)."""
    bounds_q, bounds_k = packing.cu_seqlens_q.tolist(), packing.cu_seqlens_k.tolist()
    outs, lses = [], []
    for (q0, q1), (k0, k1) in zip(zip(bounds_q, bounds_q[1:]), zip(bounds_k, bounds_k[1:])):
        if q1 == q0:  # no query: nothing to compute (its keys get zero gradients)
            continue
        out, lse = attention(q[q0:q1].unsqueeze(0), k[k0:k1].unsqueeze(0), v[k0:k1].unsqueeze(0), sinks=sinks,
                             return_lse=True, **options)
        outs.append(out[0])
        lses.append(lse[0])
    if not outs:
        return _NoQueries.apply(q, k, v, sinks)
    return torch.cat(outs), torch.cat(lses, dim=1)


def varlen_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    cu_seqlens_k: torch.Tensor,
    max_seqlen_q: int,
    max_seqlen_k: int,
    *,
    causal: bool = False,
    window: tuple[int, int] | None = None,
    scale: float | None = None,
    softcap: float | None = None,
    sinks: torch.Tensor | None = None,
    deterministic: bool = False,
    return_lse: bool = False,
):
    """Exact attention over packed variable-length sequences, forward and backward.

    q: (total_q, Hq, D), k: (total_k, Hkv, D), v: (total_k, Hkv, Dv); ``cu_seqlens_q`` /
    ``cu_seqlens_k``: int32 (sequences + 1,) offsets, starting at 0 and ending at the token count
    (a sequence may be empty), on q's device or on the CPU (then checked without waiting for the
    GPU); ``max_seqlen_q`` / ``max_seqlen_k``: at least the longest length.
    The options mean what they mean for ``fusedattn.attention``, per sequence (causal and window
    bottom-right aligned within each). Returns out (total_q, Hq, Dv), and with ``return_lse=True``
    also lse (Hq, total_q) float32 (FlashAttention's varlen layout). Bias and mask are not taken.
    """
    check_options(layout="bshd", causal=causal, window=window, scale=scale, softcap=softcap,
                  deterministic=deterministic, return_lse=return_lse, caller=_NAME)
    heads_q = check_qkv(q, k, v, "bshd", caller=_NAME, packed=True).heads_q
    check_sinks(sinks, q, heads_q)
    packing = check_packing(cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, q, k)
    q, k, v = (_unit_stride_head_dim(t) for t in (q, k, v))
    if q.shape[0] == 0:  # no query in any sequence
        out, lse = _NoQueries.apply(q, k, v, sinks)
    elif _resolve_backend(q.device) == "torch" or beyond_first_order(q, k, v, sinks):
        # (forward-mode AD and torch.func transforms: ``attention`` runs each sequence in plain torch ops)
        options = dict(causal=causal, window=window, scale=scale, softcap=softcap, deterministic=deterministic)
        out, lse = _per_sequence(q, k, v, packing, sinks, options, heads_q)
    else:
        spec = resolve_spec(q.shape[-1], layout="bshd", causal=causal, window=window, scale=scale, softcap=softcap,
                            deterministic=deterministic)
        out, lse = _VarlenAttention.apply(q, k, v, sinks, packing, spec)
    return (out, lse) if return_lse else out
