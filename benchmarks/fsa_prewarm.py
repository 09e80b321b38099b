"""Compile flash-sparse-attn's autotune configurations in parallel before a bench run (issue 4's peers).

flash-sparse-attn 2.0.6 autotunes each of its dense kernels (forward, backward) over 54
configurations per problem and compiles every one on its first call: ~5 s each, 8+ minutes for one
bench row on the GPU machine, past the 10-minute limit of one command there (NOTES.md v49). Triton
keeps what it compiles in its cache folder; so this script makes the same calls as the bench, in
``--workers`` processes that each autotune over a share of the configurations, and the bench's own
autotune afterwards finds every configuration compiled and only times them (which itself took up to
~3 minutes a kernel: NOTES.md v50; a winner is then kept in ``benchmarks/fsa_launch_config``). What
the bench measures does not change: the same configurations, timed by the same autotuner, in its process. (The
workers keep their winners out of flash-sparse-attn's launch-config folder, where the bench would find
one and not autotune; a folder already holding winners from an earlier run is read as it is.)

    python benchmarks/fsa_prewarm.py --workers 14 window GQA D128-S4096-full
    python -m fusedattn.bench --variants --only window,GQA

Rows: a word of a variant's name (``--variants`` rows: ``window``, ``GQA``) or a standard shape's
name (``D128-S4096-causal``, ``D128-S4096-gqa16/2-full``). Prints, per worker, its configurations
and seconds; exits non-zero if a worker fails.
"""

from __future__ import annotations

import argparse
import multiprocessing
import sys
import time


def _configs_share(configs: list, worker: int, workers: int) -> list:
    return configs[worker::workers]


def _calls(rows: list[str]):
    """(name, step) for each row: ``step()`` runs flash-sparse-attn's forward and backward as the bench
    does, on the bench's inputs for the row."""
    import torch

    from fusedattn.bench import __main__ as bench
    from fusedattn.bench import systems, variants

    shapes = {s.name: s for s in bench.standard_shapes()}
    calls = []
    for row in rows:
        if row in shapes:
            shape = shapes[row]
            fn = systems._flash_sparse_dense(shape)
            q, k, v, dout = bench._inputs(shape, "cuda", "bshd")
            leaves = [t.requires_grad_() for t in (q, k, v)]
            calls.append((row, lambda fn=fn, leaves=leaves, dout=dout: fn(*leaves).backward(dout)))
            continue
        chosen = [v for v in variants.VARIANTS if row in v.name]
        if len(chosen) != 1:
            raise SystemExit(f"fsa_prewarm: {row!r} names {len(chosen)} rows; choose a standard shape "
                             f"({', '.join(shapes)}) or a word of one variant's name")
        fn = variants.SYSTEMS["flash-sparse-attn"](chosen[0])
        inp = variants._inputs(chosen[0], plain=False, layout="bshd")
        calls.append((row, lambda fn=fn, inp=inp: torch.autograd.grad(fn(inp), inp.leaves(), inp.dout)))
    return calls


def _worker(worker: int, workers: int, rows: list[str], launch_configs: str | None) -> tuple[int, int, float]:
    """Autotune every row over this worker's share of the configurations: (forward configs,
    backward configs, seconds). ``launch_configs``: a launch-config folder whose winners the worker
    starts from (a kernel with a winner there is not autotuned, so not compiled beyond it)."""
    import os
    import shutil
    import tempfile

    import torch

    from fusedattn.bench import systems

    start = time.perf_counter()
    # flash-sparse-attn saves each autotune's winner in its launch-config folder and, finding one
    # there, does not autotune again: a worker's winner among its share must not reach the bench.
    own = tempfile.mkdtemp(prefix=f"fsa-prewarm-{worker}-")
    if launch_configs:
        shutil.copytree(launch_configs, own, dirs_exist_ok=True)
    os.environ["FLASH_SPARSE_ATTENTION_LAUNCH_CONFIG_DIR"] = own
    systems.flash_dense_attn_func()  # imports it, standing in for its missing projection dependency
    from flash_sparse_attn.ops.triton import autotuner

    forward, backward = autotuner.get_fwd_dense_autotune_configs, autotuner.get_bwd_dense_autotune_configs
    fwd_share = _configs_share(forward(), worker, workers)
    bwd_share = _configs_share(backward(), worker, workers)
    # read when its kernels are first made (lazily, on the first call): patched before any call
    autotuner.get_fwd_dense_autotune_configs = lambda tile_n=None: fwd_share if tile_n is None else forward(tile_n)
    autotuner.get_bwd_dense_autotune_configs = lambda: bwd_share
    for _, step in _calls(rows):
        step()
    torch.cuda.synchronize()
    return len(fwd_share), len(bwd_share), time.perf_counter() - start


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("rows", nargs="+")
    parser.add_argument("--workers", type=int, default=max(1, (multiprocessing.cpu_count() or 2) - 2))
    parser.add_argument("--launch-configs", default=None,
                        help="a flash-sparse-attn launch-config folder of winners found earlier (the one the bench "
                             "will read, FLASH_SPARSE_ATTENTION_LAUNCH_CONFIG_DIR): kernels with a winner there are "
                             "neither autotuned nor compiled beyond it")
    args = parser.parse_args(argv)
    start = time.perf_counter()
    with multiprocessing.get_context("spawn").Pool(args.workers) as pool:
        jobs = [pool.apply_async(_worker, (w, args.workers, args.rows, args.launch_configs)) for w in range(args.workers)]
        failed = 0
        for w, job in enumerate(jobs):
            try:
                fwd, bwd, seconds = job.get()
                print(f"worker {w}: {fwd} forward and {bwd} backward configurations, {seconds:.0f} s", flush=True)
            except Exception as e:  # noqa: BLE001  report every worker, then fail
                failed += 1
                print(f"worker {w} failed: {type(e).__name__}: {e}", flush=True)
    print(f"fsa_prewarm: {', '.join(args.rows)} in {time.perf_counter() - start:.0f} s", flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
