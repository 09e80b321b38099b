"""fwd+bwd in a short burst (boost clock) and sustained for seconds (the board's power cap), each
system side by side in one process, with the SM clock and power sampled by nvidia-smi through the
sustained phase: how much of a ratio is SM cycles and how much the clock each system's draw
leaves it at the cap.

    python benchmarks/sustained_clock.py [--systems fusedattn,fa4,sdpa-cudnn] [--seconds 3] [--out F.json]

Per (shape, system, round): ``burst_ms`` (20 steps after 1 s idle), ``sustained_ms`` (steps over
``--seconds`` after 0.5 s of load), the mean SM clock and power over the sustained window,
and ``kcycles`` = sustained_ms x MHz (thousands of SM cycles a step: what the step costs at any
clock). Two systems with equal kcycles and different sustained_ms differ only in the clock their
power leaves them. Timing only: outputs are not compared (``python -m fusedattn.bench`` does).
"""

from __future__ import annotations

import argparse
import collections
import datetime
import json
import statistics
import subprocess
import time

import torch

from fusedattn.bench.systems import SYSTEMS, Shape, stored_as

SHAPES = "4096:full:128:16,16384:full:128:16,4096:causal:128:16,4096:full:64:32,4096:causal:64:32"


def _timed(step, count: int) -> float:
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(count):
        step()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / count


def _samples(path: str, begin: float, end: float) -> list[tuple[float, float]]:
    """(MHz, W) samples nvidia-smi wrote between wall times ``begin`` and ``end``."""
    out = []
    with open(path) as f:
        for line in f:
            parts = [p.strip() for p in line.split(",")]
            if len(parts) < 3:
                continue
            try:
                stamp = datetime.datetime.strptime(parts[0], "%Y/%m/%d %H:%M:%S.%f").timestamp()
                mhz, watts = float(parts[1]), float(parts[2])
            except ValueError:
                continue
            if begin <= stamp <= end:
                out.append((mhz, watts))
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--systems", default="fusedattn,fa4,sdpa-cudnn")
    p.add_argument("--shapes", default=SHAPES, help="S:full|causal:D:H, B x S = 16k")
    p.add_argument("--seconds", type=float, default=3.0)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--log", default="/tmp/smi.csv")
    p.add_argument("--out", default="sustained-clock.json")
    args = p.parse_args()
    smi = subprocess.Popen(["nvidia-smi", "--query-gpu=timestamp,clocks.sm,power.draw", "--format=csv,noheader,nounits",
                            "-lms", "50", "-i", str(torch.cuda.current_device())], stdout=open(args.log, "w"))
    rows = []
    try:
        for shape in args.shapes.split(","):
            seqlen, kind, head_dim, heads = shape.split(":")
            seqlen, head_dim, heads, causal = int(seqlen), int(head_dim), int(heads), kind == "causal"
            gen = torch.Generator(device="cuda").manual_seed(0)
            base = [torch.randn(16384 // seqlen, heads, seqlen, head_dim, device="cuda", dtype=torch.bfloat16,
                                generator=gen) for _ in range(4)]
            steps = {}
            by_name = {system.name: system for system in SYSTEMS}
            for name in args.systems.split(","):
                system = by_name[name]  # the bench's own call of each system, on its own storage layout
                call = system.make(Shape(16384 // seqlen, heads, seqlen, head_dim, causal))
                leaves = [stored_as(t, system.layout).clone().requires_grad_() for t in base[:3]]
                grad = stored_as(base[3], system.layout)

                def step(call=call, leaves=leaves, grad=grad):
                    for t in leaves:
                        t.grad = None
                    call(*leaves).backward(grad)
                for _ in range(3):
                    step()
                torch.cuda.synchronize()
                steps[name] = step
            medians = collections.defaultdict(lambda: collections.defaultdict(list))
            for rnd in range(args.rounds):
                for name, step in steps.items():
                    time.sleep(1.0)  # idle: the clock back at boost
                    burst = _timed(step, 20)
                    warm_until = time.time() + 0.5
                    while time.time() < warm_until:
                        _timed(step, 5)
                    begin = time.time()
                    count, total = 0, 0.0
                    while time.time() - begin < args.seconds:
                        total += _timed(step, 10) * 10
                        count += 10
                    end = time.time()
                    sustained = total / count
                    time.sleep(0.2)  # nvidia-smi's last samples of the window written
                    samples = _samples(args.log, begin, end)
                    mhz = statistics.mean(s[0] for s in samples) if samples else float("nan")
                    watts = statistics.mean(s[1] for s in samples) if samples else float("nan")
                    row = dict(S=seqlen, D=head_dim, H=heads, causal=causal, system=name, round=rnd, burst_ms=burst,
                               sustained_ms=sustained, mhz=mhz, watts=watts, samples=len(samples),
                               kcycles=sustained * mhz)
                    rows.append(row)
                    for key in ("burst_ms", "sustained_ms", "mhz", "watts", "kcycles"):
                        medians[name][key].append(row[key])
            ref = medians.get("fusedattn")
            for name, m in medians.items():
                med = {k: statistics.median(v) for k, v in m.items()}
                vs = ""
                if ref and name != "fusedattn":
                    r = {k: statistics.median(v) for k, v in ref.items()}
                    vs = (f"  its / ours: burst {med['burst_ms'] / r['burst_ms']:.3f} sustained "
                          f"{med['sustained_ms'] / r['sustained_ms']:.3f} kcycles {med['kcycles'] / r['kcycles']:.3f}")
                print(f"D={head_dim} S={seqlen} {kind:6s} {name:11s} burst {med['burst_ms']:.3f} ms  sustained "
                      f"{med['sustained_ms']:.3f} ms at {med['mhz']:.0f} MHz {med['watts']:.0f} W  "
                      f"kcycles {med['kcycles']:.0f}{vs}", flush=True)
    finally:
        smi.terminate()
    with open(args.out, "w") as f:
        json.dump({"device": torch.cuda.get_device_name(), "rows": rows}, f, indent=1)
    print("wrote", args.out)


if __name__ == "__main__":
    main()
