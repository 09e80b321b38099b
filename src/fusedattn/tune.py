"""``python -m fusedattn.tune``: the opt-in tuning run (needs a CUDA GPU).

    python -m fusedattn.tune                          # D=64 and 128, bf16, both key-length classes
    python -m fusedattn.tune --head-dims 128 --lengths long
    python -m fusedattn.tune --head-dims 128 --causal --softcap 30

Times candidate launch configs on this GPU (tuning/search.py: every candidate must pass the
correctness rule first) and writes the fastest into the tuning cache
(``$FUSEDATTN_TUNING_CACHE`` or ``~/.cache/fusedattn/tuning.json``), keyed by everything that
changes the compiled kernels. Later processes use those entries automatically; one changed
kernel source, package version, Triton version or GPU makes them stale (never used). Delete
the file to go back to the heuristic defaults.
"""

from __future__ import annotations

import argparse
import sys

import torch

from .tuning.cache import TuningCache, cache_path, config_key
from .tuning.configs import (SHORT_KEYS, AttentionConfigs, _cuda_configs, band_window, reload_tuning_cache,
                             select_configs)
from .tuning.search import DQ_SCHEME, KERNELS, TuningProblem, TuningResult, length_class_seqlen, tune

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}


def _progress(items, desc):
    try:
        from tqdm import tqdm

        return tqdm(items, desc=desc, unit="config", dynamic_ncols=True, leave=False)
    except ImportError:
        return items


def _shown(config) -> str:
    """A chosen or skipped config; None is the Gluon dQ pass's "use the Triton dQ pass"."""
    if config is None:
        return "none (the Triton dQ pass)"
    text = f"block_m={config.block_m} block_n={config.block_n} warps={config.num_warps} stages={config.num_stages}"
    if config.hopper_overlap is not None:
        text += f" (Gluon: {config.hopper_split} warpgroups, ping-pong {config.hopper_pingpong})"
    return text


def tune_entry(problem: TuningProblem, device, gpu: str, capability: tuple[int, int], cache: TuningCache,
               start: AttentionConfigs | None = None, **tune_options) -> TuningResult:
    """Tune one cache entry (from the heuristic's configs unless ``start`` is given) and store it
    under the key that ``select_configs`` will look up for this problem's class."""
    spec = problem.spec
    start = start or _cuda_configs(problem.dtype, problem.head_dim, problem.head_dim_v, problem.seqlen, capability,
                                   band_window(spec, problem.head_dim), spec.has_window_right, spec.has_softcap)
    result = tune(problem, start, device, **tune_options)
    key = config_key(gpu, capability, problem.dtype, problem.head_dim, problem.head_dim_v, problem.seqlen,
                     band_window(spec, problem.head_dim), spec.has_window_right, spec.has_softcap)
    cache.put(key, result.configs)
    return result


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m fusedattn.tune", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--head-dims", default="64,128", help="e.g. 64,128 (Dv = D)")
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="bf16")
    parser.add_argument("--lengths", choices=("short", "long", "both"), default="both",
                        help=f"key-length class: short (<= {SHORT_KEYS} keys, tuned at 1k), long (tuned at 4k)")
    parser.add_argument("--causal", action="store_true")
    parser.add_argument("--window", default=None, help="LEFT,RIGHT (sliding window; -1 = unbounded)")
    parser.add_argument("--softcap", type=float, default=None)
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("python -m fusedattn.tune times kernels on a CUDA GPU; none is visible here "
              "(without a cache every launch uses the heuristic defaults).", file=sys.stderr)
        return 2
    window = tuple(int(x) for x in args.window.split(",")) if args.window else None
    dtype, device = DTYPES[args.dtype], torch.device("cuda")
    index = torch.cuda.current_device()
    gpu, capability = torch.cuda.get_device_name(index), torch.cuda.get_device_capability(index)
    classes = {"short": [True], "long": [False], "both": [True, False]}[args.lengths]
    cache = TuningCache(cache_path())
    print(f"tuning on {gpu} (sm_{capability[0]}{capability[1]}), {args.dtype}; cache: {cache.path}")
    for head_dim in (int(d) for d in args.head_dims.split(",")):
        for short in classes:
            problem = TuningProblem(head_dim, head_dim, length_class_seqlen(short), dtype, args.causal, window,
                                    args.softcap)
            result = tune_entry(problem, device, gpu, capability, cache, progress=_progress)
            print(f"\nD={head_dim}, keys {'<=' if short else '>'} {SHORT_KEYS} (tuned at S={problem.seqlen}): "
                  f"forward {result.before_ms['forward']:.3f} -> {result.after_ms['forward']:.3f} ms, "
                  f"backward {result.before_ms['backward']:.3f} -> {result.after_ms['backward']:.3f} ms "
                  "(heuristic -> tuned, timed alternately)")
            for kernel in KERNELS:
                print(f"  {kernel:<8} {_shown(getattr(result.configs, kernel))}")
                if kernel in result.confirmed_ms:
                    kept_ms, contender_ms = result.confirmed_ms[kernel]
                    print(f"           the stage's fastest, timed again alternately: {contender_ms:.3f} ms against "
                          f"{kept_ms:.3f}")
                skipped = [(c, why) for c, why in result.trials[kernel] if isinstance(why, str)]
                for c, why in skipped:
                    print(f"           skipped {_shown(c)}: {why}")
            (_, atomics_ms), = result.trials[DQ_SCHEME]
            print(f"  dQ       {'by atomics from the dK/dV pass' if result.configs.atomic_dq else 'its own pass'} "
                  f"outside deterministic mode (atomics: {atomics_ms if isinstance(atomics_ms, str) else f'{atomics_ms:.3f} ms'})")
    reload_tuning_cache()
    spec = problem.spec
    check = select_configs(device, dtype, problem.head_dim, problem.head_dim_v, problem.seqlen,
                           band_window(spec, problem.head_dim), spec.has_window_right, spec.has_softcap)
    if check != result.configs:
        raise RuntimeError(f"the cache entry just written is not the one selected: {check} != {result.configs}")
    print(f"\nwrote {cache.path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
