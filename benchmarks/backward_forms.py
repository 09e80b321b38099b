"""The Hopper backward's forms side by side, in one process, rounds alternating (CUDA events,
``triton.testing.do_bench``): fwd+bwd and the backward alone, each form's gradients compared with
the first form's before it is timed.

    python benchmarks/backward_forms.py --out DIR                       # the forms below, 4 shapes
    python benchmarks/backward_forms.py --forms wg3,rows-pp2 --shapes 4096:causal:32:32
    python benchmarks/backward_forms.py --head-dim 128 --forms heuristic,cols-pp0,cols-pp1 --shapes 4096:causal:16:16

Forms (pinned configs; the forward is the heuristic's in every form):
- ``heuristic``: the heuristic's configs; ``dq-pass``: the same with dQ in a pass of its own (the
  Gluon dQ pass at D=128, the Triton one at D=64);
- ``rows-pp0/1/2`` (D=64), ``cols-pp0/1/2`` (D=128): the dK/dV+dQ pass on 2 warpgroups of 64 keys,
  128-row steps with dQ split by rows (D=64) or 64-row steps split by columns (D=128), with no
  turns (lockstep: S^T and dP^T back to back, dQ issued before dK) or ping-pong 1 or 2;
- ``wg3`` (D=64): the Gluon dK/dV pass on 3 warpgroups x 64 keys, 64-row steps, then the Triton dQ
  pass (7 matmuls);
- ``det-heuristic``: ``deterministic=True`` with the heuristic's configs (dQ summed by the dK/dV
  pass in a fixed order where it can); ``det-dq-pass``, ``det-wg3``: ``deterministic=True`` with dQ
  in a pass of its own, after the heuristic's dK/dV pass or the 3-warpgroup one;
  ``det-block-major``, ``det-chunks-N``: ``deterministic=True``, the programs launched
  block-major or in chunks of N head rows (``Knobs.chunk_heads``); ``chunks-N`` the same without
  ``deterministic``; ``det-ordered``,
  ``det-ordered-chunks-N``: the same with dQ summed in the fixed order wherever the pass can
  (``AttentionConfigs.ordered_dq`` forced on: D=128 under a causal bound, short keys).
Shapes: ``S:causal|full|windowN[+capC]:Hq:Hkv`` (B x S = 16k tokens, bf16, bhsd; ``windowN``: a causal
sliding window of N keys; ``+capC``: softcap C). Writes
``<out>/backward-forms-D<head dim>-<gpu>.json`` and prints the medians.
"""

from __future__ import annotations

import argparse
import collections
import json
import re
from dataclasses import replace
from pathlib import Path

import torch
import triton

import fusedattn
from fusedattn.kernels.shared import knobs
from fusedattn.tuning.configs import KernelConfig, pinned_configs
from program_cost import call_masking, heuristic_configs

def _dq_split_config(block_m: int, pingpong: int) -> KernelConfig:
    """The dK/dV+dQ pass on 2 warpgroups of 64 keys: 128-row steps (D=64, dQ split by rows) or
    64-row steps (D=128, dQ split by columns)."""
    return KernelConfig(block_m, 128, 4, 2, tma_loads=True, hopper_overlap=0, hopper_split=2, hopper_pingpong=pingpong)


def _wg3_config() -> KernelConfig:
    return KernelConfig(64, 192, 4, 2, tma_loads=True, hopper_overlap=0, hopper_split=3, hopper_pingpong=1)


def forms_for(base, head_dim: int) -> dict:
    """name -> (configs, deterministic[, knobs for the launch order])."""
    dq_pass = replace(base, atomic_dq=False, dq_tma=False)
    forms = {"heuristic": (base, False), "dq-pass": (dq_pass, False)}
    split_name, block_m = ("cols", 64) if head_dim == 128 else ("rows", 128)
    for n in (0, 1, 2):
        forms[f"{split_name}-pp{n}"] = (replace(base, dkdv=_dq_split_config(block_m, n), atomic_dq=True,
                                                dq_tma=True), False)
    if head_dim == 64:
        wg3 = replace(base, dkdv=_wg3_config(), atomic_dq=False, dq_tma=False)
        forms.update({"wg3": (wg3, False), "det-wg3": (wg3, True)})
    forms.update({
        "det-heuristic": (base, True),
        "det-dq-pass": (dq_pass, True),
        "det-block-major": (base, True, dict(chunk_heads=0)),
        "det-ordered": (replace(base, ordered_dq=True), True),
    })
    return forms


