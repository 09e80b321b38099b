"""Launch configs: what a kernel compiles with (tiles, warps, stages, schedule), per kernel and per
call. Frozen, so every per-problem cache of launches keys on them by value. Which config a problem
gets is ``tuning/configs.py``'s choice; which kernel runs it, the planner's (``dispatch.py``)."""

from __future__ import annotations

from dataclasses import dataclass

SHORT_KEYS = 2048  # key lengths up to this are the short length class: configs with short-sequence tiles


@dataclass(frozen=True)
class KernelConfig:
    block_m: int  # query rows per tile
    block_n: int  # key rows per tile
    num_warps: int = 4
    num_stages: int = 2
    # Load the tiles of the inner loop through TMA descriptors (Hopper and later; the launcher
    # falls back to pointers where a tensor's alignment rules TMA out).
    tma_loads: bool = False
    # The Gluon kernel's schedule, and None for the Triton kernel (``family``). Forward: the 8-warp
    # kernel with this schedule (0 plain, 1 softmax under the PV matmul, 2 also the next QK^T issued
    # early; block_m 128), or with ``hopper_split`` the warp-specialised one. dK/dV: 0 (the
    # warp-specialised pass is its only schedule). The planner runs the Gluon kernel only where it
    # takes the problem (kernels/gluon/__init__.py: sm_90, 16-bit, D = Dv in {64, 128}, a right
    # window of none or causal), else the Triton kernel with fallback tiles (dispatch.triton_fallback,
    # dispatch.triton_dkdv_fallback).
    hopper_overlap: int | None = None
    # With hopper_overlap set: 2 or 3 runs the warp-specialised Gluon kernel (a 1-warp TMA producer
    # and that many consumer warpgroups of 64 rows: query rows in the forward, keys in dK/dV).
    hopper_split: int = 0
    # Their turns at the tensor cores: 0 none; 1 the turn covers issuing the score matmul; 2 (dK/dV
    # only) it covers both score matmuls, S^T and dP^T.
    hopper_pingpong: int = 0

    @property
    def family(self) -> str:
        """The kernels the config is for: "gluon" where ``hopper_overlap`` names a Gluon schedule, else
        "triton". The planner (dispatch.py) runs a Gluon config's kernel only where it takes the problem."""
        return "triton" if self.hopper_overlap is None else "gluon"


@dataclass(frozen=True)
class AttentionConfigs:
    forward: KernelConfig
    dkdv: KernelConfig  # one program per key block; block_m is its query-loop step
    dq: KernelConfig  # one program per query block (the separate dQ pass)
    preprocess_block_m: int = 64
    # Run the dQ programs in the dK/dV launch (they then use its warps and stages)?
    fuse_dq_pass: bool = False
    # Outside deterministic mode, dQ may instead be summed by fp32 atomics from the dK/dV pass
    # (5 matmuls per tile instead of 7); on Hopper those atomics can be TMA bulk reduce-adds.
    atomic_dq: bool = False
    dq_tma: bool = False
    # In deterministic mode, where the Gluon dK/dV pass would sum dQ (``atomic_dq``): it sums it in
    # a fixed order of its programs (``dispatch.ordered_dq_form``) instead of leaving dQ to a pass
    # of its own.
    ordered_dq: bool = False
    # The dQ pass on the warp-specialised Gluon forward's skeleton (kernels/gluon/fwd.py, GRAD_Q)
    # where it takes the problem (``dispatch.takes_gluon_dq``); else ``dq`` (Triton).
    gluon_dq: KernelConfig | None = None

