"""The collectives the strategies and the plan use, over a plan's process group: gathers, the
ring's neighbour exchange, and a sum-to-owner whose order is the same every run."""

from __future__ import annotations

import torch
import torch.distributed as dist


def cp_group(ranks=None):
    """A process group for ``shard_plan(..., group=)`` over ``ranks`` (default: every rank; with a
    list, only those ranks call it) whose NCCL streams run at high priority. The strategies'
    transfers are meant to travel under the attention kernels; an NCCL kernel launched on a stream of
    normal priority waits until every queued block of the running attention kernel has been placed
    on an SM, so the transfer starts only as the kernel ends. At high priority its blocks take the
    next SM a finished attention block frees. (``TORCH_NCCL_HIGH_PRIORITY=1`` does the same for every
    group of the process.) Other backends: a plain group."""
    local = ranks is not None  # only the members synchronise: other ranks need not call it
    if dist.get_backend() == "nccl":
        options = dist.ProcessGroupNCCL.Options(is_high_priority_stream=True)
        return dist.new_group(ranks, pg_options=options, use_local_synchronization=local)
    return dist.new_group(ranks, use_local_synchronization=local)


def all_gather_concat(out: torch.Tensor, x: torch.Tensor, group) -> None:
    """Every rank's ``x`` concatenated along dim 0 into ``out`` (torch's name for it changed)."""
    gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    gather(out, x, group=group)


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


def sparse_exchange(sends: dict, receive_like: dict, plan) -> tuple:
    """Point-to-point with the peers that need it: ``sends[peer]`` tensors go to group rank
    ``peer``; ``receive_like[peer]`` ((shape, dtype) pairs) says what arrives from it. Returns
    (received tensors by peer, requests to wait on)."""
    ops, received = [], {}
    device = next((t.device for ts in sends.values() for t in ts), None)
    for peer in sorted(set(sends) | set(receive_like)):
        target = dist.get_global_rank(plan.group, peer) if plan.group is not None else peer
        ops += [dist.P2POp(dist.isend, t.contiguous(), target, plan.group) for t in sends.get(peer, [])]
        buffers = [torch.empty(shape, dtype=dtype, device=device) for shape, dtype in receive_like.get(peer, [])]
        ops += [dist.P2POp(dist.irecv, b, target, plan.group) for b in buffers]
        if buffers:
            received[peer] = buffers
    return received, dist.batch_isend_irecv(ops) if ops else []
