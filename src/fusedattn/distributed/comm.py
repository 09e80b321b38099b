"""The collectives the strategies and the plan use, over a plan's process group: gathers, the
ring's neighbour exchange, and a sum-to-owner whose order is the same every run."""

from __future__ import annotations

import torch
import torch.distributed as dist


def all_gather_concat(out: torch.Tensor, x: torch.Tensor, group) -> None:
    """Every rank's ``x`` concatenated along dim 0 into ``out`` (torch's name for it changed)."""
    gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    gather(out, x, group=group)


def all_gather(x: torch.Tensor, plan) -> list:
    """Every rank's ``x`` (same shape), in rank order."""
    flat = x.contiguous()
    out = flat.new_empty((plan.world_size * flat.shape[0], *flat.shape[1:]))
    all_gather_concat(out, flat, plan.group)
    return list(out.view(plan.world_size, *flat.shape).unbind(0))


def sum_to_owners(parts: list, plan) -> torch.Tensor:
    """parts[r]: this rank's contribution to rank r's tensor; returns this rank's tensor, the sum
    of every rank's contribution in rank order (an all-to-all, then a local sum: the same order
    every run, unlike a reduction's)."""
    send = torch.stack(parts).contiguous()
    recv = torch.empty_like(send)
    dist.all_to_all_single(recv, send, group=plan.group)
    total = recv[0].clone()
    for r in range(1, plan.world_size):
        total += recv[r]
    return total


def exchange(tensors: list, plan, to_next: bool = True) -> tuple:
    """Send ``tensors`` to the next rank of the ring and receive the previous rank's (same shapes);
    returns (received tensors, requests to wait on)."""
    me, n = plan.rank, plan.world_size
    dst, src = ((me + 1) % n, (me - 1) % n) if to_next else ((me - 1) % n, (me + 1) % n)
    dst, src = dist.get_global_rank(plan.group, dst) if plan.group is not None else dst, \
        dist.get_global_rank(plan.group, src) if plan.group is not None else src
    received = [torch.empty_like(t) for t in tensors]
    ops = [dist.P2POp(dist.isend, t.contiguous(), dst, plan.group) for t in tensors]
    ops += [dist.P2POp(dist.irecv, r, src, plan.group) for r in received]
    return received, dist.batch_isend_irecv(ops)


def wait_all(requests) -> None:
    for request in requests:
        request.wait()
