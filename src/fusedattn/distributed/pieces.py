"""Attention between this rank's queries and one block of keys, as calls of the single-device kernels.

The queries and the keys are runs of global positions (``plan.ShardPlan``). A query sees a key of
its own sequence (document), of its own chunk of it with ``chunk``, inside the window
``[q - left, q + right]`` of global positions (causal: right = 0). ``pieces`` cuts a (query runs, key
runs) pair into kernel calls over contiguous sub-ranges, each with the window that puts the kernel's
bottom-right diagonal where the global one is: for rows [qa, qb) against keys [ka, kb), the kernel's
offset of key ka + j from row qa + i's diagonal is (k - q) - (kb - qb) in global positions, so the
global window (left, right) is the kernel's (left + (kb - qb), right - (kb - qb)). The ranges are
first clipped to the rows that see a key and the keys some row sees, which keeps both bounds >= 0.

Forward: each call's (out, lse), merged into fp32 accumulators by lse. Backward: each call's
gradients from the merged (out, lse) -- P = exp(S - lse) with the whole row's lse, delta from the
whole output -- summed in fp32, in a fixed order.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass, replace

import torch

from .. import dispatch
from ..spec import UNBOUNDED, AttentionSpec


@dataclass(frozen=True)
class Piece:
    """One kernel call: local rows [q_off, + q_len) against local keys [k_off, + k_len) of the
    block, with the kernel's window (left, right) (UNBOUNDED: none)."""

    q_off: int
    q_len: int
    k_off: int
    k_len: int
    left: int
    right: int


def located_runs(runs) -> list:
    """(global start, length, local offset) of each run."""
    out, offset = [], 0
    for start, length in runs:
        out.append((start, length, offset))
        offset += length
    return out


def segment_parts(documents, chunk: int, lo: int, hi: int):
    """The parts of [lo, hi) inside one document (and one chunk of it), as (start, end)."""
    starts = [s for s, _ in documents]
    i = max(bisect.bisect_right(starts, lo) - 1, 0)
    while i < len(documents) and documents[i][0] < hi:
        ds, de = documents[i]
        a, b = max(lo, ds), min(hi, de)
        if a < b:
            if chunk:
                c = ds + (a - ds) // chunk * chunk
                while c < b:
                    yield max(a, c), min(b, c + chunk)
                    c += chunk
            else:
                yield a, b
        i += 1


def pieces(q_runs, k_runs, documents, left: int, right: int, chunk: int = 0) -> list:
    """The kernel calls of this rank's queries (runs of global positions) against a block of keys.
    ``left`` / ``right``: the global window (UNBOUNDED: none; causal is right = 0)."""
    out = []
    for qs, ql, qo in located_runs(q_runs):
        for seg_a, seg_b in segment_parts(documents, chunk, qs, qs + ql):
            ea, eb = segment_extent(documents, chunk, seg_a)
            for ks, kl, ko in located_runs(k_runs):
                clipped = _clipped(seg_a, seg_b, max(ks, ea), min(ks + kl, eb), left, right)
                if clipped is not None:
                    qa, qb, ka, kb, k_left, k_right = clipped
                    out.append(Piece(qo + qa - qs, qb - qa, ko + ka - ks, kb - ka, k_left, k_right))
    return out


def segment_extent(documents, chunk: int, position: int) -> tuple:
    """The segment (document, or chunk of it) that holds ``position``."""
    ds, de = documents[bisect.bisect_right([s for s, _ in documents], position) - 1]
    if not chunk:
        return ds, de
    start = ds + (position - ds) // chunk * chunk
    return start, min(de, start + chunk)


