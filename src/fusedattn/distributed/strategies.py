"""The strategies of ``cp_attention``: how keys reach the queries that need them, forward and backward.

- ``allgather``: every rank receives, for each of its segments (``segments.py``), the one key
  range the segment reaches (the whole prefix for causal attention, the window's reach with a
  window) and runs all segments as one packed call: each row's output comes from one call, no
  merge. The backward fetches the ranges again and sends the dK/dV partial sums (fp32) back to
  their owner, which adds them in source-rank order. Every feature.
- ``ring``: K/V blocks travel around the ring; each step attends to the block it holds while the
  next block is in flight, the running output and lse merged in fp32. The backward sends the
  blocks around again with their dK/dV accumulators (fp32), which end at their owner.
- ``ulysses``: all-to-all over heads: each rank gets every token of Hq / N query heads (and their
  K/V heads, replicated where N > Hkv), runs the whole sequence, and sends the output back.

Where a row's keys are split over calls (the ring), the calls' outputs are merged by lse in fp32
(never rounded between steps). All of them: sinks applied
once to the merged row, every sum in a fixed order (``deterministic=True`` gives bitwise-identical
gradients run to run).
"""

from __future__ import annotations

from dataclasses import replace
from functools import lru_cache

import torch
import torch.distributed as dist

from .. import dispatch
from ..merge import merge_into
from ..row_gradients import sink_gradient_from_outputs
from ..spec import AttentionSpec
from .pieces import backward_block, forward_block, pieces
from .comm import exchange, sparse_exchange, wait_all
from .plan import ShardPlan
from .segments import key_sources, most_received, reach, segments

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

    def reach(self) -> tuple:
        """reach[r][s]: the range (lo, hi) of rank s's local keys that rank r's segments need, or
        None (every rank computes the same table from the plan, once: ``segments.reach``)."""
        return reach(self.plan, self.spec.window_left, self.spec.window_right, self.chunk)


# ----------------------------------------------------------------------------- sinks, once per row


def _finish(acc_out, acc_lse, sinks, dtype):
    """The merged row with the sinks' logits in its denominator (a part of output 0, merged in
    place): (out in ``dtype``, lse fp32)."""
    if sinks is not None:
        merge_into(acc_out, acc_lse, None, sinks.detach().float().view(1, -1, 1).expand_as(acc_lse), "bshd")
    return acc_out.to(dtype), acc_lse


def _accumulators(q: torch.Tensor, v: torch.Tensor) -> tuple:
    batch, seqlen, heads_q, _ = q.shape
    out = torch.zeros((batch, seqlen, heads_q, v.shape[-1]), dtype=torch.float32, device=q.device)
    lse = torch.full((batch, heads_q, seqlen), float("-inf"), dtype=torch.float32, device=q.device)
    return out, lse


# ----------------------------------------------------------------------------- all-gather


def _fetch(tensors: list, problem: Problem) -> tuple:
    """The slices of ``tensors`` (this rank's K and V, or what else is laid out like them) that
    other ranks' segments reach, sent to them; those this rank's segments reach, received. Returns
    (received by source rank, requests)."""
    plan, table, me = problem.plan, problem.reach(), problem.plan.rank
    sends = {r: [t[:, table[r][me][0]:table[r][me][1]] for t in tensors]
             for r in range(plan.world_size) if r != me and table[r][me] is not None}
    receive = {s: [((t.shape[0], table[me][s][1] - table[me][s][0], *t.shape[2:]), t.dtype) for t in tensors]
               for s in range(plan.world_size) if s != me and table[me][s] is not None}
    return sparse_exchange(sends, receive, plan)


