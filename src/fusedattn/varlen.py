"""``varlen_attention``: packed batches of variable-length sequences (FlashAttention's varlen API).

Sequence i is rows ``cu_seqlens_q[i]:cu_seqlens_q[i + 1]`` of q and rows
``cu_seqlens_k[i]:cu_seqlens_k[i + 1]`` of k and v; each is an attention problem of its own (its
causal / window rule and ALiBi's distances aligned bottom-right within the sequence), so no token attends
across a sequence boundary and no padding is computed. The kernels take the packing as data
(``spec.Packing``): a new set of lengths compiles nothing new.
"""

from __future__ import annotations

import torch

from typing import Optional

from .cpu import chunked_forward
from .dropout import check_dropout, draw_seed
from .checks import check_alibi, check_chunk, check_options, check_qkv, check_sinks, is_integer
from .dispatch import attention_backward, attention_forward, packed_configs, prepare_packed_maps, resolve_backend
from .interface import (_backward_impl, _forward_impl, _unit_stride_head_dim, beyond_first_order,
                        differentiable_grads)
from .spec import AttentionSpec, Packing, gradient_like, resolve_spec

_NAME = "fusedattn.varlen_attention"


def check_packing_args(cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, q) -> None:
    """What the types and shapes of the packing decide (nothing read from the offsets: this runs
    where torch.compile traces too)."""
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


def check_packing(cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, q, k) -> Packing:
    """The packing, checked: bad offsets are errors, never a wrong result or a bad access.

    Offsets on the CPU are read where they are and copied to q's device without waiting: the call
    never stalls the host on the GPU. Offsets on q's GPU are read back (a small device-to-host copy
    that waits for the GPU), except while a CUDA graph is captured, where nothing can be read: then
    they are checked on the device (``device_checked_packing``)."""
    if _unreadable(cu_seqlens_q) or _unreadable(cu_seqlens_k):
        return device_checked_packing(cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, q, k)
    # The offsets read on the host (one small copy each; one when q and k share them), checked there,
    # and kept: the Gluon kernels' maps of the blocks that exist are built from them (packed_tiles.py).
    cus = (("cu_seqlens_q", cu_seqlens_q), ("cu_seqlens_k", cu_seqlens_k))
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


def _unreadable(offsets: torch.Tensor) -> bool:
    """Whether the host cannot read ``offsets`` now: GPU offsets while a CUDA graph is being captured."""
    return offsets.is_cuda and torch.cuda.is_current_stream_capturing()


def device_checked_packing(cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, q, k) -> Packing:
    """The packing checked by device ops alone (no host read, so it captures into a CUDA graph and
    each replay checks the offsets it is given): the same rules as ``check_packing``, folded into a
    0-d ``valid`` flag. The kernels read clamped copies of the offsets -- within [0, tokens], never
    decreasing -- so bad offsets cannot make them read or write outside the tensors; every output and
    gradient of an invalid packing is then NaN (``poison``). Without host offsets the Gluon kernels'
    maps cannot be made: the Triton kernels run."""
    def clamped(cu: torch.Tensor, total: int, longest: int):
        offsets = cu.to(q.device).long()
        lengths = offsets[1:] - offsets[:-1]
        ok = (offsets[0] == 0) & (offsets[-1] == total) & (lengths.min() >= 0) & (lengths.max() <= longest)
        return offsets.clamp(0, total).cummax(0).values.to(torch.int32), ok

    safe_q, ok_q = clamped(cu_seqlens_q, q.shape[0], int(max_seqlen_q))
    safe_k, ok_k = clamped(cu_seqlens_k, k.shape[0], int(max_seqlen_k))
    return Packing(safe_q, safe_k, int(max_seqlen_q), int(max_seqlen_k), valid=ok_q & ok_k)


def poison(packing: Packing, *tensors):
    """The tensors, NaN throughout where the device check found the packing invalid (in place)."""
    if packing.valid is not None:
        for t in tensors:
            if t is not None:
                t.masked_fill_(~packing.valid, float("nan"))
    return tensors


