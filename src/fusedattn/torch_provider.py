"""fusedattn as a provider of torch's flash-attention registry (torch >= 2.10).

torch routes ``F.scaled_dot_product_attention``'s flash backend and
``torch.nn.attention.varlen.varlen_attn`` through five aten ops; a provider overrides their CUDA
kernels (torch's own ``torch/nn/attention/_fa4.py`` does this for FlashAttention 4)::

    import fusedattn.torch_provider
    from torch.nn.attention import activate_flash_attention_impl, restore_flash_attention_impl

    fusedattn.torch_provider.register()          # adds "fusedattn" to list_flash_attention_impls()
    activate_flash_attention_impl("fusedattn")   # the flash ops now run fusedattn's kernels
    ...
    restore_flash_attention_impl()               # torch's own kernels again

Nothing is registered or activated on import: torch's registry asks providers to let the user opt
in. ``register()`` is a no-op returning False on a torch without the registry.

The kernels are those of ``fusedattn.attention`` (dense) and ``fusedattn.varlen_attention``
(ragged: ``cum_seq_q`` / ``cum_seq_k`` given, 3-D (total, H, D) tensors); the backward ops compute
dq, dk, dv from the saved ``out`` and ``logsumexp`` by fusedattn's backward (``dispatch.backward``,
``varlen._backward``) without re-running the forward. The semantics are those of torch's default
kernel (FlashAttention 2, ``aten/src/ATen/native/transformers/cuda/flash_attn/flash_api.cpp``):

- ``is_causal`` is bottom-right aligned when Sq != Sk (query i sees keys j <= i + Sk - Sq), on
  ``_scaled_dot_product_flash_attention`` as on ``_flash_attention_forward``. (SDPA itself never
  sends a causal call with Sq != Sk to the flash backend: its dispatcher refuses that case.)
- ``window_size_left`` / ``window_size_right``: None or negative is unbounded; a size >= Sk
  (varlen: ``max_k``) is unbounded; ``is_causal`` sets the right size to 0; with a left size and an
  unbounded right one, the right size is Sk (what ``set_params_fprop`` does).
- ``scale`` None is 1/sqrt(D).
- ``logsumexp`` is float32, natural log, (B, H, Sq) dense and (H, total_q) ragged; a row that sees
  no key gets out 0 and logsumexp **+inf**, as FlashAttention 2 writes it (fusedattn's own
  functions write -inf there; the backward ops take either).
- The philox seed/offset outputs are zeros (uint64 (2,) and ()), the debug mask empty: no dropout.
- Deterministic gradients where ``torch.use_deterministic_algorithms(True)`` (not warn-only) is on.
- ``num_splits`` (a split-KV hint of newer torch versions) is ignored.

Unsupported arguments raise ``NotImplementedError`` (a ``RuntimeError``, as FA4's provider raises
for what it does not support; there is no fallback to torch's kernel while a provider is active):
``dropout_p > 0``, ``return_debug_mask``, ``alibi_slopes``, ``seqused_k``, ``block_table``, and
any keyword a newer torch adds that this module does not know. fp32 inputs, which torch's kernel
refuses, are computed (fusedattn takes fp16, bf16 and fp32).
"""

from __future__ import annotations

import math

import torch

from . import dispatch, interface
from . import varlen as _varlen
from .spec import AttentionSpec

PROVIDER = "fusedattn"

# The aten ops a provider overrides, and this module's implementation of each (by name, below).
_IMPLS = {
    "_flash_attention_forward": "flash_attention_forward",
    "_flash_attention_forward_no_dropout_inplace": "flash_attention_forward_no_dropout_inplace",
    "_flash_attention_backward": "flash_attention_backward",
    "_scaled_dot_product_flash_attention": "scaled_dot_product_flash_attention",
    "_scaled_dot_product_flash_attention_backward": "scaled_dot_product_flash_attention_backward",
}

_NAME = "fusedattn (torch flash-attention provider)"


# ----------------------------------------------------------------------------- registration


