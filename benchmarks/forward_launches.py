"""The causal forward's launch forms side by side: the heuristic's config (3 warpgroups taking turns over
192-row tiles at long keys) against 2 warpgroups over 128-row tiles, one program per tile or persistent
(132 programs, 128 = one launch-order chunk a round, and the planner's rule: kernels/shared/rounds.py).
Forward kernel time (profiler, one process, 3 alternating rounds, median), bf16; every form's output
checked against the heuristic's.

    PYTHONPATH=src python benchmarks/forward_launches.py OUT.json

Target: a form faster than the heuristic's where FA4's causal forward is (benchmarks/NOTES.md v76)."""
import collections, json, sys
from dataclasses import replace
import torch
import fusedattn
from fusedattn.kernels.shared import knobs as K
from fusedattn.tuning import configs
sys.path.insert(0, "benchmarks")
from program_cost import bhsd_inputs, kernel_times, role

TWO_WG = configs.KernelConfig(128, 128, 4, 2, tma_loads=True, hopper_overlap=0, hopper_split=2)
FORMS = [  # name, forward config (None: the heuristic's), programs knob (None: the rule, 0: one per tile)
    ("heuristic", None, None),
    ("2wg", TWO_WG, 0),
    ("2wg-132", TWO_WG, 132),
    ("2wg-128", TWO_WG, 128),
    ("2wg-turns-128", replace(TWO_WG, hopper_pingpong=1), 128),
    ("2wg-rule", TWO_WG, None),
]
ROWS = [(4, 16, 16, 4096, 128, True), (4, 16, 2, 4096, 128, True), (2, 16, 16, 8192, 128, True),
        (4, 32, 32, 4096, 64, True), (16, 16, 16, 1024, 128, True), (4, 16, 16, 4096, 128, False)]
out = []
for (b, h, hkv, s, d, causal) in ROWS:
    q, k, v = bhsd_inputs(b, h, hkv, s, d)
    base = configs.select_configs(q.device, q.dtype, d, d, seqlen_k=s, has_right=causal)
    res, err = collections.defaultdict(list), {}
    with torch.no_grad():
        want = fusedattn.attention(q, k, v, layout="bhsd", causal=causal).float()
        for rnd in range(3):
            for name, fwd, programs in FORMS:
                K._current = K.Knobs(programs=programs)
                configs._pinned = None if fwd is None else replace(base, forward=fwd)
                step = lambda: fusedattn.attention(q, k, v, layout="bhsd", causal=causal)  # noqa: E731
                if rnd == 0:
                    err[name] = (step().float() - want).abs().max().item()
                times = kernel_times(step, 10)
                res[name].append(sum(t for n, t in times.items() if role(n) == "forward"))
    configs._pinned, K._current = None, K.Knobs()
    med = {n: sorted(t)[1] for n, t in res.items()}
    out.append(dict(shape=[b, h, hkv, s, d], causal=causal, us=med, max_abs_diff=err, raw=res))
    print(f"B{b} H{h}/{hkv} S{s} D{d} {'causal' if causal else 'full'}: " +
          ", ".join(f"{n} {t:.0f}" for n, t in med.items()) + f" us; max |diff| {max(err.values()):.2e}", flush=True)
json.dump({"device": torch.cuda.get_device_name(), "rows": out}, open(sys.argv[1], "w"), indent=1)
