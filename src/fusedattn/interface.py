"""``fusedattn.attention`` and its autograd glue; no kernel logic lives here.

The forward and backward are ``torch.library`` custom ops with fake (meta)
implementations, so ``torch.compile`` traces a model that calls ``attention``
without graph breaks; eager calls skip the custom ops' dispatch (host time) through
an ``autograd.Function`` over the same implementations. Each op dispatches to one of
two backends that compute the same thing (docs/SEMANTICS.md, "Backends and `explain`"): ``"triton"`` (the fused
kernels: CUDA tensors, or CPU tensors under ``TRITON_INTERPRET=1``) and ``"torch"`` (the chunked PyTorch path).
"""

from __future__ import annotations

import functools
from typing import Optional

import torch
from torch.autograd import forward_ad

from . import cpu, dispatch, dropout
from .block_mask import BlockMask
from .dropout import check_dropout
from .checks import check_alibi, check_bias, check_chunk, check_mask, check_options, check_qkv, check_sinks
from .dispatch import use_backend  # noqa: F401  (public: fusedattn.use_backend)
from .spec import AttentionSpec, bhsd_shape, gradient_like, resolve_spec


def beyond_first_order(*tensors) -> bool:
    """Whether forward-mode AD or a ``torch.func`` transform (grad, vmap, jvp, jacrev, ...) sees the
    call. The fused kernels have no tangent or batching rule, so such calls run
    ``cpu.chunked_forward``, plain torch ops that those transforms differentiate and batch."""
    if torch._C._are_functorch_transforms_active():
        return True
    if getattr(forward_ad, "_current_level", 0) < 0:  # no dual level entered: nothing carries a tangent
        return False
    return any(t is not None and forward_ad.unpack_dual(t).tangent is not None for t in tensors)


def _unit_stride_head_dim(t: torch.Tensor) -> torch.Tensor:
    """Any strides are honoured except on the head dim, which needs unit stride: copy once."""
    return t if t.stride(-1) == 1 or t.shape[-1] == 1 else t.contiguous()


# ----------------------------------------------------------------------------- custom ops


def _mask_args(mask: BlockMask | None) -> tuple:
    """A BlockMask as the custom ops carry it: (mask, tile states, [cell_q, cell_k, shift_q, shift_k])."""
    if mask is None:
        return None, None, [0, 0, 0, 0]
    return mask.source, mask.states, [*mask.cell, *mask.source_shift]


def _block_mask(mask, mask_states, mask_grid, q, k, layout: str) -> BlockMask | None:
    """The BlockMask back from the custom ops' arguments (``_mask_args``). Its element shape: the
    source's, except that a dim of whole blocks (shift > 0) spans the sequence length."""
    if mask is None:
        return None
    seqlen_q, seqlen_k = bhsd_shape(q, layout)[2], bhsd_shape(k, layout)[2]
    shift_q, shift_k = mask_grid[2:]
    shape = (*mask.shape[:2], seqlen_q if shift_q else mask.shape[2], seqlen_k if shift_k else mask.shape[3])
    return BlockMask(shape, mask_states, tuple(mask_grid[:2]), mask, (shift_q, shift_k))


# The spec of the ops' plain option values, made once per set of options: a short step's forward and
# backward each rebuilt it (host time, which bounds a short step).
_spec = functools.lru_cache(maxsize=256)(AttentionSpec)


def _forward_impl(q, k, v, sinks, mask, mask_states, mask_grid, bias, alibi, dropout_seed, layout, window_left,
                  window_right, scale, softcap, deterministic, chunk, dropout_p, backend, dropout_first_batch=0):
    """``dropout_first_batch``: the batch index dropout's mask gives q's first batch (a packed
    sequence run alone on the PyTorch path keeps its index in the packing)."""
    spec = _spec(layout, window_left, window_right, scale, softcap, deterministic, alibi is not None, chunk, dropout_p)
    mask = _block_mask(mask, mask_states, mask_grid, q, k, layout)
    if sinks is not None:
        sinks = sinks.detach().float().contiguous()
    if bias is not None:
        bias = bias.detach()
    return dispatch.forward(q, k, v, spec, sinks, mask, bias, backend, alibi=alibi, dropout_seed=dropout_seed,
                            dropout_first_batch=dropout_first_batch)