class _Gathered:
    """This rank's segments grouped by kernel window, and where each segment's keys are in the
    blocks at hand (its own K/V, and the slices received from each rank)."""

    def __init__(self, problem: Problem, received: dict, own: list):
        plan, me = problem.plan, problem.plan.rank
        table = problem.reach()
        self.blocks = {me: (own, 0)}
        self.blocks.update({s: (tensors, table[me][s][0]) for s, tensors in received.items()})
        groups = {}
        for seg in segments(plan.runs[me], plan.documents, problem.spec.window_left, problem.spec.window_right,
                            problem.chunk):
            groups.setdefault((seg.left, seg.right), []).append(seg)
        self.groups = list(groups.items())
        self.plan = plan

    def keys(self, segs, which: int) -> tuple:
        """The group's keys packed (B, sum of ranges, ...) from tensor ``which`` of each block,
        and each range's pieces as (source rank, offset in its block, length)."""
        sources = []
        for seg in segs:
            for rank, local, length in key_sources(seg.ka, seg.kb, self.plan):
                start = local - self.blocks[rank][1]
                if sources and sources[-1][0] == rank and sum(sources[-1][1:]) == start:
                    sources[-1] = (rank, sources[-1][1], sources[-1][2] + length)  # one slice, one add
                else:
                    sources.append((rank, start, length))
        parts = [self.blocks[rank][0][which][:, start:start + length] for rank, start, length in sources]
        # one range (one rank holding every key of the group, Ulysses' whole sequence): no copy
        return (parts[0] if len(parts) == 1 else torch.cat(parts, 1)), sources


def _varlen_layout(segs, batch: int, seqlen: int, q, k_packed):
    """The packing of the group's rows (every batch row's segments, in order) against its packed
    keys; and the rows as one index (None where the group is every row in order)."""
    from ..varlen import check_packing

    q_lens = [seg.q_len for seg in segs]
    k_lens = [seg.kb - seg.ka for seg in segs]
    k_total = sum(k_lens)
    cu_q, cu_k = [0], [0]
    for b in range(batch):
        for lq, lk in zip(q_lens, k_lens):
            cu_q.append(cu_q[-1] + lq)
            cu_k.append(cu_k[-1] + lk)
    in_order = [(seg.q_off, seg.q_len) for seg in segs]
    whole = sum(q_lens) == seqlen and all(off == sum(q_lens[:i]) for i, (off, _) in enumerate(in_order))
    # built on q's device: a host index copied there would stall the host on the GPU
    rows = None if whole else torch.cat([torch.arange(seg.q_off, seg.q_off + seg.q_len, device=q.device)
                                         for seg in segs])
    flat_q = q.reshape(batch * seqlen, *q.shape[2:]) if rows is None else \
        q[:, rows].reshape(batch * len(rows), *q.shape[2:])
    flat_k = k_packed.reshape(batch * k_total, *k_packed.shape[2:])
    packing = check_packing(torch.tensor(cu_q, dtype=torch.int32), torch.tensor(cu_k, dtype=torch.int32),
                            max(q_lens), max(k_lens), flat_q, flat_k)
    return packing, rows


def _whole_rows(segs, seqlen: int) -> bool:
    """One segment holding every row: one sequence a batch row, against one key range."""
    return len(segs) == 1 and segs[0].q_off == 0 and segs[0].q_len == seqlen


def _own_keys_in_order(sources, me: int, length: int) -> bool:
    """Whether packed key pieces ``sources`` are exactly this rank's keys [0, length), in order."""
    end = 0
    for rank, start, size in sources:
        if rank != me or start != end:
            return False
        end += size
    return end == length


def _rows_of(t: torch.Tensor, rows) -> torch.Tensor:
    """(B, S, ...) -> (B * rows, ...): the group's rows, flattened."""
    picked = t if rows is None else t[:, rows]
    return picked.reshape(picked.shape[0] * picked.shape[1], *picked.shape[2:])


def allgather_forward(q, k, v, sinks, problem: Problem):
    """Each rank receives the key ranges its segments reach (the whole prefix for causal
    attention, the window's reach with a window) and runs one packed call per kernel window: every
    row in one call, its output the result (no merge)."""
    from ..varlen import _forward

    received, requests = _fetch([k, v], problem)
    wait_all(requests)
    gathered = _Gathered(problem, received, [k, v])
    batch, seqlen = q.shape[:2]
    out = lse = None  # allocated where a group covers only some rows
    for (left, right), segs in gathered.groups:
        k_packed, _ = gathered.keys(segs, 0)
        v_packed, _ = gathered.keys(segs, 1)
        spec = replace(problem.spec, window_left=left, window_right=right)
        if _whole_rows(segs, seqlen):  # one sequence a batch row: the dense kernels, the batch as it is
            out, lse = dispatch.forward(q, k_packed, v_packed, spec, None, None, None, problem.backend)
            continue
        packing, rows = _varlen_layout(segs, batch, seqlen, q, k_packed)
        o, l = _forward(_rows_of(q, rows), _rows_of(k_packed, None), _rows_of(v_packed, None), None, packing, spec,
                        problem.backend, True)
        o = o.view(batch, -1, *o.shape[1:])
        l = l.view(l.shape[0], batch, -1).transpose(0, 1)
        if rows is None:
            out, lse = o, l.contiguous()
        else:
            if out is None:
                out, lse = _no_result(q, v)
            out[:, rows] = o
            lse[:, :, rows] = l
    if out is None:  # no rows at all
        out, lse = _no_result(q, v)
    if sinks is not None:
        out, lse = _finish(out.float(), lse, sinks, q.dtype)
    kept = [t for source in sorted(received) for t in received[source]] if _keeps_received(problem) else []
    return out, lse, (q, k, v, out, lse, *kept)


