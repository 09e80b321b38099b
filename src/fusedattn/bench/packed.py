"""The packed rows: training on packed documents (varlen), side by side in one process.

    python -m fusedattn.bench --packed

16 documents of random lengths (seeded) totalling 16k tokens, H=16, D=128, bf16, causal within
each document. Systems: ``fusedattn.varlen_attention`` on the packed tokens, its offsets given on
the GPU (read back every call: a wait for the GPU) or on the host (as a data loader has them; copied
to the GPU without a wait); FlexAttention under
torch.compile on the packed tokens with a document mask (its block mask built once, outside the
timed steps); SDPA (cuDNN and FlashAttention-2 backends) and fusedattn's own dense kernel on the
padded batch (16 x the longest document; causal is exact for every real row there, the padded
rows are computed and thrown away). TFLOP/s count each document's causal work only. Each row also
gives the step's GPU time (its kernels' device time, ``kernel_ms``) beside do_bench's. Bars: varlen
fwd+bwd >= 1.2x Flex's document mask and >= 2x SDPA's padded batch.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

import fusedattn

from . import gpu_state
from .systems import Unavailable, failure_note
from .timing import progress
from .variants import time_step

DOCS, TOTAL, H, D = 16, 16384, 16, 128


def document_lengths(seed: int = 0) -> list[int]:
    """DOCS random lengths (each >= 1) that sum to TOTAL: the gaps between sorted random cuts."""
    gen = torch.Generator().manual_seed(seed)
    cuts = sorted(torch.randperm(TOTAL - 1, generator=gen)[:DOCS - 1].add(1).tolist())
    bounds = [0, *cuts, TOTAL]
    return [b - a for a, b in zip(bounds, bounds[1:])]


def causal_flops(lengths: list[int]) -> float:
    """Forward FLOPs of causal attention within each document (the bench's FLOP convention: 4*S*S*D*H/2,
    counted exactly as the kept pairs: S*(S+1)/2)."""
    return sum(4.0 * H * D * n * (n + 1) / 2 for n in lengths)


class Packed:
    """The packed q, k, v, dout (TOTAL, H, D), their offsets, and the padded batch made from them."""

    def __init__(self, lengths: list[int]):
        gen = torch.Generator(device="cuda").manual_seed(1)
        self.lengths = lengths
        self.q, self.k, self.v, self.dout = (torch.randn(TOTAL, H, D, device="cuda", dtype=torch.bfloat16,
                                                         generator=gen) for _ in range(4))
        self.cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32, device="cuda")
        self.max_len = max(lengths)

    def padded(self, t: torch.Tensor) -> torch.Tensor:
        """(DOCS, H, max_len, D), zeros past each document's end."""
        out = t.new_zeros(DOCS, self.max_len, H, D)
        for i, (a, n) in enumerate(zip(self.cu.tolist(), self.lengths)):
            out[i, :n] = t[a:a + n]
        return out.transpose(1, 2)


def _varlen(data: Packed, host_offsets: bool = False):
    cu = data.cu.cpu() if host_offsets else data.cu

    def fn(q, k, v):
        return fusedattn.varlen_attention(q, k, v, cu, cu, data.max_len, data.max_len, causal=True)

    return fn, (data.q, data.k, data.v), data.dout


def _flex_document(data: Packed):
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    document = torch.repeat_interleave(torch.arange(DOCS, device="cuda"),
                                       torch.tensor(data.lengths, device="cuda"))

    def doc_causal(b, h, q_idx, kv_idx):
        return (document[q_idx] == document[kv_idx]) & (q_idx >= kv_idx)

    block_mask = create_block_mask(doc_causal, None, None, TOTAL, TOTAL, device="cuda")
    compiled = torch.compile(flex_attention, dynamic=False)

    def fn(q, k, v):  # (1, H, TOTAL, D) views of the packed tokens
        return compiled(q, k, v, block_mask=block_mask)

    as_bhsd = [t.unsqueeze(0).transpose(1, 2) for t in (data.q, data.k, data.v)]
    return fn, as_bhsd, data.dout.unsqueeze(0).transpose(1, 2)


def _padded(system: str):
    def make(data: Packed):
        if system == "fusedattn":
            def fn(q, k, v):
                return fusedattn.attention(q, k, v, layout="bhsd", causal=True)
        else:
            from torch.nn.attention import SDPBackend, sdpa_kernel

            backend = getattr(SDPBackend, system)

            def fn(q, k, v):
                with sdpa_kernel(backend):
                    return F.scaled_dot_product_attention(q, k, v, is_causal=True)

        return fn, [data.padded(t) for t in (data.q, data.k, data.v)], data.padded(data.dout)

    return make