def _forward(q, k, v, sinks, packing: Packing, spec: AttentionSpec, backend: str, for_backward: bool,
             alibi: torch.Tensor | None = None, dropout_seed: torch.Tensor | None = None):
    """(out (total_q, Hq, Dv), lse (Hq, total_q)) of every sequence, no autograd: the kernels over the
    packed tensors ("triton"), or the PyTorch path sequence by sequence ("torch"). ``alibi`` (with
    ``spec.alibi``): the contiguous float32 (sequences, Hq) slopes (``checks.check_alibi``).
    ``dropout_seed`` (with ``spec.dropout_p``): the call's seed; sequence s is batch s of its mask."""
    heads_q = q.shape[1]
    if q.shape[0] == 0:  # no query in any sequence
        return q.new_empty((0, heads_q, v.shape[-1])), q.new_empty((heads_q, 0), dtype=torch.float32)
    if backend == "torch":
        out = q.new_empty((q.shape[0], heads_q, v.shape[-1]))
        lse = q.new_empty((heads_q, q.shape[0]), dtype=torch.float32)
        for index, ((q0, q1), (k0, k1)) in enumerate(_sequences(packing)):
            if q1 > q0:
                out_s, lse_s = _forward_impl(q[None, q0:q1], k[None, k0:k1], v[None, k0:k1], sinks, None, None,
                                             [0, 0, 0, 0], None, _slopes_of(alibi, index), dropout_seed,
                                             *spec.op_args(), "torch", dropout_first_batch=index)
                out[q0:q1], lse[:, q0:q1] = out_s[0], lse_s[0]
        return out, lse
    q4, k4, v4 = (t.unsqueeze(0) for t in (q, k, v))
    configs = packed_configs(q, v, spec)
    if for_backward:
        prepare_packed_maps(q4, k4, v4, sinks, packing, spec, configs)
    kernel_sinks = sinks.detach().float().contiguous() if sinks is not None else None
    out, lse = attention_forward(q4, k4, v4, spec, configs.forward, kernel_sinks, packing=packing, alibi=alibi,
                                 dropout_seed=dropout_seed)
    return poison(packing, out[0], lse)


def _backward(dout, dlse, q, k, v, out, lse, sinks, sinks_grad: bool, packing: Packing, spec: AttentionSpec,
              backend: str, alibi: torch.Tensor | None = None, dropout_seed: torch.Tensor | None = None):
    """(dq, dk, dv, dsinks (float32, or None unless ``sinks_grad``)) of ``_forward`` (``alibi``: its
    slopes; constants, no gradient; ``dropout_seed``: its seed)."""
    dout = torch.zeros_like(out) if dout is None else _unit_stride_head_dim(dout)
    if dlse is not None:
        dlse = dlse.float().contiguous()
    if q.shape[0] == 0:  # no query at all: every gradient is 0
        dsinks = torch.zeros(sinks.shape, dtype=torch.float32, device=q.device) if sinks_grad else None
        return gradient_like(q).zero_(), gradient_like(k).zero_(), gradient_like(v).zero_(), dsinks
    if backend == "torch":
        dq, dk, dv = (gradient_like(t).zero_() for t in (q, k, v))
        dsinks = torch.zeros(q.shape[1], dtype=torch.float32, device=q.device) if sinks_grad else None
        for index, ((q0, q1), (k0, k1)) in enumerate(_sequences(packing)):
            if q1 > q0:
                parts = _backward_impl(dout[None, q0:q1], None if dlse is None else dlse[None, :, q0:q1],
                                       q[None, q0:q1], k[None, k0:k1], v[None, k0:k1], out[None, q0:q1],
                                       lse[None, :, q0:q1], sinks, sinks_grad, None, None, [0, 0, 0, 0], None, False,
                                       _slopes_of(alibi, index), dropout_seed, *spec.op_args(), "torch",
                                       dropout_first_batch=index)
                dq[q0:q1], dk[k0:k1], dv[k0:k1] = parts[0][0], parts[1][0], parts[2][0]
                if sinks_grad:
                    dsinks += parts[4]
        return dq, dk, dv, dsinks
    q4, k4, v4 = (t.unsqueeze(0) for t in (q, k, v))
    dq, dk, dv, _, dsinks = attention_backward(dout.unsqueeze(0), dlse, q4, k4, v4, out.unsqueeze(0), lse, spec,
                                               packed_configs(q, v, spec), packing=packing,
                                               sinks=sinks if sinks_grad else None, alibi=alibi,
                                               dropout_seed=dropout_seed)
    return poison(packing, dq[0], dk[0], dv[0], dsinks)


