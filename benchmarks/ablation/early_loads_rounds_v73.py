"""A/B (alternating rounds) of the early loads: dK/dV kernel us."""
import json, sys
sys.path.insert(0, "benchmarks")
import torch
import fusedattn
from fusedattn.kernels.shared.knobs import overridden
from program_cost import kernel_times, role

OUT = sys.argv[1]
variants = [("old", 128), ("kv-early", 256), ("kv+step0-early", 0)]
rows = {}
for rnd in range(3):
    for d in (64, 128):
        for causal in (True, False):
            for s in (1024, 4096):
                gen = torch.Generator(device="cuda").manual_seed(0)
                size = (16384 // s, 2048 // d, s, d)
                q, k, v, dout = (torch.randn(size, device="cuda", dtype=torch.bfloat16, generator=gen) for _ in range(4))
                leaves = [t.requires_grad_() for t in (q, k, v)]
                def step():
                    for t in leaves:
                        t.grad = None
                    fusedattn.attention(*leaves, layout="bhsd", causal=causal).backward(dout)
                order = variants if rnd % 2 == 0 else variants[::-1]
                for name, a in order:
                    with overridden(ablate=a):
                        times = kernel_times(step, 10)
                    rows.setdefault((d, causal, s, name), []).append(sum(t for n, t in times.items() if role(n) == "dkdv"))
out = []
for (d, causal, s, name), ts in sorted(rows.items()):
    ts.sort()
    print(f"D={d} {'causal' if causal else 'full':6s} S={s:5d} {name:15s} median {ts[1]:8.1f}  ({ts[0]:.1f}-{ts[2]:.1f})")
    out.append({"head_dim": d, "causal": causal, "seqlen": s, "variant": name, "dkdv_us": ts})
json.dump(out, open(f"{OUT}/ab73b.json", "w"), indent=1)
