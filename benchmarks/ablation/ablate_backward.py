"""Ablations side by side, one process: our dK/dV+dQ pass (Knobs.ablate) and FA4's SM90 backward
(patched copies, .gpu/fa4_ablate_patch.py), backward ms; dK/dV compared with each one's own baseline
(the dQ ablations must leave them exact)."""
import importlib, json, site, sys
site.addsitedir("/root/fa4/site")
import torch, triton
import flash_attn.cute.interface as I
from flash_attn.cute import flash_attn_func
from flash_attn.cute.cache_utils import JITCache
import fusedattn
from fusedattn.kernels.shared import knobs

ABL = [int(a) for a in sys.argv[2].split(",")]
FA4_ABL = [int(a) for a in sys.argv[4].split(",")] if len(sys.argv) > 4 else ABL
classes = {0: I.FlashAttentionBackwardSm90}
for n in FA4_ABL:
    if n:
        classes[n] = importlib.import_module(f"flash_attn.cute.flash_bwd_sm90_abl{n}").FlashAttentionBackwardSm90
caches = {n: JITCache() for n in classes}

def use_fa4(n):
    I.FlashAttentionBackwardSm90 = classes[n]
    I._flash_attn_bwd.compile_cache = caches[n]

rows = []
dev = torch.device("cuda")
for shape in sys.argv[1].split(","):
    d, s, kind = shape.split(":"); d, s, causal = int(d), int(s), kind == "causal"
    h = 2048 // d; b = 16384 // s
    g = torch.Generator(device=dev).manual_seed(0)
    q, k, v, do = (torch.randn(b, s, h, d, device=dev, dtype=torch.bfloat16, generator=g) for _ in range(4))
    base = {}
    for rnd in range(3):
        for system in ("ours", "fa4"):
            for n in (FA4_ABL if system == "fa4" else ABL):
                leaves = [t.clone().requires_grad_() for t in (q, k, v)]
                if system == "fa4":
                    use_fa4(n)
                    out = flash_attn_func(*leaves, causal=causal)
                    out = out[0] if isinstance(out, tuple) else out
                    run = lambda: torch.autograd.grad(out, leaves, do, retain_graph=True)
                else:
                    out = fusedattn.attention(*leaves, causal=causal, layout="bshd")
                    def run(n=n, out=out, leaves=leaves):
                        with knobs.overridden(ablate=n):
                            return torch.autograd.grad(out, leaves, do, retain_graph=True)
                grads = run()
                if rnd == 0:
                    ref = base.setdefault(system, grads)
                    diff = [(a.float() - r.float()).abs().max().item() for a, r in zip(grads, ref)]
                else:
                    diff = None
                ms = triton.testing.do_bench(run, warmup=30, rep=200)
                rows.append(dict(D=d, S=s, B=b, H=h, causal=causal, system=system, ablate=n, round=rnd, bwd_ms=ms,
                                 diff_dq_dk_dv_vs_base=diff))
                print(json.dumps(rows[-1]), flush=True)
    json.dump(dict(gpu=torch.cuda.get_device_name(), rows=rows), open(sys.argv[3], "w"), indent=1)
