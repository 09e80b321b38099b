"""compute-sanitizer over every kernel of fusedattn, on small odd shapes (a GPU with the CUDA toolkit).

    python benchmarks/sanitize.py                       # memcheck, racecheck, synccheck over every probe
    python benchmarks/sanitize.py --tools racecheck --probes gluon-dkdv-dq
    python benchmarks/sanitize.py --out DIR             # logs and summary.json there (default: a temp dir)

Each probe is one call of the public API (forward and backward where there is one) whose shapes
and options route it to a given set of kernels: the Triton forward, dQ and dK/dV programs, the
bias-gradient and mask-classification kernels, the warp-specialised Gluon forward, dQ and dK/dV
passes (with dQ by reduce-adds, group sums, a mask's tile lists, a bias, persistent launches), the
KV-cache append, decoding and split combination, and packed sequences on both kernel families,
including offsets checked on the device. Lengths are odd (ragged tiles, the causal diagonal inside
a tile), inputs random normal.

The driver runs all probes in one process per tool (the kernels compile once, before the tool
starts: a first plain run fills Triton's cache), splits the tool's report at the probes' markers
and prints a table of errors (memcheck, synccheck) and hazards (racecheck) per probe. Memcheck runs
with PyTorch's caching allocator off, so every tensor is its own allocation and an access past its
end is caught. racecheck cannot see ordering made by mbarriers and the async (TMA / wgmma) proxy:
its reports on the Gluon kernels are read against the code (see the notes in hopper_bwd.py).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

MARKER = "=== probe "
TOOLS = ("memcheck", "racecheck", "synccheck")


def _probes():
    """name -> function running the probe once (imports here: the driver needs no GPU libraries)."""
    import torch

    import fusedattn

    gen = torch.Generator(device="cuda").manual_seed(0)
    bf16, fp16 = torch.bfloat16, torch.float16

    def randn(*shape, dtype=bf16, grad=True):
        t = torch.randn(*shape, device="cuda", dtype=dtype, generator=gen)
        return t.requires_grad_() if grad else t

    def fwd_bwd(q, k, v, lse_grad=False, **options):
        out, lse = fusedattn.attention(q, k, v, return_lse=True, **options)
        loss = out.float().square().sum() + (lse.float().sum() if lse_grad else 0)
        leaves = [t for t in (q, k, v, options.get("sinks"), options.get("bias")) if t is not None and t.requires_grad]
        torch.autograd.grad(loss, leaves)

    def attention(b, hq, hkv, sq, sk, d, dtype=bf16, dv=None, **options):
        def run():
            q = randn(b, sq, hq, d, dtype=dtype)
            k, v = randn(b, sk, hkv, d, dtype=dtype), randn(b, sk, hkv, dv or d, dtype=dtype)
            fwd_bwd(q, k, v, **{name: value() if callable(value) else value for name, value in options.items()})
        return run

    def varlen(lengths, hq, hkv, d, device_checked=False, **options):
        def run():
            from fusedattn import varlen as module

            cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32, device="cuda")
            total = sum(lengths)
            q, k, v = randn(total, hq, d), randn(total, hkv, d), randn(total, hkv, d)
            unreadable = module._unreadable
            if device_checked:  # as under CUDA-graph capture: offsets checked on the device
                module._unreadable = lambda offsets: True
            try:
                out = fusedattn.varlen_attention(q, k, v, cu, cu, max(lengths), max(lengths), **options)
                torch.autograd.grad(out.float().square().sum(), (q, k, v))
            finally:
                module._unreadable = unreadable
        return run

    def kvcache(batch, sq, hq, hkv, d, capacity, lengths, paged, new=0, **options):
        def run():
            q = randn(batch, sq, hq, d, grad=False)
            table = None
            if paged:
                pages = capacity // 16
                k_cache, v_cache = (randn(batch * pages + 3, 16, hkv, d, grad=False) for _ in range(2))
                order = torch.randperm(batch * pages + 3, device="cuda", generator=gen)[:batch * pages]
                table = order.view(batch, pages).to(torch.int32)
            else:
                k_cache, v_cache = (randn(batch, capacity, hkv, d, grad=False) for _ in range(2))
            k_new = v_new = None
            if new:
                k_new, v_new = (randn(batch, new, hkv, d, grad=False) for _ in range(2))
            seqlens = torch.tensor(lengths, dtype=torch.int32, device="cuda")
            fusedattn.kvcache_attention(q, k_cache, v_cache, seqlens, block_table=table, k_new=k_new, v_new=v_new,
                                        **options)
        return run

    def block_sparse():
        keep = torch.rand(1, 2, 4, 4, device="cuda", generator=gen) < 0.6
        keep[..., 0] = True  # every query block keeps a key block
        mask = fusedattn.BlockMask.from_blocks(keep, (128, 128), 500, 512)
        fwd_bwd(randn(1, 500, 2, 128), randn(1, 512, 2, 128), randn(1, 512, 2, 128), mask=mask)

    def masked_triton():
        mask = torch.rand(2, 1, 113, 255, device="cuda", generator=gen) < 0.7
        bias = randn(1, 4, 1, 255, dtype=fp16)  # broadcast over the batch and the queries
        fwd_bwd(randn(2, 113, 4, 80, dtype=fp16), randn(2, 255, 2, 80, dtype=fp16), randn(2, 255, 2, 80, dtype=fp16),
                mask=mask, bias=bias, deterministic=True)

    def warp_specialize_control(captures: bool):
        def run():
            out = torch.zeros(8 * 288, device="cuda", dtype=torch.int32)
            seven = torch.full((1,), 7, device="cuda", dtype=torch.int32)
            kernel = _control_kernel(captures)
            options = dict(maxnreg=128) if captures else {}
            kernel[(8,)](out, seven if captures else 7, num_warps=4, **options)
            rows = out.view(8, 288).cpu()
            expected = torch.cat([torch.full((128,), 7), torch.arange(32) + 7, torch.arange(128) + 7]).int()
            assert torch.equal(rows, expected.expand(8, -1)), "the control kernel's partitions did not all run"
        return run

    return {
        # a control: a Gluon kernel that only warp-specialises, with no shared memory of its own -- what
        # racecheck reports here is Triton's own dispatch of the warps to their partitions
        "control-warp-specialize": warp_specialize_control(captures=False),
        # the same with values the partitions take through shared memory (loaded, not recomputable) and
        # registers handed between partitions (maxnreg), as in fusedattn's kernels
        "control-ws-captures": warp_specialize_control(captures=True),
        # Gluon (sm_90, 16-bit, D = Dv in {64, 128}): forward; dK/dV with dQ by reduce-adds (D=128)
        "gluon-fwd-dkdv-dq": attention(1, 2, 2, 333, 333, 128, causal=True),
        # D=64: the Gluon dK/dV pass, dQ by the Triton pass; a left window
        "gluon-d64-window": attention(1, 4, 2, 301, 517, 64, causal=True, window=(100, 0), lse_grad=True),
        # deterministic: the Gluon dQ pass (the forward's kernel in its dQ mode), dK/dV without atomics
        "gluon-deterministic": attention(1, 2, 1, 333, 333, 128, causal=True, deterministic=True),
        # causal GQA over > 2048 keys: dK/dV summed over the group by reduce-adds
        "gluon-group-sums": attention(1, 4, 1, 2100, 2100, 128, causal=True),
        # a mask of whole 128-blocks: the Gluon kernels walk its lists (the forward persistent)
        "gluon-block-sparse": block_sparse,
        # a full-shape 16-bit bias, read by the Gluon forward and dK/dV pass, its gradient stored
        "gluon-bias": attention(1, 2, 2, 256, 320, 128, causal=True, bias=lambda: randn(1, 2, 256, 320)),
        # Triton kernels: D=96, softcap, sinks, GQA, fp16, a right window (Gluon declines all of these)
        "triton-fwd-dq-dkdv": attention(2, 4, 2, 113, 255, 96, dtype=fp16, dv=64, window=(40, 7), softcap=20.0,
                                        sinks=lambda: torch.randn(4, device="cuda", generator=gen).requires_grad_()),
        # Triton: a partial mask (classify kernel, tile lists), a broadcast bias, its deterministic pass
        "triton-mask-bias": masked_triton,
        # KV cache: append + decoding split over keys + combination, contiguous and paged
        "kvcache-decode": kvcache(2, 1, 8, 2, 128, 1024, [777, 301], paged=False, new=1, causal=True),
        "kvcache-paged": kvcache(2, 3, 4, 1, 64, 512, [200, 17], paged=True, new=3, causal=True, softcap=30.0),
        # packed sequences: Gluon (host maps), Triton (D=96), and offsets checked on the device
        "varlen-gluon": varlen([130, 1, 0, 257, 64], 4, 2, 128, causal=True),
        "varlen-triton": varlen([130, 1, 0, 257, 64], 4, 2, 96, window=(31, 5)),
        "varlen-device-checked": varlen([130, 1, 0, 257, 64], 4, 2, 128, device_checked=True, causal=True),
    }


def _control_kernel(captures: bool):
    """A kernel of a 4-warp default partition, a 1-warp and a 4-warp worker that each store registers to
    global memory: no shared memory but what Triton's warp specialisation itself uses. ``captures``:
    the value stored is loaded before the partitions split (so it reaches them through shared memory,
    not recomputed in each), and the workers give up registers (setmaxnreg)."""
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl

    @gluon.jit
    def default(out, n):
        layout: gl.constexpr = gl.BlockedLayout([1], [32], [4], [0])
        offsets = gl.arange(0, 128, layout=layout)
        gl.store(out + gl.program_id(0) * 288 + offsets, offsets * 0 + n)

    @gluon.jit
    def small_worker(out, n):
        layout: gl.constexpr = gl.BlockedLayout([1], [32], [1], [0])
        offsets = gl.arange(0, 32, layout=layout)
        gl.store(out + gl.program_id(0) * 288 + 128 + offsets, offsets + n)

    @gluon.jit
    def large_worker(out, n):
        layout: gl.constexpr = gl.BlockedLayout([1], [32], [4], [0])
        offsets = gl.arange(0, 128, layout=layout)
        gl.store(out + gl.program_id(0) * 288 + 160 + offsets, offsets + n)

    @gluon.jit
    def by_value(out, n):  # a kernel argument: each partition reads it, nothing is captured
        gl.warp_specialize([(default, (out, n)), (small_worker, (out, n)), (large_worker, (out, n))], [1, 4],
                           [24, 24])

    @gluon.jit
    def loaded(out, seven):
        n = gl.load(seven)
        gl.warp_specialize([(default, (out, n)), (small_worker, (out, n)), (large_worker, (out, n))], [1, 4],
                           [24, 80])

    return loaded if captures else by_value


def disassemble(racecheck_log: Path, out: Path) -> str:
    """The SASS instruction at every kernel offset racecheck reports, in every cubin of that kernel in
    Triton's cache (the report names no specialisation): what the racing accesses are."""
    import glob

    sites = sorted(set(re.findall(r"at (\w+)\+0x([0-9a-f]+) in", racecheck_log.read_text())))
    cache = os.environ.get("TRITON_CACHE_DIR", os.path.expanduser("~/.triton/cache"))
    lines, opcodes = [], {}
    for kernel, offset in sites:
        for cubin in glob.glob(f"{cache}/*/{kernel}.cubin"):
            sass = subprocess.run(["cuobjdump", "-sass", cubin], capture_output=True, text=True).stdout.splitlines()
            wanted = f"/*{int(offset, 16):04x}*/"
            for i, line in enumerate(sass):
                if wanted in line:
                    lines += [f"{kernel}+0x{offset} ({Path(cubin).parent.name[:8]}):"] + sass[max(0, i - 3):i + 1]
                    opcode = line.split("*/")[1].strip().split()[0] if "*/" in line else "?"
                    opcodes.setdefault(opcode, set()).add(f"{kernel}+0x{offset}")
    (out / "racecheck-sites.txt").write_text("\n".join(lines))
    return "; ".join(f"{op}: {len(where)} sites" for op, where in sorted(opcodes.items()))


