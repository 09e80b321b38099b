"""The gather strategy's layout: each query segment against the one key range it reaches.

A rank's tokens, in local order, are cut into segments: the parts of its runs inside one document
(and one chunk of it). Under causal, window and chunk rules the keys a segment's rows reach form
one contiguous range of global positions, [max(segment start, qa - left), min(segment end, qb +
right)); the rank assembles each range from the ranks that hold it and runs all its segments as
one packed (varlen) call: rows are in exactly one call, so the kernel's output is the result, with
no merge. The kernel aligns each sequence bottom-right; a range that ends ``shift`` = kb - qb past
its rows gets the window (left + shift, right - shift), so segments are grouped by that window
(causal attention has one group: every range ends at its rows' end).
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

from ..spec import UNBOUNDED
from .pieces import segment_extent, located_runs, segment_parts


@dataclass(frozen=True)
class Segment:
    """Rows [q_off, + q_len) of this rank (global [qa, qb)) against global keys [ka, kb), with
    the kernel's window for that range."""

    q_off: int
    q_len: int
    ka: int
    kb: int
    left: int
    right: int


# The layout is a pure function of the plan and the options, the same for every layer's call:
# computed once (it walks every rank's runs for every segment: host time that grows with documents
# times ranks, spent before the first kernel of the call) and kept, as tuples.
@lru_cache(maxsize=256)
def segments(runs, documents, left: int, right: int, chunk: int) -> tuple:
    """The query segments of ``runs`` (a rank's), in local order."""
    out = []
    for qs, ql, qo in located_runs(runs):
        for qa, qb in segment_parts(documents, chunk, qs, qs + ql):
            ea, eb = segment_extent(documents, chunk, qa)
            ka = ea if left == UNBOUNDED else max(ea, qa - left)
            kb = eb if right == UNBOUNDED else min(eb, qb + right)
            shift = kb - qb
            out.append(Segment(qo + qa - qs, qb - qa, ka, kb, UNBOUNDED if left == UNBOUNDED else left + shift,
                               UNBOUNDED if right == UNBOUNDED else right - shift))
    return tuple(out)


@lru_cache(maxsize=4096)
def key_sources(ka: int, kb: int, plan) -> tuple:
    """Where global keys [ka, kb) live: (rank, local offset, length), in global order."""
    out = []
    for rank, runs in enumerate(plan.runs):
        for start, length, offset in located_runs(runs):
            a, b = max(ka, start), min(kb, start + length)
            if a < b:
                out.append((a, rank, offset + a - start, b - a))
    return tuple((rank, local, length) for _, rank, local, length in sorted(out))


@lru_cache(maxsize=64)
def reach(plan, left: int, right: int, chunk: int) -> tuple:
    """reach[r][s]: the range (lo, hi) of rank s's local keys that rank r's segments need, or None."""
    n = plan.world_size
    table = [[None] * n for _ in range(n)]
    for r in range(n):
        for seg in segments(plan.runs[r], plan.documents, left, right, chunk):
            for s, local, length in key_sources(seg.ka, seg.kb, plan):
                lo, hi = table[r][s] or (local, local + length)
                table[r][s] = (min(lo, local), max(hi, local + length))
    return tuple(tuple(row) for row in table)


@lru_cache(maxsize=64)
def most_received(plan, left: int, right: int, chunk: int) -> int:
    """The most keys any rank receives from the others for its segments (``reach``'s spans)."""
    return max(sum(span[1] - span[0] for s, span in enumerate(row) if s != r and span is not None)
               for r, row in enumerate(reach(plan, left, right, chunk)))
