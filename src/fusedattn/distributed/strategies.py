"""The strategies of ``cp_attention``: how keys reach the queries that need them, forward and backward.

- ``allgather``: every rank receives the slices of every other rank's K/V that its queries reach
  (all of them for causal attention; with a window only its reach, from the neighbours) while it
  computes its own block; the backward fetches them again and sends the dK/dV partial sums (fp32)
  back to their owner, which adds them in source-rank order. Every feature.
- ``ring``: K/V blocks travel around the ring; each step attends to the block it holds while the
  next block is in flight, the running output and lse merged in fp32. The backward sends the
  blocks around again with their dK/dV accumulators (fp32), which end at their owner.
- ``ulysses``: all-to-all over heads: each rank gets every token of Hq / N query heads (and their
  K/V heads, replicated where N > Hkv), runs the whole sequence, and sends the output back.

All of them: the blocks' outputs merged by lse in fp32 (never rounded between steps), sinks applied
once to the merged row, every sum in a fixed order (``deterministic=True`` gives bitwise-identical
gradients run to run).
"""

from __future__ import annotations

from dataclasses import replace

import torch
import torch.distributed as dist

from .. import dispatch
from ..row_gradients import sink_gradient_from_outputs
from ..spec import AttentionSpec
from .pieces import (backward_block, backward_tiled, diagonal_tiling, disjoint, forward_block, forward_direct,
                     forward_tiled, pieces)
from .comm import exchange, sparse_exchange, wait_all
from .plan import ShardPlan

STRATEGIES = ("auto", "allgather", "ring", "ulysses")


class Problem:
    """One call's fixed parts: the plan, the spec, the backend, which rank holds what."""

    def __init__(self, plan: ShardPlan, spec: AttentionSpec, backend: str, chunk: int, heads_kv: int):
        self.plan, self.spec, self.backend, self.chunk, self.heads_kv = plan, spec, backend, chunk, heads_kv

    def block_pieces(self, key_rank: int, query_rank: int | None = None) -> list:
        """The kernel calls of ``query_rank``'s queries (default: this rank's) against
        ``key_rank``'s keys."""
        plan = self.plan
        return pieces(plan.runs[plan.rank if query_rank is None else query_rank], plan.runs[key_rank],
                      plan.documents, self.spec.window_left, self.spec.window_right, self.chunk)

    def needed_keys(self) -> list:
        """needed[r][s]: the range (lo, hi) of rank s's local keys that rank r's queries reach, or
        None (every rank computes the same table from the plan)."""
        if not hasattr(self, "_needed"):
            n = self.plan.world_size
            self._needed = [[_key_range(self.block_pieces(s, r)) for s in range(n)] for r in range(n)]
        return self._needed


def _key_range(block_pieces) -> tuple | None:
    if not block_pieces:
        return None
    return min(p.k_off for p in block_pieces), max(p.k_off + p.k_len for p in block_pieces)


def _shifted(block_pieces, lo: int) -> list:
    """The calls against a slice of the block that starts at its key ``lo``."""
    return [replace(p, k_off=p.k_off - lo) for p in block_pieces]


# ----------------------------------------------------------------------------- sinks, once per row


def _finish(acc_out, acc_lse, sinks, dtype):
    """The merged row with the sinks' logits in its denominator: (out in ``dtype``, lse fp32)."""
    if sinks is not None:
        lse = torch.logaddexp(acc_lse, sinks.detach().float().view(1, -1, 1))
        safe = torch.where(torch.isinf(lse), torch.zeros_like(lse), lse)
        acc_out = acc_out * torch.exp(acc_lse - safe).transpose(1, 2).unsqueeze(-1)
        acc_lse = lse
    return acc_out.to(dtype), acc_lse


def _accumulators(q: torch.Tensor, v: torch.Tensor) -> tuple:
    batch, seqlen, heads_q, _ = q.shape
    out = torch.zeros((batch, seqlen, heads_q, v.shape[-1]), dtype=torch.float32, device=q.device)
    lse = torch.full((batch, heads_q, seqlen), float("-inf"), dtype=torch.float32, device=q.device)
    return out, lse


# ----------------------------------------------------------------------------- all-gather


def _fetch(tensors: list, problem: Problem) -> tuple:
    """The slices of ``tensors`` (this rank's K and V, or what else is laid out like them) that
    other ranks' queries reach, sent to them; those this rank's queries reach, received. Returns
    (received by source rank, requests)."""
    plan, needed, me = problem.plan, problem.needed_keys(), problem.plan.rank
    sends = {r: [t[:, needed[r][me][0]:needed[r][me][1]] for t in tensors]
             for r in range(plan.world_size) if r != me and needed[r][me] is not None}
    receive = {s: [((t.shape[0], needed[me][s][1] - needed[me][s][0], *t.shape[2:]), t.dtype) for t in tensors]
               for s in range(plan.world_size) if s != me and needed[me][s] is not None}
    return sparse_exchange(sends, receive, plan)


