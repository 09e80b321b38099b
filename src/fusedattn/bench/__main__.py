"""Benchmark fusedattn against its peers, side by side in one process.

    python -m fusedattn.bench                 # the standard shapes, all installed peers
    python -m fusedattn.bench --quick         # D=128, S in {1k, 4k}
    python -m fusedattn.bench --systems fusedattn,sdpa-cudnn,flex
    python -m fusedattn.bench --variants      # bias, softcap, window, sinks, GQA, mask, top-k rows (bench/variants.py)
    python -m fusedattn.bench --packed        # varlen training on packed documents (bench/packed.py)
    python -m fusedattn.bench --decode        # decoding over a KV cache, contiguous and paged (bench/decode.py)
    python -m fusedattn.bench --hf            # training steps of a Llama-3-8B-shaped HF model per attn_implementation (bench/hf.py)
    python -m fusedattn.bench --backward-on-caller   # any of the above, every backward on the calling thread

Writes ``benchmarks/results/<gpu>-<date>.json`` (and a PNG plot when matplotlib is
there) and prints a table. Times are medians of ``triton.testing.do_bench`` on CUDA,
taken two ways for every system: eager calls (what a training loop pays, host time
included) and replays of a CUDA graph of the same calls (the GPU's time alone: a short
step whose Python outlasts its kernels measures the host there, not the kernels).
``--rounds N`` measures every system N times per shape in rotated order and keeps
the medians: this machine's clocks drift a few % between minutes, and rounds take
peers at the same minutes.

On a machine without a GPU it compares fusedattn's CPU path with torch SDPA on the CPU (its
default backend, torch's fused CPU kernel) on ``cpu_shapes()`` -- B=1, H=8, D=64, float32,
S in {1k, 4k}, causal and not; a GQA row, a sliding-window row (SDPA: a dense mask) and a bf16
row -- each output checked against fusedattn's before timing, and prints SDPA's time over ours,
forward and forward+backward (> 1: ours is faster); the JSON is ``<out>/cpu-<machine>-<date>.json``.
"""

from __future__ import annotations

import argparse
import datetime
import json
import platform
import re
import statistics
from pathlib import Path

import torch

import fusedattn

from . import gpu_state
from .systems import CPU_SYSTEMS, SYSTEMS, Shape, Unavailable, agreement, disagreement, failure_note, stored_as
from .timing import graph_ms, median_ms, progress

TOKENS, HIDDEN = 16384, 2048  # the standard shapes: B * S = 16k tokens, H * D = 2048


GQA_HEADS = (16, 2)  # the grouped-query case: B=4, 16 query heads / 2 key-value heads, S=4k, D=128