def _slopes_of(alibi: torch.Tensor | None, index: int) -> torch.Tensor | None:
    """Sequence ``index``'s row of the (sequences, Hq) ALiBi slopes, as the (1, Hq) slopes of a batch of one."""
    return None if alibi is None else alibi[index:index + 1]


def _sequences(packing: Packing):
    """((q0, q1), (k0, k1)) row ranges of each sequence, from the offsets the host read."""
    bounds_q, bounds_k = packing.offsets_q, packing.offsets_k
    return zip(zip(bounds_q, bounds_q[1:]), zip(bounds_k, bounds_k[1:]))


class _VarlenAttention(torch.autograd.Function):
    """Eager calls: ``_forward`` / ``_backward`` under autograd, the packing and spec carried by the
    context (torch.compile traces the custom ops below instead; both run the same code)."""

    @staticmethod
    def forward(ctx, q, k, v, sinks, packing: Packing, spec: AttentionSpec, backend: str, alibi=None,
                dropout_seed=None):
        out, lse = _forward(q, k, v, sinks, packing, spec, backend, for_backward=any(ctx.needs_input_grad[:4]),
                            alibi=alibi, dropout_seed=dropout_seed)
        # the inputs themselves: a backward with create_graph differentiates through them
        ctx.save_for_backward(q, k, v, out, lse, sinks, alibi, dropout_seed)
        ctx.packing, ctx.spec, ctx.backend = packing, spec, backend
        ctx.set_materialize_grads(False)
        return out, lse

    @staticmethod
    def backward(ctx, dout, dlse):
        q, k, v, out, lse, sinks, alibi, dropout_seed = ctx.saved_tensors
        if torch.is_grad_enabled():  # create_graph=True: differentiable gradients (interface._differentiable_backward)
            return (*_differentiable_backward(ctx, q, k, v, sinks, dout, dlse, alibi, dropout_seed), None, None,
                    None, None, None)
        sinks_grad = sinks is not None and ctx.needs_input_grad[3]
        dq, dk, dv, dsinks = _backward(dout, dlse, q, k, v, out, lse, sinks, sinks_grad, ctx.packing, ctx.spec,
                                       ctx.backend, alibi, dropout_seed)
        # no gradient for the packing, spec, backend, the ALiBi slopes (constants) or the seed
        return dq, dk, dv, dsinks.to(sinks.dtype) if sinks_grad else None, None, None, None, None, None



# ----------------------------------------------------------------------------- custom ops (torch.compile)
# The offsets are read (or checked on the device) inside the ops, where torch.compile does not trace:
# ``varlen_attention`` compiles with fullgraph=True. The backward rebuilds the packing from the same
# offsets (the host maps made for the forward are found again in ``packed_tiles``' cache).


@torch.library.custom_op("fusedattn::varlen_forward", mutates_args=())
def _forward_op(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens_q: torch.Tensor,
                cu_seqlens_k: torch.Tensor, sinks: Optional[torch.Tensor], alibi: Optional[torch.Tensor],
                dropout_seed: Optional[torch.Tensor], max_seqlen_q: int, max_seqlen_k: int, window_left: int,
                window_right: int, scale: float, softcap: float, deterministic: bool, chunk: int, dropout_p: float,
                backend: str) -> tuple[torch.Tensor, torch.Tensor]:
    packing = check_packing(cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, q, k)
    spec = AttentionSpec("bshd", window_left, window_right, scale, softcap, deterministic, alibi is not None, chunk,
                         dropout_p)
    out, lse = _forward(q, k, v, sinks, packing, spec, backend, for_backward=True, alibi=alibi,
                        dropout_seed=dropout_seed)
    return out, lse


@_forward_op.register_fake
def _forward_fake(q, k, v, cu_seqlens_q, cu_seqlens_k, sinks, alibi, dropout_seed, *options):
    return q.new_empty((q.shape[0], q.shape[1], v.shape[-1])), q.new_empty((q.shape[1], q.shape[0]),
                                                                           dtype=torch.float32)


