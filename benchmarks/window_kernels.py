"""The sliding-window step per kernel, fusedattn beside FlashAttention-4: B=4, H=16, S=4k, D=128,
bf16, (B, S, H, D) storage for both, causal with a left window of 1024 and 549 keys and the causal
row for reference; fwd+bwd steps under the profiler (each kernel's mean device time over 5 steps,
the median of 3 rounds alternating between the two). Each output is compared with the other's first.

    PYTHONPATH=src python benchmarks/window_kernels.py OUT.json [--fa4-site /root/fa4/site]

FA4's wheels: ``--fa4-site`` is the folder they were installed into (``site.addsitedir``; its .pth
files matter); without it FA4 must be importable as installed."""
import collections
import json
import site
import sys

import torch

import fusedattn

sys.path.insert(0, "benchmarks")
from program_cost import call_masking, kernel_times  # noqa: E402

WINDOWS = (1024, 549, None)  # None: the causal row


def main() -> None:
    if "--fa4-site" in sys.argv:
        site.addsitedir(sys.argv[sys.argv.index("--fa4-site") + 1])
    from flash_attn.cute import flash_attn_func
    out = {"device": torch.cuda.get_device_name()}
    for keys in WINDOWS:
        gen = torch.Generator(device="cuda").manual_seed(0)
        q, k, v = (torch.randn(4, 4096, 16, 128, device="cuda", dtype=torch.bfloat16, generator=gen)
                   for _ in range(3))
        leaves = [t.requires_grad_() for t in (q, k, v)]
        dout = torch.randn_like(q)
        window = (keys - 1, 0) if keys else (None, None)

        def ours():
            o = fusedattn.attention(*leaves, layout="bshd", **call_masking(keys))
            o.backward(dout)
            return o

        def fa4():
            o = flash_attn_func(*leaves, causal=True, window_size=window)
            o = o[0] if isinstance(o, tuple) else o
            o.backward(dout)
            return o

        diff = (ours().float() - fa4().float()).abs().max().item()
        times = collections.defaultdict(lambda: collections.defaultdict(list))
        for _ in range(3):
            for name, fn in (("fusedattn", ours), ("fa4", fa4)):
                for kernel, t in kernel_times(fn, 5).items():
                    times[name][kernel].append(t)
        row = {"max_abs_diff": diff}
        for name, kernels in times.items():
            row[name] = {kernel: sorted(ts)[len(ts) // 2] for kernel, ts in kernels.items() if len(ts) == 3}
            print(keys or "causal", name, f"total {sum(row[name].values()):.1f} us:",
                  ", ".join(f"{kernel[:48]} {t:.1f}" for kernel, t in sorted(row[name].items(), key=lambda x: -x[1])),
                  flush=True)
        out[str(keys or "causal")] = row
    json.dump(out, open(sys.argv[1], "w"), indent=1)


if __name__ == "__main__":
    main()