@torch.library.custom_op("fusedattn::attention_forward", mutates_args=())
def _forward_op(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, sinks: Optional[torch.Tensor], mask: Optional[torch.Tensor],
    mask_states: Optional[torch.Tensor], mask_grid: list[int], bias: Optional[torch.Tensor],
    alibi: Optional[torch.Tensor], dropout_seed: Optional[torch.Tensor], layout: str, window_left: int,
    window_right: int, scale: float, softcap: float, deterministic: bool, chunk: int, dropout_p: float, backend: str,
) -> tuple[torch.Tensor, torch.Tensor]:
    return _forward_impl(q, k, v, sinks, mask, mask_states, mask_grid, bias, alibi, dropout_seed, layout, window_left,
                         window_right, scale, softcap, deterministic, chunk, dropout_p, backend)


@_forward_op.register_fake
def _forward_fake(q, k, v, sinks, mask, mask_states, mask_grid, bias, alibi, dropout_seed, layout, window_left,
                  window_right, scale, softcap, deterministic, chunk, dropout_p, backend):
    batch, heads_q, seqlen_q, _ = bhsd_shape(q, layout)
    head_dim_v = v.shape[-1]
    out_shape = (batch, seqlen_q, heads_q, head_dim_v) if layout == "bshd" else (batch, heads_q, seqlen_q, head_dim_v)
    return q.new_empty(out_shape), q.new_empty((batch, heads_q, seqlen_q), dtype=torch.float32)


def _backward_impl(dout, dlse, q, k, v, out, lse, sinks, sinks_grad, mask, mask_states, mask_grid, bias, bias_grad,
                   alibi, dropout_seed, layout, window_left, window_right, scale, softcap, deterministic, chunk,
                   dropout_p, backend, dropout_first_batch=0):
    """(dq, dk, dv, dbias, dsinks); dbias None unless ``bias_grad``, dsinks (float32) None unless
    ``sinks_grad`` (the custom op returns empty tensors in their place: ``_backward_op``).
    ``dropout_first_batch``: as for ``_forward_impl``."""
    spec = _spec(layout, window_left, window_right, scale, softcap, deterministic, alibi is not None, chunk, dropout_p)
    mask = _block_mask(mask, mask_states, mask_grid, q, k, layout)
    if bias is not None:
        bias = bias.detach()
    return dispatch.backward(dout, dlse, q, k, v, out, lse, spec, sinks, sinks_grad, mask, bias, bias_grad, backend,
                             alibi=alibi, dropout_seed=dropout_seed, dropout_first_batch=dropout_first_batch)


