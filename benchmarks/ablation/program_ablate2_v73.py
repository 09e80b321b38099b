"""Per-program cost of the dK/dV kernel under experiment switches; the per-program timeline."""
import json, sys, time
sys.path.insert(0, "benchmarks")
import torch
import fusedattn
from fusedattn.kernels.shared.knobs import overridden
from fusedattn.kernels.gluon import bwd as gbwd
from program_cost import kernel_times, role, fit

OUT = sys.argv[1]
def run(d, causal, s, kn, iters=10):
    gen = torch.Generator(device="cuda").manual_seed(0)
    size = (16384 // s, 2048 // d, s, d)
    q, k, v, dout = (torch.randn(size, device="cuda", dtype=torch.bfloat16, generator=gen) for _ in range(4))
    leaves = [t.requires_grad_() for t in (q, k, v)]
    def step():
        for t in leaves:
            t.grad = None
        fusedattn.attention(*leaves, layout="bhsd", causal=causal).backward(dout)
    with overridden(**kn):
        times = kernel_times(step, iters)
        if kn.get("ablate", 0) & 32 and s in (1024, 4096):
            buf = gbwd.timeline(q.device)
            buf.zero_()
            step(); torch.cuda.synchronize()
            torch.save(buf[: 16 * 8192].cpu(), f"{OUT}/timeline-D{d}-{'c' if causal else 'f'}-S{s}-a{kn['ablate']}.pt")
    return sum(t for n, t in times.items() if role(n) == "dkdv")

variants = [("base", {}), ("no-dkdv-store", {"ablate": 1}), ("no-mask", {"ablate": 8}),
            ("masked-first", {"ablate": 4}), ("stamps", {"ablate": 32})]
out = []
seqlens = [512, 1024, 2048, 4096]
for d, causal, names in [(64, True, None), (64, False, ("base", "no-dkdv-store", "stamps")), (128, True, ("base", "no-dkdv-store", "no-mask", "stamps"))]:
    for name, kn in variants:
        if names and name not in names:
            continue
        t0 = time.time()
        ts = [run(d, causal, s, kn) for s in seqlens]
        a, b = fit([float(s) for s in seqlens], ts)
        print(f"D={d} {'causal' if causal else 'full':6s} {name:14s} " + " ".join(f"{t:8.1f}" for t in ts) +
              f" | fit {a:7.1f} + {b*1024:7.1f}/1k ({time.time()-t0:.0f}s)", flush=True)
        out.append({"head_dim": d, "causal": causal, "variant": name, "knobs": kn, "seqlens": seqlens, "dkdv_us": ts})
json.dump(out, open(f"{OUT}/ablate-pc2.json", "w"), indent=1)