@torch.library.custom_op("fusedattn::varlen_backward", mutates_args=())
def _backward_op(dout: torch.Tensor, dlse: Optional[torch.Tensor], q: torch.Tensor, k: torch.Tensor,
                 v: torch.Tensor, out: torch.Tensor, lse: torch.Tensor, cu_seqlens_q: torch.Tensor,
                 cu_seqlens_k: torch.Tensor, sinks: Optional[torch.Tensor], sinks_grad: bool,
                 alibi: Optional[torch.Tensor], dropout_seed: Optional[torch.Tensor], max_seqlen_q: int,
                 max_seqlen_k: int, window_left: int, window_right: int, scale: float, softcap: float,
                 deterministic: bool, chunk: int, dropout_p: float,
                 backend: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    packing = check_packing(cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, q, k)
    spec = AttentionSpec("bshd", window_left, window_right, scale, softcap, deterministic, alibi is not None, chunk,
                         dropout_p)
    dq, dk, dv, dsinks = _backward(dout, dlse, q, k, v, out, lse, sinks, sinks_grad, packing, spec, backend, alibi,
                                   dropout_seed)
    return dq, dk, dv, dsinks if dsinks is not None else q.new_empty(0, dtype=torch.float32)


@_backward_op.register_fake
def _backward_fake(dout, dlse, q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, sinks, sinks_grad, alibi, dropout_seed,
                   *options):
    return gradient_like(q), gradient_like(k), gradient_like(v), \
        q.new_empty(sinks.shape if sinks_grad else (0,), dtype=torch.float32)


def _setup_context(ctx, inputs, output):
    q, k, v, cu_seqlens_q, cu_seqlens_k, sinks, alibi, dropout_seed, *options = inputs
    ctx.save_for_backward(q, k, v, *output, cu_seqlens_q, cu_seqlens_k, sinks, alibi, dropout_seed)
    ctx.options = options
    ctx.set_materialize_grads(False)


def _op_backward(ctx, dout, dlse):
    q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, sinks, alibi, dropout_seed = ctx.saved_tensors
    sinks_grad = sinks is not None and ctx.needs_input_grad[5]
    dout = torch.zeros_like(out) if dout is None else dout
    dq, dk, dv, dsinks = _backward_op(dout, dlse, q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, sinks, sinks_grad,
                                      alibi, dropout_seed, *ctx.options)
    # None for the offsets, the ALiBi slopes (constants), the seed and the options
    return dq, dk, dv, None, None, dsinks.to(sinks.dtype) if sinks_grad else None, None, None, \
        *(None,) * len(ctx.options)


_forward_op.register_autograd(_op_backward, setup_context=_setup_context)


def _differentiable_backward(ctx, q, k, v, sinks, dout, dlse, alibi=None, dropout_seed=None) -> tuple:
    """(dq, dk, dv, dsinks) as differentiable functions of the inputs and of (dout, dlse), for a
    backward with ``create_graph=True``: the sequences recomputed by plain torch ops
    (``_per_sequence``), which autograd differentiates to any order."""
    with torch.enable_grad():
        out, lse = _per_sequence(q, k, v, ctx.packing, sinks, ctx.spec, q.shape[1], alibi, dropout_seed)
    return differentiable_grads((out, lse), (dout, dlse), (q, k, v, sinks), ctx.needs_input_grad[:4])


def _per_sequence(q, k, v, packing: Packing, sinks, spec: AttentionSpec, heads_q: int, alibi=None,
                  dropout_seed=None):
    """Each sequence by ``cpu.chunked_forward`` (plain torch ops, on any device), through autograd: the
    differentiable form of the call (forward-mode AD and torch.func transforms, and a backward with
    ``create_graph``). ``alibi``: the (sequences, Hq) slopes, a row to each sequence; ``dropout_seed``:
    the call's, sequence s being batch s of its mask, as in the kernels."""
    bounds_q, bounds_k = packing.offsets_q, packing.offsets_k
    outs, lses = [], []
    for index, ((q0, q1), (k0, k1)) in enumerate(zip(zip(bounds_q, bounds_q[1:]), zip(bounds_k, bounds_k[1:]))):
        if q1 == q0:  # no query: nothing to compute (its keys get zero gradients)
            continue
        out, lse = chunked_forward(q[q0:q1].unsqueeze(0), k[k0:k1].unsqueeze(0), v[k0:k1].unsqueeze(0), spec, sinks,
                                   alibi=_slopes_of(alibi, index), dropout_seed=dropout_seed,
                                   dropout_first_batch=index)
        outs.append(out[0])
        lses.append(lse[0])
    if not outs:  # empty outputs that still depend on every input (zero gradients, zero tangents)
        nothing = 0.0 * sum(t.sum() for t in (q, k, v, sinks) if t is not None)
        return (q.new_zeros((0, heads_q, v.shape[-1])) + nothing,
                q.new_zeros((heads_q, 0), dtype=torch.float32) + nothing.float())
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
    alibi_slopes: torch.Tensor | None = None,
    chunk: int | None = None,
    dropout_p: float = 0.0,
    deterministic: bool = False,
    return_lse: bool = False,
):
    """Exact attention over packed variable-length sequences, forward and backward.

    q: (total_q, Hq, D), k: (total_k, Hkv, D), v: (total_k, Hkv, Dv); ``cu_seqlens_q`` /
    ``cu_seqlens_k``: int32 (sequences + 1,) offsets, starting at 0 and ending at the token count
    (a sequence may be empty), on q's device or on the CPU (then checked without waiting for the
    GPU); ``max_seqlen_q`` / ``max_seqlen_k``: at least the longest length. Offsets on q's GPU are
    read back to be checked (a copy that waits for the GPU), except under CUDA-graph capture, where
    they are checked on the device and a bad packing gives NaN outputs and gradients.
    The options mean what they mean for ``fusedattn.attention``, per sequence (causal and window
    bottom-right aligned within each). ``alibi_slopes``: float32 (Hq,) or (sequences, Hq) -- FlashAttention
    2's varlen (batch, nheads), batch = sequences -- adds ``-slope * |i + Sk - Sq - j|`` with i, j, Sq, Sk
    those of each sequence; constants, no gradient. ``chunk``: int >= 1, chunked local attention per sequence:
    query i of a sequence sees its key j only if ``(i + Sk - Sq) // chunk == j // chunk`` (i, j, Sq, Sk
    the sequence's own), ANDed with the other rules. ``dropout_p``: as for ``fusedattn.attention``, sequence s
    being batch s of the mask (``fusedattn.dropout.keep_mask``). Returns out (total_q, Hq, Dv), and with ``return_lse=True``
    also lse (Hq, total_q) float32 (FlashAttention's varlen layout). Bias and mask are not taken.
    """
    check_options(layout="bshd", causal=causal, window=window, scale=scale, softcap=softcap,
                  deterministic=deterministic, return_lse=return_lse, caller=_NAME)
    shapes = check_qkv(q, k, v, "bshd", caller=_NAME, packed=True)
    heads_q = shapes.heads_q
    check_sinks(sinks, q, heads_q)
    check_chunk(chunk, caller=_NAME)
    dropout_p = check_dropout(dropout_p)
    check_packing_args(cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, q)
    # the slopes of each sequence: their number from the offsets' shape (nothing read from the offsets)
    alibi = check_alibi(alibi_slopes, q, shapes._replace(batch=cu_seqlens_q.shape[0] - 1), caller=_NAME,
                        batch_name="sequences")
    q, k, v = (_unit_stride_head_dim(t) for t in (q, k, v))
    spec = resolve_spec(q.shape[-1], layout="bshd", causal=causal, window=window, scale=scale, softcap=softcap,
                        deterministic=deterministic, alibi=alibi is not None, chunk=chunk, dropout_p=dropout_p)
    backend = resolve_backend(q.device)
    seed = draw_seed(q.device) if spec.has_dropout else None
    if torch.compiler.is_compiling():
        out, lse = _forward_op(q, k, v, cu_seqlens_q, cu_seqlens_k, sinks, alibi, seed, int(max_seqlen_q),
                               int(max_seqlen_k), *spec.op_args()[1:], backend)
    else:
        packing = check_packing(cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, q, k)
        if beyond_first_order(q, k, v, sinks):  # each sequence by plain torch ops
            out, lse = _per_sequence(q, k, v, packing, sinks, spec, heads_q, alibi, seed)
        else:
            out, lse = _VarlenAttention.apply(q, k, v, sinks, packing, spec, backend, alibi, seed)
    return (out, lse) if return_lse else out