def _clipped(qa: int, qb: int, ka: int, kb: int, left: int, right: int):
    """Rows [qa, qb) and keys [ka, kb) of one segment clipped to the rows that see a key and the
    keys some row sees; with the kernel's window. None: no pair is kept."""
    if ka >= kb:
        return None
    if right != UNBOUNDED:
        qa = max(qa, ka - right)
    if left != UNBOUNDED:
        qb = min(qb, kb + left)
    if qa >= qb:
        return None
    if right != UNBOUNDED:
        kb = min(kb, qb + right)
    if left != UNBOUNDED:
        ka = max(ka, qa - left)
    if ka >= kb:
        return None
    shift = kb - qb  # the kernel's diagonal minus the global one
    lq, lk = qb - qa, kb - ka
    k_left = UNBOUNDED if left == UNBOUNDED else left + shift
    k_right = UNBOUNDED if right == UNBOUNDED else right - shift
    # bounds no pair reaches are no bounds: the kernels' unmasked walks (causal where right is 0)
    if k_right != UNBOUNDED and k_right >= lq - 1:
        k_right = UNBOUNDED
    if k_left != UNBOUNDED and k_left >= lk - 1:
        k_left = UNBOUNDED
    return qa, qb, ka, kb, k_left, k_right


def _rows(t: torch.Tensor, off: int, length: int) -> torch.Tensor:
    return t.narrow(1, off, length).contiguous()


def _call(q, k, v, p: Piece, spec: AttentionSpec, backend: str):
    call_spec = replace(spec, window_left=p.left, window_right=p.right)
    return dispatch.forward(_rows(q, p.q_off, p.q_len), _rows(k, p.k_off, p.k_len), _rows(v, p.k_off, p.k_len),
                            call_spec, None, None, None, backend)


def disjoint(ranges) -> bool:
    """Whether the (offset, length) ranges overlap nowhere."""
    ordered = sorted(ranges)
    return all(a_off + a_len <= b_off for (a_off, a_len), (b_off, _) in zip(ordered, ordered[1:]))


def forward_direct(q, k, v, block_pieces, spec: AttentionSpec, backend: str):
    """(out in q's dtype, lse fp32) where no row is in two calls: each call's result is its rows'
    whole result, written in place (rows no call has: out 0, lse -inf). No fp32 accumulator."""
    batch, seqlen, heads_q, _ = q.shape
    out = q.new_zeros((batch, seqlen, heads_q, v.shape[-1]))
    lse = torch.full((batch, heads_q, seqlen), float("-inf"), dtype=torch.float32, device=q.device)
    for p in block_pieces:
        o, l = _call(q, k, v, p, spec, backend)
        out[:, p.q_off:p.q_off + p.q_len] = o
        lse[:, :, p.q_off:p.q_off + p.q_len] = l
    return out, lse


def diagonal_tiling(block_pieces, seqlen: int) -> list | None:
    """The segment offsets where the calls are the diagonal blocks of a self-attention that tile
    [0, seqlen) with the global window unshifted (Ulysses over documents or chunks): one packed
    (varlen) call then does them all. None otherwise."""
    if len(block_pieces) < 2:
        return None
    offsets = [0]
    for p in sorted(block_pieces, key=lambda p: p.q_off):
        if p.q_off != offsets[-1] or p.k_off != p.q_off or p.k_len != p.q_len:
            return None
        offsets.append(p.q_off + p.q_len)
    return offsets if offsets[-1] == seqlen else None


def _packing(offsets: list, batch: int, seqlen: int, q, k):
    from ..varlen import check_packing

    cu = torch.tensor([b * seqlen + o for b in range(batch) for o in offsets[:-1]] + [batch * seqlen],
                      dtype=torch.int32)
    longest = max(b - a for a, b in zip(offsets, offsets[1:]))
    return check_packing(cu, cu, longest, longest, q, k)


def _flat(t: torch.Tensor) -> torch.Tensor:
    return t.reshape(t.shape[0] * t.shape[1], *t.shape[2:])


def forward_tiled(q, k, v, offsets: list, spec: AttentionSpec, backend: str):
    """(out, lse) of ``diagonal_tiling``'s calls as one packed call over every batch row's segments."""
    from ..varlen import _forward

    batch, seqlen = q.shape[:2]
    qf, kf, vf = _flat(q), _flat(k), _flat(v)
    out, lse = _forward(qf, kf, vf, None, _packing(offsets, batch, seqlen, qf, kf), spec, backend, True)
    return out.view(batch, seqlen, *out.shape[1:]), \
        lse.view(lse.shape[0], batch, seqlen).transpose(0, 1).contiguous()


