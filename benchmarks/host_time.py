"""Where a short training step's host time goes (issue 3: the eager S=1k causal row).

A step that is host-bound leaves the GPU idle between its kernels: after the forward kernel the
GPU waits for the host to get through the autograd engine and the backward's Python to the first
backward launch. Two views, one process (GPU machine only):

- ``gaps``: a do_bench-like loop (L2 flush, step) of fusedattn and of SDPA cuDNN under the torch
  profiler; per step the GPU's busy time, the step's span on the GPU, and the idle time before each
  kernel (medians over the steps). What the bench's eager row pays for the host is the idle time.
- ``graph_gaps``: the same for the step replayed from a CUDA graph (no host time: what is left
  between kernels is their launch and ramp-up).
- ``pieces``: the GPU kept busy by a sleep kernel (so that nothing the host does waits on it);
  perf_counter around the forward call, ``backward()``, and the named pieces of fusedattn's
  backward (wrapped in place), and the host latency from the forward kernel's launch to each later
  launch of the step (``launch._DirectLaunch`` timestamps). Medians over rounds of 20 steps.

    PYTHONPATH=src python benchmarks/host_time.py --mode gaps,pieces --out $OUT/host.json

Host speed moves +-25% between processes on the GPU machine (NOTES.md v36, v38): compare trees by
alternating processes, never across machines.
"""

from __future__ import annotations

import argparse
import collections
import functools
import importlib
import json
import statistics
import time

import torch
import torch.nn.functional as F

import fusedattn
from fusedattn.kernels.shared import launch as launch_mod

PIECES = [  # (module, attribute): functions timed in ``pieces`` mode (those a tree lacks are skipped)
    ("fusedattn.interface", "_forward_impl"),
    ("fusedattn.interface", "_backward_impl"),
    ("fusedattn.dispatch", "attention_backward"),
    ("fusedattn.dispatch", "attention_forward"),
    ("fusedattn.dispatch", "configs_for"),
    ("fusedattn.dispatch", "plan_forward"),
    ("fusedattn.dispatch", "plan_backward"),
    ("fusedattn.dispatch", "_gluon_dkdv_pass"),
    ("fusedattn.kernels.gluon.bwd", "dkdv_pass"),
    ("fusedattn.kernels.triton.bwd", "run_passes"),
    ("fusedattn.kernels.triton.bwd", "_triton_passes"),
    ("fusedattn.kernels.shared.launch", "Launcher.__call__"),
    ("fusedattn.kernels.gluon.bwd", "descriptor"),
    ("fusedattn.kernels.gluon.fwd", "descriptor"),
    ("fusedattn.kernels.shared.descriptors", "tma_addressable"),
    ("fusedattn.kernels.shared.launch", "_DirectLaunch.__call__"),
    ("fusedattn.kernels.shared.launch", "_DirectLaunch.launch_expanded"),
    ("fusedattn.checks", "check_qkv"),
    ("torch", "empty"),
    ("torch", "Tensor.to"),
]


def _inputs(args, requires_grad: bool):
    gen = torch.Generator(device="cuda").manual_seed(0)
    size = (args.batch, args.heads, args.seqlen, args.head_dim)
    if args.layout == "bshd" and args.storage == "contiguous":
        size = (args.batch, args.seqlen, args.heads, args.head_dim)
    q, k, v, dout = (torch.randn(size, device="cuda", dtype=torch.bfloat16, generator=gen) for _ in range(4))
    if args.layout == "bshd" and args.storage == "transposed":  # bshd views of (B, H, S, D) storage
        q, k, v, dout = (t.transpose(1, 2) for t in (q, k, v, dout))
    if requires_grad:
        q, k, v = (t.requires_grad_() for t in (q, k, v))
    return q, k, v, dout


def _systems(args):
    window = None if args.window is None else (args.window, 0 if args.causal else -1)

    def ours(q, k, v):
        return fusedattn.attention(q, k, v, layout=args.layout, causal=args.causal, window=window,
                                   deterministic=args.deterministic)

    def cudnn(q, k, v):
        if args.layout == "bshd":
            q, k, v = (t.transpose(1, 2) for t in (q, k, v))
        with torch.nn.attention.sdpa_kernel(torch.nn.attention.SDPBackend.CUDNN_ATTENTION):
            out = F.scaled_dot_product_attention(q, k, v, is_causal=args.causal)
        return out.transpose(1, 2) if args.layout == "bshd" else out

    return {"fusedattn": ours} if window else {"fusedattn": ours, "cudnn": cudnn}  # cuDNN: no sliding window