def allgather_forward(q, k, v, sinks, problem: Problem):
    """Each rank's K/V goes to the ranks whose queries reach it -- to every rank for causal
    attention, only the window's reach to the neighbours with a window -- while the own block is
    computed."""
    me, needed = problem.plan.rank, problem.needed_keys()
    received, requests = _fetch([k, v], problem)
    acc_out, acc_lse = _accumulators(q, v)
    written = []
    forward_block(q, k, v, problem.block_pieces(me), problem.spec, acc_out, acc_lse, problem.backend, written)
    wait_all(requests)
    for s in sorted(received):
        forward_block(q, *received[s], _shifted(problem.block_pieces(s), needed[me][s][0]), problem.spec, acc_out,
                      acc_lse, problem.backend, written)
    out, lse = _finish(acc_out, acc_lse, sinks, q.dtype)
    return out, lse, (q, k, v, out, lse)


def allgather_backward(dout, dlse, saved, sinks, problem: Problem):
    """The K/V slices fetched again; each rank's dK/dV partial sums (fp32) go back to the owner,
    which adds them to its own in source-rank order."""
    q, k, v, out, lse = saved
    plan, me, needed = problem.plan, problem.plan.rank, problem.needed_keys()
    received, requests = _fetch([k, v], problem)
    dq = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
    dk = torch.zeros(k.shape, dtype=torch.float32, device=k.device)
    dv = torch.zeros(v.shape, dtype=torch.float32, device=v.device)
    backward_block(dout, dlse, q, k, v, out, lse, problem.block_pieces(me), problem.spec, dq, dk, dv,
                   problem.backend)
    wait_all(requests)
    partial = {}
    for s in sorted(received):
        k_s, v_s = received[s]
        dk_s = torch.zeros(k_s.shape, dtype=torch.float32, device=k.device)
        dv_s = torch.zeros(v_s.shape, dtype=torch.float32, device=v.device)
        backward_block(dout, dlse, q, k_s, v_s, out, lse, _shifted(problem.block_pieces(s), needed[me][s][0]),
                       problem.spec, dq, dk_s, dv_s, problem.backend)
        partial[s] = [dk_s, dv_s]
    receive = {r: [((k.shape[0], needed[r][me][1] - needed[r][me][0], *t.shape[2:]), torch.float32) for t in (k, v)]
               for r in range(plan.world_size) if r != me and needed[r][me] is not None}
    returned, requests = sparse_exchange(partial, receive, plan)
    wait_all(requests)
    for r in sorted(returned):
        lo, hi = needed[r][me]
        dk[:, lo:hi] += returned[r][0]
        dv[:, lo:hi] += returned[r][1]
    return dq, dk, dv, _sinks_gradient(sinks, out, dout, lse, dlse)


# ----------------------------------------------------------------------------- ring


def ring_forward(q, k, v, sinks, problem: Problem):
    plan = problem.plan
    acc_out, acc_lse = _accumulators(q, v)
    written = []
    block = [k, v]
    for step in range(plan.world_size):
        if step + 1 < plan.world_size:  # the next block in flight while this one is computed
            incoming, requests = exchange(block, plan)
        source = (plan.rank - step) % plan.world_size
        forward_block(q, block[0], block[1], problem.block_pieces(source), problem.spec, acc_out, acc_lse,
                      problem.backend, written)
        if step + 1 < plan.world_size:
            wait_all(requests)
            block = incoming
    out, lse = _finish(acc_out, acc_lse, sinks, q.dtype)
    return out, lse, (q, k, v, out, lse)


def ring_backward(dout, dlse, saved, sinks, problem: Problem):
    """At step s this rank holds source (rank - s)'s K/V and the dK/dV that the ranks before it
    added for that source; it adds its own and passes both on. After the last step the
    accumulators are one hop from their owner."""
    q, k, v, out, lse = saved
    plan = problem.plan
    n = plan.world_size
    dq = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
    block = [k, v]
    # the accumulators of step 0's source (this rank's own keys) start at zero; later ones arrive
    incoming_grads = [torch.zeros(k.shape, dtype=torch.float32, device=k.device),
                      torch.zeros(v.shape, dtype=torch.float32, device=v.device)]
    grad_requests = []
    for step in range(n):
        if step + 1 < n:
            incoming, requests = exchange(block, plan)
        wait_all(grad_requests)  # this source's accumulators, from the previous rank
        grads = incoming_grads
        source = (plan.rank - step) % n
        backward_block(dout, dlse, q, block[0], block[1], out, lse, problem.block_pieces(source), problem.spec, dq,
                       grads[0], grads[1], problem.backend)
        incoming_grads, grad_requests = exchange(grads, plan)  # on to the next holder (after the last: the owner)
        if step + 1 < n:
            wait_all(requests)
            block = incoming
    wait_all(grad_requests)
    return dq, incoming_grads[0], incoming_grads[1], _sinks_gradient(sinks, out, dout, lse, dlse)