def backward_tiled(dout, dlse, q, k, v, out, lse, offsets: list, spec: AttentionSpec, backend: str):
    """(dq, dk, dv) of ``forward_tiled``, from the rows' ``out`` and ``lse``."""
    from ..varlen import _backward

    batch, seqlen = q.shape[:2]
    qf, kf = _flat(q), _flat(k)

    def packed_lse(t):
        return None if t is None else t.transpose(0, 1).reshape(t.shape[1], batch * seqlen)
    dq, dk, dv, _ = _backward(_flat(dout), packed_lse(dlse), qf, kf, _flat(v), _flat(out), packed_lse(lse),
                              None, False, _packing(offsets, batch, seqlen, qf, kf), spec, backend)
    return dq.view(q.shape), dk.view(k.shape), dv.view(v.shape)


def forward_block(q, k, v, block_pieces, spec: AttentionSpec, acc_out, acc_lse, backend: str,
                  written: list | None = None) -> None:
    """Merge the block's calls into ``acc_out`` (fp32, q's (B, S, Hq, Dv)) and ``acc_lse`` (fp32,
    (B, Hq, S), -inf where no key was seen yet), in place. ``written``: the (offset, length) row
    ranges merged so far (kept up to date): rows no earlier call reached are copied, not merged."""
    for p in block_pieces:
        out, lse = _call(q, k, v, p, spec, backend)
        rows = slice(p.q_off, p.q_off + p.q_len)
        if written is not None and disjoint([*written, (p.q_off, p.q_len)]):
            acc_out[:, rows] = out
            acc_lse[:, :, rows] = lse
        else:
            merge_into(acc_out[:, rows], acc_lse[:, :, rows], out, lse.float())
        if written is not None:
            written.append((p.q_off, p.q_len))


def merge_into(acc_out, acc_lse, out, lse) -> None:
    """acc := merge(acc, (out, lse)) by lse, in fp32, in place (``fusedattn.merge``'s rule: a part
    that saw no key weighs 0, never NaN)."""
    new_lse = torch.logaddexp(acc_lse, lse)
    safe = torch.where(torch.isinf(new_lse), torch.zeros_like(new_lse), new_lse)
    w_old = torch.exp(acc_lse - safe).transpose(1, 2).unsqueeze(-1)
    w_new = torch.exp(lse - safe).transpose(1, 2).unsqueeze(-1)
    acc_out.mul_(w_old).add_(out.float() * w_new)
    acc_lse.copy_(new_lse)


def backward_block(dout, dlse, q, k, v, out, lse, block_pieces, spec: AttentionSpec, dq_acc, dk_acc, dv_acc,
                   backend: str) -> None:
    """Add the block's gradients into ``dq_acc`` (q's rows) and ``dk_acc`` / ``dv_acc`` (the
    block's keys), fp32, from the merged ``out`` (q's dtype) and ``lse`` (fp32). Where no row and
    no key is in two calls (``disjoint``), the accumulators may be of q's dtype: each call's
    gradients are then its rows' and keys' whole gradients, written in place."""
    direct = dq_acc.dtype != torch.float32
    for p in block_pieces:
        call_spec = replace(spec, window_left=p.left, window_right=p.right)
        rows = slice(p.q_off, p.q_off + p.q_len)
        dq, dk, dv, _, _ = dispatch.backward(
            _rows(dout, p.q_off, p.q_len), None if dlse is None else dlse[:, :, rows].contiguous(),
            _rows(q, p.q_off, p.q_len), _rows(k, p.k_off, p.k_len), _rows(v, p.k_off, p.k_len),
            _rows(out, p.q_off, p.q_len), lse[:, :, rows].contiguous(), call_spec, None, False, None, None, False,
            backend)
        keys = slice(p.k_off, p.k_off + p.k_len)
        if direct:
            dq_acc[:, rows], dk_acc[:, keys], dv_acc[:, keys] = dq, dk, dv
        else:
            dq_acc[:, rows] += dq.float()
            dk_acc[:, keys] += dk.float()
            dv_acc[:, keys] += dv.float()