@torch.library.custom_op("fusedattn::attention_backward", mutates_args=())
def _backward_op(
    dout: torch.Tensor, dlse: Optional[torch.Tensor],
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor, lse: torch.Tensor,
    sinks: Optional[torch.Tensor], sinks_grad: bool,
    mask: Optional[torch.Tensor], mask_states: Optional[torch.Tensor], mask_grid: list[int],
    bias: Optional[torch.Tensor], bias_grad: bool, alibi: Optional[torch.Tensor], dropout_seed: Optional[torch.Tensor],
    layout: str, window_left: int, window_right: int, scale: float, softcap: float, deterministic: bool, chunk: int,
    dropout_p: float, backend: str,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    dq, dk, dv, dbias, dsinks = _backward_impl(dout, dlse, q, k, v, out, lse, sinks, sinks_grad, mask, mask_states,
                                               mask_grid, bias, bias_grad, alibi, dropout_seed, layout, window_left,
                                               window_right, scale, softcap, deterministic, chunk, dropout_p, backend)
    return dq, dk, dv, dbias if dbias is not None else q.new_empty(0), \
        dsinks if dsinks is not None else q.new_empty(0, dtype=torch.float32)


@_backward_op.register_fake
def _backward_fake(dout, dlse, q, k, v, out, lse, sinks, sinks_grad, mask, mask_states, mask_grid, bias, bias_grad,
                   alibi, dropout_seed, *options):
    # dq, dk, dv in their inputs' strides where those are dense, else contiguous (``empty_like``),
    # as both backends return them
    return gradient_like(q), gradient_like(k), gradient_like(v), \
        torch.empty_like(bias, memory_format=torch.contiguous_format) if bias_grad else q.new_empty(0), \
        q.new_empty(sinks.shape if sinks_grad else (0,), dtype=torch.float32)


def _setup_context(ctx, inputs, output):
    q, k, v, sinks, mask, mask_states, mask_grid, bias, alibi, dropout_seed, *options = inputs
    out, lse = output
    ctx.save_for_backward(q, k, v, out, lse, sinks, mask, mask_states, bias, alibi, dropout_seed)
    ctx.mask_grid = mask_grid
    ctx.options = options
    ctx.set_materialize_grads(False)


# The forward op's inputs by name, in the order its schema declares them: gradients and
# ``needs_input_grad`` are matched to inputs by name, never by a position written here.
_OP_INPUTS = tuple(argument.name for argument in torch.ops.fusedattn.attention_forward.default._schema.arguments)
# What the eager Function takes (``_EagerAttention.forward``): the inputs that can have a gradient.
_EAGER_INPUTS = ("q", "k", "v", "sinks", "bias")


def _backward_with(backward_fn, ctx, dout, dlse, sinks_grad: bool, bias_grad: bool):
    """(dq, dk, dv, dsinks, dbias) -- ``_EAGER_INPUTS`` order -- of a call saved by ``_setup_context``;
    dsinks / dbias None unless asked."""
    q, k, v, out, lse, sinks, mask, mask_states, bias, alibi, dropout_seed = ctx.saved_tensors
    if dout is None:  # only lse was used
        dout = torch.zeros_like(out)
    dout = _unit_stride_head_dim(dout)  # e.g. the expanded ones of out.sum() have stride 0
    if dlse is not None:
        dlse = dlse.float().contiguous()
    bias_grad = bias is not None and bias_grad
    sinks_grad = sinks is not None and sinks_grad
    dq, dk, dv, dbias, dsinks = backward_fn(dout, dlse, q, k, v, out, lse, sinks, sinks_grad, mask, mask_states,
                                            ctx.mask_grid, bias, bias_grad, alibi, dropout_seed, *ctx.options)
    return dq, dk, dv, dsinks.to(sinks.dtype) if sinks_grad else None, dbias if bias_grad else None


def _backward(ctx, dout, dlse):
    needs = dict(zip(_OP_INPUTS, ctx.needs_input_grad))
    grads = dict(zip(_EAGER_INPUTS, _backward_with(_backward_op, ctx, dout, dlse, needs["sinks"], needs["bias"])))
    # None for the mask, its tiles, the ALiBi slopes (constants: no gradient), the seed and the options
    return tuple(grads.get(name) for name in _OP_INPUTS)


_forward_op.register_autograd(_backward, setup_context=_setup_context)


class _EagerAttention(torch.autograd.Function):
    """Eager mode: the two ops' implementations under a plain autograd.Function. Through the
    custom ops' dispatch a forward+backward step measured markedly more host time than this way,
    and at S=1k a layer's GPU work is no longer than its host time. Only the inputs that
    can take a gradient are the Function's inputs; the rest travel as one Python value (``rest``):
    the engine handles every input and gradient slot on each step. torch.compile
    traces the custom ops instead (``attention``); both run the same code (``_forward_impl``,
    ``_backward_impl``)."""

    @staticmethod
    def forward(ctx, q, k, v, sinks, bias, rest):
        mask, mask_states, mask_grid, alibi, dropout_seed, *options = rest
        out, lse = _forward_impl(q, k, v, sinks, mask, mask_states, mask_grid, bias, alibi, dropout_seed, *options)
        _setup_context(ctx, (q, k, v, sinks, mask, mask_states, mask_grid, bias, alibi, dropout_seed, *options),
                       (out, lse))
        return out, lse

    @staticmethod
    def backward(ctx, dout, dlse):
        needs = dict(zip(_EAGER_INPUTS, ctx.needs_input_grad))
        if torch.is_grad_enabled():  # create_graph=True: the gradients must be differentiable themselves
            grads = _differentiable_backward(ctx, dout, dlse, tuple(needs.values()))
        else:
            grads = _backward_with(_backward_impl, ctx, dout, dlse, needs["sinks"], needs["bias"])
        return (*grads, None)  # in _EAGER_INPUTS order, then none for ``rest``


def _differentiable_backward(ctx, dout, dlse, needs: tuple) -> tuple:
    """(dq, dk, dv, dsinks, dbias) as differentiable functions of the inputs and of (dout, dlse), for
    a backward run with ``create_graph=True`` (a gradient penalty, a Hessian-vector product). Neither
    backend's backward is differentiable (the kernels are opaque to autograd; the PyTorch path's may
    hand blocks to fused CPU kernels), so the forward is recomputed through ``cpu.chunked_forward``,
    whose plain torch ops autograd differentiates to any order -- on every device, so CPU and GPU
    agree. Costs what autograd through plain attention costs: every chunk's probabilities are kept."""
    q, k, v, _, _, sinks, mask, mask_states, bias, alibi, dropout_seed = ctx.saved_tensors
    layout = ctx.options[0]
    spec = _spec(*ctx.options[:6], alibi is not None, *ctx.options[6:8])
    block_mask = _block_mask(mask, mask_states, ctx.mask_grid, q, k, layout)
    with torch.enable_grad():
        out, lse = cpu.chunked_forward(q, k, v, spec, sinks, block_mask, bias, alibi=alibi, dropout_seed=dropout_seed)
    return differentiable_grads((out, lse), (dout, dlse), (q, k, v, sinks, bias), needs)


def differentiable_grads(outputs: tuple, cotangents: tuple, inputs: tuple, needs: tuple) -> tuple:
    """The gradients of ``inputs`` (None where ``needs`` is False) from ``outputs`` recomputed under
    autograd and their ``cotangents`` (None: not used), themselves differentiable (create_graph)."""
    pairs = [(o, g) for o, g in zip(outputs, cotangents) if g is not None]
    wanted = [t for t, need in zip(inputs, needs) if need]
    if not pairs or not wanted:
        return tuple(None for _ in needs)
    grads = iter(torch.autograd.grad([o for o, _ in pairs], wanted, [g for _, g in pairs], create_graph=True,
                                     allow_unused=True))
    return tuple(next(grads) if need else None for need in needs)


# ----------------------------------------------------------------------------- public API


def _checked_call(q, k, v, layout, causal, window, scale, softcap, bias, mask, sinks, deterministic, return_lse,
                  alibi_slopes=None, chunk=None, dropout_p=0.0):
    """``attention``'s arguments checked and resolved (``explain`` takes the same): (q, k, v with a
    unit-stride head dim, the mask as a BlockMask, the bias, the frozen AttentionSpec, the ALiBi
    slopes as a contiguous float32 (B, Hq) tensor or None)."""
    check_options(layout=layout, causal=causal, window=window, scale=scale, softcap=softcap,
                  deterministic=deterministic, return_lse=return_lse)
    shapes = check_qkv(q, k, v, layout)
    check_sinks(sinks, q, shapes.heads_q)
    mask = check_mask(mask, shapes, q)
    bias = check_bias(bias, shapes, q)
    alibi = check_alibi(alibi_slopes, q, shapes)
    check_chunk(chunk)
    dropout_p = check_dropout(dropout_p)
    q, k, v = (_unit_stride_head_dim(t) for t in (q, k, v))
    spec = resolve_spec(q.shape[-1], layout=layout, causal=causal, window=window, scale=scale,
                        softcap=softcap, deterministic=deterministic, alibi=alibi is not None, chunk=chunk,
                        dropout_p=dropout_p)
    return q, k, v, mask, bias, spec, alibi


def attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    layout: str = "bshd",
    causal: bool = False,
    window: tuple[int, int] | None = None,
    scale: float | None = None,
    softcap: float | None = None,
    bias: torch.Tensor | None = None,
    mask: torch.Tensor | BlockMask | None = None,
    sinks: torch.Tensor | None = None,
    alibi_slopes: torch.Tensor | None = None,
    chunk: int | None = None,
    dropout_p: float = 0.0,
    deterministic: bool = False,
    return_lse: bool = False,
):
    """Exact softmax attention, forward and backward (semantics: docs/SEMANTICS.md, "Options").

    q: (B, Sq, Hq, D), k: (B, Sk, Hkv, D), v: (B, Sk, Hkv, Dv) for ``layout="bshd"``;
    (B, H, S, D) for ``layout="bhsd"``. Returns ``out`` in the same layout as q (with
    head dim Dv), and with ``return_lse=True`` also ``lse`` (B, Hq, Sq), float32,
    natural log, -inf for rows that attend to nothing. ``lse`` is differentiable.
    ``mask``: a bool tensor broadcastable to (B, Hq, Sq, Sk), True = attend, or a
    ``fusedattn.BlockMask`` built once for many calls; tiles the mask empties are skipped.
    ``alibi_slopes``: float32 (Hq,) or (B, Hq); adds ``-slope * |i + Sk - Sq - j|`` to the scores
    (FlashAttention 2's ALiBi), computed in the kernels; constants, no gradient.
    ``chunk``: int >= 1, chunked local attention (Llama 4): query i sees key j only if both lie in the
    same chunk of ``chunk`` positions, ``(i + Sk - Sq) // chunk == j // chunk``, combined with every
    other rule by AND; key blocks outside a query block's chunks are skipped.
    ``dropout_p``: attention dropout on the probabilities, p in [0, 1) rounded to a multiple of 1/256,
    the kept ones scaled by the inverse of the kept fraction (docs/SEMANTICS.md 3.11). The call draws
    its seed from torch's generator on q's device (``fusedattn.dropout``: ``torch.manual_seed``
    reproduces the mask, ``dropout.keep_mask`` returns it); the backward regenerates the same mask.
    ``lse`` stays that of the undropped probabilities. Pass 0.0 in evaluation, as with SDPA.
    """
    q, k, v, mask, bias, spec, alibi = _checked_call(q, k, v, layout, causal, window, scale, softcap, bias, mask,
                                                     sinks, deterministic, return_lse, alibi_slopes, chunk, dropout_p)
    mask_args, options = _mask_args(mask), (*spec.op_args(), dispatch.resolve_backend(q.device))
    seed = dropout.draw_seed(q.device) if spec.has_dropout else None
    args = (q, k, v, sinks, *mask_args, bias, alibi, seed, *options)
    if torch.compiler.is_compiling():
        out, lse = _forward_op(*args)
    elif beyond_first_order(q, k, v, sinks, bias):
        out, lse = cpu.chunked_forward(q, k, v, spec, sinks, mask, bias, alibi=alibi, dropout_seed=seed)
    elif torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in (q, k, v, sinks, bias)):
        out, lse = _EagerAttention.apply(q, k, v, sinks, bias, (*mask_args, alibi, seed, *options))
    else:  # nothing to differentiate: no autograd node (its host time is a fifth of an inference call's)
        out, lse = _forward_impl(*args)
    return (out, lse) if return_lse else out


