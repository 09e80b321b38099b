"""The Gluon kernels of this tree against another revision's, in one process: that revision's
``kernels/gluon/{common,fwd,bwd}.py`` are loaded as modules beside this tree's (``fwd_other`` and
``bwd_other`` import ``common_other``) and each call is routed to one set or the other (the
dispatcher imports ``gluon.fwd`` and ``gluon.bwd`` at call time). Microseconds per kernel (profiler,
10 calls a round, rounds alternating and each in the other order than the last, median), bf16, every output compared bitwise (dQ summed by
atomics differs in its last bits between any two runs: compared within 2e-2 as well).

    mkdir -p /tmp/other && for f in common fwd bwd; do
        git show REV:src/fusedattn/kernels/gluon/$f.py > /tmp/other/$f.py; done
    PYTHONPATH=src python benchmarks/gluon_modules_ab.py /tmp/other OUT.json \\
        [--rows 4x16x4096x128xw1024,4x16x4096x128xcausal,packed,alibi] [--forward-only] [--rounds 3]
        [--reference _attn_fwd_ws_kernel] [--other-ptxas PATH]

A module missing from the directory is taken from this tree (only ``fwd.py`` there: the forward's
change alone). ``--other-ptxas PATH`` compiles the other modules' kernels with that ptxas
(``TRITON_PTXAS_PATH`` while they compile, at their first call): with a copy of this tree's modules
as the other revision, the same kernels from two assemblers. The other modules are loaded one line
down from their files, so that a kernel identical to this tree's still hashes apart from it (Triton's
cache key takes the source and its place, not the module's name: without the shift the two forms
share one binary). Triton kernels outside the Gluon modules compile once, at the first call of
either form, and serve both.

Rows: BxHxSxDxMASK with MASK causal, full or wN (a causal sliding window of N keys), then any of
+det (``deterministic=True``), +kvN (N key/value heads: GQA), +cap30 (softcap 30), +alibi (random ALiBi slopes), +dropP (dropout
P%, the same seed every call); ``packed``:
causal packed sequences of nine lengths, 16 heads, D=128 (``flash_attn_varlen_func``); ``alibi``:
causal ALiBi, 4x16x4096x128. ``packed`` and ``alibi`` time the forward."""
import argparse
import collections
import importlib.util
import itertools
import json
import os
import statistics
import sys

import torch

import fusedattn
import fusedattn.kernels.gluon as package
import fusedattn.kernels.gluon.bwd as this_bwd
import fusedattn.kernels.gluon.fwd as this_fwd
from fusedattn.flash_attn import flash_attn_varlen_func

sys.path.insert(0, os.path.dirname(__file__))
from program_cost import kernel_times  # noqa: E402

ROWS = "4x16x4096x128xw1024,4x16x4096x128xw549,4x16x4096x128xcausal,16x16x1024x128xcausal,4x32x4096x64xw1024"


def load_other(directory: str) -> dict:
    """The other revision's modules, its fwd and bwd importing its own common; a module the directory
    lacks is this tree's (a changed ``fwd.py`` alone: the forward's A/B)."""
    modules = {}
    for name in ("common", "fwd", "bwd"):
        given = os.path.join(directory, f"{name}.py")
        if not os.path.exists(given):
            given = os.path.join(os.path.dirname(package.__file__), f"{name}.py")
        # the leading line moves every kernel down one: identical kernels hash apart (docstring)
        source = "# the other revision's module, loaded by gluon_modules_ab\n" + \
            open(given).read().replace("from .common import", "from .common_other import")
        path = os.path.join(directory, f"{name}_other.py")
        with open(path, "w") as f:
            f.write(source)
        spec = importlib.util.spec_from_file_location(f"fusedattn.kernels.gluon.{name}_other", path)
        module = importlib.util.module_from_spec(spec)
        sys.modules[spec.name] = module  # so that the others' relative import finds it
        spec.loader.exec_module(module)
        modules[name] = module
    return {"fwd": modules["fwd"], "bwd": modules["bwd"]}


def route_to(modules: dict, ptxas: str | None = None) -> None:
    """Route the dispatcher's calls to ``modules``; ``ptxas`` (or Triton's own when None) compiles
    whatever they compile from here on."""
    if ptxas:
        os.environ["TRITON_PTXAS_PATH"] = ptxas
    else:
        os.environ.pop("TRITON_PTXAS_PATH", None)
    for name, module in modules.items():
        sys.modules[f"fusedattn.kernels.gluon.{name}"] = module
        setattr(package, name, module)


