"""Runs one Case through fusedattn and the references, forward and backward."""

from __future__ import annotations

import zlib

import torch

import fusedattn
from fusedattn.reference import reference_attention

from cases import Case
from numerics import assert_close_to_reference


def make_inputs(case: Case, device, seed: int | None = None):
    """Fresh random normal q, k, v, dout, dlse (never zeros), seeded by the case id."""
    gen = torch.Generator().manual_seed(zlib.crc32(case.id.encode()) if seed is None else seed)

    def shape(seqlen, heads, dim):
        return (case.batch, seqlen, heads, dim) if case.layout == "bshd" else (case.batch, heads, seqlen, dim)

    def randn(*size):
        return torch.randn(*size, generator=gen).to(device=device, dtype=case.dtype)

    q = randn(shape(case.seqlen_q, case.heads_q, case.head_dim))
    k = randn(shape(case.seqlen_k, case.heads_kv, case.head_dim))
    v = randn(shape(case.seqlen_k, case.heads_kv, case.dv))
    dout = randn(shape(case.seqlen_q, case.heads_q, case.dv))
    dlse = torch.randn(case.batch, case.heads_q, case.seqlen_q, generator=gen).to(device)
    return q, k, v, dout, dlse


def make_sinks(case: Case, device) -> torch.Tensor | None:
    """(Hq,) float32 sink logits spread around the scores' range (some rows lose most of their
    mass to the sink, some almost none), or None when the case has none."""
    if not case.sinks:
        return None
    gen = torch.Generator().manual_seed(zlib.crc32(case.id.encode()) + 1)
    return (2.0 * torch.randn(case.heads_q, generator=gen) + 1.0).to(device)


def make_mask(case: Case, device) -> torch.Tensor | None:
    """A random boolean mask of the case's shape (about 70% True), with a few rows and keys
    switched off entirely (rows with no key: output 0, lse -inf or the sink)."""
    if case.mask is None:
        return None
    from cases import MASK_SHAPES

    gen = torch.Generator().manual_seed(zlib.crc32(case.id.encode()) + 2)
    shape = MASK_SHAPES[case.mask](case)
    mask = torch.rand(shape, generator=gen) < 0.7
    if shape[-2] > 2:
        mask[..., 1, :] = False  # a query row with no key
    if shape[-1] > 2:
        mask[..., -1] = False  # a key nobody attends
    return mask.to(device)


def forward_backward(fn, q, k, v, dout, dlse, dtype=None, lse_grad=False, sinks=None):
    """(out, lse, dq, dk, dv[, dsinks]) of ``fn(q, k, v[, sinks]) -> (out, lse)``; inputs cast to
    ``dtype`` (the sinks stay float32 unless it is float64)."""
    leaves = [t.detach().to(dtype or t.dtype).requires_grad_() for t in (q, k, v)]
    if sinks is not None:
        leaves.append(sinks.detach().to(torch.float64 if dtype == torch.float64 else sinks.dtype).requires_grad_())
    out, lse = fn(*leaves)
    outputs, grads = [out], [dout.to(out.dtype)]
    if lse_grad:
        outputs.append(lse)
        grads.append(dlse.to(lse.dtype))
    return (out, lse, *torch.autograd.grad(outputs, leaves, grads))


def check_case(case: Case, backend: str, device, inputs=None) -> None:
    q, k, v, dout, dlse = make_inputs(case, device) if inputs is None else inputs
    opts = case.options()

    sinks, mask = make_sinks(case, q.device), make_mask(case, q.device)

    def ours(q_, k_, v_, sinks_=None):
        with fusedattn.use_backend(backend):
            return fusedattn.attention(q_, k_, v_, sinks=sinks_, mask=mask, deterministic=case.deterministic,
                                       return_lse=True, **opts)

    def reference(q_, k_, v_, sinks_=None):
        mask4 = None if mask is None else mask.reshape((1,) * (4 - mask.dim()) + tuple(mask.shape))
        return reference_attention(q_, k_, v_, sinks=sinks_, mask=mask4, return_lse=True, **opts)

    got = forward_backward(ours, q, k, v, dout, dlse, lse_grad=case.lse_grad, sinks=sinks)
    lowp = forward_backward(reference, q, k, v, dout, dlse, lse_grad=case.lse_grad, sinks=sinks)
    ref64 = forward_backward(reference, q, k, v, dout, dlse, dtype=torch.float64, lse_grad=case.lse_grad,
                             sinks=sinks)
    for name, ours_t, lowp_t, ref_t in zip(("out", "lse", "dq", "dk", "dv", "dsinks"), got, lowp, ref64):
        assert_close_to_reference(f"{case.id} {name}", ours_t, lowp_t, ref_t)


def record_launches(monkeypatch, module, name: str) -> list:
    """Wrap ``module.name`` (a launcher that returns None or False when it declines the problem)
    so each call appends whether it ran its kernel; returns that list (tests spy on which kernel ran)."""
    calls = []
    real = getattr(module, name)

    def spy(*args):
        result = real(*args)
        calls.append(result is not None and result is not False)
        return result

    monkeypatch.setattr(module, name, spy)
    return calls