def standard_shapes(quick: bool = False, head_dims=None, seqlens=None) -> list[Shape]:
    """The standard shapes (docs/PERFORMANCE.md, "Method"), then the grouped-query
    shapes where D=128 and S=4k are among them."""
    head_dims = head_dims or ((128,) if quick else (64, 128))
    seqlens = seqlens or ((1024, 4096) if quick else (1024, 4096, 16384))
    shapes = [Shape(TOKENS // s, HIDDEN // d, s, d, causal) for d in head_dims for s in seqlens for causal in (False, True)]
    if 128 in head_dims and 4096 in seqlens:
        heads, kv_heads = GQA_HEADS
        shapes += [Shape(TOKENS // 4096, heads, 4096, 128, causal, heads_kv=kv_heads) for causal in (False, True)]
    return shapes


CPU_WINDOW = 1024  # the CPU window row's keys per query (bench/variants.py's sliding-window row)


def cpu_shapes() -> list[Shape]:
    """The CPU rows: B=1, H=8, D=64, float32, S in {1k, 4k}, causal and
    not; GQA 8/2 at 4k, causal and not; a causal sliding window of CPU_WINDOW keys at 4k (SDPA: a
    dense mask); the 1k causal row in bf16."""
    shapes = [Shape(1, 8, s, 64, causal, torch.float32) for s in (1024, 4096) for causal in (False, True)]
    shapes += [Shape(1, 8, 4096, 64, causal, torch.float32, heads_kv=2) for causal in (False, True)]
    shapes.append(Shape(1, 8, 4096, 64, True, torch.float32, window=CPU_WINDOW))
    shapes.append(Shape(1, 8, 1024, 64, True, torch.bfloat16))
    return shapes


def _inputs(shape: Shape, device, layout: str = "bhsd"):
    """q, k, v, dout as (B, H, S, D) tensors, the same values for every system; ``layout`` "bshd":
    stored as (B, S, H, D) (``systems.System.layout``)."""
    gen = torch.Generator(device=device).manual_seed(0)
    q_size = (shape.batch, shape.heads, shape.seqlen, shape.head_dim)
    kv_size = (shape.batch, shape.kv_heads, shape.seqlen, shape.head_dim)
    return tuple(stored_as(torch.randn(size, device=device, dtype=shape.dtype, generator=gen), layout)
                 for size in (q_size, kv_size, kv_size, q_size))


def measure(system, shape: Shape, device, baseline_out=None) -> tuple[dict, torch.Tensor | None]:
    """One system on one shape: (row, its forward output for checking the others)."""
    row = dict(system=system.name, case=shape.name, B=shape.batch, H=shape.heads, Hkv=shape.kv_heads, Sq=shape.seqlen,
               Sk=shape.seqlen, D=shape.head_dim, causal=shape.causal, dtype=str(shape.dtype).replace("torch.", ""))
    if shape.window:
        row["window"] = shape.window
    if system.backend:
        row["backend"] = system.backend(shape)
    out = None
    try:
        fn = system.make(shape)
        q, k, v, dout = _inputs(shape, device, system.layout)
        with torch.no_grad():
            out = fn(q, k, v)
            if baseline_out is not None:  # before any timing: a wrong answer is known before its time
                row.update(agreement(out, baseline_out))
            fwd_ms = median_ms(lambda: fn(q, k, v))
        leaves = [t.requires_grad_() for t in (q, k, v)]

        def step():
            fn(*leaves).backward(dout)

        fwdbwd_ms = median_ms(step, grad_to_none=leaves)
        if torch.cuda.is_available():
            # the clock the sustained fwd+bwd timing ended at, and what limited it (gpu_state.py)
            row["gpu_state"] = gpu_state.query()
            try:
                with torch.no_grad():
                    row["graph_fwd_ms"] = graph_ms(lambda: fn(q, k, v))
                row["graph_fwdbwd_ms"] = graph_ms(step, grad_to_none=leaves)
            except Exception as e:  # noqa: BLE001  a peer that cannot be captured keeps its eager times
                row["graph_note"] = f"graph capture fails: {type(e).__name__}: {str(e).splitlines()[0][:120]}"
    except Unavailable as e:
        row["note"] = f"skipped: {e}"
        return row, None
    except Exception as e:  # a peer failing on a shape is a result, not a crash
        row["note"] = failure_note(e)
        return row, None
    finally:
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    row.update(fwd_ms=fwd_ms, fwdbwd_ms=fwdbwd_ms)
    row.update(_rates(row))
    return row, out


def device_name() -> str:
    if torch.cuda.is_available():
        return torch.cuda.get_device_name()
    return f"cpu-{platform.machine()}"


def environment() -> dict:
    env = dict(device=device_name(), torch=torch.__version__, fusedattn=fusedattn.__version__,
               date=datetime.date.today().isoformat(), backward_thread=backward_thread())
    try:
        import triton

        env["triton"] = triton.__version__
    except ImportError:
        pass
    if torch.cuda.is_available():
        env["cudnn"] = torch.backends.cudnn.version()
        env["cuda"] = torch.version.cuda
    else:
        env["threads"] = torch.get_num_threads()
        env["cpu_capability"] = torch.backends.cpu.get_cpu_capability()
    return env


def backward_thread() -> str:
    """Where autograd runs a CUDA backward in this run: "engine" (its device thread, the default) or
    "caller" (``--backward-on-caller``)."""
    return "engine" if torch._C._is_multithreading_enabled() else "caller"


def result_stem(env: dict, prefix: str = "") -> str:
    """A result file's name without its suffix: [prefix-]device-date[-backward-on-caller]."""
    stem = f"{re.sub(r'[^A-Za-z0-9]+', '-', env['device']).strip('-')}-{env['date']}"
    stem = f"{prefix}-{stem}" if prefix else stem
    return stem + "-backward-on-caller" if env["backward_thread"] == "caller" else stem


TIME_KEYS = ("fwd_ms", "fwdbwd_ms", "graph_fwd_ms", "graph_fwdbwd_ms")


def merge_rounds(measured: list[dict]) -> dict:
    """One row from a system's rounds on one shape: the median of each time (and the rates from
    those medians); a round that failed makes the row a failure (a peer's crash is a result)."""
    failed = [r for r in measured if "fwd_ms" not in r]
    if failed:
        return failed[0]
    row = dict(measured[0], rounds=len(measured))
    if any("gpu_state" in r for r in measured):
        row["gpu_state_rounds"] = [r.get("gpu_state", {}) for r in measured]
    for key in TIME_KEYS:
        times = sorted(r[key] for r in measured if key in r)
        if times:
            row[key] = statistics.median(times)
            row[key + "_rounds"] = [r[key] for r in measured if key in r]
    row.update(_rates(row))
    return row


def _rates(row: dict) -> dict:
    """TFLOP/s and the backward alone (fwd+bwd less fwd) from a row's times."""
    shape = Shape(row["B"], row["H"], row["Sq"], row["D"], row["causal"], heads_kv=row["Hkv"], window=row.get("window"))
    rates = {}
    for prefix in ("", "graph_"):
        fwd, fwdbwd = row.get(prefix + "fwd_ms"), row.get(prefix + "fwdbwd_ms")
        if fwd is None or fwdbwd is None:
            continue
        rates[prefix + "bwd_ms"] = fwdbwd - fwd
        rates[prefix + "fwd_tflops"] = shape.flops("fwd") / fwd * 1e-9
        rates[prefix + "fwdbwd_tflops"] = shape.flops("fwdbwd") / fwdbwd * 1e-9
        rates[prefix + "bwd_tflops"] = shape.flops("bwd") / max(fwdbwd - fwd, 1e-6) * 1e-9
    return rates


def run(shapes, systems, device, on_row=None, rounds: int = 1) -> list[dict]:
    """Every system on every shape, ``rounds`` times each in rotated order (round r starts with the
    r-th system), merged by ``merge_rounds``; ``on_row(rows so far)`` after each shape (the JSON is
    saved as it goes, so an interrupted run keeps what it measured)."""
    work = [(shape, system) for shape in shapes for r in range(rounds)
            for system in systems[r % len(systems):] + systems[:r % len(systems)]]
    rows, baseline = [], {}
    measured = {(shape.name, system.name): [] for shape in shapes for system in systems}
    for shape, system in progress(work, "benchmark"):
        row, out = measure(system, shape, device, baseline.get(shape.name))
        if system.name == "fusedattn" and out is not None:
            baseline.setdefault(shape.name, out)
        measured[shape.name, system.name].append(row)
        if all(len(measured[shape.name, s.name]) == rounds for s in systems):  # the shape's last run
            rows += [merge_rounds(measured[shape.name, s.name]) for s in systems]
            if on_row:
                on_row(rows)
    return rows


def table(rows: list[dict]) -> str:
    """Eager times and rates, the CUDA graph's fwd+bwd time, fusedattn's speed over each peer's
    (> 1: ours is faster) from both, and the SM clock the fwd+bwd timings ended at (MHz, the
    rounds' middle one; '*': the board's power cap was limiting it, ``gpu_state.py``)."""
    ours = {r["case"]: r for r in rows if r["system"] == "fusedattn" and "fwd_ms" in r}
    lines = [f"{'case':<28}{'system':<24}{'fwd ms':>9}{'fwd TF/s':>10}{'f+b ms':>9}{'f+b TF/s':>10}"
             f"{'bwd TF/s':>10}{'graph f+b':>11}{'ours/peer f+b':>15}{'(graph)':>9}{'MHz':>7}"]
    for r in rows:
        if "fwd_ms" not in r:
            lines.append(f"{r['case']:<28}{r['system']:<24}  {r.get('note', '')}")
            continue
        ratio = graph_ratio = ""
        mine = ours.get(r["case"])
        if r["system"] != "fusedattn" and mine:
            ratio = f"{r['fwdbwd_ms'] / mine['fwdbwd_ms']:.2f}x"
            if "graph_fwdbwd_ms" in r and "graph_fwdbwd_ms" in mine:
                graph_ratio = f"{r['graph_fwdbwd_ms'] / mine['graph_fwdbwd_ms']:.2f}x"
        graph = f"{r['graph_fwdbwd_ms']:.3f}" if "graph_fwdbwd_ms" in r else "-"
        lines.append(f"{r['case']:<28}{r['system']:<24}{r['fwd_ms']:>9.3f}{r['fwd_tflops']:>10.1f}"
                     f"{r['fwdbwd_ms']:>9.3f}{r['fwdbwd_tflops']:>10.1f}{r['bwd_tflops']:>10.1f}{graph:>11}"
                     f"{ratio:>15}{graph_ratio:>9}{gpu_state.cell(r):>7}".rstrip() + disagreement(r))
    return "\n".join(lines)


def cpu_table(rows: list[dict], peer: str = "sdpa") -> str:
    """The CPU run: each row's times for fusedattn and ``peer``, and the peer's time over ours, forward
    and forward+backward (> 1: ours is faster)."""
    by_case = {}
    for r in rows:
        by_case.setdefault(r["case"], {})[r["system"]] = r
    lines = [f"{'case':<38}{'dtype':<10}{'ours fwd':>10}{peer + ' fwd':>10}{'ratio':>8}"
             f"{'ours f+b':>10}{peer + ' f+b':>10}{'ratio':>8}  {peer + ' backend':<18}(ms; ratio = {peer} / ours)"]
    for case, systems in by_case.items():
        mine, theirs = systems.get("fusedattn", {}), systems.get(peer, {})
        dtype = mine.get("dtype", theirs.get("dtype", ""))
        if "fwd_ms" not in mine or "fwd_ms" not in theirs:
            notes = "; ".join(f"{name}: {r.get('note', '')}" for name, r in systems.items() if "fwd_ms" not in r)
            lines.append(f"{case:<38}{dtype:<10}  {notes}")
            continue
        lines.append(f"{case:<38}{dtype:<10}{mine['fwd_ms']:>10.1f}{theirs['fwd_ms']:>10.1f}"
                     f"{theirs['fwd_ms'] / mine['fwd_ms']:>7.2f}x{mine['fwdbwd_ms']:>10.1f}{theirs['fwdbwd_ms']:>10.1f}"
                     f"{theirs['fwdbwd_ms'] / mine['fwdbwd_ms']:>7.2f}x  {theirs.get('backend', ''):<18}".rstrip()
                     + disagreement(theirs))
    return "\n".join(lines)


def plot(rows: list[dict], path: Path, title: str) -> bool:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    rows = [r for r in rows if r.get("Hkv", r["H"]) == r["H"]]  # lines by length: the grouped-query rows are one length
    panels = sorted({(r["D"], r["causal"]) for r in rows})
    fig, axes = plt.subplots(1, len(panels), figsize=(4.2 * len(panels), 3.8), squeeze=False)
    for ax, (d, causal) in zip(axes[0], panels):
        for system in dict.fromkeys(r["system"] for r in rows):
            pts = sorted((r["Sq"], r["fwdbwd_tflops"]) for r in rows
                         if r["system"] == system and r["D"] == d and r["causal"] == causal and "fwdbwd_tflops" in r)
            if pts:
                ax.plot(*zip(*pts), marker="o", label=system, linewidth=2.5 if system == "fusedattn" else 1.2)
        ax.set_xscale("log", base=2)
        ax.set_title(f"D={d}, {'causal' if causal else 'non-causal'}")
        ax.set_xlabel("sequence length")
        ax.set_ylabel("fwd+bwd TFLOP/s")
        ax.grid(alpha=0.3)
    axes[0][0].legend(fontsize=7)
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    return True


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(prog="python -m fusedattn.bench", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="D=128, S in {1k, 4k} only")
    parser.add_argument("--systems", default=None, help="comma-separated subset of system names")
    parser.add_argument("--head-dims", default=None, help="e.g. 64,128 (default: the standard 64 and 128)")
    parser.add_argument("--seqlens", default=None, help="e.g. 1024,4096 (default: the standard 1k, 4k, 16k)")
    parser.add_argument("--rounds", type=int, default=None,
                        help="measure every system this many times per shape, in rotated order, and keep the "
                             "medians (default: 3)")
    parser.add_argument("--out", default="benchmarks/results", help="folder for the JSON and the plot")
    parser.add_argument("--no-save", action="store_true", help="print the table only")
    parser.add_argument("--variants", action="store_true",
                        help="the variant rows (bias, softcap, window, sinks, GQA, masks, top-k, block-sparse) "
                             "instead of the shapes")
    parser.add_argument("--only", default=None,
                        help="with --variants: comma-separated words; the rows whose name contains one of them")
    parser.add_argument("--packed", action="store_true",
                        help="varlen training on 16 packed documents (vs Flex's document mask and "
                             "SDPA on the padded batch)")
    parser.add_argument("--backward-on-caller", action="store_true",
                        help="run every system's backward on the calling thread "
                             "(torch.autograd.set_multithreading_enabled(False)) instead of the autograd engine's "
                             "device thread: what a short step's host time is without the engine's thread hand-off")
    parser.add_argument("--decode", action="store_true",
                        help="decoding over a KV cache, contiguous and paged (bandwidth vs the "
                             "device-to-device copy; vs SDPA and Flex)")
    parser.add_argument("--hf", action="store_true",
                        help="training steps of a Llama-3-8B-shaped transformers model (random weights) with "
                             "attn_implementation sdpa, flex_attention, fusedattn: S in {4k, 16k} and packed "
                             "documents (bench/hf.py; without CUDA a tiny float32 model, as a smoke test)")
    parser.add_argument("--hf-layers", type=int, default=2, help="with --hf: decoder layers (default 2)")
    parser.add_argument("--hf-vocab", type=int, default=None,
                        help="with --hf: vocabulary size (default Llama 3's 128256; the tiny CPU model's 256)")
    parser.add_argument("--cp", action="store_true",
                        help="context parallelism's strong scaling under torchrun, one process per GPU "
                             "(bench/cp.py): one GPU vs N on causal, windowed and packed rows, torch's "
                             "context_parallel beside")
    parser.add_argument("--cp-seqlen", type=int, default=None, help="with --cp: tokens (default 32k per GPU)")
    parser.add_argument("--cp-strategies", default="ulysses,ring,allgather",
                        help="with --cp: comma-separated strategies to time")
    parser.add_argument("--cp-rows", default=None,
                        help="with --cp: comma-separated rows among causal, window, documents (default: all)")
    args = parser.parse_args(argv)
    # Thread-local: the whole run happens on this thread. A graph's replay runs no Python, so only the
    # eager times can change.
    with torch.autograd.set_multithreading_enabled(not args.backward_on_caller):
        return _main(args, parser)


def _main(args, parser) -> None:
    if args.variants:
        return _main_variants(args)
    if args.cp:
        from . import cp

        env = environment()
        return cp.main(args, env, result_stem(env, "cp"))
    if args.packed:
        return _main_packed(args)
    if args.decode:
        return _main_decode(args)
    if args.hf:
        return _main_hf(args)

    on_gpu = torch.cuda.is_available()
    device = "cuda" if on_gpu else "cpu"
    systems = SYSTEMS if on_gpu else CPU_SYSTEMS
    if args.systems:
        wanted = args.systems.split(",")
        unknown = set(wanted) - {s.name for s in systems}
        if unknown:
            parser.error(f"unknown systems {sorted(unknown)}; choose from {[s.name for s in systems]}")
        systems = [s for s in systems if s.name in wanted or s.name == "fusedattn"]
    ints = lambda text: tuple(int(x) for x in text.split(",")) if text else None  # noqa: E731
    shapes = standard_shapes(args.quick, ints(args.head_dims), ints(args.seqlens)) if on_gpu else cpu_shapes()
    env = environment()
    print(f"fusedattn benchmark on {env['device']} (torch {env['torch']}, triton {env.get('triton', '-')}; "
          f"backward on the {env['backward_thread']} thread)")
    for s in systems:
        print(f"  {s.name:<20}{s.detail}")
    stem = result_stem(env)
    out_dir, json_path = Path(args.out), Path(args.out) / f"{stem}.json"

    rounds = args.rounds or 3

    def save(rows):
        if not args.no_save:
            out_dir.mkdir(parents=True, exist_ok=True)
            json_path.write_text(json.dumps(dict(environment=dict(env, rounds=rounds),
                                                 systems={s.name: s.detail for s in systems}, rows=rows), indent=1))

    rows = run(shapes, systems, device, on_row=save, rounds=rounds)
    print(table(rows) if on_gpu else cpu_table(rows))
    if args.no_save:
        return
    print(f"wrote {json_path}")
    if on_gpu and plot(rows, out_dir / f"{stem}.png", f"{env['device']}: forward+backward, bf16, 16k tokens"):
        print(f"wrote {out_dir / f'{stem}.png'}")


def _main_variants(args) -> None:
    from . import variants

    _main_side_rows(args, "--variants", "variants", lambda on_row: variants.run(
        on_row=on_row, only=args.only.split(",") if args.only else None), variants.table)


def _main_packed(args) -> None:
    from . import packed

    _main_side_rows(args, "--packed", "packed", packed.run, packed.table,
                    extra=dict(lengths=packed.document_lengths()))


def _main_decode(args) -> None:
    from . import decode

    _main_side_rows(args, "--decode", "decode", decode.run, decode.table)


def _main_hf(args) -> None:
    from . import hf

    env = environment()
    hf.main(args, env, result_stem(env, "hf"))


def _main_side_rows(args, flag: str, prefix: str, run_rows, table_of, extra: dict | None = None) -> None:
    """A GPU-only set of rows (``--variants``, ``--packed``, ``--decode``): run, save as it goes, print the table."""
    if not torch.cuda.is_available():
        print(f"fusedattn benchmark {flag}: needs a CUDA device (its peers and shapes are GPU-sized)")
        return
    env = environment()
    stem = result_stem(env, prefix)
    json_path = Path(args.out) / f"{stem}.json"

    def save(rows):
        if not args.no_save:
            json_path.parent.mkdir(parents=True, exist_ok=True)
            json_path.write_text(json.dumps(dict(environment=env, **(extra or {}), rows=rows), indent=1))

    rows = run_rows(on_row=save)
    print(table_of(rows))
    if not args.no_save:
        print(f"wrote {json_path}")


if __name__ == "__main__":
    main()
