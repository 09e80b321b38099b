"""The variant rows of BENCHMARKS.md: fusedattn with a feature on, next to its own plain kernel
and the peers that can run the same variant, side by side in one process.

    python -m fusedattn.bench --variants

B=4, H=16, S=4096, D=128, bf16. Each row times the forward and forward+backward (the gradient of
every trainable input: q, k, v and the bias or sinks) and records the peak memory the step
allocates beyond its inputs. TFLOP/s count only the kept fraction of the score matrix (causal,
window, mask), as BENCHMARKS.md does. Bars (issue 4): a variant keeps >= 0.8x the plain kernel
and >= 1.5x FlexAttention on the same variant; a trainable (B,H,S,S) bias >= 0.6x plain and
>= 2x FlexAttention.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import torch
import torch.nn.functional as F

import fusedattn

from .systems import Unavailable

B, H, S, D = 4, 16, 4096, 128
WINDOW = 1024  # keys each query sees in the sliding-window row, itself included


@dataclass
class Inputs:
    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    dout: torch.Tensor
    extra: dict = field(default_factory=dict)  # trainable or fixed extras by name: bias, sinks, mask

    def leaves(self) -> list[torch.Tensor]:
        return [self.q, self.k, self.v] + [t for t in self.extra.values() if t.requires_grad]


@dataclass(frozen=True)
class Variant:
    name: str
    causal: bool
    heads_kv: int = H
    kept_fraction: Callable[[], float] = lambda: 1.0
    make_extra: Callable[[torch.Generator], dict] = lambda gen: {}


def _causal_fraction() -> float:
    return (S + 1) / (2 * S)


def _window_fraction() -> float:
    kept = sum(min(i + 1, WINDOW) for i in range(S))
    return kept / (S * S)


def _key_padding(gen):
    keep = torch.rand(B, 1, 1, S, device="cuda", generator=gen) < 0.9
    return dict(mask=keep)


VARIANTS = [
    Variant("bias (B,H,S,S) trainable", False,
            make_extra=lambda gen: dict(bias=torch.randn(B, H, S, S, device="cuda", dtype=torch.bfloat16,
                                                         generator=gen).requires_grad_())),
    Variant("softcap 30", True, kept_fraction=_causal_fraction),
    Variant(f"sliding window {WINDOW}", True, kept_fraction=_window_fraction),
    Variant("sinks (trainable)", True, kept_fraction=_causal_fraction,
            make_extra=lambda gen: dict(sinks=torch.randn(H, device="cuda", generator=gen).requires_grad_())),
    Variant("GQA 16/2", True, heads_kv=2, kept_fraction=_causal_fraction),
    Variant("key-padding mask (B,1,1,S)", False, kept_fraction=lambda: 0.9, make_extra=_key_padding),
]


def _fused(variant: Variant, plain: bool):
    window = (WINDOW - 1, 0) if variant.name.startswith("sliding") else None
    softcap = 30.0 if variant.name.startswith("softcap") else None

    def fn(inp: Inputs):  # the plain kernel's inputs carry no extras
        return fusedattn.attention(inp.q, inp.k, inp.v, layout="bhsd", causal=variant.causal,
                                   window=None if plain else window, softcap=None if plain else softcap, **inp.extra)

    return fn


def _flex(variant: Variant):
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    for knob in ("cache_size_limit", "recompile_limit", "accumulated_cache_size_limit", "accumulated_recompile_limit"):
        if hasattr(torch._dynamo.config, knob):
            setattr(torch._dynamo.config, knob, 4096)
    compiled = torch.compile(flex_attention, dynamic=False)
    if variant.name.startswith("sinks"):
        raise Unavailable("FlexAttention has no sink logit")

    def fn(inp: Inputs):
        mask_mod, score_mod = None, None
        if variant.causal:
            mask_mod = lambda b, h, qi, ki: qi >= ki  # noqa: E731
        if variant.name.startswith("sliding"):
            mask_mod = lambda b, h, qi, ki: (qi >= ki) & (qi - ki < WINDOW)  # noqa: E731
        if "mask" in inp.extra:
            keep = inp.extra["mask"]
            mask_mod = lambda b, h, qi, ki: keep[b, 0, 0, ki]  # noqa: E731
        if "bias" in inp.extra:
            bias = inp.extra["bias"]
            score_mod = lambda s, b, h, qi, ki: s + bias[b, h, qi, ki]  # noqa: E731
        if variant.name.startswith("softcap"):
            score_mod = lambda s, b, h, qi, ki: 30.0 * torch.tanh(s / 30.0)  # noqa: E731
        block_mask = None
        if mask_mod is not None:
            batch = B if "mask" in inp.extra else None
            block_mask = create_block_mask(mask_mod, batch, None, S, S, device="cuda")
        return compiled(inp.q, inp.k, inp.v, score_mod=score_mod, block_mask=block_mask,
                        enable_gqa=variant.heads_kv != H)

    return fn


def _sdpa(backend_name: str, variant: Variant):
    from torch.nn.attention import SDPBackend, sdpa_kernel

    if variant.name.startswith(("sinks", "softcap")):
        raise Unavailable("SDPA has no " + variant.name.split()[0])
    backend = getattr(SDPBackend, backend_name)

    def fn(inp: Inputs):
        attn_mask, causal = None, variant.causal
        if "bias" in inp.extra:
            attn_mask = inp.extra["bias"]
        if "mask" in inp.extra:
            attn_mask = inp.extra["mask"]
        if variant.name.startswith("sliding"):  # a dense boolean mask: SDPA has no window
            i = torch.arange(S, device="cuda")
            attn_mask, causal = (i[:, None] >= i[None, :]) & (i[:, None] - i[None, :] < WINDOW), False
        with sdpa_kernel(backend):
            return F.scaled_dot_product_attention(inp.q, inp.k, inp.v, attn_mask=attn_mask, is_causal=causal,
                                                  enable_gqa=variant.heads_kv != H)

    return fn


SYSTEMS = {
    "fusedattn": lambda variant: _fused(variant, plain=False),
    "fusedattn-plain": lambda variant: _fused(variant, plain=True),
    "flex": _flex,
    "sdpa-cudnn": lambda variant: _sdpa("CUDNN_ATTENTION", variant),
    "sdpa-efficient": lambda variant: _sdpa("EFFICIENT_ATTENTION", variant),
}


def _inputs(variant: Variant, plain: bool) -> Inputs:
    """The variant's inputs; for the plain kernel, multi-head q, k, v and no extras."""
    gen = torch.Generator(device="cuda").manual_seed(0)

    def randn(heads):
        return torch.randn(B, heads, S, D, device="cuda", dtype=torch.bfloat16, generator=gen).requires_grad_()

    heads_kv = H if plain else variant.heads_kv
    q, k, v = randn(H), randn(heads_kv), randn(heads_kv)
    return Inputs(q, k, v, torch.randn_like(q), {} if plain else variant.make_extra(gen))


