"""The causal forward's launch order side by side: programs start in launch order as SMs free up, so
the order decides how evenly the SMs end. Head-major order (each head's query blocks heaviest first,
then the next head's) starts the last heads' heaviest programs within the last wave; block-major
chunks of heads (every head's heaviest block, then every head's next, ...) start them earlier, and a
chunk whose heads' K and V fit in L2 keeps the operands the programs share there (FA4's order:
L2-sized sections of heads, heaviest first in each). Forward kernel time (profiler, one process,
rounds alternating, median), bf16, every form's output checked against the first.

    PYTHONPATH=src python benchmarks/launch_chunks.py OUT.json [--rounds 3] [--backward]
    PYTHONPATH=src python benchmarks/launch_chunks.py OUT.json --chunks 4,8,16,0 --rows 1x16x16x16384x128
    PYTHONPATH=src python benchmarks/launch_chunks.py OUT.json --window 1024 --chunks 16,0 [--backward]

Forms: ``chunk_heads`` of the launch order (``kernels/gluon/common.launch_order``): the rule, 1
(head-major), 6 (about a wave of programs), 16, 0 (all heads: block-major over the grid), with the
heuristic's forward config. ``--backward``: the dK/dV pass's kernel time under chunks of 2, 8, 16 and
all head rows beside its rule's (about a wave of programs). ``--window N``: a causal sliding window of N
keys instead of the causal bound alone (the rows' own rule: chunks of about a wave)."""
import collections
import json
import sys
import torch

import fusedattn
from fusedattn.kernels.shared import knobs as K

sys.path.insert(0, "benchmarks")
from program_cost import bhsd_inputs, call_masking, kernel_times, role  # noqa: E402

CHUNKS = [("rule", None), ("head-major", 1), ("6", 6), ("16", 16), ("all", 0)]
FORMS = [(f"heur/{c}", n) for c, n in CHUNKS]
ROWS = [(4, 16, 16, 4096, 128), (4, 16, 2, 4096, 128), (4, 32, 32, 4096, 64), (1, 16, 16, 16384, 128),
        (1, 32, 32, 16384, 64), (16, 16, 16, 1024, 128)]


BACKWARD_CHUNKS = [("rule", None), ("2", 2), ("8", 8), ("16", 16), ("all", 0)]


def row_name(b: int, h: int, hkv: int, s: int, d: int, window: int | None) -> str:
    return f"B{b} H{h}/{hkv} S{s} D{d} " + (f"window {window}" if window else "causal")


def backward_rows(rounds: int, rows: list, window: int | None) -> list:
    """The dK/dV pass's kernel time (fwd+bwd steps, the pass's kernels only) under the same chunks:
    its programs (one per key block) are uneven under a causal bound too, heaviest first."""
    out = []
    for (b, h, hkv, s, d) in rows:
        q, k, v = bhsd_inputs(b, h, hkv, s, d)
        leaves = [t.requires_grad_() for t in (q, k, v)]
        dout = torch.randn_like(q)
        res = collections.defaultdict(list)
        for _ in range(rounds):
            for name, chunk in BACKWARD_CHUNKS:
                K._current = K.Knobs(chunk_heads=chunk)

                def step():
                    fusedattn.attention(*leaves, layout="bhsd", **call_masking(window)).backward(dout)
                times = kernel_times(step, 5)
                res[name].append(sum(t for n, t in times.items() if role(n) == "dkdv"))
        K._current = K.Knobs()
        med = {n: sorted(t)[len(t) // 2] for n, t in res.items()}
        out.append(dict(shape=[b, h, hkv, s, d], causal=True, window=window, dkdv_us=med, raw=res))
        print(f"dK/dV {row_name(b, h, hkv, s, d, window)}: " + ", ".join(f"{n} {t:.0f}" for n, t in med.items())
              + " us", flush=True)
    return out


def main() -> None:
    rounds = int(sys.argv[sys.argv.index("--rounds") + 1]) if "--rounds" in sys.argv else 3
    window = int(sys.argv[sys.argv.index("--window") + 1]) if "--window" in sys.argv else None
    rows = ROWS
    if "--rows" in sys.argv:
        rows = [tuple(int(x) for x in r.split("x")) for r in sys.argv[sys.argv.index("--rows") + 1].split(",")]
    if "--backward" in sys.argv:
        json.dump({"device": torch.cuda.get_device_name(), "rows": backward_rows(rounds, rows, window)},
                  open(sys.argv[1], "w"), indent=1)
        return
    forms = FORMS
    if "--chunks" in sys.argv:  # a sweep of the heuristic's config alone: --chunks 4,8,0 [--rows BxHxHkvxSxD,...]
        chunks = [int(c) for c in sys.argv[sys.argv.index("--chunks") + 1].split(",")]
        forms = [("heur/rule", None)] + [(f"heur/{c or 'all'}", c) for c in chunks]
    out = []
    for (b, h, hkv, s, d) in rows:
        q, k, v = bhsd_inputs(b, h, hkv, s, d)
        res, err = collections.defaultdict(list), {}
        with torch.no_grad():
            want = fusedattn.attention(q, k, v, layout="bhsd", **call_masking(window)).float()
            for rnd in range(rounds):
                for name, chunk in forms:
                    K._current = K.Knobs(chunk_heads=chunk)

                    def step():
                        return fusedattn.attention(q, k, v, layout="bhsd", **call_masking(window))
                    if rnd == 0:
                        err[name] = (step().float() - want).abs().max().item()
                    times = kernel_times(step, 10)
                    res[name].append(sum(t for n, t in times.items() if role(n) == "forward"))
        K._current = K.Knobs()
        med = {n: sorted(t)[len(t) // 2] for n, t in res.items()}
        out.append(dict(shape=[b, h, hkv, s, d], causal=True, window=window, us=med, max_abs_diff=err, raw=res))
        print(f"{row_name(b, h, hkv, s, d, window)}: " + ", ".join(f"{n} {t:.0f}" for n, t in med.items())
              + f" us; max |diff| {max(err.values()):.2e}", flush=True)
    json.dump({"device": torch.cuda.get_device_name(), "rows": out}, open(sys.argv[1], "w"), indent=1)


if __name__ == "__main__":
    main()