# ----------------------------------------------------------------------------- Ulysses


def _heads_to_sequence(x: torch.Tensor, plan: ShardPlan, order: torch.Tensor) -> torch.Tensor:
    """(B, S/N, H, D) sharded by sequence -> (B, S, H/N, D) sharded by heads, in global order."""
    n = plan.world_size
    batch, local, heads = x.shape[:3]
    send = x.reshape(batch, local, n, heads // n, *x.shape[3:]).movedim(2, 0).contiguous()
    recv = torch.empty_like(send)
    dist.all_to_all_single(recv, send, group=plan.group)
    whole = recv.movedim(0, 1).reshape(batch, n * local, heads // n, *x.shape[3:])  # rank-major
    out = torch.empty_like(whole)
    out[:, order] = whole
    return out


def _sequence_to_heads(x: torch.Tensor, plan: ShardPlan, order: torch.Tensor) -> torch.Tensor:
    """The inverse of ``_heads_to_sequence``: (B, S, H/N, D) -> (B, S/N, H, D)."""
    n = plan.world_size
    batch, total, heads_part = x.shape[:3]
    local = total // n
    rank_major = x[:, order]
    send = rank_major.reshape(batch, n, local, heads_part, *x.shape[3:]).movedim(1, 0).contiguous()
    recv = torch.empty_like(send)
    dist.all_to_all_single(recv, send, group=plan.group)
    return recv.movedim(0, 2).reshape(batch, local, n * heads_part, *x.shape[3:])


def _kv_replicas(heads_kv: int, n: int) -> int:
    """How many copies of each K/V head the all-to-all sends, so that N divides them."""
    return 1 if heads_kv % n == 0 else n // heads_kv


def ulysses_layout(plan: ShardPlan, heads_q: int, heads_kv: int) -> str | None:
    """Why Ulysses cannot run this problem, or None."""
    n = plan.world_size
    if heads_q % n:
        return f"{heads_q} query heads do not divide over {n} ranks"
    if heads_kv % n and n % heads_kv:
        return f"{heads_kv} key/value heads neither divide over {n} ranks nor divide {n}"
    return None


def _whole_problem(problem: Problem) -> Problem:
    plan = problem.plan
    whole = ShardPlan(1, 0, plan.seqlen, plan.balance, (((0, plan.seqlen),),), plan.documents, plan.packed)
    return Problem(whole, problem.spec, problem.backend, problem.chunk, problem.heads_kv)


def ulysses_forward(q, k, v, sinks, problem: Problem):
    plan = problem.plan
    order = torch.cat([plan.global_index(r, device=q.device) for r in range(plan.world_size)])
    reps = _kv_replicas(k.shape[2], plan.world_size)
    qh = _heads_to_sequence(q, plan, order)
    kh = _heads_to_sequence(k.repeat_interleave(reps, dim=2), plan, order)
    vh = _heads_to_sequence(v.repeat_interleave(reps, dim=2), plan, order)
    whole = _whole_problem(problem)
    calls = whole.block_pieces(0)
    heads = q.shape[2] // plan.world_size
    my_sinks = None if sinks is None else sinks.narrow(0, plan.rank * heads, heads)
    tiling = diagonal_tiling(calls, qh.shape[1], whole.spec)
    if tiling is not None:  # documents or chunks: one packed call over all of them
        out_h, lse_h = forward_tiled(qh, kh, vh, tiling, whole.spec, whole.backend)
        if my_sinks is not None:
            out_h, lse_h = _finish(out_h.float(), lse_h, my_sinks, q.dtype)
    elif disjoint([(p.q_off, p.q_len) for p in calls]):  # every row's keys in one call: its result as is
        out_h, lse_h = forward_direct(qh, kh, vh, calls, whole.spec, whole.backend)
        if my_sinks is not None:
            out_h, lse_h = _finish(out_h.float(), lse_h, my_sinks, q.dtype)
    else:
        acc_out, acc_lse = _accumulators(qh, vh)
        forward_block(qh, kh, vh, calls, whole.spec, acc_out, acc_lse, whole.backend, [])
        out_h, lse_h = _finish(acc_out, acc_lse, my_sinks, q.dtype)
    out = _sequence_to_heads(out_h, plan, order)
    lse = _sequence_to_heads(lse_h.transpose(1, 2).unsqueeze(-1), plan, order).squeeze(-1).transpose(1, 2)
    # the backward reads the head-sharded tensors kept from here: no all-to-all of q, k, v, out again
    return out, lse.contiguous(), (qh, kh, vh, out_h, lse_h.contiguous())


def ulysses_backward(dout, dlse, saved, sinks, problem: Problem):
    qh, kh, vh, out_h, lse_h = saved
    plan = problem.plan
    n = plan.world_size
    order = torch.cat([plan.global_index(r, device=qh.device) for r in range(n)])
    reps = _kv_replicas(problem.heads_kv, n)
    dout_h = _heads_to_sequence(dout, plan, order)
    dlse_h = None if dlse is None else \
        _heads_to_sequence(dlse.transpose(1, 2).unsqueeze(-1), plan, order).squeeze(-1).transpose(1, 2).contiguous()
    whole = _whole_problem(problem)
    calls = whole.block_pieces(0)
    # every row's and key's gradient from one call: sent back as is, in q's dtype; else summed in fp32
    direct = disjoint([(p.q_off, p.q_len) for p in calls]) and disjoint([(p.k_off, p.k_len) for p in calls])
    tiling = diagonal_tiling(calls, qh.shape[1], whole.spec)
    if tiling is not None:
        dq_h, dk_h, dv_h = backward_tiled(dout_h, dlse_h, qh, kh, vh, out_h, lse_h, tiling, whole.spec,
                                          whole.backend)
    else:
        grad_type = qh.dtype if direct else torch.float32
        dq_h, dk_h, dv_h = (torch.zeros(t.shape, dtype=grad_type, device=qh.device) for t in (qh, kh, vh))
        backward_block(dout_h, dlse_h, qh, kh, vh, out_h, lse_h.contiguous(), calls, whole.spec, dq_h, dk_h, dv_h,
                       whole.backend)
    if reps > 1:  # replicas' partial gradients: summed back into their head in fp32, in a fixed order
        dk_h, dv_h = dk_h.float(), dv_h.float()
    dq = _sequence_to_heads(dq_h, plan, order)
    dk = _sequence_to_heads(dk_h, plan, order)
    dv = _sequence_to_heads(dv_h, plan, order)
    if reps > 1:
        dk = dk.unflatten(2, (-1, reps)).sum(3)
        dv = dv.unflatten(2, (-1, reps)).sum(3)
    dsinks = None
    if sinks is not None:  # this rank's heads' part (the other heads' entries 0)
        heads = qh.shape[2]
        dsinks = torch.zeros(sinks.shape, dtype=torch.float32, device=sinks.device)
        dsinks[plan.rank * heads:(plan.rank + 1) * heads] = _sinks_gradient(
            sinks.narrow(0, plan.rank * heads, heads), out_h, dout_h, lse_h, dlse_h)
    return dq, dk, dv, dsinks


FORWARD = {"allgather": allgather_forward, "ring": ring_forward, "ulysses": ulysses_forward}
BACKWARD = {"allgather": allgather_backward, "ring": ring_backward, "ulysses": ulysses_backward}


def _sinks_gradient(sinks, out, dout, lse, dlse):
    """The sinks' gradient from these rows (None without sinks)."""
    return None if sinks is None else sink_gradient_from_outputs(sinks, out, dout, lse, dlse, "bshd")


class ContextParallelAttention(torch.autograd.Function):
    """Forward and backward of one strategy; q, k, v are (B, S/N, H, D) shards. Each strategy's
    forward returns what its backward reads (saved here)."""

    @staticmethod
    def forward(ctx, q, k, v, sinks, problem: Problem, strategy: str):
        out, lse, saved = FORWARD[strategy](q, k, v, sinks, problem)
        ctx.save_for_backward(sinks, *saved)
        ctx.problem, ctx.strategy, ctx.dtypes = problem, strategy, (q.dtype, k.dtype, v.dtype)
        return out, lse

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, dout, dlse):
        sinks, *saved = ctx.saved_tensors
        dq, dk, dv, dsinks = BACKWARD[ctx.strategy](dout.contiguous(), dlse, saved,
                                                    sinks if ctx.needs_input_grad[3] else None, ctx.problem)
        q_type, k_type, v_type = ctx.dtypes
        # a rank's sinks gradient is its own rows' (Ulysses: heads') part, as every parameter's under
        # context parallelism: the group's sum is the gradient
        return dq.to(q_type), dk.to(k_type), dv.to(v_type), None if dsinks is None else dsinks.to(sinks.dtype), \
            None, None


def resolve_backend(q: torch.Tensor) -> str:
    return dispatch.resolve_backend(q.device)