def run_probes(names: list[str] | None) -> None:
    import torch

    probes = _probes()
    for name in names or list(probes):
        print(f"{MARKER}{name}", flush=True)
        probes[name]()
        torch.cuda.synchronize()
        print(f"{MARKER}{name} done", flush=True)


def _counts(report: str, tool: str) -> dict:
    """Reports per probe, from the tool's output split at the probes' markers: for racecheck the
    hazards (the "[N hazards]" of each racing pair of instructions), for the others the errors."""
    per_probe, current = {}, None
    headline = re.compile(r"^========= (?!COMPUTE-SANITIZER|ERROR SUMMARY|RACECHECK SUMMARY|Saved host|Target)[A-Z]")
    for line in report.splitlines():
        if line.startswith(MARKER):
            current = line[len(MARKER):].removesuffix(" done")
            per_probe.setdefault(current, 0)
        elif current is None:
            continue
        elif tool == "racecheck":
            found = re.search(r"\[(\d+) hazards?\]", line)
            per_probe[current] += int(found.group(1)) if found else 0
        elif headline.match(line):
            per_probe[current] += 1
    summary = re.findall(r"(ERROR SUMMARY: \d+ errors?|RACECHECK SUMMARY: .*)", report)
    return {"per_probe": per_probe, "summary": summary}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tools", default=",".join(TOOLS))
    p.add_argument("--probes", default=None, help="comma-separated probe names (default: all)")
    p.add_argument("--out", default=None, help="folder for the logs and summary.json")
    p.add_argument("--timeout", type=float, default=1200, help="seconds a tool may run")
    p.add_argument("--run-probes", action="store_true", help=argparse.SUPPRESS)  # the child process
    args = p.parse_args()
    names = args.probes.split(",") if args.probes else None
    if args.run_probes:
        run_probes(names)
        return
    out = Path(args.out or tempfile.mkdtemp(prefix="fusedattn-sanitize-"))
    out.mkdir(parents=True, exist_ok=True)
    child = [sys.executable, __file__, "--run-probes"] + (["--probes", args.probes] if args.probes else [])
    print("compiling every probe's kernels once, without a tool ...", flush=True)
    subprocess.run(child, check=True, stdout=subprocess.DEVNULL)
    running = {}
    for tool in args.tools.split(","):  # the tools side by side: each is slow, the GPU has room for all
        env = dict(os.environ)
        options = ["--print-limit", "200"]
        if tool == "memcheck":
            env["PYTORCH_NO_CUDA_MEMORY_CACHING"] = "1"
        if tool == "racecheck":  # one line per racing pair of instructions, every pair
            options = ["--print-limit", "100000", "--racecheck-report", "analysis"]
        command = ["compute-sanitizer", "--tool", tool, *options, *child]
        print(f"{tool}: {' '.join(command)}", flush=True)
        log = open(out / f"{tool}.log", "w")
        running[tool] = (subprocess.Popen(command, env=env, stdout=log, stderr=subprocess.STDOUT), log)
    summary = {}
    for tool, (process, log) in running.items():
        try:
            code = process.wait(timeout=args.timeout)
        except subprocess.TimeoutExpired:
            process.kill()
            code = "timed out"
        log.close()
        summary[tool] = {**_counts((out / f"{tool}.log").read_text(), tool), "exit_code": code}
    (out / "summary.json").write_text(json.dumps(summary, indent=1))
    probes = sorted({name for tool in summary.values() for name in tool["per_probe"]})
    print(f"\n{'probe':<26}" + "".join(f"{tool:>12}" for tool in summary))
    for name in probes:
        print(f"{name:<26}" + "".join(f"{summary[t]['per_probe'].get(name, '-'):>12}" for t in summary))
    for tool, result in summary.items():
        print(f"{tool}: exit {result['exit_code']}; {'; '.join(result['summary']) or 'no summary line'}")
    if "racecheck" in summary:
        print(f"instructions at the racecheck sites: {disassemble(out / 'racecheck.log', out)}")
    print(f"logs: {out}")


if __name__ == "__main__":
    main()