def gaps(args, graph: bool = False) -> dict:
    """GPU busy time, span and idle gaps per step of a do_bench-like loop, each system. ``graph``: the
    step (forward and backward) replayed from a CUDA graph, the flush outside it: the gaps left
    between kernels without any host time (what a kernel's launch and its first wave's ramp-up cost
    after the previous kernel's last wave)."""
    from torch.profiler import ProfilerActivity, profile

    from fusedattn.bench.timing import capture_graph

    flush = torch.empty(256 * 1024 * 1024, dtype=torch.int8, device="cuda")
    result = {}
    for name, fn in _systems(args).items():
        q, k, v, dout = _inputs(args, True)

        def clear_grads():
            for t in (q, k, v):
                t.grad = None

        def eager_step():
            fn(q, k, v).backward(dout)

        replay = capture_graph(eager_step, before_each=clear_grads).replay if graph else eager_step

        def step():
            if not graph:
                clear_grads()
            flush.zero_()
            torch.cuda.nvtx.range_push("step")
            replay()
            torch.cuda.nvtx.range_pop()

        for _ in range(10):
            step()
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(args.steps):
                step()
            torch.cuda.synchronize()
        kernels = sorted((e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA
                          and e.time_range.elapsed_us() > 0), key=lambda e: e.time_range.start)
        # Steps start at the flush (a memset or fill kernel of 256 MB).
        starts = [i for i, e in enumerate(kernels) if e.time_range.elapsed_us() > 40 and
                  ("fill" in e.name.lower() or "memset" in e.name.lower())]
        per_step = collections.defaultdict(list)
        for a, b in zip(starts, starts[1:]):
            body = kernels[a + 1:b]
            if not body:
                continue
            busy = sum(e.time_range.elapsed_us() for e in body)
            span = body[-1].time_range.end - body[0].time_range.start
            per_step["busy_us"].append(busy)
            per_step["span_us"].append(span)
            per_step["idle_us"].append(span - busy)
            prev_end = kernels[a].time_range.end
            for j, e in enumerate(body):
                per_step[f"gap before {j}:{e.name[:40]}"].append(e.time_range.start - prev_end)
                per_step[f"time of {j}:{e.name[:40]}"].append(e.time_range.elapsed_us())
                prev_end = e.time_range.end
        result[name] = {key: round(statistics.median(vals), 1) for key, vals in per_step.items()}
    return result


class _Timers:
    def __init__(self):
        self.totals = collections.defaultdict(float)
        self.marks = []  # (name, perf_counter) of each direct launch

    def wrap(self, module_name: str, attr: str):
        owner = importlib.import_module(module_name)
        *path, attr = attr.split(".")
        for name in path:  # a class's method: "Class.method"
            owner = getattr(owner, name, None)
        original = getattr(owner, attr, None)
        if original is None:
            return
        label = f"{module_name.split('.')[-1]}.{'.'.join([*path, attr])}"

        @functools.wraps(original)
        def timed(*a, **kw):
            start = time.perf_counter()
            try:
                return original(*a, **kw)
            finally:
                self.totals[label] += time.perf_counter() - start

        setattr(owner, attr, timed)

    def hook_launches(self):
        direct = launch_mod._DirectLaunch
        method = "launch_expanded" if hasattr(direct, "launch_expanded") else "__call__"  # older trees
        original = getattr(direct, method)
        names = {}
        marks = self.marks

        def call(launcher, grid3, a, device):
            marks.append((names.get(id(launcher)) or _kernel_name(launcher, names), time.perf_counter()))
            return original(launcher, grid3, a, device)

        setattr(direct, method, call)


def _kernel_name(direct, names: dict) -> str:
    for entry in launch_mod._compiled.values():
        if entry[2] is direct:
            names[id(direct)] = entry[3].__name__ if hasattr(entry[3], "__name__") else str(entry[3])[:40]
            return names[id(direct)]
    return "?"