def register() -> bool:
    """Register "fusedattn" with torch's flash-attention registry; True where torch has one.
    Does not activate it (``torch.nn.attention.activate_flash_attention_impl("fusedattn")`` does).
    Calling it again is harmless (the registry keeps one entry per name)."""
    import torch.nn.attention as attention_api

    register_impl = getattr(attention_api, "register_flash_attention_impl", None)
    if register_impl is None:
        return False
    register_impl(PROVIDER, register_fn=_activate)
    return True


class _Handle:
    """What the registry keeps while "fusedattn" is active; ``remove()`` (called by
    ``restore_flash_attention_impl``) drops the kernels, giving the ops back to torch's own."""

    def __init__(self, library):
        self.library = library

    def remove(self) -> None:
        library, self.library = self.library, None
        if library is not None and hasattr(library, "_destroy"):
            library._destroy()


def _activate() -> _Handle:
    """The registry's ``register_fn``: fusedattn's kernels for the ops on the CUDA dispatch key."""
    return _Handle(_register_kernels("CUDA"))


def _register_kernels(dispatch_key: str = "CUDA") -> torch.library.Library:
    """A Library holding this module's implementation of each flash op the installed torch has, for
    ``dispatch_key`` (the tests also register them for "CPU", where torch has no flash kernel, to
    run the whole dispatcher and autograd path without a GPU). Destroy it (or drop it) to undo."""
    library = torch.library.Library("aten", "IMPL", dispatch_key)
    for op_name, impl_name in _IMPLS.items():
        if hasattr(torch.ops.aten, op_name):  # e.g. the in-place forward is newer than the registry
            library.impl(op_name, globals()[impl_name], dispatch_key)
    return library


# ----------------------------------------------------------------------------- argument handling


def _refuse(dropout_p=0.0, return_debug_mask=False, alibi_slopes=None, seqused_k=None, block_table=None,
            unknown=None) -> None:
    """NotImplementedError for what this provider does not take (as torch's FA4 provider does not)."""
    if dropout_p:
        # fusedattn's dropout draws and keeps its own seed; this op's philox outputs are not it
        raise NotImplementedError(f"{_NAME}: dropout_p > 0 is not taken by this provider (got {dropout_p}); "
                                  "fusedattn.attention and fusedattn.sdpa take dropout_p, and "
                                  "restore_flash_attention_impl() gives torch's kernel back")
    if return_debug_mask:
        raise NotImplementedError(f"{_NAME}: return_debug_mask=True is not supported (no dropout mask exists)")
    for name, value in (("alibi_slopes", alibi_slopes), ("seqused_k", seqused_k), ("block_table", block_table)):
        if value is not None:
            raise NotImplementedError(f"{_NAME}: `{name}` is not taken by this provider")
    for name, value in (unknown or {}).items():
        if value is not None:
            raise NotImplementedError(f"{_NAME}: argument `{name}` (of a newer torch) is not supported")


def _window(is_causal: bool, left, right, seqlen_k: int) -> tuple[int, int]:
    """FlashAttention 2's window rule (mha_fwd / mha_bwd, then set_params_fprop) as fusedattn's
    (left, right), -1 unbounded, both around the bottom-right diagonal."""
    left = -1 if left is None or left < 0 else int(left)
    right = -1 if right is None or right < 0 else int(right)
    if left >= seqlen_k:
        left = -1
    if right >= seqlen_k:
        right = -1
    if is_causal:
        right = 0
    if left >= 0 and right < 0:
        right = seqlen_k
    return left, right


def _options(query, is_causal, window_size_left, window_size_right, seqlen_k, scale) -> dict:
    left, right = _window(bool(is_causal), window_size_left, window_size_right, int(seqlen_k))
    return dict(window=None if (left, right) == (-1, -1) else (left, right),
                scale=float(scale) if scale is not None else 1.0 / math.sqrt(query.shape[-1]),
                deterministic=_deterministic())


def _deterministic() -> bool:
    """torch's flash kernels' rule: deterministic where deterministic algorithms are on, not warn-only."""
    return torch.are_deterministic_algorithms_enabled() and not torch.is_deterministic_algorithms_warn_only_enabled()


def _torch_lse(lse: torch.Tensor) -> torch.Tensor:
    """fusedattn's lse in FlashAttention 2's convention: +inf on a row that sees no key."""
    lse = lse.contiguous()
    return lse.masked_fill_(lse == -math.inf, math.inf)


