import sys, torch, fusedattn
from fusedattn.kernels.shared.knobs import overridden
from fusedattn.kernels.gluon import bwd as gbwd
OUT = sys.argv[1]
for d, causal, s in ((64, False, 1024), (64, False, 4096), (64, True, 4096)):
    for a in (32 | 128, 32):
        gen = torch.Generator(device="cuda").manual_seed(0)
        size = (16384 // s, 2048 // d, s, d)
        q, k, v, dout = (torch.randn(size, device="cuda", dtype=torch.bfloat16, generator=gen) for _ in range(4))
        leaves = [t.requires_grad_() for t in (q, k, v)]
        with overridden(ablate=a):
            for _ in range(3):
                fusedattn.attention(*leaves, layout="bhsd", causal=causal).backward(dout)
            buf = gbwd.timeline(q.device); buf.zero_()
            fusedattn.attention(*leaves, layout="bhsd", causal=causal).backward(dout); torch.cuda.synchronize()
            torch.save(buf[: 16 * 4096].cpu(), f"{OUT}/tl-D{d}-{'c' if causal else 'f'}-S{s}-a{a}.pt")
print("ok")