def _no_result(q, v) -> tuple:
    """(out, lse) of rows that see no key: 0 in q's dtype, -inf; what rows no call covers keep."""
    batch, seqlen, heads_q = q.shape[:3]
    return q.new_zeros((batch, seqlen, heads_q, v.shape[-1])), \
        torch.full((batch, heads_q, seqlen), float("-inf"), dtype=torch.float32, device=q.device)


def _keeps_received(problem: Problem) -> bool:
    """Whether the forward's received keys are kept for the backward instead of fetched again:
    where no rank receives more keys than it holds (a window's halo), not a causal prefix (up to the
    whole sequence). Decided from the plan, the same on every rank (a fetch needs both sides)."""
    spec = problem.spec
    return most_received(problem.plan, spec.window_left, spec.window_right, problem.chunk) <= problem.plan.local_len


def allgather_backward(dout, dlse, saved, sinks, problem: Problem):
    """The key ranges fetched again; one packed backward per kernel window gives dQ whole and the
    packed keys' dK/dV, added (fp32) into this rank's own and into a partial sum per source rank,
    which goes back to its owner and is added there in source-rank order."""
    from ..varlen import _backward

    q, k, v, out, lse, *kept = saved
    plan, me, table = problem.plan, problem.plan.rank, problem.reach()
    if _keeps_received(problem):
        sources = sorted(s for s in range(plan.world_size) if s != me and table[me][s] is not None)
        received = {s: kept[2 * i:2 * i + 2] for i, s in enumerate(sources)}
    else:
        received, requests = _fetch([k, v], problem)
        wait_all(requests)
    gathered = _Gathered(problem, received, [k, v])
    batch, seqlen = q.shape[:2]
    dq = None  # allocated where a group covers only some rows
    pieces_of_groups = []  # (dK, dV of the packed keys, where each piece belongs) per group

    def packed_stats(t, rows):
        if t is None:
            return None
        picked = t if rows is None else t[:, :, rows]
        return picked.transpose(0, 1).reshape(t.shape[1], -1)
    for (left, right), segs in gathered.groups:
        k_packed, sources = gathered.keys(segs, 0)
        v_packed, _ = gathered.keys(segs, 1)
        spec = replace(problem.spec, window_left=left, window_right=right)
        if _whole_rows(segs, seqlen):
            dq, dk_g, dv_g, _, _ = dispatch.backward(dout, dlse, q, k_packed, v_packed, out, lse, spec, None, False,
                                                     None, None, False, problem.backend)
        else:
            packing, rows = _varlen_layout(segs, batch, seqlen, q, k_packed)
            dq_g, dk_g, dv_g, _ = _backward(_rows_of(dout, rows), packed_stats(dlse, rows), _rows_of(q, rows),
                                            _rows_of(k_packed, None), _rows_of(v_packed, None), _rows_of(out, rows),
                                            packed_stats(lse, rows), None, False, packing, spec, problem.backend)
            if rows is None:
                dq = dq_g.view(q.shape)
            else:
                if dq is None:
                    dq = torch.zeros(q.shape, dtype=q.dtype, device=q.device)
                dq[:, rows] = dq_g.view(batch, -1, *q.shape[2:])
            dk_g, dv_g = dk_g.view(batch, -1, *dk_g.shape[1:]), dv_g.view(batch, -1, *dv_g.shape[1:])
        if plan.world_size == 1 and len(gathered.groups) == 1 and _own_keys_in_order(sources, me, k.shape[1]):
            # one rank (Ulysses' whole sequence), every key once and in order: the kernel's dK/dV
            # are the gradients, nothing to add
            return dq, dk_g, dv_g, _sinks_gradient(sinks, out, dout, lse, dlse)
        pieces_of_groups.append((dk_g, dv_g, sources))
    if dq is None:  # no rows at all
        dq = torch.zeros(q.shape, dtype=q.dtype, device=q.device)
    sums = {rank: [torch.zeros(t[0].shape, dtype=torch.float32, device=q.device) for _ in range(2)]
            for rank, (t, _) in gathered.blocks.items()}

    def add_pieces(owners):
        """Each packed key's dK/dV added (fp32) into its owner's sum, for ``owners``; a fixed order
        (the groups', then their segments', then their keys') for each owner."""
        for dk_g, dv_g, sources in pieces_of_groups:
            offset = 0
            for rank, start, length in sources:
                if rank in owners:
                    sums[rank][0][:, start:start + length] += dk_g[:, offset:offset + length]
                    sums[rank][1][:, start:start + length] += dv_g[:, offset:offset + length]
                offset += length
    # the other ranks' partial sums first: they travel while this rank's own pieces are added
    add_pieces(set(sums) - {me})
    partial = {s: grads for s, grads in sums.items() if s != me}
    receive = {r: [((k.shape[0], table[r][me][1] - table[r][me][0], *t.shape[2:]), torch.float32) for t in (k, v)]
               for r in range(plan.world_size) if r != me and table[r][me] is not None}
    returned, requests = sparse_exchange(partial, receive, plan)
    add_pieces({me})
    dk, dv = sums[me]
    wait_all(requests)
    for r in sorted(returned):
        lo, hi = table[r][me]
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


