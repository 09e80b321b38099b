"""``python -m fusedattn.bench --cp``: context parallelism's strong scaling, one process per GPU.

    torchrun --nproc-per-node 2 -m fusedattn.bench --cp                 # 64k tokens
    torchrun --nproc-per-node 4 -m fusedattn.bench --cp --cp-seqlen 131072

bf16, D=128, Hq=32, Hkv=8, B=1, forward+backward. Rows: causal; causal with a 4096-key window;
packed documents (causal; ``balance="documents"``: short documents whole on a rank, the longest
zigzagged). Each row times one GPU running the whole sequence (T1, rank 0 while
the others wait) and every strategy on all N GPUs (T_N: the slowest rank's time), checked first
against the one-GPU output on each rank's rows; efficiency = T1 / (N x T_N). Beside them torch's
``context_parallel`` (SDPA, cuDNN backend, causal; its own round-robin sharding), where it runs.
The process group's NCCL streams run at high priority (``cp.cp_group``'s reason), for torch's
``context_parallel`` too. Per-GPU peak memory of each run is reported: the step's own, from its q, k, v on (inputs, outputs,
gradients, activations, communication buffers), the largest rank's.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import torch
import torch.distributed as dist

import fusedattn
from fusedattn import distributed as cp

HEADS_Q, HEADS_KV, HEAD_DIM = 32, 8, 128
WINDOW = 4096


class _Memory:
    """The step's memory on a CUDA device (nothing to report on the CPU, where the bench runs only
    as a smoke test of its own code)."""

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"

    def sync(self) -> None:
        if self.cuda:
            torch.cuda.synchronize()

    def start(self) -> int:
        if not self.cuda:
            return 0
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        return torch.cuda.memory_allocated()

    def peak_gb(self, base: int) -> float:
        return (torch.cuda.max_memory_allocated() - base) / 2**30 if self.cuda else 0.0


def _timed(fn, iters: int = 7, together: bool = True) -> float:
    """ms per call of ``fn`` (forward+backward), the median of ``iters`` after one warm-up;
    ``together``: every rank synchronised around each call (the step ends with its slowest rank)."""
    fn()
    times = []
    sync = torch.cuda.synchronize if torch.cuda.is_available() else (lambda: None)
    for _ in range(iters):
        if together:
            dist.barrier()
        sync()
        start = time.perf_counter()
        fn()
        sync()
        if together:
            dist.barrier()
        times.append((time.perf_counter() - start) * 1e3)
    return sorted(times)[len(times) // 2]


def _documents(total: int, world: int, granule: int = 64) -> list:
    """Document lengths summing to ``total``, each a multiple of 2N x ``granule`` (zigzag per
    document): a fixed mix of long and short documents."""
    unit = 2 * world * granule
    weights = [8, 3, 5, 1, 2, 6, 4, 3]
    lengths = [max(unit, total * w // sum(weights) // unit * unit) for w in weights]
    lengths[-1] += total - sum(lengths)
    return lengths


def _rows(world: int, window: int = WINDOW) -> list:
    return [dict(key="causal", name="causal", causal=True, window=None, documents=False),
            dict(key="window", name=f"causal, window {window}", causal=True, window=(window, 0), documents=False),
            dict(key="documents", name="packed documents, causal", causal=True, window=None, documents=True)]


def whole_sequence_step(leaves: list, dout: torch.Tensor, options: dict, cu=None, lengths=None):
    """One GPU's forward+backward over the whole sequence (T1): ``leaves`` q, k, v (B, S, H, D);
    with ``cu`` (and the document ``lengths``) packed documents of batch row 0. Returns the output."""
    def whole():
        if cu is None:
            o = fusedattn.attention(*leaves, **options)
        else:
            o = fusedattn.varlen_attention(*(t[0] for t in leaves), cu, cu, max(lengths), max(lengths),
                                           **options)[None]
        o.backward(dout)
        return o
    return whole


def run(seqlen: int, strategies: list, out_path: Path | None, env: dict, heads: tuple = (HEADS_Q, HEADS_KV),
        head_dim: int = HEAD_DIM, window: int = WINDOW, granule: int = 64, rows: tuple | None = None) -> list:
    """Every row (or those named in ``rows``: "causal", "window", "documents"), T1 then each
    strategy (module docstring). On the CPU (gloo, float32) with small ``heads``, ``head_dim``,
    ``window`` and document ``granule``: a smoke test of this code."""
    rank, world = dist.get_rank(), dist.get_world_size()
    # gloo moves CPU tensors: a gloo group runs the CPU smoke test even where a GPU is present
    on_gpu = torch.cuda.is_available() and dist.get_backend() != "gloo"
    device = torch.device("cuda", torch.cuda.current_device()) if on_gpu else torch.device("cpu")
    dtype = torch.bfloat16 if on_gpu else torch.float32
    memory = _Memory(device)
    gen = torch.Generator(device=device).manual_seed(0)
    shape_q, shape_kv = (1, seqlen, heads[0], head_dim), (1, seqlen, heads[1], head_dim)
    q, dout = (torch.randn(shape_q, device=device, dtype=dtype, generator=gen) for _ in range(2))
    k, v = (torch.randn(shape_kv, device=device, dtype=dtype, generator=gen) for _ in range(2))
    results = []
    for row in _rows(world, window):
        if rows is not None and row["key"] not in rows:
            continue
        lengths = _documents(seqlen, world, granule) if row["documents"] else None
        cu = None if lengths is None else torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()],
                                                       dtype=torch.int32, device=device)
        options = dict(causal=row["causal"], window=row["window"])
        # T1: the whole sequence on rank 0
        one = dict(row=row["name"], system="fusedattn, 1 GPU", gpus=1, seqlen=seqlen)
        reference = None
        if rank == 0:
            base = memory.start()  # the step's memory: from its own q, k, v on
            leaves = [t.detach().clone().requires_grad_() for t in (q, k, v)]
            whole = whole_sequence_step(leaves, dout, options, cu, lengths)
            one["fwdbwd_ms"] = _timed(whole, together=False)
            one["peak_gb"] = memory.peak_gb(base)
            reference = whole().detach()
            for t in leaves:
                t.grad = None
        dist.barrier()  # the other ranks wait for rank 0's whole sequence
        ref = torch.empty_like(q) if reference is None else reference
        dist.broadcast(ref, 0)
        results.append(one)
        plan = cp.shard_plan(seqlen, balance="zigzag") if cu is None else \
            cp.shard_plan(cu_seqlens=cu.cpu(), balance="documents")

        def local(t):
            return plan.shard(t[0] if cu is not None else t)
        ql, kl, vl, dl = (local(t).detach().clone() for t in (q, k, v, dout))
        for strategy in strategies:
            entry = dict(row=row["name"], system=f"fusedattn cp {strategy}", gpus=world, seqlen=seqlen)
            try:
                base = memory.start()
                leaves = [t.clone().requires_grad_() for t in (ql, kl, vl)]
                used = strategy if strategy != "auto" else \
                    cp.choose_strategy(plan, *heads, options["window"], causal=options["causal"])

                def step():
                    o = cp.cp_attention(*leaves, plan, strategy=used, **options)
                    o.backward(dl)
                    return o
                out = step().detach()
                err = (out.float() - local(ref).float()).abs().max()
                dist.all_reduce(err, op=dist.ReduceOp.MAX)
                entry["max_abs_diff_vs_1gpu"] = err.item()
                if err.item() > 0.05:
                    entry["note"] = f"output differs from one GPU's by {err.item():.3g}: not timed"
                else:
                    entry["fwdbwd_ms"] = _timed(step)
                    peak = torch.tensor(memory.peak_gb(base), device=device)
                    dist.all_reduce(peak, op=dist.ReduceOp.MAX)
                    entry["peak_gb"] = peak.item()
                    if "fwdbwd_ms" in one:
                        entry["efficiency"] = one["fwdbwd_ms"] / (world * entry["fwdbwd_ms"])
                entry["strategy"], entry["balance"] = used, plan.balance
            except Exception as e:  # a strategy that cannot run this row is a result
                entry["note"] = f"{type(e).__name__}: {str(e)[:200]}"
            _share_t1(entry, device)
            results.append(entry)
            _save(results, out_path, env, rank)
        if on_gpu and cu is None and not row["window"]:
            results.append(_torch_context_parallel(row, q, k, v, dout, seqlen, one, world))
        _save(results, out_path, env, rank)
    return results


def _share_t1(entry: dict, device: torch.device) -> None:
    """T1 lives on rank 0: every rank's entry gets rank 0's efficiency."""
    value = torch.tensor(entry.get("efficiency", float("nan")), device=device)
    dist.broadcast(value, 0)
    if value.isfinite():
        entry["efficiency"] = value.item()


def _torch_context_parallel(row, q, k, v, dout, seqlen, one, world) -> dict:
    """torch's context_parallel around SDPA (cuDNN backend, is_causal), K/V heads expanded to Hq
    (its ring has no GQA)."""
    entry = dict(row=row["name"], system="torch context_parallel, SDPA cuDNN", gpus=world, seqlen=seqlen)
    try:
        import torch.nn.functional as F
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.tensor.experimental import context_parallel
        from torch.nn.attention import SDPBackend, sdpa_kernel

        mesh = init_device_mesh("cuda", (world,))
        group = HEADS_Q // HEADS_KV
        buffers = [t.transpose(1, 2).contiguous() for t in (q, k.repeat_interleave(group, 2),
                                                            v.repeat_interleave(group, 2), dout)]
        qt, kt, vt, dt = buffers
        memory = _Memory(q.device)
        with context_parallel(mesh, buffers=buffers, buffer_seq_dims=[2, 2, 2, 2]):
            base = memory.start()
            leaves = [t.detach().clone().requires_grad_() for t in (qt, kt, vt)]

            def step():
                with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
                    o = F.scaled_dot_product_attention(*leaves, is_causal=True)
                o.backward(dt)
            entry["fwdbwd_ms"] = _timed(step)
            peak = torch.tensor(memory.peak_gb(base), device=q.device)
            dist.all_reduce(peak, op=dist.ReduceOp.MAX)
            entry["peak_gb"] = peak.item()
        t1 = torch.tensor(one.get("fwdbwd_ms", float("nan")), device="cuda")
        dist.broadcast(t1, 0)
        entry["efficiency"] = t1.item() / (world * entry["fwdbwd_ms"])
        entry["note"] = "its output is not checked against ours (its own sharding and SDPA's kernel)"
    except Exception as e:
        entry["note"] = f"{type(e).__name__}: {str(e)[:200]}"
    return entry


def _save(results, out_path, env, rank) -> None:
    if rank == 0 and out_path is not None:
        out_path.parent.mkdir(parents=True, exist_ok=True)
        out_path.write_text(json.dumps(dict(environment=env, rows=results), indent=1))


def table(results: list) -> str:
    lines = [f"{'row':<28} {'system':<36} {'GPUs':>4} {'f+b ms':>9} {'efficiency':>10} {'peak GB':>8}  note"]
    for r in results:
        ms = f"{r['fwdbwd_ms']:.1f}" if "fwdbwd_ms" in r else "--"
        eff = f"{100 * r['efficiency']:.1f}%" if "efficiency" in r else "--"
        peak = f"{r['peak_gb']:.1f}" if "peak_gb" in r else "--"
        lines.append(f"{r['row']:<28} {r['system']:<36} {r['gpus']:>4} {ms:>9} {eff:>10} {peak:>8}  {r.get('note', '')}")
    return "\n".join(lines)


def plot(results: list, path: Path, title: str) -> bool:
    """Efficiency (T1 / (N x T_N)) of every multi-GPU system, grouped by row; the issue's bars
    dashed. False where matplotlib is missing."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    rows = list(dict.fromkeys(r["row"] for r in results))
    systems = list(dict.fromkeys(r["system"] for r in results if r["gpus"] > 1))
    fig, ax = plt.subplots(figsize=(8, 3.6))
    width = 0.8 / max(len(systems), 1)
    for i, system in enumerate(systems):
        values = [next((100 * r["efficiency"] for r in results if r["row"] == row and r["system"] == system
                        and "efficiency" in r), 0.0) for row in rows]
        ax.bar([x + i * width for x in range(len(rows))], values, width, label=system)
    for bar, style in ((90, "--"), (85, ":")):
        ax.axhline(bar, color="gray", linestyle=style, linewidth=1)
    ax.set_xticks([x + width * (len(systems) - 1) / 2 for x in range(len(rows))], rows, fontsize=8)
    ax.set_ylabel("efficiency, % (T1 / (N x T_N))")
    ax.set_ylim(0, 105)
    ax.legend(fontsize=7, loc="lower left")
    ax.set_title(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    return True


def main(args, env: dict, stem: str) -> None:
    if "WORLD_SIZE" not in os.environ or not torch.cuda.is_available():
        print("fusedattn benchmark --cp: run it under torchrun on CUDA devices, one process per GPU, e.g.\n"
              "  torchrun --nproc-per-node 2 -m fusedattn.bench --cp")
        return
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    torch.cuda.set_device(local_rank)
    # NCCL at high priority (cp.cp_group's reason), for every system here: torch's context_parallel too
    dist.init_process_group("nccl", device_id=torch.device("cuda", local_rank),
                            pg_options=dist.ProcessGroupNCCL.Options(is_high_priority_stream=True))
    world = dist.get_world_size()
    seqlen = args.cp_seqlen or 32768 * world
    strategies = args.cp_strategies.split(",")
    out_path = None if args.no_save else Path(args.out) / f"{stem}-{world}gpu.json"
    try:
        rows = None if args.cp_rows is None else tuple(args.cp_rows.split(","))
        results = run(seqlen, strategies, out_path, env, rows=rows)
        if dist.get_rank() == 0:
            print(table(results))
            if out_path is not None:
                print(f"wrote {out_path}")
                title = f"{env['device']} x {world}: {seqlen // 1024}k tokens, bf16, Hq=32, Hkv=8, D=128, fwd+bwd"
                if plot(results, out_path.with_suffix(".png"), title):
                    print(f"wrote {out_path.with_suffix('.png')}")
    finally:
        dist.destroy_process_group()
