"""Compile our backward for one (D:S:kind, ablate) (warms Triton's cache; run many in parallel)."""
import sys
import torch, fusedattn
from fusedattn.kernels.shared import knobs
d, s, kind = sys.argv[1].split(":"); d, s, causal = int(d), int(s), kind == "causal"
h = 2048 // d
dev = torch.device("cuda")
q, k, v, do = (torch.randn(1, s, h, d, device=dev, dtype=torch.bfloat16) for _ in range(4))
leaves = [t.clone().requires_grad_() for t in (q, k, v)]
out = fusedattn.attention(*leaves, causal=causal, layout="bshd")
with knobs.overridden(ablate=int(sys.argv[2])):
    torch.autograd.grad(out, leaves, do)
torch.cuda.synchronize()
print("warm", sys.argv[1], sys.argv[2])