def _head_groups(heads_q_per_rank: int, heads_kv_per_rank: int) -> int:
    """How many head groups a rank's heads run in, one after another, so that each group's
    all-to-all travels while the previous group's attention runs: 2 where both the query and the
    K/V heads a rank gets split in two, else 1."""
    return 2 if heads_q_per_rank % 2 == 0 and heads_kv_per_rank % 2 == 0 else 1


def _start_to_sequence(x: torch.Tensor, plan: ShardPlan, groups: int, g: int) -> tuple:
    """(B, S/N, H, ...) sharded by sequence -> head group ``g`` of this rank's heads over every
    token: the all-to-all started, (received buffer, request); ``_finish_to_sequence`` completes it.
    Rank r's heads are [r H/N, (r + 1) H/N), its group g the g-th of ``groups`` equal parts."""
    n = plan.world_size
    batch, local, heads = x.shape[:3]
    part = x.reshape(batch, local, n, groups, heads // (n * groups), *x.shape[3:])[:, :, :, g]
    send = part.movedim(2, 0).contiguous()
    recv = torch.empty_like(send)
    return recv, dist.all_to_all_single(recv, send, group=plan.group, async_op=True)


def _finish_to_sequence(started: tuple, inverse: torch.Tensor) -> torch.Tensor:
    """The started all-to-all waited for: (B, S, h, ...) in global order."""
    recv, request = started
    request.wait()
    n, batch, local = recv.shape[:3]
    return recv.movedim(0, 1).reshape(batch, n * local, *recv.shape[3:])[:, inverse]  # from rank-major


@lru_cache(maxsize=16)
def _orders(plan: ShardPlan, device: torch.device) -> tuple:
    """(order, inverse): order[j] is the global position of the j-th token of the ranks' shards
    concatenated (rank-major); inverse puts rank-major rows in global order. Both are used as
    gathers: an indexed read coalesces its writes, an indexed write does not."""
    order = torch.cat([plan.global_index(r, device=device) for r in range(plan.world_size)])
    return order, torch.argsort(order)


def _start_to_shards(x: torch.Tensor, plan: ShardPlan, order: torch.Tensor) -> tuple:
    """The way back for one head group: (B, S, h, ...) in global order -> each rank its tokens;
    the all-to-all started."""
    n = plan.world_size
    batch, total = x.shape[:2]
    send = x[:, order].reshape(batch, n, total // n, *x.shape[2:]).movedim(1, 0).contiguous()
    recv = torch.empty_like(send)
    return recv, dist.all_to_all_single(recv, send, group=plan.group, async_op=True)


def _finish_to_shards(started: list) -> torch.Tensor:
    """Every head group's rows waited for, in the heads' order: (B, S/N, H, ...)."""
    parts = []
    for recv, request in started:
        request.wait()
        parts.append(recv.movedim(0, 2))  # (B, S/N, N, h, ...)
    whole = torch.stack(parts, 3)  # (B, S/N, N, groups, h, ...)
    return whole.reshape(*whole.shape[:2], -1, *whole.shape[5:])


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
    """All-to-all into head groups over the whole sequence, the gather's calls on it (one process,
    nothing to fetch: one call, or one packed call over documents or chunks), all-to-all back.
    A rank's heads run in two groups where they split: the second group's all-to-all travels while
    the first group's attention runs, and the first group's output travels back under the second's."""
    plan = problem.plan
    n = plan.world_size
    order, inverse = _orders(plan, q.device)
    reps = _kv_replicas(k.shape[2], n)
    if reps > 1:
        k, v = k.repeat_interleave(reps, dim=2), v.repeat_interleave(reps, dim=2)
    groups = _head_groups(q.shape[2] // n, k.shape[2] // n)
    whole = _whole_problem(problem)
    incoming = [[_start_to_sequence(x, plan, groups, g) for x in (q, k, v)] for g in range(groups)]
    returning, saved = [], []
    for g in range(groups):
        qh, kh, vh = (_finish_to_sequence(started, inverse) for started in incoming[g])
        out_h, lse_h, kept = allgather_forward(qh, kh, vh, _group_sinks(sinks, plan, groups, g, qh.shape[2]), whole)
        returning.append((_start_to_shards(out_h, plan, order),
                          _start_to_shards(lse_h.transpose(1, 2).unsqueeze(-1), plan, order)))
        saved += kept  # the backward reads these head-sharded tensors: no all-to-all of q, k, v, out again
    out = _finish_to_shards([r[0] for r in returning])
    lse = _finish_to_shards([r[1] for r in returning]).squeeze(-1).transpose(1, 2)
    return out, lse.contiguous(), tuple(saved)


def _group_sinks(sinks, plan: ShardPlan, groups: int, g: int, heads: int):
    """The sinks of this rank's head group ``g`` (``heads`` heads)."""
    return None if sinks is None else sinks.narrow(0, (plan.rank * groups + g) * heads, heads)


def ulysses_backward(dout, dlse, saved, sinks, problem: Problem):
    plan = problem.plan
    n = plan.world_size
    groups = len(saved) // 5  # (q, k, v, out, lse) of each head group
    heads = saved[0].shape[2]
    order, inverse = _orders(plan, dout.device)
    reps = _kv_replicas(problem.heads_kv, n)
    rows = [dout] + ([] if dlse is None else [dlse.transpose(1, 2).unsqueeze(-1)])
    incoming = [[_start_to_sequence(x, plan, groups, g) for x in rows] for g in range(groups)]
    whole = _whole_problem(problem)
    returning = []
    dsinks = None if sinks is None else torch.zeros(sinks.shape, dtype=torch.float32, device=sinks.device)
    for g in range(groups):
        dout_h, *dlse_h = (_finish_to_sequence(started, inverse) for started in incoming[g])
        dlse_h = dlse_h[0].squeeze(-1).transpose(1, 2).contiguous() if dlse_h else None
        # dQ, dK, dV whole (one rank's call over the sequence), in the kernel's dtype
        dq_h, dk_h, dv_h, dsinks_h = allgather_backward(dout_h, dlse_h, saved[5 * g:5 * g + 5],
                                                        _group_sinks(sinks, plan, groups, g, heads), whole)
        returning.append([_start_to_shards(t, plan, order) for t in (dq_h, dk_h, dv_h)])
        if dsinks is not None:  # this rank's heads' part (the other heads' entries 0)
            dsinks.narrow(0, (plan.rank * groups + g) * heads, heads).copy_(dsinks_h)
    dq, dk, dv = (_finish_to_shards([r[i] for r in returning]) for i in range(3))
    if reps > 1:  # the replicas' dK/dV (the kernel's, in its dtype) summed in fp32
        dk = dk.float().unflatten(2, (-1, reps)).sum(3)
        dv = dv.float().unflatten(2, (-1, reps)).sum(3)
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
