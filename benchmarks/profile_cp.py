"""Where a context-parallel step's time goes: torch.profiler on every rank, one step of each
(row, strategy), beside rank 0's whole-sequence step (the T1 of ``python -m fusedattn.bench --cp``).

    torchrun --nproc-per-node 2 benchmarks/profile_cp.py --rows documents,window --out prof/

Writes ``<out>/<row>-<strategy>-rank<r>.txt``: the step's wall time, the sum of its GPU kernel
time split into attention kernels, communication (NCCL) and the rest, and the top operations by
GPU time; ``.trace.json`` timelines of the first and last rank. Rows and shapes are the bench's
(bench/cp.py).
"""

from __future__ import annotations

import argparse
import os
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch.profiler import ProfilerActivity, profile

from fusedattn import distributed as cp
from fusedattn.bench.cp import HEADS_KV, HEADS_Q, HEAD_DIM, WINDOW, _documents, whole_sequence_step

ROWS = {"causal": dict(causal=True, window=None, documents=False),
        "window": dict(causal=True, window=(WINDOW, 0), documents=False),
        "documents": dict(causal=True, window=None, documents=True)}


def _kind(name: str) -> str:
    lowered = name.lower()
    if "nccl" in lowered:
        return "communication"
    if any(word in lowered for word in ("_forward_kernel", "_backward_kernel", "_attn_fwd", "_dkdv", "_dq",
                                        "_preprocess", "_convert_dq")):
        return "attention"
    return "other"


def _report(prof, wall_ms: float, title: str) -> str:
    events = [e for e in prof.key_averages() if e.device_time_total > 0 and e.device_type.name == "CUDA"]
    split = {}
    for e in events:
        split[_kind(e.key)] = split.get(_kind(e.key), 0.0) + e.device_time_total / 1e3
    lines = [title, f"wall {wall_ms:.2f} ms; GPU kernels: " +
             ", ".join(f"{k} {v:.2f} ms" for k, v in sorted(split.items()))]
    for e in sorted(events, key=lambda e: -e.device_time_total)[:25]:
        lines.append(f"  {e.device_time_total / 1e3:9.3f} ms  x{e.count:<4} {e.key[:110]}")
    return "\n".join(lines)


def _profiled(step) -> tuple:
    step()
    torch.cuda.synchronize()
    dist.barrier()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        start = time.perf_counter()
        step()
        torch.cuda.synchronize()
        wall = (time.perf_counter() - start) * 1e3
    return prof, wall


def _warm_profiler() -> None:
    """The profiler's first use starts CUPTI (seconds, and at different times on each rank): done
    once on a no-op so no measured step pays for it."""
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]):
        torch.ones(1, device="cuda").add_(1)
        torch.cuda.synchronize()
    dist.barrier()


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--rows", default="documents,window")
    p.add_argument("--strategies", default="allgather,ulysses")
    p.add_argument("--seqlen", type=int, default=None)
    p.add_argument("--out", default="prof")
    args = p.parse_args()
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    torch.cuda.set_device(local_rank)
    # NCCL at high priority (cp.cp_group's reason), for every system here: torch's context_parallel too
    dist.init_process_group("nccl", device_id=torch.device("cuda", local_rank),
                            pg_options=dist.ProcessGroupNCCL.Options(is_high_priority_stream=True))
    rank, world = dist.get_rank(), dist.get_world_size()
    seqlen = args.seqlen or 32768 * world
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    gen = torch.Generator(device="cuda").manual_seed(0)
    q, dout = (torch.randn(1, seqlen, HEADS_Q, HEAD_DIM, device="cuda", dtype=torch.bfloat16, generator=gen)
               for _ in range(2))
    k, v = (torch.randn(1, seqlen, HEADS_KV, HEAD_DIM, device="cuda", dtype=torch.bfloat16, generator=gen)
            for _ in range(2))
    _warm_profiler()
    for name in args.rows.split(","):
        row = ROWS[name]
        lengths = _documents(seqlen, world) if row["documents"] else None
        cu = None if lengths is None else torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()],
                                                       dtype=torch.int32, device="cuda")
        options = dict(causal=row["causal"], window=row["window"])
        if rank == 0:
            whole = whole_sequence_step([t.detach().clone().requires_grad_() for t in (q, k, v)], dout, options,
                                        cu, lengths)
            whole()
            torch.cuda.synchronize()
            with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
                start = time.perf_counter()
                whole()
                torch.cuda.synchronize()
                wall = (time.perf_counter() - start) * 1e3
            (out / f"{name}-1gpu.txt").write_text(_report(prof, wall, f"{name}, one GPU, {seqlen} tokens"))
        dist.barrier()
        plan = cp.shard_plan(seqlen, balance="zigzag") if cu is None else \
            cp.shard_plan(cu_seqlens=cu.cpu(), balance="documents")
        local = [plan.shard(t[0] if cu is not None else t).detach().clone() for t in (q, k, v, dout)]
        for strategy in args.strategies.split(","):
            leaves = [t.clone().requires_grad_() for t in local[:3]]

            def step():
                o = cp.cp_attention(*leaves, plan, strategy=strategy, **options)
                o.backward(local[3])
            prof, wall = _profiled(step)
            text = _report(prof, wall, f"{name}, {strategy}, rank {rank} of {world}, {seqlen} tokens")
            (out / f"{name}-{strategy}-rank{rank}.txt").write_text(text)
            if rank in (0, world - 1):  # a timeline of the first and last rank (chrome://tracing)
                prof.export_chrome_trace(str(out / f"{name}-{strategy}-rank{rank}.trace.json"))
            if rank == 0:
                print(text.splitlines()[1], f"({name}, {strategy})", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
