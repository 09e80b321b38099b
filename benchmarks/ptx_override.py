"""Price a PTX edit of the Gluon kernels without writing it in Gluon: dump the kernels' PTX, edit
it, load it back through Triton's kernel override, and time the fwd+bwd kernels beside the
unmodified modules in one process. Timing only.

Edits (forms):
- "wait", "all": the warpgroup ``bar.sync`` that Triton's shared-memory barrier analysis puts
  before each mbarrier wait ("wait"), and before each arrive too ("all"), in the consumer
  partitions, deleted where no ordinary shared-memory access and no wgmma still in flight lies
  between the last synchronisation and the barrier. A barrier before a one-thread arrive is what
  orders the other warps' reads before the release (the "all" form relies on the wgmma wait having
  completed the warpgroup's matmul, as CUTLASS's pipelines do).
- "prefetch": every TMA descriptor the kernel takes prefetched at its entry (``prefetch.tensormap``
  on the generic address each descriptor parameter is converted to), as FlashAttention-4's kernels
  do before their first loads; Gluon has no such call.

Each form is a copy of ``gluon/fwd.py`` and ``gluon/bwd.py`` shifted by leading lines, so its
kernels hash apart from this tree's and from each other's (Triton keys dumps and overrides by that
hash). ``PTX_FORMS`` (comma-separated, default every form) picks the forms the edit and time phases
take.

    export PYTHONPATH=src BARS_WORK=/tmp/bars TRITON_OVERRIDE_DIR=/tmp/bars/ovr PTX_FORMS=wait,all
    for v in wait all; do TRITON_CACHE_DIR=/tmp/bars/c1_$v TRITON_KERNEL_DUMP=1 \
        TRITON_DUMP_DIR=/tmp/bars/dump_$v python benchmarks/ptx_override.py dump $v & done; wait
    python benchmarks/ptx_override.py edit        # writes $OUT/ptx-edits.json
    for v in base wait all; do TRITON_CACHE_DIR=/tmp/bars/c2 TRITON_KERNEL_OVERRIDE=1 \
        python benchmarks/ptx_override.py dump $v & done; wait   # compiles, overridden
    TRITON_CACHE_DIR=/tmp/bars/c2 TRITON_KERNEL_OVERRIDE=1 python benchmarks/ptx_override.py time
"""
import collections
import importlib.util
import json
import os
import re
import sys

ROOT = os.getcwd()
WORK = os.environ.get("BARS_WORK", "/tmp/bars")
OUT = os.environ.get("OUT", "/tmp")
SHIFTS = {"wait": 1, "all": 2, "prefetch": 3}  # leading lines of each form's copies
VARIANTS = {name: SHIFTS[name] for name in os.environ.get("PTX_FORMS", ",".join(SHIFTS)).split(",")}
ROWS = os.environ.get("PTX_ROWS", "4x16x4096x128xw1024,4x16x4096x128xcausal,4x16x4096x128xfull,4x32x4096x64xcausal").split(",")


def copies(variant):
    import fusedattn.kernels.gluon as pkg  # noqa
    mods = {}
    for name in ("fwd", "bwd"):
        src = open(os.path.join(ROOT, f"src/fusedattn/kernels/gluon/{name}.py")).read()
        path = os.path.join(WORK, f"{name}_{variant}.py")
        # leading lines shift every function's starting line, so each copy's kernels hash apart
        open(path, "w").write(f"# variant {variant}\n" * SHIFTS[variant] + src)
        spec = importlib.util.spec_from_file_location(f"fusedattn.kernels.gluon.{name}_{variant}", path)
        m = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(m)
        mods[name] = m
    return mods


def phase_dump(variant):
    """Run with TRITON_DUMP_DIR=WORK/dump_<variant>, one process per variant (or form, to warm the cache)."""
    import torch
    from gluon_modules_ab import make_call, route_to
    import fusedattn.kernels.gluon.fwd, fusedattn.kernels.gluon.bwd  # noqa
    if variant != "base":
        route_to(copies(variant))
    for row in ROWS:
        make_call(row, forward_only=False)()
    torch.cuda.synchronize()
    print("compiled", variant, flush=True)


SMEM = re.compile(r"\b(ld\.shared|st\.shared|ldmatrix|stmatrix|atom\.shared|red\.shared|ld\.volatile\.shared|"
                  r"cp\.async|st\.async|tcgen05|fence)")
SYNC = re.compile(r"\b(bar\.sync|bar\.arrive|barrier\.|mbarrier\.|wgmma\.wait_group)")