def explain(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    layout: str = "bshd",
    causal: bool = False,
    window: tuple[int, int] | None = None,
    scale: float | None = None,
    softcap: float | None = None,
    bias: torch.Tensor | None = None,
    mask: torch.Tensor | BlockMask | None = None,
    sinks: torch.Tensor | None = None,
    alibi_slopes: torch.Tensor | None = None,
    chunk: int | None = None,
    dropout_p: float = 0.0,
    deterministic: bool = False,
    show: bool = True,
):
    """Print, and return, the plan ``attention`` would run for these arguments: the backend, then
    each pass of the forward and of the backward -- which kernel, with which launch config, and for
    every faster path not taken, why. Runs nothing and checks the arguments as ``attention`` does.
    The backward's bias and sinks gradients are planned where those tensors require a gradient.
    ``show=False`` only returns it (``str()`` of the result is the printed text)."""
    q, k, v, mask, bias, spec, _ = _checked_call(q, k, v, layout, causal, window, scale, softcap, bias, mask, sinks,
                                                 deterministic, False, alibi_slopes, chunk, dropout_p)
    plans = dispatch.explain_plans(q, k, v, spec, None if sinks is None else sinks.detach().float(), mask,
                                   None if bias is None else bias.detach(), dispatch.resolve_backend(q.device),
                                   bias_grad=bias is not None and bias.requires_grad,
                                   sinks_grad=sinks is not None and sinks.requires_grad)
    if show:
        print(plans)
    return plans
