"""Per-program cost of the dK/dV kernel under experiment switches: dK/dV kernel time at several S."""
import json, sys, time
sys.path.insert(0, "benchmarks")
import torch
import fusedattn
from fusedattn.kernels.shared.knobs import overridden
from program_cost import kernel_times, role, fit

variants = [("base", {}), ("chunk1", {"chunk_heads": 1}), ("no-dkdv-store", {"ablate": 1}),
            ("no-last-dsbar", {"ablate": 2}), ("masked-first", {"ablate": 4}), ("store+dsbar", {"ablate": 3})]
out = []
for d, causal, names in [(64, True, None), (64, False, ("base", "no-dkdv-store", "chunk1")),
                         (128, True, ("base", "masked-first", "no-dkdv-store", "chunk1"))]:
    for name, kn in variants:
        if names and name not in names:
            continue
        ts = []
        seqlens = [512, 1024, 2048, 4096]
        t0 = time.time()
        for s in seqlens:
            gen = torch.Generator(device="cuda").manual_seed(0)
            size = (16384 // s, 2048 // d, s, d)
            q, k, v, dout = (torch.randn(size, device="cuda", dtype=torch.bfloat16, generator=gen) for _ in range(4))
            leaves = [t.requires_grad_() for t in (q, k, v)]
            def step():
                for t in leaves:
                    t.grad = None
                fusedattn.attention(*leaves, layout="bhsd", causal=causal).backward(dout)
            with overridden(**kn):
                times = kernel_times(step, 10)
            ts.append(sum(t for n, t in times.items() if role(n) == "dkdv"))
        a, b = fit([float(s) for s in seqlens], ts)
        a2, b2 = fit([1024.0, 4096.0], [ts[1], ts[3]])
        line = f"D={d} {'causal' if causal else 'full':6s} {name:14s} " + " ".join(f"{t:8.1f}" for t in ts) + \
               f" | fit {a:7.1f} + {b*1024:7.1f}/1k | 1k-4k {a2:7.1f} + {b2*1024:7.1f}/1k  ({time.time()-t0:.0f}s)"
        print(line, flush=True)
        out.append({"head_dim": d, "causal": causal, "variant": name, "knobs": kn, "seqlens": seqlens, "dkdv_us": ts})
json.dump(out, open(sys.argv[1], "w"), indent=1)