SYSTEMS = {
    "fusedattn-varlen": _varlen,
    # the offsets given on the host (as a data loader has them): no device-to-host read a call
    "fusedattn-varlen-host-offsets": lambda data: _varlen(data, host_offsets=True),
    "flex-document-mask": _flex_document,
    "sdpa-cudnn-padded": _padded("CUDNN_ATTENTION"),
    "sdpa-flash-padded": _padded("FLASH_ATTENTION"),
    "fusedattn-padded": _padded("fusedattn"),
}


def measure(name: str, data: Packed) -> dict:
    row = dict(row="varlen training", system=name, docs=DOCS, total=TOTAL, max_len=data.max_len, H=H, D=D,
               causal=True)
    try:
        fn, inputs, dout = SYSTEMS[name](data)
        leaves = [t.detach().clone().requires_grad_() for t in inputs]
        def step():
            return torch.autograd.grad(fn(*leaves), leaves, dout)

        fwd_ms, fwdbwd_ms, peak_gb = time_step(lambda: fn(*inputs), step)
        gpu_ms = kernel_ms(step)
    except Unavailable as e:
        row["note"] = f"skipped: {e}"
        return row
    except Exception as e:  # a peer failing is a result
        row["note"] = failure_note(e)
        return row
    finally:
        torch.cuda.empty_cache()
    flops = causal_flops(data.lengths)
    row.update(fwd_ms=fwd_ms, fwdbwd_ms=fwdbwd_ms, fwd_tflops=flops / fwd_ms * 1e-9,
               fwdbwd_tflops=3.5 * flops / fwdbwd_ms * 1e-9, step_peak_gb=peak_gb, fwdbwd_gpu_ms=gpu_ms,
               gpu_state=gpu_state.query())  # the clock the timings ended at
    return row


def kernel_ms(step, steps: int = 10) -> float:
    """The GPU's own time of a step: the device time of every kernel and copy it runs (profiler),
    without the host's. The ``f+b ms`` column (do_bench) includes what the host adds between them: a
    varlen call given its offsets on the GPU reads them back first (a wait), and none of these steps
    can be captured in a CUDA graph to time the GPU alone otherwise."""
    from torch.profiler import ProfilerActivity, profile

    for _ in range(3):
        step()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            step()
        torch.cuda.synchronize()
    return sum(e.self_device_time_total for e in prof.key_averages() if e.device_type.name == "CUDA") / steps / 1e3


def check_agreement(data: Packed) -> float:
    """Max |varlen - padded dense| over the real rows: the rows compare like with like."""
    out = fusedattn.varlen_attention(data.q, data.k, data.v, data.cu, data.cu, data.max_len, data.max_len,
                                     causal=True)
    dense = fusedattn.attention(*(data.padded(t) for t in (data.q, data.k, data.v)), layout="bhsd", causal=True)
    worst = 0.0
    for i, (a, n) in enumerate(zip(data.cu.tolist(), data.lengths)):
        worst = max(worst, (out[a:a + n].float() - dense[i, :, :n].transpose(0, 1).float()).abs().max().item())
    return worst


def run(on_row=None) -> list[dict]:
    data = Packed(document_lengths())
    diff = check_agreement(data)
    rows = []
    for name in progress(list(SYSTEMS), "packed"):
        row = measure(name, data)
        if name.startswith("fusedattn-varlen"):
            row["max_diff_vs_padded_dense"] = diff
        rows.append(row)
        if on_row:
            on_row(rows)
    return rows


def table(rows: list[dict]) -> str:
    """Ratios against the faster of fusedattn's two varlen rows (device or host offsets), by do_bench
    and by GPU time."""
    lines = [f"{'row':<18}{'system':<31}{'fwd ms':>9}{'f+b ms':>9}{'f+b TF/s':>10}{'GPU f+b ms':>12}{'peak GB':>9}"
             f"{'ours vs this':>14}{'(GPU time)':>12}"]
    timed = [r for r in rows if r["system"].startswith("fusedattn-varlen") and "fwdbwd_ms" in r]
    ours = min(timed, key=lambda r: r["fwdbwd_ms"], default=None)
    for r in rows:
        if "fwdbwd_ms" not in r:
            lines.append(f"{r['row']:<18}{r['system']:<31}  {r.get('note', '')}")
            continue
        ratio = f"{r['fwdbwd_ms'] / ours['fwdbwd_ms']:.2f}x" if ours and r is not ours else ""
        gpu_ratio = f"{r['fwdbwd_gpu_ms'] / ours['fwdbwd_gpu_ms']:.2f}x" if ours and r is not ours else ""
        lines.append(f"{r['row']:<18}{r['system']:<31}{r['fwd_ms']:>9.3f}{r['fwdbwd_ms']:>9.3f}"
                     f"{r['fwdbwd_tflops']:>10.1f}{r['fwdbwd_gpu_ms']:>12.3f}{r['step_peak_gb']:>9.2f}{ratio:>14}"
                     f"{gpu_ratio:>12}")
    return "\n".join(lines)