def make_call(row: str, forward_only: bool):
    gen = torch.Generator(device="cuda").manual_seed(0)
    if row == "packed":
        lengths = [1000, 3000, 517, 2500, 4096, 777, 2048, 1333, 700]
        cu = torch.tensor([0, *itertools.accumulate(lengths)], device="cuda", dtype=torch.int32)
        q, k, v = (torch.randn(int(cu[-1]), 16, 128, device="cuda", dtype=torch.bfloat16, generator=gen)
                   for _ in range(3))
        return lambda: (flash_attn_varlen_func(q, k, v, cu, cu, max(lengths), max(lengths), causal=True),)
    if row == "alibi":
        q, k, v = (torch.randn(4, 16, 4096, 128, device="cuda", dtype=torch.bfloat16, generator=gen) for _ in range(3))
        slopes = torch.rand(16, device="cuda", generator=gen) * 0.1
        return lambda: (fusedattn.attention(q, k, v, layout="bhsd", causal=True, alibi_slopes=slopes),)
    b, h, s, d, mask = row.split("x")
    mask, *extras = mask.split("+")
    kv = [extra for extra in extras if extra.startswith("kv")]
    heads_kv = int(kv[0][len("kv"):]) if kv else int(h)
    q, k, v, do = (torch.randn(int(b), int(h) if i in (0, 3) else heads_kv, int(s), int(d), device="cuda",
                               dtype=torch.bfloat16, generator=gen) for i in range(4))
    options = dict(window=(int(mask[1:]) - 1, 0)) if mask[0] == "w" else dict(causal=mask == "causal")
    options["deterministic"] = "det" in extras
    if "cap30" in extras:
        options["softcap"] = 30.0
    if "alibi" in extras:
        options["alibi_slopes"] = torch.rand(int(h), device="cuda", generator=gen) * 0.1
    drop = [extra for extra in extras if extra.startswith("drop")]
    if drop:
        options["dropout_p"] = int(drop[0][len("drop"):]) / 100
    if not forward_only:
        for t in (q, k, v):
            t.requires_grad_(True)

    def call():
        if drop:  # the same seed every call: both revisions' outputs under one mask
            torch.cuda.manual_seed(0)
        out = fusedattn.attention(q, k, v, layout="bhsd", **options)
        return (out,) if forward_only else (out, *torch.autograd.grad(out, (q, k, v), do))
    return call


def against_reference(rounds: dict, kernel: str, reference: str) -> float:
    """The median over rounds of kernel's this/other time ratio divided by the reference kernel's
    ratio in the same round, less one: a kernel whose code is the same on both sides (the forward,
    when only ``bwd.py`` differs) moves only with the clocks the two sides happened to run at in that
    round, and at the power cap those differ from round to round by more than small changes do."""
    ratios = [(this[kernel] / other[kernel]) / (this[reference] / other[reference])
              for other, this in zip(rounds["other"], rounds["this"])]
    return statistics.median(ratios) - 1


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("other_dir")
    p.add_argument("out")
    p.add_argument("--rows", default=ROWS)
    p.add_argument("--rounds", type=int, default=4)
    p.add_argument("--forward-only", action="store_true")
    p.add_argument("--other-ptxas", default=None, help="ptxas for the other modules' kernels")
    p.add_argument("--reference", default=None,
                   help="a kernel with the same code on both sides (e.g. _attn_fwd_ws_kernel when only bwd.py "
                        "differs): each kernel's change is also printed relative to it, round by round")
    args = p.parse_args()
    ptxas = {"other": args.other_ptxas, "this": os.environ.get("TRITON_PTXAS_PATH")}
    forms = (("other", load_other(args.other_dir)), ("this", {"fwd": this_fwd, "bwd": this_bwd}))
    results = {"device": torch.cuda.get_device_name(), "other_dir": args.other_dir, "ptxas": ptxas, "rows": {}}
    for row in args.rows.split(","):
        call = make_call(row, args.forward_only)
        outputs, rounds = {}, collections.defaultdict(list)
        for r in range(args.rounds):
            # each round in the other order than the last: a row's second call runs warmer (on a long
            # row, identical kernels measured 2% apart by their place in the round)
            for name, modules in (forms if r % 2 == 0 else forms[::-1]):
                route_to(modules, ptxas[name])
                if r == 0:
                    outputs[name] = [t.clone() for t in call()]
                rounds[name].append(kernel_times(call, 10))
        route_to(forms[1][1], ptxas["this"])
        median = {}
        for name, _ in forms:
            per_kernel = collections.defaultdict(list)
            for times in rounds[name]:
                for kernel, us in times.items():
                    per_kernel[kernel].append(us)
            median[name] = {kernel: statistics.median(us) for kernel, us in per_kernel.items()}
        equal = [torch.equal(a, b) for a, b in zip(outputs["other"], outputs["this"])]
        close = [torch.allclose(a.float(), b.float(), atol=2e-2, rtol=0) for a, b in zip(outputs["other"], outputs["this"])]
        results["rows"][row] = dict(median_us=median, rounds_us={name: rounds[name] for name, _ in forms},
                                    bitwise_equal=equal, close=close)
        parts = []
        for kernel, us in median["other"].items():
            if us <= 20:
                continue
            part = (f"{kernel} {us:.1f} -> {median['this'].get(kernel, float('nan')):.1f} "
                    f"({median['this'].get(kernel, float('nan')) / us - 1:+.1%}")
            if (args.reference and kernel != args.reference and kernel in median["this"]
                    and args.reference in median["other"] and args.reference in median["this"]):
                change = against_reference(rounds, kernel, args.reference)
                results["rows"][row].setdefault("against_reference", {})[kernel] = change
                part += f"; {change:+.1%} against {args.reference}"
            parts.append(part + ")")
        print(f"{row}: " + " | ".join(parts) + f" | outputs equal {equal}, close {close}", flush=True)
    with open(args.out, "w") as f:
        json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
