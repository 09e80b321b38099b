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


def make_mask(case: Case, device) -> torch.Tensor | fusedattn.BlockMask | None:
    """A random boolean mask of the case's shape (about 70% True), with a few rows and keys
    switched off entirely (rows with no key: output 0, lse -inf or the sink). With
    ``mask_cells``: cells of that size dropped, kept or random (a third each), so tiles of every
    state occur (``mask_cells_partial=False``: dropped or kept, half each). With ``mask_blocks``:
    a BlockMask of whole blocks, 60% of them kept."""
    if case.mask is None:
        return None
    from cases import BROADCAST_SHAPES

    gen = torch.Generator().manual_seed(zlib.crc32(case.id.encode()) + 2)
    shape = BROADCAST_SHAPES[case.mask](case)
    if case.mask_blocks:
        block_q, block_k = case.mask_blocks
        blocks = (*shape[:-2], -(-shape[-2] // block_q), -(-shape[-1] // block_k))
        keep = torch.rand(blocks, generator=gen) < 0.6
        return fusedattn.BlockMask.from_blocks(keep.to(device), case.mask_blocks, case.seqlen_q, case.seqlen_k)
    mask = torch.rand(shape, generator=gen) < 0.7
    if case.mask_cells:
        cell = case.mask_cells
        cell_shape = (*shape[:-2], *(-(-n // cell) if n > 1 else 1 for n in shape[-2:]))
        states = torch.randint(0, 3 if case.mask_cells_partial else 2, cell_shape, generator=gen)
        for dim in (-2, -1):
            if shape[dim] > 1:
                states = states.repeat_interleave(cell, dim=dim).narrow(dim, 0, shape[dim])
        return torch.where(states == 0, False, torch.where(states == 1, True, mask)).to(device)
    if shape[-2] > 2:
        mask[..., 1, :] = False  # a query row with no key
    if shape[-1] > 2:
        mask[..., -1] = False  # a key nobody attends
    return mask.to(device)


def dense_mask(mask) -> torch.Tensor | None:
    """A mask as the reference takes it: a 4-D bool tensor (a BlockMask expanded)."""
    if mask is None:
        return None
    if isinstance(mask, fusedattn.BlockMask):
        return mask.to_dense()
    return mask.reshape((1,) * (4 - mask.dim()) + tuple(mask.shape))


def make_bias(case: Case, device) -> torch.Tensor | None:
    """A random bias of the case's shape and dtype, scaled like the scores, with a few -inf
    entries (masked like mask=False) and, where it has more than two query rows, one row that is
    -inf throughout (a row with no key: output 0, lse -inf or the sink)."""
    if case.bias is None:
        return None
    from cases import BROADCAST_SHAPES

    gen = torch.Generator().manual_seed(zlib.crc32(case.id.encode()) + 3)
    bias = 2.0 * torch.randn(BROADCAST_SHAPES[case.bias](case), generator=gen)
    bias.view(-1)[::11] = float("-inf")
    if bias.shape[-2] > 2:
        bias[..., 2, :] = float("-inf")
    return bias.to(device=device, dtype=case.bias_dtype or case.dtype)


def make_alibi(case: Case, device) -> torch.Tensor | None:
    """float32 ALiBi slopes, (Hq,) or (B, Hq) as the case says, between 0.02 and 0.52 (strong enough
    that a wrong sign or alignment moves every output), or None."""
    if case.alibi is None:
        return None
    gen = torch.Generator().manual_seed(zlib.crc32(case.id.encode()) + 4)
    shape = (case.heads_q,) if case.alibi == "heads" else (case.batch, case.heads_q)
    return (0.02 + 0.5 * torch.rand(shape, generator=gen)).to(device)


def forward_backward(fn, q, k, v, dout, dlse, dtype=None, lse_grad=False, sinks=None, bias=None, bias_grad=True):
    """(out, lse, dq, dk, dv[, dsinks][, dbias]) of ``fn(q, k, v, sinks_=..., bias_=...) -> (out, lse)``
    (the keywords only when given); q/k/v cast to ``dtype``, the sinks and bias only to float64.
    ``bias_grad`` False: the bias is a constant (no dbias)."""
    leaves = [t.detach().to(dtype or t.dtype).requires_grad_() for t in (q, k, v)]
    named = {}
    for name, extra in (("sinks_", sinks), ("bias_", bias)):
        if extra is not None:
            named[name] = extra.detach().to(torch.float64 if dtype == torch.float64 else extra.dtype)
            if name == "sinks_" or bias_grad:
                leaves.append(named[name].requires_grad_())
    out, lse = fn(*leaves[:3], **named)
    outputs, grads = [out], [dout.to(out.dtype)]
    if lse_grad:
        outputs.append(lse)
        grads.append(dlse.to(lse.dtype))
    return (out, lse, *torch.autograd.grad(outputs, leaves, grads))


def check_case(case: Case, backend: str, device, inputs=None) -> None:
    q, k, v, dout, dlse = make_inputs(case, device) if inputs is None else inputs
    opts = case.options()

    sinks, mask, bias = make_sinks(case, q.device), make_mask(case, q.device), make_bias(case, q.device)
    alibi = make_alibi(case, q.device)
    if alibi is not None:
        opts["alibi_slopes"] = alibi

    ref_opts = dict(opts)
    if case.dropout:  # the call's own mask: its seed drawn again from the same generator state
        rng_seed = zlib.crc32(case.id.encode()) + 5
        opts["dropout_p"] = case.dropout
        torch.manual_seed(rng_seed)
        keep = fusedattn.dropout.keep_mask(fusedattn.dropout.draw_seed(q.device), case.batch, case.heads_q,
                                           case.seqlen_q, case.seqlen_k, case.dropout, q.device)
        ref_opts.update(dropout_keep=keep, dropout_p=case.dropout)

    def ours(q_, k_, v_, sinks_=None, bias_=None):
        with fusedattn.use_backend(backend):
            if case.dropout:
                torch.manual_seed(rng_seed)
            return fusedattn.attention(q_, k_, v_, sinks=sinks_, mask=mask, bias=bias_,
                                       deterministic=case.deterministic, return_lse=True, **opts)

    def as_4d(t):
        return None if t is None else t.reshape((1,) * (4 - t.dim()) + tuple(t.shape))

    def reference(q_, k_, v_, sinks_=None, bias_=None):
        return reference_attention(q_, k_, v_, sinks=sinks_, mask=dense_mask(mask), bias=as_4d(bias_), return_lse=True,
                                   **ref_opts)

    extras = dict(lse_grad=case.lse_grad, sinks=sinks, bias=bias, bias_grad=case.bias_trainable)
    got = forward_backward(ours, q, k, v, dout, dlse, **extras)
    lowp = forward_backward(reference, q, k, v, dout, dlse, **extras)
    ref64 = forward_backward(reference, q, k, v, dout, dlse, dtype=torch.float64, **extras)
    names = (["out", "lse", "dq", "dk", "dv"] + ["dsinks"] * (sinks is not None)
             + ["dbias"] * (bias is not None and case.bias_trainable))
    assert len(names) == len(got) == len(ref64)
    for name, ours_t, lowp_t, ref_t in zip(names, got, lowp, ref64):
        assert_close_to_reference(f"{case.id} {name}", ours_t, lowp_t, ref_t)


def launcher_constexprs(monkeypatch, kernel, pick) -> list:
    """``pick(constexprs)`` of every launch of ``kernel`` made through a per-problem
    ``launch.Launcher`` (the Gluon kernels, the backward's pre-pass), in order."""
    from fusedattn.kernels.shared.launch import Launcher

    seen, real_call = [], Launcher.__call__

    def spy(self, *values, **kwargs):
        if self.kernel is kernel:
            seen.append(pick(self.options))
        return real_call(self, *values, **kwargs)

    monkeypatch.setattr(Launcher, "__call__", spy)
    return seen


def record_launches(monkeypatch, module, name: str) -> list:
    """Wrap ``module.name`` (a launcher that returns None or False when it declines the problem)
    so each call appends whether it ran its kernel; returns that list (tests spy on which kernel ran)."""
    calls = []
    real = getattr(module, name)

    def spy(*args, **kwargs):
        result = real(*args, **kwargs)
        calls.append(result is not None and result is not False)
        return result

    monkeypatch.setattr(module, name, spy)
    return calls


def set_knobs(monkeypatch, **changes) -> None:
    """Set experiment switches (``kernels.shared.knobs.Knobs`` fields) for the rest of the test."""
    from dataclasses import replace

    from fusedattn.kernels.shared import knobs

    monkeypatch.setattr(knobs, "_current", replace(knobs.knobs(), **changes))


def capture_graph(step):
    """(graph, outputs) of ``step`` captured in a CUDA graph after two warm-up runs on a side stream
    (compiles, and the caching allocator's pools, outside the capture)."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(2):
            step()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = step()
    return graph, captured
