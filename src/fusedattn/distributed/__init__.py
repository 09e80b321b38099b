"""Context parallelism: attention over a sequence sharded across the ranks of a process group.

    import fusedattn.distributed as cp

    group = cp.cp_group()                                # NCCL at high priority: transfers under the kernels
    plan = cp.shard_plan(seqlen, group=group)            # or cu_seqlens=... for packed documents
    q, k, v = (plan.shard(t) for t in (q_full, k_full, v_full))   # or build the shards directly
    positions = plan.positions(device)                   # this rank's positions, for RoPE
    out = cp.cp_attention(q, k, v, plan, causal=True)    # this rank's rows of the whole sequence's attention
    out_full = plan.unshard(out)

Every rank calls ``cp_attention`` with its shard (same shapes on every rank); the result equals
single-device attention on the whole sequence, row for row (docs/SEMANTICS.md, "Context
parallelism"). The strategies are described in ``strategies.py``.
"""

from __future__ import annotations

import torch

from ..checks import check_chunk, check_options, check_qkv, check_sinks
from ..spec import fold_window, resolve_spec
from .comm import cp_group
from .plan import BALANCES, ShardPlan, shard_plan
from .segments import most_received
from .strategies import STRATEGIES, ContextParallelAttention, Problem, resolve_backend, ulysses_layout

__all__ = ["shard_plan", "ShardPlan", "cp_group", "cp_attention", "choose_strategy", "STRATEGIES", "BALANCES"]

_CALLER = "fusedattn.distributed.cp_attention"


def choose_strategy(plan: ShardPlan, heads_q: int, heads_kv: int, window: tuple[int, int] | None = None,
                    chunk: int | None = None, causal: bool = False) -> str:
    """``strategy="auto"``: the strategy that moves fewer words, the gather or Ulysses. The gather
    moves, per key a rank receives, K and V in and their gradients' fp32 partial sums back (6 Hkv
    words; 8 where the keys are fetched again for the backward); Ulysses moves (N - 1) / N of every
    token's q, out, dout, dq (4 Hq) and k, v, dk, dv (4 Hkv, Hkv replicated up to N). The gather wins
    where ranks receive few keys: a window's halo, whole documents on a rank, a causal prefix over
    few ranks; Ulysses over many ranks and long prefixes. Where Ulysses cannot split the heads and
    the gather would move more, the ring (O(S/N) memory)."""
    if plan.world_size == 1:
        return "allgather"
    n, shard = plan.world_size, plan.local_len
    received = most_received(plan, *fold_window(causal, window), int(chunk or 0))
    gather_words = (6 if received <= shard else 8) * heads_kv * received
    ulysses_words = (n - 1) * shard * 4 * (heads_q + max(heads_kv, n)) / n
    if gather_words <= ulysses_words:
        return "allgather"
    return "ulysses" if ulysses_layout(plan, heads_q, heads_kv) is None else "ring"


def cp_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, plan: ShardPlan, *, strategy: str = "auto",
                 causal: bool = False, window: tuple[int, int] | None = None, scale: float | None = None,
                 softcap: float | None = None, sinks: torch.Tensor | None = None, chunk: int | None = None,
                 deterministic: bool = False, return_lse: bool = False, alibi_slopes=None, dropout_p: float = 0.0,
                 bias=None, mask=None):
    """This rank's rows of attention over the whole sharded sequence, forward and backward.

    q: (B, S/N, Hq, D), k: (B, S/N, Hkv, D), v: (B, S/N, Hkv, Dv) -- this rank's tokens in the
    plan's local order (``plan.shard``); with a plan built from ``cu_seqlens``, (T/N, H, D).
    Positions, causality, windows and chunks are those of the whole sequence (of each document,
    for packed plans). ``strategy``: "allgather", "ring", "ulysses" or "auto" (``choose_strategy``).
    Returns ``out`` like q (head dim Dv), and with ``return_lse`` also this rank's ``lse`` (B, Hq,
    S/N) float32 (packed: (Hq, T/N)); both differentiable. ``sinks`` (Hq,) float32: each rank's
    gradient is its part (its rows', or with Ulysses its heads'), as for every parameter under
    context parallelism -- sum it over the group as for the others (FSDP or DDP over the group do). ``alibi_slopes``, ``dropout_p``,
    ``bias`` and ``mask`` raise ``NotImplementedError``: their terms depend on positions or entries
    the shards do not carry."""
    for name, given in (("alibi_slopes", alibi_slopes is not None), ("dropout_p", dropout_p != 0.0),
                        ("bias", bias is not None), ("mask", mask is not None)):
        if given:
            raise NotImplementedError(f"{_CALLER}: `{name}` is not taken under context parallelism; use "
                                      f"fusedattn.attention on the whole sequence")
    if not isinstance(plan, ShardPlan):
        raise TypeError(f"{_CALLER}: `plan` must be a ShardPlan (fusedattn.distributed.shard_plan), got "
                        f"{type(plan).__name__}")
    if strategy not in STRATEGIES:
        raise ValueError(f"{_CALLER}: `strategy` must be one of {STRATEGIES}, got {strategy!r}")
    check_options(layout="bshd", causal=causal, window=window, scale=scale, softcap=softcap,
                  deterministic=deterministic, return_lse=return_lse, caller=_CALLER)
    check_chunk(chunk, _CALLER)
    packed = plan.packed
    if packed:
        for name, t in (("q", q), ("k", k), ("v", v)):
            if not isinstance(t, torch.Tensor) or t.dim() != 3:
                raise ValueError(f"{_CALLER}: with a plan of packed documents `{name}` must be (tokens, heads, "
                                 f"head dim), got {getattr(t, 'shape', type(t).__name__)}")
        q, k, v = q.unsqueeze(0), k.unsqueeze(0), v.unsqueeze(0)
    shapes = check_qkv(q, k, v, "bshd", _CALLER)
    if shapes.seqlen_q != plan.local_len or shapes.seqlen_k != plan.local_len:
        raise ValueError(f"{_CALLER}: this rank holds {plan.local_len} tokens of the plan; got q with "
                         f"{shapes.seqlen_q} and k with {shapes.seqlen_k}")
    check_sinks(sinks, q, shapes.heads_q)
    if strategy == "auto":
        strategy = choose_strategy(plan, shapes.heads_q, shapes.heads_kv, window, chunk, causal)
    if strategy == "ulysses":
        why = ulysses_layout(plan, shapes.heads_q, shapes.heads_kv)
        if why:
            raise ValueError(f"{_CALLER}: strategy='ulysses' splits the heads over the group: {why}")
    spec = resolve_spec(q.shape[-1], layout="bshd", causal=causal, window=window, scale=scale, softcap=softcap,
                        deterministic=deterministic)
    problem = Problem(plan, spec, resolve_backend(q), int(chunk or 0), shapes.heads_kv)
    out, lse = ContextParallelAttention.apply(q.contiguous(), k.contiguous(), v.contiguous(), sinks, problem,
                                              strategy)
    if packed:
        out, lse = out.squeeze(0), lse.squeeze(0)
    return (out, lse) if return_lse else out