def measure(variant: Variant, system: str) -> dict:
    import triton.testing

    row = dict(variant=variant.name, system=system, B=B, H=H, Hkv=variant.heads_kv, S=S, D=D, causal=variant.causal)
    try:
        fn = SYSTEMS[system](variant)
        inp = _inputs(variant, plain=system == "fusedattn-plain")
        leaves = inp.leaves()
        with torch.no_grad():
            fwd_ms = triton.testing.do_bench(lambda: fn(inp), warmup=25, rep=100, return_mode="median")

        def step():
            out = fn(inp)
            torch.autograd.grad(out, leaves, inp.dout)

        step()
        torch.cuda.synchronize()
        before = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        step()
        torch.cuda.synchronize()
        peak_gb = (torch.cuda.max_memory_allocated() - before) / 2**30
        fwdbwd_ms = triton.testing.do_bench(step, warmup=25, rep=100, return_mode="median")
    except Unavailable as e:  # the peer has no such feature
        row["note"] = f"skipped: {e}"
        return row
    except Exception as e:  # a peer failing on a variant is a result
        first_line = str(e).splitlines()[0][:160] if str(e) else ""
        row["note"] = f"fails: {type(e).__name__}: {first_line}"
        return row
    finally:
        torch.cuda.empty_cache()
    plain = system == "fusedattn-plain"
    kept = 1.0 if plain and not variant.causal else (_causal_fraction() if plain else variant.kept_fraction())
    flops = 4 * B * H * S * S * D * kept
    row.update(fwd_ms=fwd_ms, fwdbwd_ms=fwdbwd_ms, fwd_tflops=flops / fwd_ms * 1e-9,
               fwdbwd_tflops=3.5 * flops / fwdbwd_ms * 1e-9, step_peak_gb=peak_gb)
    return row


def run(on_row=None) -> list[dict]:
    from .__main__ import _progress

    rows = []
    for variant, system in _progress([(v, s) for v in VARIANTS for s in SYSTEMS], "variants"):
        rows.append(measure(variant, system))
        if on_row:
            on_row(rows)
    return rows


def table(rows: list[dict]) -> str:
    """Times, TFLOP/s, peak memory, and fusedattn's time ratio to its plain kernel and to each peer
    (>1: fusedattn is faster)."""
    lines = [f"{'variant':<30}{'system':<18}{'fwd ms':>9}{'f+b ms':>9}{'f+b TF/s':>10}{'peak GB':>9}"
             f"{'ours vs this':>14}"]
    ours = {r["variant"]: r for r in rows if r["system"] == "fusedattn" and "fwdbwd_ms" in r}
    for r in rows:
        if "fwdbwd_ms" not in r:
            lines.append(f"{r['variant']:<30}{r['system']:<18}  {r.get('note', '')}")
            continue
        ratio = ""
        mine = ours.get(r["variant"])
        if mine is not None and r["system"] != "fusedattn":
            ratio = f"{r['fwdbwd_ms'] / mine['fwdbwd_ms']:.2f}x"
        lines.append(f"{r['variant']:<30}{r['system']:<18}{r['fwd_ms']:>9.3f}{r['fwdbwd_ms']:>9.3f}"
                     f"{r['fwdbwd_tflops']:>10.1f}{r['step_peak_gb']:>9.2f}{ratio:>14}")
    return "\n".join(lines)
