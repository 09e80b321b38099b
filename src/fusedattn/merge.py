"""``merge_attention``: one attention result from partial ones over disjoint key sets.

Attention over keys split into parts (split-KV decoding, a KV cache plus new tokens, ring /
context parallelism) gives one (out_i, lse_i) per part: out_i normalised over its own keys,
lse_i = log of its softmax denominator. The whole is

    lse = log(sum_i exp(lse_i)),    out = sum_i exp(lse_i - lse) * out_i

computed in fp32 (float64 for float64 inputs). A part that saw no key (lse_i = -inf, out_i = 0) weighs 0; a row no
part saw gets out = 0, lse = -inf, and zero gradients (never NaN). Plain PyTorch ops: autograd
gives the gradients of every out_i and lse_i.
"""

from __future__ import annotations

from typing import Sequence

import torch

from .spec import LAYOUTS


def _check(outs, lses, layout: str) -> None:
    name = "fusedattn.merge_attention"
    if not isinstance(layout, str) or layout not in LAYOUTS:
        raise ValueError(f"{name}: `layout` must be one of {LAYOUTS}, got {layout!r}")
    for arg, seq in (("outs", outs), ("lses", lses)):
        if isinstance(seq, torch.Tensor) or not isinstance(seq, Sequence) or not seq:
            raise TypeError(f"{name}: `{arg}` must be a non-empty list or tuple of tensors, got {type(seq).__name__}")
        for i, t in enumerate(seq):
            if not isinstance(t, torch.Tensor):
                raise TypeError(f"{name}: `{arg}[{i}]` must be a torch.Tensor, got {type(t).__name__}")
    if len(outs) != len(lses):
        raise ValueError(f"{name}: got {len(outs)} outputs and {len(lses)} lse tensors; expected one lse per output")
    first = outs[0]
    if first.dim() < 3:
        raise ValueError(f"{name}: `outs[0]` must have at least 3 dims ((..., S, H, D) or (..., H, S, D)), got shape "
                         f"{tuple(first.shape)}")
    expected_lse = _lse_shape(first.shape, layout)
    for i, (o, lse) in enumerate(zip(outs, lses)):
        if o.shape != first.shape or o.dtype != first.dtype or o.device != first.device:
            raise ValueError(f"{name}: `outs[{i}]` is {tuple(o.shape)} {o.dtype} on {o.device}; expected "
                             f"{tuple(first.shape)} {first.dtype} on {first.device} like outs[0]")
        if tuple(lse.shape) != expected_lse or lse.device != first.device:
            raise ValueError(f"{name}: `lses[{i}]` has shape {tuple(lse.shape)} on {lse.device}; expected "
                             f"{expected_lse} on {first.device} for outputs of shape {tuple(first.shape)} "
                             f"(layout={layout!r})")
        if not lse.dtype.is_floating_point:
            raise TypeError(f"{name}: `lses[{i}]` must be a float tensor, got {lse.dtype}")


def _lse_shape(out_shape, layout: str) -> tuple:
    """lse of an output: (..., H, S) for (..., S, H, D) ("bshd", also the packed (total, H, D) of
    varlen_attention, whose lse is (H, total)); (..., H, S) for (..., H, S, D) ("bhsd")."""
    if layout == "bshd":
        return (*out_shape[:-3], out_shape[-2], out_shape[-3])
    return tuple(out_shape[:-1])


def merge_attention(outs: Sequence[torch.Tensor], lses: Sequence[torch.Tensor], *,
                    layout: str = "bshd") -> tuple[torch.Tensor, torch.Tensor]:
    """Combine partial attention results by their lse: returns (out, lse) as attention over the
    union of the parts' keys would (module docstring). ``outs``: tensors of one shape, in the
    layout of ``fusedattn.attention`` (or the packed (total, H, D) of ``varlen_attention``);
    ``lses``: their fp32 lse, (B, H, S) (or (H, total)). ``out`` has the outputs' dtype, ``lse`` is
    fp32 (float64 where the inputs are). Differentiable in every input."""
    _check(outs, lses, layout)
    # fp32 at least; float64 parts (a reference) stay float64.
    compute = torch.promote_types(torch.promote_types(outs[0].dtype, lses[0].dtype), torch.float32)
    lse_parts = torch.stack([lse.to(compute) for lse in lses])  # (parts, ..., H, S)
    # The max is only a shift for exp's range: detached, the gradient is the softmax's alone.
    shift = lse_parts.detach().amax(0)
    shift = torch.where(torch.isfinite(shift), shift, torch.zeros_like(shift))
    exp_parts = torch.exp(lse_parts - shift)
    total = exp_parts.sum(0)
    seen = total > 0
    safe_total = torch.where(seen, total, torch.ones_like(total))  # no log(0) / 0 on the backward either
    lse = torch.where(seen, shift + torch.log(safe_total), torch.full_like(total, float("-inf")))
    weights = exp_parts / safe_total  # (parts, ..., H, S); 0 for a part that saw no key
    if layout == "bshd":
        weights = weights.transpose(-1, -2)  # (parts, ..., S, H) like the outputs' leading dims
    out = (weights.unsqueeze(-1) * torch.stack([o.to(compute) for o in outs])).sum(0)
    return out.to(outs[0].dtype), lse


def merge_into(acc: torch.Tensor, acc_lse: torch.Tensor, out: torch.Tensor | None, lse: torch.Tensor,
               layout: str = "bhsd") -> None:
    """(acc, acc_lse) <- the merge of two results over disjoint keys of the same rows, in place, by
    ``merge_attention``'s rule in float32: weights exp(lse_i - lse) from a finite shift; a part that
    saw no key weighs 0, a row neither saw stays (0, -inf). ``out`` None: a part of output 0 (a
    sink). ``acc``: (B, H, S, D), or (B, S, H, D) with ``layout`` "bshd"; the lse (B, H, S)."""
    shift = torch.maximum(acc_lse, lse)
    shift = torch.where(torch.isfinite(shift), shift, torch.zeros_like(shift))
    mine, theirs = torch.exp(acc_lse - shift), torch.exp(lse - shift)
    total = mine + theirs
    seen = total > 0
    safe_total = torch.where(seen, total, torch.ones_like(total))

    def per_row(weight):
        return (weight if layout == "bhsd" else weight.transpose(-1, -2)).unsqueeze(-1)
    acc.mul_(per_row(mine / safe_total))
    if out is not None:
        acc.add_(out * per_row(theirs / safe_total))
    acc_lse.copy_(torch.where(seen, shift + torch.log(safe_total), torch.full_like(total, float("-inf"))))
