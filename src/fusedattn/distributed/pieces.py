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
from ..merge import merge_into
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


def forward_block(q, k, v, block_pieces, spec: AttentionSpec, acc_out, acc_lse, backend: str,
                  written: list | None = None) -> None:
    """Merge the block's calls into ``acc_out`` (fp32, q's (B, S, Hq, Dv)) and ``acc_lse`` (fp32,
    (B, Hq, S), -inf where no key was seen yet), in place. ``written``: the (offset, length) row
    ranges merged so far (kept up to date): rows no earlier call reached are copied, not merged."""
    for p in block_pieces:
        out, lse = _call(q, k, v, p, spec, backend)
        rows = slice(p.q_off, p.q_off + p.q_len)
        if written is not None and all(p.q_off + p.q_len <= off or off + n <= p.q_off for off, n in written):
            acc_out[:, rows] = out
            acc_lse[:, :, rows] = lse
        else:
            merge_into(acc_out[:, rows], acc_lse[:, :, rows], out.float(), lse.float(), "bshd")
        if written is not None:
            written.append((p.q_off, p.q_len))


def backward_block(dout, dlse, q, k, v, out, lse, block_pieces, spec: AttentionSpec, dq_acc, dk_acc, dv_acc,
                   backend: str) -> None:
    """Add the block's gradients into ``dq_acc`` (q's rows) and ``dk_acc`` / ``dv_acc`` (the
    block's keys), fp32, from the merged ``out`` (q's dtype) and ``lse`` (fp32)."""
    for p in block_pieces:
        call_spec = replace(spec, window_left=p.left, window_right=p.right)
        rows = slice(p.q_off, p.q_off + p.q_len)
        dq, dk, dv, _, _ = dispatch.backward(
            _rows(dout, p.q_off, p.q_len), None if dlse is None else dlse[:, :, rows].contiguous(),
            _rows(q, p.q_off, p.q_len), _rows(k, p.k_off, p.k_len), _rows(v, p.k_off, p.k_len),
            _rows(out, p.q_off, p.q_len), lse[:, :, rows].contiguous(), call_spec, None, False, None, None, False,
            backend)
        keys = slice(p.k_off, p.k_off + p.k_len)
        dq_acc[:, rows] += dq.float()
        dk_acc[:, keys] += dk.float()
        dv_acc[:, keys] += dv.float()