def pieces(args) -> dict:
    """Host time of a step's pieces with the GPU kept busy (module docstring)."""
    timers = _Timers()
    if not args.bare:  # the wrappers cost ~1 us a call: A/B of whole calls runs bare
        for module_name, attr in PIECES:
            timers.wrap(module_name, attr)
        timers.hook_launches()
    fn = _systems(args)["fusedattn"]
    q, k, v, dout = _inputs(args, True)
    for _ in range(5):
        fn(q, k, v).backward(dout)
    torch.cuda.synchronize()
    samples = collections.defaultdict(list)
    for _ in range(args.rounds):
        timers.totals.clear()
        timers.marks.clear()
        torch.cuda._sleep(int(args.sleep_ms * 1.7e6))  # keeps the GPU busy past the round's host work
        fwd_t = bwd_t = 0.0
        latencies = collections.defaultdict(float)
        for _ in range(args.round_steps):
            for t in (q, k, v):
                t.grad = None
            first_mark = len(timers.marks)
            start = time.perf_counter()
            out = fn(q, k, v)
            mid = time.perf_counter()
            out.backward(dout)
            fwd_t += mid - start
            bwd_t += time.perf_counter() - mid
            step_marks = timers.marks[first_mark:]
            for i, (name, t) in enumerate(step_marks[1:], 1):
                latencies[f"launch {i} ({name}) after forward launch"] += t - step_marks[0][1]
        torch.cuda.synchronize()
        n = args.round_steps
        samples["forward call"].append(fwd_t / n * 1e6)
        samples["backward() call"].append(bwd_t / n * 1e6)
        for label, total in timers.totals.items():
            samples[label].append(total / n * 1e6)
        for label, total in latencies.items():
            samples[label].append(total / n * 1e6)
    report = {label: round(statistics.median(vals), 1) for label, vals in samples.items()}
    report.update({f"{label} (min)": round(min(samples[label]), 1) for label in ("forward call", "backward() call")})
    return report


def cprofile(args) -> dict:
    """cProfile of the forward call (main thread) and of the backward's body on the thread the
    autograd engine runs it on: the top functions by own time, per step (profiler overhead included)."""
    import cProfile
    import io
    import pstats

    from fusedattn import interface

    profiles = {"forward": cProfile.Profile(), "backward": cProfile.Profile()}
    original = interface._backward_impl

    def profiled_backward(*a, **kw):
        profiles["backward"].enable()
        try:
            return original(*a, **kw)
        finally:
            profiles["backward"].disable()

    fn = _systems(args)["fusedattn"]
    q, k, v, dout = _inputs(args, True)
    for _ in range(5):
        fn(q, k, v).backward(dout)
    interface._backward_impl = profiled_backward
    torch.cuda._sleep(int(args.sleep_ms * 1.7e6))
    for _ in range(args.round_steps):
        for t in (q, k, v):
            t.grad = None
        profiles["forward"].enable()
        out = fn(q, k, v)
        profiles["forward"].disable()
        out.backward(dout)
    torch.cuda.synchronize()
    interface._backward_impl = original
    report = {}
    for name, prof in profiles.items():
        stats = pstats.Stats(prof, stream=io.StringIO()).stats
        rows = sorted(stats.items(), key=lambda item: -item[1][2])[:32]
        steps = args.round_steps
        report[name] = [f"{tt / steps * 1e6:8.1f} us own {ct / steps * 1e6:8.1f} us cum {nc // steps:4d}x "
                        f"{file.split('/')[-1]}:{line}({func})" for (file, line, func), (_, nc, tt, ct, _) in rows]
    return report


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--mode", default="gaps,pieces")
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--seqlen", type=int, default=1024)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--causal", action=argparse.BooleanOptionalAction, default=True)
    p.add_argument("--layout", default="bhsd", choices=("bhsd", "bshd"))
    p.add_argument("--storage", default="contiguous", choices=("contiguous", "transposed"),
                   help="bshd inputs: contiguous (B, S, H, D) leaves, or transposed views of (B, H, S, D) storage")
    p.add_argument("--deterministic", action="store_true")
    p.add_argument("--window", type=int, default=None, help="a left window (fusedattn only; right: causal or none)")
    p.add_argument("--steps", type=int, default=30, help="profiled steps (gaps)")
    p.add_argument("--rounds", type=int, default=7, help="rounds of GPU-busy host timing (pieces)")
    p.add_argument("--round-steps", type=int, default=20)
    p.add_argument("--sleep-ms", type=float, default=60.0)
    p.add_argument("--bare", action="store_true", help="pieces: whole calls only, nothing wrapped")
    p.add_argument("--label", default="")
    p.add_argument("--out", default=None)
    args = p.parse_args()
    report = {"label": args.label, "device": torch.cuda.get_device_name(), "args": vars(args)}
    for mode in args.mode.split(","):
        report[mode] = {"gaps": gaps, "graph_gaps": functools.partial(gaps, graph=True), "pieces": pieces,
                        "cprofile": cprofile}[mode](args)
    text = json.dumps(report, indent=1)
    print(text)
    if args.out:
        with open(args.out, "a") as f:
            f.write(json.dumps(report) + "\n")


if __name__ == "__main__":
    main()
