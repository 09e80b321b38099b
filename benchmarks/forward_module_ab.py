"""The Gluon forward of this tree against another revision's, in one process: the other revision's
``kernels/gluon/fwd.py`` is loaded as a second module beside this tree's and each call is routed to
one or the other (the dispatcher imports the module at call time). Forward kernel us (profiler, 10
calls a round, rounds alternating, median), bf16, outputs compared bitwise (a change to how the
kernel's warpgroups are scheduled must not change a bit).

    git show REV:src/fusedattn/kernels/gluon/fwd.py > /tmp/fwd_old.py
    PYTHONPATH=src python benchmarks/forward_module_ab.py /tmp/fwd_old.py OUT.json \\
        [--rows 4x16x4096x128x1024,4x16x4096x128x549] [--rounds 3]

Rows: BxHxSxDxW, a causal sliding window of W keys (W = 0: causal alone)."""
import argparse
import collections
import importlib.util
import json
import sys

import torch

import fusedattn
import fusedattn.kernels.gluon.fwd as this_module

sys.path.insert(0, "benchmarks")
from program_cost import call_masking, kernel_times  # noqa: E402

ROWS = "4x16x4096x128x1024,4x16x4096x128x549,4x32x4096x64x1024"


def load_other(path: str):
    spec = importlib.util.spec_from_file_location("fusedattn.kernels.gluon.fwd_other", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)  # its relative imports resolve in the package
    return module


def route_to(module) -> None:
    package = sys.modules["fusedattn.kernels.gluon"]
    sys.modules["fusedattn.kernels.gluon.fwd"] = module
    package.fwd = module


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("other_module")
    p.add_argument("out")
    p.add_argument("--rows", default=ROWS)
    p.add_argument("--rounds", type=int, default=3)
    args = p.parse_args()
    forms = (("other", load_other(args.other_module)), ("this", this_module))
    results = {"device": torch.cuda.get_device_name(), "other_module": args.other_module, "rows": {}}
    for row in args.rows.split(","):
        b, h, s, d, w = (int(x) for x in row.split("x"))
        gen = torch.Generator(device="cuda").manual_seed(0)
        q, k, v = (torch.randn(b, h, s, d, device="cuda", dtype=torch.bfloat16, generator=gen) for _ in range(3))
        options = call_masking(w or None)

        def call():
            return fusedattn.attention(q, k, v, layout="bhsd", **options)

        outputs, times = {}, collections.defaultdict(list)
        for r in range(args.rounds):
            for name, module in forms:
                route_to(module)
                if r == 0:
                    outputs[name] = call().clone()
                t = kernel_times(call, 10)
                times[name].append(sum(v for kernel, v in t.items() if "fwd" in kernel))
        route_to(this_module)
        median = {name: sorted(ts)[len(ts) // 2] for name, ts in times.items()}
        equal = torch.equal(outputs["other"], outputs["this"])
        results["rows"][row] = dict(median_us=median, rounds_us=dict(times), bitwise_equal=equal)
        print(f"{row}: other {median['other']:.1f} us, this {median['this']:.1f} us "
              f"({median['this'] / median['other'] - 1:+.1%}); outputs bitwise equal: {equal}", flush=True)
    with open(args.out, "w") as f:
        json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
