"""Host time of a short training step, for comparing two source trees side by side (issue 3).

The GPU machine's host speed moves +-30% between processes and minutes (NOTES.md v36, v48), far
more than a host-time change moves it, so processes run one after the other cannot compare two
trees. This script times one tree; run two copies *at the same time*, one per tree, on disjoint
cores, and swap the cores for a second pair: both see the same machine state.

    git archive HEAD src | tar -x -C /tmp/old
    PYTHONPATH=/tmp/old/src taskset -c 0-3 python benchmarks/host_ab.py 20 & \
    PYTHONPATH=src taskset -c 8-11 python benchmarks/host_ab.py 20 & wait

Prints the medians (us a step, and the sample count) of: the forward call on the main thread
(``fwd``); forward plus the backward's body called directly on the main thread (``fwd+body``,
``grad_fn.apply``); and forward plus ``backward()`` (``step``: the autograd engine runs the body
on its device thread, where the same Python takes ~2x as long). The GPU is kept busy by a sleep
kernel, so only the host is timed. D=128 S=1k causal, B=16 H=16, bhsd (the bench's host-bound row).
"""

from __future__ import annotations

import json
import statistics
import sys
import time

import torch

import fusedattn


def main(seconds: float, deterministic: bool) -> dict:
    batch, heads, seqlen, head_dim = 16, 16, 1024, 128
    gen = torch.Generator(device="cuda").manual_seed(0)
    q, k, v, dout = (torch.randn((batch, heads, seqlen, head_dim), device="cuda", dtype=torch.bfloat16,
                                 generator=gen) for _ in range(4))
    leaves = [t.requires_grad_() for t in (q, k, v)]

    def forward():
        return fusedattn.attention(*leaves, layout="bhsd", causal=True, deterministic=deterministic)

    def step():
        out = forward()
        out.backward(dout)

    def body():
        out = forward()  # kept alive: the node reads it back as a saved output
        out.grad_fn.apply(dout, None)

    for _ in range(5):
        step()
    torch.cuda.synchronize()
    samples: dict = {"fwd": [], "fwd+body": [], "step": []}
    calls = {"fwd": forward, "fwd+body": body, "step": step}
    end = time.time() + seconds
    while time.time() < end:
        for name, call in calls.items():
            torch.cuda._sleep(int(10 * 1.7e6))  # ~10 ms of GPU work ahead of the timed calls
            start = time.perf_counter()
            for _ in range(10):
                for t in leaves:
                    t.grad = None
                call()
            samples[name].append((time.perf_counter() - start) / 10 * 1e6)
            torch.cuda.synchronize()
    return {name: [round(statistics.median(vals), 1), len(vals)] for name, vals in samples.items()}


if __name__ == "__main__":
    print(json.dumps(main(float(sys.argv[1]) if len(sys.argv) > 1 else 20.0, "det" in sys.argv[2:])))