def _fusedattn_lse(logsumexp: torch.Tensor) -> torch.Tensor:
    """A logsumexp from the ops (+inf, or -inf, on a row that sees no key) in fusedattn's convention."""
    lse = logsumexp.float().contiguous()
    return lse.masked_fill(lse == math.inf, -math.inf)


def _unit_stride(*tensors):
    return tuple(interface._unit_stride_head_dim(t) for t in tensors)


def _strided_like(reference: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
    """``t`` in the strides torch's meta kernels give (``empty_like(reference)``), copied only where
    they differ (inductor checks an extern kernel's output strides against its meta)."""
    if t.shape != reference.shape:
        return t
    want = torch.empty_like(reference, device="meta").stride()
    if t.stride() == want:
        return t
    return torch.empty_like(reference).copy_(t)


def _aux(query: torch.Tensor):
    """The rng_state, unused and debug_attn_mask outputs of a call without dropout."""
    return (torch.zeros((2,), dtype=torch.uint64, device=query.device),
            torch.zeros((), dtype=torch.uint64, device=query.device),
            torch.empty(0, dtype=query.dtype, device=query.device))


def _dense_forward(q, k, v, layout: str, options: dict):
    """(out in ``layout``, fusedattn lse (B, H, Sq)) by ``fusedattn.attention``."""
    with torch.no_grad():  # below autograd: the aten op's own derivative formula takes the gradient
        return interface.attention(q, k, v, layout=layout, return_lse=True, **options)


def _varlen_forward(q, k, v, cum_seq_q, cum_seq_k, max_q, max_k, options: dict):
    if cum_seq_k is None:
        raise ValueError(f"{_NAME}: `cum_seq_k` is required with `cum_seq_q` (ragged inputs)")
    with torch.no_grad():
        return _varlen.varlen_attention(q, k, v, cum_seq_q, cum_seq_k, int(max_q), int(max_k), return_lse=True,
                                        **options)


def _check_rank(query, ragged: bool) -> None:
    rank = 3 if ragged else 4
    if query.dim() != rank:
        raise ValueError(f"{_NAME}: {'ragged' if ragged else 'dense'} query must be {rank}-D, got shape "
                         f"{tuple(query.shape)}")


def _dense_backward(grad_out, query, key, value, out, logsumexp, layout: str, options: dict):
    """(dq, dk, dv) in their inputs' layout, from the saved out and logsumexp (no forward re-run)."""
    window = options["window"] or (-1, -1)
    spec = AttentionSpec(layout, window[0], window[1], options["scale"], 0.0, options["deterministic"])
    q, k, v, out, dout = _unit_stride(query, key, value, out, grad_out)
    with torch.no_grad():
        dq, dk, dv, _, _ = dispatch.backward(dout, None, q, k, v, out, _fusedattn_lse(logsumexp), spec, None, False,
                                             None, None, False, dispatch.resolve_backend(q.device))
    return dq, dk, dv


# ----------------------------------------------------------------------------- the ops


def flash_attention_forward(query, key, value, cum_seq_q, cum_seq_k, max_q, max_k, dropout_p, is_causal,
                            return_debug_mask, *, scale=None, window_size_left=None, window_size_right=None,
                            seqused_k=None, alibi_slopes=None, block_table=None, num_splits=None, out=None,
                            **unknown):
    """``aten::_flash_attention_forward``: dense (B, S, H, D) tensors, or ragged (total, H, D) ones with
    ``cum_seq_q`` / ``cum_seq_k``. Returns (output, logsumexp, rng_state, unused, debug_attn_mask).
    ``out``: write the output there (the in-place op's form; not in the op's schema)."""
    _refuse(dropout_p, return_debug_mask, alibi_slopes, seqused_k, block_table, unknown)
    ragged = cum_seq_q is not None
    _check_rank(query, ragged)
    options = _options(query, is_causal, window_size_left, window_size_right, max_k if ragged else key.shape[1],
                       scale)
    if ragged:
        result, lse = _varlen_forward(query, key, value, cum_seq_q, cum_seq_k, max_q, max_k, options)
    else:
        result, lse = _dense_forward(query, key, value, "bshd", options)
    if out is not None:
        result = out.copy_(result)
    else:
        result = _strided_like(query, result)
    return (result, _torch_lse(lse), *_aux(query))


def flash_attention_forward_no_dropout_inplace(out, query, key, value, cum_seq_q, cum_seq_k, max_q, max_k,
                                               dropout_p, is_causal, return_debug_mask, **kwargs):
    """``aten::_flash_attention_forward_no_dropout_inplace``: the output into ``out``; returns logsumexp."""
    return flash_attention_forward(query, key, value, cum_seq_q, cum_seq_k, max_q, max_k, dropout_p, is_causal,
                                   return_debug_mask, out=out, **kwargs)[1]


def flash_attention_backward(grad_out, query, key, value, out, logsumexp, cum_seq_q, cum_seq_k, max_q, max_k,
                             dropout_p, is_causal, rng_state=None, unused=None, *, scale=None,
                             window_size_left=None, window_size_right=None, **unknown):
    """``aten::_flash_attention_backward``: (dq, dk, dv) of ``flash_attention_forward``."""
    _refuse(dropout_p, unknown=unknown)
    ragged = cum_seq_q is not None
    _check_rank(query, ragged)
    options = _options(query, is_causal, window_size_left, window_size_right, max_k if ragged else key.shape[1],
                       scale)
    if not ragged:
        grads = _dense_backward(grad_out, query, key, value, out, logsumexp, "bshd", options)
    else:
        if cum_seq_k is None:
            raise ValueError(f"{_NAME}: `cum_seq_k` is required with `cum_seq_q` (ragged inputs)")
        window = options["window"] or (-1, -1)
        spec = AttentionSpec("bshd", window[0], window[1], options["scale"], 0.0, options["deterministic"])
        q, k, v, o, dout = _unit_stride(query, key, value, out, grad_out)
        with torch.no_grad():
            packing = _varlen.check_packing(cum_seq_q, cum_seq_k, int(max_q), int(max_k), q, k)
            grads = _varlen._backward(dout, None, q, k, v, o, _fusedattn_lse(logsumexp), None, False, packing,
                                      spec, dispatch.resolve_backend(q.device))[:3]
    return tuple(_strided_like(x, g) for x, g in zip((query, key, value), grads))


def scaled_dot_product_flash_attention(query, key, value, dropout_p=0.0, is_causal=False, return_debug_mask=False,
                                       *, scale=None, **unknown):
    """``aten::_scaled_dot_product_flash_attention``: (B, H, S, D) tensors. Returns (output, logsumexp,
    cum_seq_q, cum_seq_k, max_q, max_k, rng_state, unused, debug_attn_mask); the cumulative
    lengths are None, as torch's kernel returns them."""
    _refuse(dropout_p, return_debug_mask, unknown=unknown)
    _check_rank(query, False)
    seqlen_q, seqlen_k = query.shape[2], key.shape[2]
    options = _options(query, is_causal, None, None, seqlen_k, scale)
    # Compute in the layout of query's memory, so that the output has the strides torch gives it
    # (empty_like(query)) without a copy: a (B, S, H, D) buffer seen as (B, H, S, D) is common.
    want = torch.empty_like(query, device="meta").stride()
    if want[1] < want[2]:
        result, lse = _dense_forward(*(t.transpose(1, 2) for t in (query, key, value)), "bshd", options)
        result = result.transpose(1, 2)
    else:
        result, lse = _dense_forward(query, key, value, "bhsd", options)
    return (_strided_like(query, result), _torch_lse(lse), None, None, seqlen_q, seqlen_k, *_aux(query))


def scaled_dot_product_flash_attention_backward(grad_out, query, key, value, out, logsumexp, cum_seq_q, cum_seq_k,
                                                max_q, max_k, dropout_p, is_causal, philox_seed=None,
                                                philox_offset=None, *, scale=None, **unknown):
    """``aten::_scaled_dot_product_flash_attention_backward``: (dq, dk, dv), (B, H, S, D)."""
    _refuse(dropout_p, unknown=unknown)
    _check_rank(query, False)
    options = _options(query, is_causal, None, None, key.shape[2], scale)
    grads = _dense_backward(grad_out, query, key, value, out, logsumexp, "bhsd", options)
    return tuple(_strided_like(x, g) for x, g in zip((query, key, value), grads))
