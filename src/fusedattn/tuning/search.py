"""The opt-in tuning run: time candidate launch configs on this GPU and cache the fastest.

For one cache key (dtype, head dims, window/softcap flags, key-length class) it times the
forward, then the dK/dV pass, then the Triton dQ pass, then the Gluon dQ pass against it (each
with the winners so far, i.e. a coordinate search starting from the heuristic), and stores the
result with
``TuningCache.put``. A candidate is timed only after it passed the correctness rule on
a small problem with odd lengths and the same features (a tuned config can never be a wrong
one); one that does not compile (shared memory, registers) is skipped.

The tuned entry keeps the default's backward schedule: dQ in a separate pass, no atomics,
so gradients stay bitwise reproducible whether or not a cache is in use.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Callable

import torch

from ..dispatch import attention_backward, attention_forward
from ..reference import reference_attention
from ..spec import AttentionSpec, resolve_spec
from ..validate import compare_to_reference
from .configs import SHORT_KEYS, AttentionConfigs, KernelConfig

# (block_m, block_n, num_warps, num_stages) candidates per kernel: the H200 sweeps of
# benchmarks/tune.py kept every config that won or came close to winning somewhere.
# Further entries pick a Gluon kernel: (hopper_overlap[, hopper_split, hopper_pingpong]); where
# the problem is not one it supports, the Triton kernel runs (tuning/configs.py,
# fwd.triton_fallback, bwd.triton_dkdv_fallback).
FORWARD_CANDIDATES = [(128, 64, 8, 3), (128, 128, 8, 3), (128, 128, 8, 4), (64, 64, 4, 3), (64, 64, 4, 4),
                      (64, 128, 4, 3), (128, 64, 8, 4), (64, 32, 4, 4), (128, 128, 8, 2),
                      (128, 128, 8, 2, 0), (128, 64, 8, 2, 0), (128, 128, 8, 2, 1), (128, 64, 8, 2, 1),
                      (128, 128, 8, 2, 2), (128, 128, 8, 3, 1),
                      (128, 128, 4, 2, 0, 2, 0), (128, 128, 4, 2, 0, 2, 1), (192, 128, 4, 2, 0, 3, 0),
                      (192, 128, 4, 2, 0, 3, 1)]
# (64, 64, 4, 2) and (32, 64, 4, 2) fit two programs per SM at D=128 (registers and shared memory).
# Gluon dK/dV entries: (64 * split keys, 4 warps per consumer warpgroup, 0, split, ping-pong mode);
# 3 warpgroups cannot hold D=128's accumulators in registers: they spill there and lose the timing.
DKDV_CANDIDATES = [(64, 128, 8, 2), (64, 128, 8, 3), (64, 128, 8, 4), (64, 64, 4, 3), (64, 64, 4, 2),
                   (32, 64, 4, 2), (32, 64, 4, 3), (32, 128, 8, 3), (128, 64, 8, 2),
                   (32, 128, 4, 2), (32, 128, 4, 3),
                   (64, 128, 4, 2, 0, 2, 0), (64, 128, 4, 2, 0, 2, 1), (64, 128, 4, 2, 0, 2, 2),
                   (64, 128, 4, 3, 0, 2, 1), (128, 128, 4, 2, 0, 2, 2),
                   (64, 192, 4, 2, 0, 3, 0), (64, 192, 4, 2, 0, 3, 1), (64, 192, 4, 2, 0, 3, 2)]
DQ_CANDIDATES = [(128, 64, 8, 3), (128, 64, 8, 4), (128, 32, 4, 3), (64, 64, 4, 3), (64, 64, 4, 2),
                 (64, 32, 4, 4), (128, 128, 8, 2), (64, 128, 4, 2)]
# The Gluon dQ pass (hopper_fwd.dq_pass: the warp-specialised forward's kernel in GRAD_Q mode, where
# dQ has a pass of its own on Hopper: deterministic mode), as (block_m, block_n, num_warps,
# num_stages, hopper_overlap, hopper_split, hopper_pingpong): 128-row tiles of 2 warpgroups taking
# turns (the heuristic's, 64-key steps and 3 stages), 128-key steps, no turns, and 192-row tiles of
# 3 warpgroups. None -- the Triton dQ pass -- is always a candidate.
GLUON_DQ_CANDIDATES = [(128, 64, 4, 3, 0, 2, 1), (128, 64, 4, 2, 0, 2, 1), (128, 128, 4, 2, 0, 2, 1),
                       (128, 64, 4, 3, 0, 2, 0), (192, 64, 4, 3, 0, 3, 1)]
KERNELS = ("forward", "dkdv", "dq", "gluon_dq")
DQ_SCHEME = "dq_scheme"  # the last stage: the tuned reproducible schedule, or dQ by atomics from the dK/dV pass


def candidate_config(candidate: tuple, tma_loads: bool) -> KernelConfig:
    """(block_m, block_n, num_warps, num_stages[, hopper_overlap[, hopper_split, hopper_pingpong]])."""
    gluon = candidate[4:]
    return KernelConfig(*candidate[:4], tma_loads or bool(gluon), *gluon)


@dataclass(frozen=True)
class TuningProblem:
    """What one cache entry is tuned on: the standard benchmark shapes' token and hidden budget at one key length."""

    head_dim: int
    head_dim_v: int
    seqlen: int
    dtype: torch.dtype = torch.bfloat16
    causal: bool = False
    window: tuple[int, int] | None = None
    softcap: float | None = None
    tokens: int = 16384
    hidden: int = 2048

    @property
    def spec(self) -> AttentionSpec:
        return self.spec_for(deterministic=True)

    def spec_for(self, deterministic: bool) -> AttentionSpec:
        return resolve_spec(self.head_dim, layout="bhsd", causal=self.causal, window=self.window, scale=None,
                            softcap=self.softcap, deterministic=deterministic)

    @property
    def options(self) -> dict:
        return dict(layout="bhsd", causal=self.causal, window=self.window, softcap=self.softcap)

    def inputs(self, device, batch=None, heads=None, seqlen_q=None, seqlen_k=None, seed=0):
        batch = batch or max(1, self.tokens // self.seqlen)
        heads = heads or max(1, self.hidden // max(self.head_dim, self.head_dim_v))
        seqlen_q, seqlen_k = seqlen_q or self.seqlen, seqlen_k or self.seqlen
        gen = torch.Generator(device=device).manual_seed(seed)
        sizes = [(batch, heads, seqlen_q, self.head_dim), (batch, heads, seqlen_k, self.head_dim),
                 (batch, heads, seqlen_k, self.head_dim_v), (batch, heads, seqlen_q, self.head_dim_v)]
        return [torch.randn(s, generator=gen, device=device).to(self.dtype) for s in sizes]


@dataclass
class TuningResult:
    configs: AttentionConfigs
    # kernel -> [(candidate, milliseconds or the reason it was skipped)]
    trials: dict[str, list[tuple[KernelConfig, float | str]]] = field(default_factory=dict)
    # "forward" / "backward" -> milliseconds of the starting and of the tuned configs, timed
    # alternately after the search (medians), so the two are comparable.
    before_ms: dict[str, float] = field(default_factory=dict)
    after_ms: dict[str, float] = field(default_factory=dict)
    # kernel -> (the current config's, the stage's fastest candidate's) milliseconds, medians of
    # CONFIRM_PAIRS alternate timings: what decided whether the candidate replaced the current one.
    confirmed_ms: dict[str, tuple[float, float]] = field(default_factory=dict)


def mode_spec(problem: TuningProblem, configs: AttentionConfigs) -> AttentionSpec:
    """The spec of the mode ``configs`` serve: a dQ-by-atomics schedule only runs outside
    deterministic mode (kernels/bwd.py ignores it there), so it is checked and timed there."""
    return problem.spec_for(deterministic=not configs.atomic_dq)


def run_kernels(configs: AttentionConfigs, spec: AttentionSpec, q, k, v, dout):
    """Forward and backward kernels as the interface launches them: (out, lse, dq, dk, dv)."""
    out, lse = attention_forward(q, k, v, spec, configs.forward)
    return (out, lse, *attention_backward(dout, None, q, k, v, out, lse, spec, configs)[:3])


CHECK_LENGTHS = (157, 203)  # off every tile size; queries and keys of different lengths


def correctness_failure(configs: AttentionConfigs, problem: TuningProblem, device, lengths=CHECK_LENGTHS) -> str:
    """'' if ``configs`` meet the correctness rule on a small odd-length problem, else what failed."""
    q, k, v, dout = problem.inputs(device, batch=2, heads=2, seqlen_q=lengths[0], seqlen_k=lengths[1], seed=1)
    ours = run_kernels(configs, mode_spec(problem, configs), q, k, v, dout)

    def reference(dtype):
        leaves = [t.detach().to(dtype).requires_grad_() for t in (q, k, v)]
        out, lse = reference_attention(*leaves, return_lse=True, **problem.options)
        return (out, lse, *torch.autograd.grad(out, leaves, dout.to(dtype)))

    lowp, ref64 = reference(problem.dtype), reference(torch.float64)
    for name, a, lo, r in zip(("out", "lse", "dq", "dk", "dv"), ours, lowp, ref64):
        verdict = compare_to_reference(a, lo, r)
        if not verdict.ok:
            return f"{name}: {verdict.problem or f'error {verdict.error:.2e} > bound {verdict.bound:.2e}'}"
    return ""


def default_timer(fn: Callable[[], object]) -> float:
    import triton.testing

    return triton.testing.do_bench(fn, warmup=10, rep=50, return_mode="median")


MIN_GAIN = 0.02  # a candidate replaces the current config only when this much faster (timing noise is of this order)
# A stage's fastest candidate is timed again against the current config, alternately, before it
# replaces it: one timing each, taken in sequence between compilations, once picked a schedule clearly
# "faster" that alternate profiles put level (the Gluon dQ pass's 3 warpgroups).
CONFIRM_PAIRS = 3


def tune(problem: TuningProblem, start: AttentionConfigs, device, *, candidates=None,
         timer: Callable[[str, AttentionConfigs, Callable], float] | None = None,
         progress: Callable = lambda items, desc: items, check_lengths=CHECK_LENGTHS) -> TuningResult:
    """Coordinate search from ``start``'s reproducible schedule (dQ in its own pass): forward, then
    dK/dV, then the Triton dQ pass (timed with the Gluon one off, so that it is what runs), then the
    Gluon dQ pass against it (None: the Triton pass; a Gluon config runs where it takes the
    problem, ``bwd.takes_gluon_dq``); last, whether dQ by atomics from the dK/dV pass (TMA
    reduce-adds on Hopper) is faster -- that choice only applies outside deterministic mode,
    deterministic calls keep the tuned dQ pass. A stage's fastest candidate replaces the current
    config only if it is also faster by MIN_GAIN in CONFIRM_PAIRS alternate timings of the two
    (medians). ``candidates`` maps a kernel name to KernelConfigs
    (default: the lists above, with ``start``'s TMA choice; Gluon ones only on Hopper; a kernel it
    does not name has none); ``timer(phase, configs, fn)`` returns the milliseconds of ``fn``, the
    forward or the whole backward (phase "forward" / "backward"; default:
    ``triton.testing.do_bench``'s median)."""
    timer = timer or (lambda phase, configs, fn: default_timer(fn))
    tma = start.forward.tma_loads
    hopper = torch.device(device).type == "cuda" and torch.cuda.get_device_capability(device)[0] == 9
    candidates = candidates or {
        name: [candidate_config(c, tma) for c in grid if len(c) == 4 or hopper]
        for name, grid in zip(KERNELS, (FORWARD_CANDIDATES, DKDV_CANDIDATES, DQ_CANDIDATES, GLUON_DQ_CANDIDATES))}
    candidates = dict(candidates, gluon_dq=[None, *candidates.get("gluon_dq", [])])
    q, k, v, dout = problem.inputs(device)
    out, lse = attention_forward(q, k, v, problem.spec, start.forward)

    def timed(phase: str, configs: AttentionConfigs) -> float:
        spec = mode_spec(problem, configs)
        if phase == "forward":
            return timer(phase, configs, lambda: attention_forward(q, k, v, spec, configs.forward))
        # dK/dV and dQ are timed as the whole backward (pre-pass, dK/dV pass, dQ pass).
        return timer(phase, configs, lambda: attention_backward(dout, None, q, k, v, out, lse, spec, configs))

    def trial(phase: str, configs: AttentionConfigs) -> float | str:
        """The milliseconds of a correct candidate, else why it is not one."""
        try:
            failure = correctness_failure(configs, problem, device, check_lengths)
            return f"wrong result ({failure})" if failure else timed(phase, configs)
        except Exception as e:  # does not compile (shared memory, registers): not a candidate
            return f"{type(e).__name__}: {str(e).splitlines()[0][:100] if str(e) else ''}"

    best = replace(start, atomic_dq=False, dq_tma=False, fuse_dq_pass=False)
    result = TuningResult(best)
    for kernel in KERNELS:
        phase = "forward" if kernel == "forward" else "backward"
        # the Triton dQ pass is timed where it runs: with the Gluon one off
        stage = replace(best, gluon_dq=None) if kernel == "dq" else best
        current_ms = timed(phase, stage)
        trials = result.trials.setdefault(kernel, [])
        for candidate in progress(candidates.get(kernel, []), f"tuning {kernel}"):
            trials.append((candidate, trial(phase, replace(stage, **{kernel: candidate}))))
        timed_trials = [(ms, i) for i, (_, ms) in enumerate(trials) if isinstance(ms, float)]
        if timed_trials:
            fastest_ms, i = min(timed_trials)
            if fastest_ms < current_ms * (1 - MIN_GAIN):
                contender = replace(stage, **{kernel: trials[i][0]})
                pairs = [(timed(phase, stage), timed(phase, contender)) for _ in range(CONFIRM_PAIRS)]
                kept_ms, contender_ms = (sorted(times)[len(times) // 2] for times in zip(*pairs))
                result.confirmed_ms[kernel] = (kept_ms, contender_ms)
                if contender_ms < kept_ms * (1 - MIN_GAIN):
                    best = replace(best, **{kernel: trials[i][0]})
    # TMA reduce-adds where there is TMA; the Gluon dK/dV pass sums dQ itself where it can.
    atomics = replace(best, atomic_dq=True, dq_tma=hopper)
    outcome = trial("backward", atomics)
    result.trials[DQ_SCHEME] = [(atomics.dkdv, outcome)]
    if isinstance(outcome, float) and outcome < timed("backward", best) * (1 - MIN_GAIN):
        best = atomics
    result.configs = best
    for phase in ("forward", "backward"):
        pairs = [(timed(phase, start), timed(phase, best)) for _ in range(3)]
        result.before_ms[phase] = sorted(a for a, _ in pairs)[1]
        result.after_ms[phase] = sorted(b for _, b in pairs)[1]
    return result


def length_class_seqlen(short_keys: bool) -> int:
    """The key length a cache entry of that class is tuned at (the standard benchmark shapes' 1k and 4k)."""
    seqlen = 1024 if short_keys else 4096
    assert (seqlen <= SHORT_KEYS) == short_keys, "the tuning lengths must fall in their class"
    return seqlen
