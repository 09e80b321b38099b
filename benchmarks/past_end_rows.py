"""A/B of the warp-specialised forward's warpgroups whose rows all lie past Sq (the last tile's
later warpgroups when Sq is not a multiple of the tile's rows: 192-row tiles at S=1k, 4k, 16k):
run as before (``Knobs.run_rows_past_end``) or handed back. Forward kernel time (profiler, one
process, 3 alternating rounds, median), bf16; the outputs must be bitwise equal.

    PYTHONPATH=src python benchmarks/past_end_rows.py OUT.json
"""
import collections, json, sys
import torch
import fusedattn
from fusedattn.kernels.shared import knobs as K
sys.path.insert(0, "benchmarks")
from program_cost import bhsd_inputs, kernel_times, role

ROWS = [(16, 16, 16, 1024, 128, False), (4, 16, 16, 4096, 128, False), (4, 16, 16, 4096, 128, True),
        (4, 16, 2, 4096, 128, True), (4, 32, 32, 4096, 64, False), (4, 32, 32, 4096, 64, True),
        (1, 16, 16, 16384, 128, True), (1, 32, 32, 16384, 64, True), (1, 16, 16, 16384, 128, False)]
out = []
for (b, h, hkv, s, d, causal) in ROWS:
    q, k, v = bhsd_inputs(b, h, hkv, s, d)
    res, outs = collections.defaultdict(list), {}
    with torch.no_grad():
        for rnd in range(3):
            for name, past_end in (("run-past-end", True), ("hand-back", False)):
                with K.overridden(run_rows_past_end=past_end):
                    call = lambda: fusedattn.attention(q, k, v, layout="bhsd", causal=causal)  # noqa: E731
                    outs[name] = call()
                    t = kernel_times(call, 20)
                res[name].append(sum(v for n, v in t.items() if role(n) == "forward"))
    same = torch.equal(outs["run-past-end"], outs["hand-back"])
    med = {n: sorted(v)[1] for n, v in res.items()}
    print(f"B{b} H{h}/{hkv} S{s} D{d} {'causal' if causal else 'full'}: forward us "
          + " ".join(f"{n}={m:.1f}" for n, m in med.items())
          + f"  ratio {med['hand-back'] / med['run-past-end']:.3f}  bitwise equal: {same}", flush=True)
    out.append(dict(B=b, H=h, Hkv=hkv, S=s, D=d, causal=causal, rounds_us=dict(res), median_us=med, bitwise_equal=same))
json.dump({"device": torch.cuda.get_device_name(), "rows": out}, open(sys.argv[1], "w"), indent=1)
