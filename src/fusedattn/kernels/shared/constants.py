"""Constants every kernel family and the host share, and the score scaling they all take."""

from __future__ import annotations

from ...spec import AttentionSpec

LOG2E = 1.4426950408889634  # log2(e): the kernels keep scores in log2 units, so exp2 replaces exp


def score_constants(spec: AttentionSpec) -> tuple[float, float]:
    """(qk_scale, softcap_log2) as every kernel's ``log2_scores`` expects them."""
    if spec.has_softcap:
        return spec.scale / spec.softcap, spec.softcap * LOG2E
    return spec.scale * LOG2E, 0.0