def parsed_form(name: str, base):
    """``chunks-N``, ``det-chunks-N``, ``det-ordered-chunks-N``: the heuristic's configs (deterministic
    with ``det-``; dQ in the fixed order wherever the pass can with ``ordered-``,
    ``AttentionConfigs.ordered_dq`` forced on), the programs launched in chunks of N head rows
    (``Knobs.chunk_heads``). None for other names."""
    match = re.fullmatch(r"(det-)?(ordered-)?chunks-(\d+)", name)
    if match is None or (match.group(2) and not match.group(1)):
        return None
    configs = replace(base, ordered_dq=True) if match.group(2) else base
    return configs, bool(match.group(1)), dict(chunk_heads=int(match.group(3)))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--forms", default="heuristic,wg3,rows-pp1,rows-pp2,det-heuristic,det-wg3")
    parser.add_argument("--shapes", default="4096:causal:32:32,4096:full:32:32,1024:causal:32:32,16384:causal:32:32")
    parser.add_argument("--head-dim", type=int, choices=(64, 128), default=64)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--out", default="benchmarks/results")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("backward_forms.py times the Hopper kernels: it needs a CUDA GPU")
    device = torch.device("cuda")
    head_dim = args.head_dim
    rows = []
    for shape in args.shapes.split(","):
        seqlen, kind, heads_q, heads_kv = shape.split(":")
        kind, _, cap = kind.partition("+cap")
        softcap = float(cap) if cap else 0.0
        seqlen, heads_q, heads_kv, causal = int(seqlen), int(heads_q), int(heads_kv), kind == "causal"
        window = int(kind[len("window"):]) if kind.startswith("window") else None
        masking = call_masking(window, causal)
        if softcap:
            masking["softcap"] = softcap
        batch = max(16384 // seqlen, 1)
        gen = torch.Generator(device=device).manual_seed(0)
        q, dout = (torch.randn(batch, heads_q, seqlen, head_dim, device=device, dtype=torch.bfloat16, generator=gen)
                   for _ in range(2))
        k, v = (torch.randn(batch, heads_kv, seqlen, head_dim, device=device, dtype=torch.bfloat16, generator=gen)
                for _ in range(2))
        base = heuristic_configs(q, v, seqlen, window, causal, softcap)
        known = forms_for(base, head_dim)
        forms = {name: known.get(name) or parsed_form(name, base) for name in args.forms.split(",")}
        unknown = [name for name, form in forms.items() if form is None]
        if unknown:
            raise SystemExit(f"unknown forms: {unknown}")
        first = None
        for rnd in range(args.rounds):
            for name, (configs, deterministic, *launch) in forms.items():
                with pinned_configs(configs), knobs.overridden(**(launch[0] if launch else {})):
                    leaves = [t.clone().requires_grad_() for t in (q, k, v)]

                    def step():
                        out = fusedattn.attention(*leaves, **masking, layout="bhsd", deterministic=deterministic)
                        out.backward(dout)
                    step()
                    grads = [t.grad.float() for t in leaves]
                    first = grads if first is None else first
                    diff = max((a - b).abs().max().item() for a, b in zip(grads, first))
                    for t in leaves:
                        t.grad = None
                    fwdbwd = triton.testing.do_bench(step, warmup=50, rep=300)
                    out = fusedattn.attention(*leaves, **masking, layout="bhsd", deterministic=deterministic)
                    bwd = triton.testing.do_bench(lambda: torch.autograd.grad(out, leaves, dout, retain_graph=True),
                                                  warmup=50, rep=300)
                rows.append(dict(D=head_dim, S=seqlen, B=batch, Hq=heads_q, Hkv=heads_kv, causal=causal, window=window,
                                 softcap=softcap,
                                 form=name, round=rnd, fwdbwd_ms=fwdbwd, bwd_ms=bwd,
                                 max_grad_diff_vs_first_form=diff))
        first = None
    gpu = torch.cuda.get_device_name().replace(" ", "-")
    out = Path(args.out) / f"backward-forms-D{head_dim}-{gpu}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(dict(gpu=torch.cuda.get_device_name(), rows=rows), indent=1))
    medians = collections.defaultdict(list)
    for r in rows:
        medians[(r["S"], r.get("window") or r["causal"], r.get("softcap") or "", r["Hq"], r["Hkv"], r["form"])].append(r)
    for key, runs in medians.items():
        mid = sorted(runs, key=lambda r: r["fwdbwd_ms"])[len(runs) // 2]
        print(*key, f"f+b {mid['fwdbwd_ms']:.3f} ms  bwd {sorted(r['bwd_ms'] for r in runs)[len(runs) // 2]:.3f} ms"
              f"  max |grad - first form's| {max(r['max_grad_diff_vs_first_form'] for r in runs):.3g}")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
