"""Persistent launches against one program per tile where the static rounds balance well and badly: the
dK/dV and forward kernel times (profiler, one process, 3 alternating rounds, median) with one program per
tile, forced persistent (one program per SM, and 128 programs: one launch-order chunk a round) and the
planner's rule (kernels/shared/rounds.py), bf16.

    PYTHONPATH=src python benchmarks/persistent_balance.py OUT.json

Target: the rule's time is the fastest of the one-tile and forced columns in every row (benchmarks/NOTES.md v75)."""
import collections, json, sys
import torch
import fusedattn
from fusedattn.kernels.shared import knobs as K
sys.path.insert(0, "benchmarks")
from program_cost import kernel_times, role

SMS = torch.cuda.get_device_properties(0).multi_processor_count
shapes = [  # (B, H, S, D, causal); the comment: the model's persistent / one program per tile (132 / 128 programs)
    (16, 32, 1024, 64, True),  # dK/dV 0.94 / 0.94 (a standard shape)
    (4, 32, 4096, 64, True),  # dK/dV 1.00 / 1.00 (a standard shape)
    (1, 32, 4096, 64, True),  # dK/dV 1.67 / 1.00
    (1, 32, 1024, 64, True),  # dK/dV 1.46 / 0.92
    (1, 32, 2048, 64, True),  # dK/dV 1.62 / 0.95
    (4, 32, 1024, 64, True),  # dK/dV 1.39 / 0.92
    (8, 12, 1024, 64, True),  # dK/dV 1.41 / 0.92
    (1, 32, 16384, 64, True),  # dK/dV: the rule's key limit (a standard shape)
    (4, 32, 4096, 64, False),  # dK/dV: no causal bound (a standard shape)
    (2, 18, 1024, 128, True),  # forward 1.08 / 1.08
    (1, 16, 2048, 128, True),  # forward 0.88 / 0.63
    (16, 16, 1024, 128, True),  # forward 0.90 / 0.90 (a standard shape)
    (4, 16, 4096, 128, True),  # forward 0.94 / 0.94 (a standard shape)
]
rows = []
for (b, h, s, d, causal) in shapes:
    g = torch.Generator(device="cuda").manual_seed(0)
    q, k, v, do = (torch.randn(b, h, s, d, device="cuda", dtype=torch.bfloat16, generator=g) for _ in range(4))
    for t in (q, k, v):
        t.requires_grad_()

    def step():
        for t in (q, k, v):
            t.grad = None
        fusedattn.attention(q, k, v, layout="bhsd", causal=causal).backward(do)

    res = collections.defaultdict(list)
    for rnd in range(3):
        for name, progs in (("one-tile", 0), ("forced", SMS), ("forced-128", 128), ("rule", None)):
            K._current = K.Knobs(dkdv_programs=progs, programs=progs if d == 128 else None)
            times = kernel_times(step, 5)
            for r in ("dkdv", "forward"):
                res[f"{name}-{r}"].append(sum(t for n, t in times.items() if role(n) == r))
    med = {n: sorted(v)[1] for n, v in res.items()}
    rows.append(dict(shape=[b, h, s, d], causal=causal, **med, raw=res))
    print(f"B{b} H{h} S{s} D{d} {'causal' if causal else 'full'}: dK/dV one-tile {med['one-tile-dkdv']:.0f}, forced {med['forced-dkdv']:.0f}, "
          f"128 programs {med['forced-128-dkdv']:.0f}, rule {med['rule-dkdv']:.0f} us; forward one-tile "
          f"{med['one-tile-forward']:.0f}, forced {med['forced-forward']:.0f}, 128 programs "
          f"{med['forced-128-forward']:.0f}, rule {med['rule-forward']:.0f} us", flush=True)
K._current = K.Knobs()
json.dump({"device": torch.cuda.get_device_name(), "rows": rows}, open(sys.argv[1], "w"), indent=1)