def edit(lines, remove_arrive):
    ins = [i for i, l in enumerate(lines) if l.strip() and not re.match(r"\s*(\{|\}|\.reg|\.loc|\.file|\$?\w+:|//)", l)]
    drop, counts = set(), collections.Counter()
    for n, i in enumerate(ins):
        m = re.match(r"\s*bar\.sync\s+\d+,\s*128;", lines[i])
        if not m or n + 1 >= len(ins):
            continue
        nxt = lines[ins[n + 1]]
        kind = "wait" if "mbarrier.try_wait" in nxt else "arrive" if "mbarrier.arrive" in nxt else None
        if kind is None:
            counts["other"] += 1
            continue
        # since the last sync point: no ordinary shared access, no wgmma still in flight
        safe, inflight = True, False
        for p in reversed(ins[:n]):
            l = lines[p]
            if SYNC.search(l):
                if "wgmma.wait_group" in l and not re.search(r"wait_group\.sync\.aligned\s+0;", l):
                    safe = False
                break
            if SMEM.search(l):
                safe = False
                break
            if "wgmma.mma_async" in l:
                inflight = True
        if inflight:
            safe = False
        if safe and (kind == "wait" or remove_arrive):
            drop.add(i)
            counts[f"removed_before_{kind}"] += 1
        else:
            counts[f"kept_before_{kind}"] += 1
    return [l for i, l in enumerate(lines) if i not in drop], counts


TENSORMAP_PARAM = re.compile(r"\s*\.param \.align 64 \.b8 (\w+)\[128\]")


def prefetch_descriptors(lines):
    """Each TMA descriptor parameter (128 bytes, 64-aligned) prefetched right where the kernel's entry
    converts it to a generic address (``cvta.param``), which the bulk tensor copies then use."""
    params = {m.group(1) for m in map(TENSORMAP_PARAM.match, lines) if m}
    moved, out, counts = {}, [], collections.Counter()
    for line in lines:
        out.append(line)
        m = re.match(r"\s*mov\.b64\s+(%rd\d+),\s*(\w+);", line)
        if m and m.group(2) in params:
            moved[m.group(1)] = m.group(2)
        m = re.match(r"\s*cvta\.param\.u64\s+(%rd\d+),\s*(%rd\d+);", line)
        if m and m.group(2) in moved:
            out.append(f"\tprefetch.tensormap [{m.group(1)}];")
            counts["prefetched"] += 1
    counts["descriptors"] = len(params)
    return out, counts


def phase_edit():
    ovr = os.environ["TRITON_OVERRIDE_DIR"]
    report = {}
    for variant in VARIANTS:
        dump = os.path.join(WORK, f"dump_{variant}")
        for d in os.listdir(dump):
            for f in os.listdir(os.path.join(dump, d)):
                if not f.endswith(".ptx"):
                    continue
                lines = open(os.path.join(dump, d, f)).read().split("\n")
                if not any("mbarrier.try_wait" in l for l in lines):
                    continue
                if variant == "prefetch":
                    new, counts = prefetch_descriptors(lines)
                else:
                    new, counts = edit(lines, variant == "all")
                os.makedirs(os.path.join(ovr, d), exist_ok=True)
                open(os.path.join(ovr, d, f), "w").write("\n".join(new))
                report[f"{variant}/{d[:8]}/{f}"] = dict(counts)
                print(variant, d[:8], f, dict(counts))
    json.dump(report, open(os.path.join(OUT, "ptx-edits.json"), "w"), indent=1)


def phase_time():
    import torch
    from gluon_modules_ab import make_call, route_to
    from program_cost import kernel_times
    import fusedattn.kernels.gluon.fwd, fusedattn.kernels.gluon.bwd  # noqa
    base = {"fwd": sys.modules["fusedattn.kernels.gluon.fwd"], "bwd": sys.modules["fusedattn.kernels.gluon.bwd"]}
    forms = {"base": base, **{v: copies(v) for v in VARIANTS}}
    res = {}
    for row in ROWS:
        call = make_call(row, forward_only=False)
        outs, times = {}, collections.defaultdict(list)
        for r in range(3):
            for name, mods in forms.items():
                route_to(mods)
                if r == 0:
                    outs[name] = [t.clone() for t in call()]
                t = kernel_times(call, 10)
                times[name].append(t)
        key = row
        entry = {}
        for name in forms:
            per = collections.defaultdict(list)
            for t in times[name]:
                for kname, us in t.items():
                    per[kname].append(us)
            med = {k: sorted(v)[len(v) // 2] for k, v in per.items()}
            fwd = sum(v for k, v in med.items() if "fwd" in k)
            tot = sum(med.values())
            same = all(torch.equal(a, b) for a, b in zip(outs["base"], outs[name]))
            entry[name] = dict(kernels_us=med, fwd_us=fwd, total_us=tot, rounds=[sum(t.values()) for t in times[name]],
                               bitwise_equal_to_base=same)
        b0 = entry["base"]
        print(key, " | ".join(f"{n}: fwd {e['fwd_us']:.1f} ({e['fwd_us'] / b0['fwd_us'] - 1:+.1%}) total {e['total_us']:.1f} "
                              f"({e['total_us'] / b0['total_us'] - 1:+.1%}) eq {e['bitwise_equal_to_base']}" for n, e in entry.items()), flush=True)
        res[key] = entry
    json.dump(res, open(os.path.join(OUT, "ptx-time.json"), "w"), indent=1)


if __name__ == "__main__":
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    os.makedirs(WORK, exist_ok=True)
    if sys.argv[1] == "dump":
        phase_dump(sys.argv[2])
    else:
        {"edit": phase_edit, "time": phase_time}[sys.argv[1]]()
