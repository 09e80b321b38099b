"""A/B of the dK/dV pass's per-program changes: kernel times at several S; gradients compared."""
import json, sys, time
sys.path.insert(0, "benchmarks")
import torch
import fusedattn
from fusedattn.kernels.shared.knobs import overridden
from fusedattn.kernels.gluon import bwd as gbwd
from program_cost import kernel_times, role, fit

OUT = sys.argv[1]
variants = [("old", 192), ("early-loads", 64), ("pointer-stores", 128), ("both", 0)]
def inputs(d, s, seed=0):
    gen = torch.Generator(device="cuda").manual_seed(seed)
    size = (16384 // s, 2048 // d, s, d)
    return [torch.randn(size, device="cuda", dtype=torch.bfloat16, generator=gen) for _ in range(4)]
# correctness: every variant's gradients against the old path's, bitwise, and odd lengths vs fp64 reference
for d in (64, 128):
    for causal in (True, False):
        for s_q, s_k, b in ((1024, 1024, 2), (999, 1100, 1), (200, 77, 3)):
            gen = torch.Generator(device="cuda").manual_seed(1)
            q = torch.randn(b, 4, s_q, d, device="cuda", dtype=torch.bfloat16, generator=gen)
            k, v = (torch.randn(b, 4, s_k, d, device="cuda", dtype=torch.bfloat16, generator=gen) for _ in range(2))
            do = torch.randn(b, 4, s_q, d, device="cuda", dtype=torch.bfloat16, generator=gen)
            grads = {}
            for name, a in variants:
                leaves = [t.clone().requires_grad_() for t in (q, k, v)]
                with overridden(ablate=a):
                    fusedattn.attention(*leaves, layout="bhsd", causal=causal).backward(do)
                grads[name] = [t.grad for t in leaves]
            ref = [t.detach().double().requires_grad_() for t in (q, k, v)]
            sc = d ** -0.5
            sco = ref[0] @ ref[1].transpose(-1, -2) * sc
            if causal:
                i = torch.arange(s_q, device="cuda")[:, None]; j = torch.arange(s_k, device="cuda")[None]
                sco = sco.masked_fill(j > i + (s_k - s_q), float("-inf"))
            out = torch.softmax(sco, -1).nan_to_num(0.0) @ ref[2]
            out.backward(do.double())
            errs = [max((g.double() - r.grad).abs().max().item() for g, r in zip(grads["both"], ref))]
            same = {n: all(torch.equal(a, b) for a, b in zip(grads[n], grads["old"])) for n in grads}
            print(f"check D={d} causal={causal} {s_q}x{s_k} b={b}: bitwise vs old {same}; max err vs fp64 {errs[0]:.4f}", flush=True)
out = []
seqlens = [512, 1024, 2048, 4096]
for d in (64, 128):
    for causal in (True, False):
        for name, a in variants:
            ts = []
            for s in seqlens:
                q, k, v, dout = inputs(d, s)
                leaves = [t.requires_grad_() for t in (q, k, v)]
                def step():
                    for t in leaves:
                        t.grad = None
                    fusedattn.attention(*leaves, layout="bhsd", causal=causal).backward(dout)
                with overridden(ablate=a):
                    times = kernel_times(step, 10)
                    if a == 32 and s == 1024:
                        pass
                ts.append(sum(t for n, t in times.items() if role(n) == "dkdv"))
            f0, f1 = fit([float(s) for s in seqlens], ts)
            print(f"D={d} {'causal' if causal else 'full':6s} {name:15s} " + " ".join(f"{t:8.1f}" for t in ts) +
                  f" | fit {f0:7.1f} + {f1*1024:7.1f}/1k", flush=True)
            out.append({"head_dim": d, "causal": causal, "variant": name, "ablate": a, "seqlens": seqlens, "dkdv_us": ts})
# timeline of the new path (stamps), D=64 causal 1k
for a in (32, 32 | 192):
    q, k, v, dout = inputs(64, 1024)
    leaves = [t.requires_grad_() for t in (q, k, v)]
    with overridden(ablate=a):
        for _ in range(3):
            fusedattn.attention(*leaves, layout="bhsd", causal=True).backward(dout)
        buf = gbwd.timeline(q.device); buf.zero_()
        fusedattn.attention(*leaves, layout="bhsd", causal=True).backward(dout); torch.cuda.synchronize()
        torch.save(buf[: 16 * 4096].cpu(), f"{OUT}/timeline-D64-c-S1024-a{a}.pt")
json.dump(out, open(f"{OUT}/ab73.json", "w"), indent=1)
