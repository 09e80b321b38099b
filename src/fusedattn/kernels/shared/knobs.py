"""Experiment switches: forced choices for tests and benchmarks, never set by a user's call.

One frozen value holds them all. It changes only inside ``overridden``, and every per-problem
cache of launchers and plans keys on the whole value (``launch.per_problem``), so a launch built
under one setting is never reused under another -- no switch has to be threaded into a cache key
by hand.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, replace


@dataclass(frozen=True)
class Knobs:
    # Gluon kernels: head rows per chunk of the launch order (None: the rule, 0: all heads).
    chunk_heads: int | None = None
    # Gluon dK/dV pass summing dQ in a fixed order under a causal bound: False never interleaves its
    # chunks (``gluon.common.interleaved_order``).
    ordered_interleave: bool = True
    # Gluon warp-specialised forward: persistent programs (None: the rule, 0: one program per tile).
    programs: int | None = None
    # Gluon dK/dV pass: persistent programs (None: the rule; 0: one program per tile; n: n programs
    # wherever the persistent form can run).
    dkdv_programs: int | None = None
    # Gluon dK/dV pass: False keeps one program per query head where the rule would sum a KV group.
    group_sums: bool = True
    # Triton dK/dV programs: block-major (True) or head-major (False) launch order (None: the rule).
    dkdv_block_major: bool | None = None
    # Cached kernels launched directly (False: through Triton's own launcher, as with hooks set).
    direct_launch: bool = True
    # KV cache: programmatic dependent launch of the split combination (None: on sm_90 and later).
    pdl: bool | None = None
    # KV cache: the decoding kernel launched early too (None: wherever ``pdl`` is on).
    early_start: bool | None = None
    # A/B only: the warp-specialised forward's warpgroups whose rows all lie past Sq run their keys.
    run_rows_past_end: bool = False


_current = Knobs()


def knobs() -> Knobs:
    return _current


@contextlib.contextmanager
def overridden(**changes):
    """Run the block with the named switches changed (``Knobs`` fields), restoring them after."""
    global _current
    previous, _current = _current, replace(_current, **changes)
    try:
        yield _current
    finally:
        _current = previous
