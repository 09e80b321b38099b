"""``python -m fusedattn``: the quick tour on whatever device is here.

1. A correctness check: fusedattn against the float64 reference on a few shapes that
   exercise every feature of this release, forward and backward (docs/SEMANTICS.md, "Correctness rule").
2. A small benchmark next to torch SDPA (on a GPU: D=128, S=1k and 4k; on a CPU: the
   PyTorch path against SDPA's default CPU backend, B=1, H=8, D=64, S=1k).
"""

from __future__ import annotations

import sys

import torch

import fusedattn
from fusedattn.reference import reference_attention
from fusedattn.validate import compare_to_reference

CHECKS = [
    # (description, B, Hq, Hkv, Sq, Sk, D, options)
    ("plain", 2, 4, 4, 129, 129, 64, {}),
    ("causal, Sq < Sk", 1, 4, 4, 77, 200, 128, dict(causal=True)),
    ("GQA 8/2, window, softcap", 1, 8, 2, 150, 150, 80, dict(window=(32, 8), softcap=30.0)),
    ("MQA, causal, Sq > Sk, D != Dv", 2, 4, 1, 90, 61, 96, dict(causal=True)),
    ("bias + top-k mask + sinks, causal", 1, 4, 2, 100, 100, 64, dict(causal=True, extras=True)),
]


def _extras(b, hq, sq, sk, device, dtype, gen) -> dict:
    """A (B, Hq, Sq, Sk) bias, the causal top-k mask it selects (fusedattn.topk_mask) and sinks."""
    bias = (2 * torch.randn(b, hq, sq, sk, generator=gen)).to(device, dtype)
    mask = fusedattn.topk_mask(bias, sk // 3, causal=True)
    return dict(bias=bias, mask=mask, sinks=torch.randn(hq, generator=gen).to(device))


def _run(fn, q, k, v, dout, dtype=None):
    leaves = [t.detach().to(dtype or t.dtype).requires_grad_() for t in (q, k, v)]
    out, lse = fn(*leaves)
    grads = torch.autograd.grad(out, leaves, dout.to(out.dtype))
    return (out, lse, *grads)


def correctness_check(device: str) -> bool:
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    print(f"correctness vs float64 reference ({device}, {str(dtype).replace('torch.', '')}):")
    all_ok = True
    gen = torch.Generator().manual_seed(0)
    for desc, b, hq, hkv, sq, sk, d, opts in CHECKS:
        dv = 64 if "D != Dv" in desc else d
        q, k, v, dout = (torch.randn(*s, generator=gen).to(device, dtype)
                         for s in ((b, sq, hq, d), (b, sk, hkv, d), (b, sk, hkv, dv), (b, sq, hq, dv)))
        opts = dict(opts)
        if opts.pop("extras", False):
            opts.update(_extras(b, hq, sq, sk, device, dtype, gen))
        ours = _run(lambda *t: fusedattn.attention(*t, return_lse=True, **opts), q, k, v, dout)
        ref = lambda *t: reference_attention(*t, return_lse=True, **opts)  # noqa: E731
        lowp, ref64 = _run(ref, q, k, v, dout), _run(ref, q, k, v, dout, torch.float64)
        verdicts = []
        for name, a, lo, r in zip(("out", "lse", "dq", "dk", "dv"), ours, lowp, ref64):
            c = compare_to_reference(a, lo, r)
            all_ok &= c.ok
            verdicts.append(f"{name} {c.error:.1e}/{c.bound:.1e}" + ("" if c.ok else " FAIL"))
        print(f"  {'ok ' if all(not v.endswith('FAIL') for v in verdicts) else 'BAD'} {desc:<34}"
              f" (error/bound) " + ", ".join(verdicts))
    return all_ok


def main() -> int:
    device = "cuda" if torch.cuda.is_available() else "cpu"
    print(f"fusedattn {fusedattn.__version__} on {torch.cuda.get_device_name() if device == 'cuda' else 'CPU'}")
    ok = correctness_check(device)
    from fusedattn.bench.__main__ import cpu_shapes, cpu_table, run, standard_shapes, table
    from fusedattn.bench.systems import CPU_SYSTEMS, SYSTEMS

    if device == "cuda":
        shapes = standard_shapes(quick=True)[:3]
        systems = [s for s in SYSTEMS if s.name in ("fusedattn", "sdpa-cudnn", "sdpa-flash")]
    else:
        shapes, systems = [s for s in cpu_shapes() if s.seqlen == 1024][:2], CPU_SYSTEMS
    print("\nsmall benchmark (full run: python -m fusedattn.bench):")
    rows = run(shapes, systems, device)
    print(table(rows) if device == "cuda" else cpu_table(rows))
    print("\nall checks passed" if ok else "\nSOME CHECKS FAILED")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
