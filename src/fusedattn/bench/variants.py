"""The variant rows: fusedattn with a feature on, next to its own plain kernel
and the peers that can run the same variant, side by side in one process.

    python -m fusedattn.bench --variants

B=4, H=16, S=4096, D=128, bf16. Each row times the forward and forward+backward (the gradient of
every trainable input: q, k, v and the bias or sinks) and records the peak memory the step
allocates beyond its inputs. Mask structures are built once per input, outside the timed steps, as
a training step shares them across layers: Flex's block mask, fusedattn's BlockMask (a bool mask
passed per call is classified per call instead, which would add that work to every timed step).
TFLOP/s count only the kept fraction of the score matrix (causal,
window, mask), so a kernel that skips masked tiles gets credit for it. Each peer's output is
checked against fusedattn's on the same inputs (``output_agrees``). Bars: a variant keeps >= 0.8x the plain kernel
and >= 1.5x FlexAttention on the same variant; a trainable (B,H,S,S) bias >= 0.6x plain and
>= 2x FlexAttention; top-k 1024 with a trainable bias >= 3x the best peer; block-sparse top-k at
25% density >= 3x faster than the dense plain kernel (its "vs plain" ratio); ALiBi >= 0.95x
plain and faster than Flex (score_mod) and SDPA (a dense ALiBi bias); chunked attention (C = 1024,
causal) within 10% of a sliding window with the same kept fraction (its own row) and ahead of
Flex's chunk block mask; dropout 0.1 >= 0.85x plain and faster than SDPA's flash and efficient
backends with dropout. A dropout row's peers draw their own masks: each is checked at dropout 0
against fusedattn at dropout 0 (the same call otherwise), then timed at its p.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Callable

import torch
import torch.nn.functional as F

import fusedattn

from . import gpu_state
from .systems import (Unavailable, agreement, disagreement, fa4_attn_func, fa4_call, failure_note,
                      flaggems_attention, flash_dense_attn_func, flash_sparse_bias_attn_func, stored_as)
from .timing import progress

B, H, S, D = 4, 16, 4096, 128
WINDOW = 1024  # keys each query sees in the sliding-window row, itself included
CHUNK = 1024  # the chunked-attention row's chunk length (Llama 4's attention_chunk_size is 8192)


@dataclass
class Inputs:
    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    dout: torch.Tensor
    extra: dict = field(default_factory=dict)  # trainable or fixed extras by name: bias, sinks, mask

    def leaves(self) -> list[torch.Tensor]:
        return [self.q, self.k, self.v] + [t for t in self.extra.values()
                                           if isinstance(t, torch.Tensor) and t.requires_grad]


@dataclass(frozen=True)
class Variant:
    name: str
    causal: bool
    heads_kv: int = H
    kept_fraction: Callable[[], float] = lambda: 1.0
    make_extra: Callable[[torch.Generator], dict] = lambda gen: {}
    window: int | None = None  # causal sliding window: keys each query sees, itself included
    softcap: float | None = None
    chunk: int | None = None  # chunked local attention (causal here)
    dropout: float = 0.0  # attention dropout's p


def _causal_fraction() -> float:
    return (S + 1) / (2 * S)


def _window_fraction(window: int = WINDOW) -> float:
    kept = window * (window + 1) // 2 + (S - window) * window  # sum over rows i of min(i + 1, window)
    return kept / (S * S)


def _chunk_fraction(chunk: int = CHUNK) -> float:
    kept = sum(i % chunk + 1 for i in range(S))
    return kept / (S * S)


def _window_like_chunk(chunk: int = CHUNK) -> int:
    """The causal window whose kept fraction is nearest the chunk's: the same work, walked as a band."""
    return min(range(1, chunk + 1), key=lambda w: abs(_window_fraction(w) - _chunk_fraction(chunk)))


def _alibi_slopes(gen):
    """FlashAttention's and BLOOM's geometric slopes, 2^(-8 (h + 1) / H), fp32 (H,)."""
    return dict(alibi_slopes=torch.tensor([2.0 ** (-8.0 * (h + 1) / H) for h in range(H)], device="cuda"))


PADDED_LENGTHS = [S - 512 * b for b in range(B)]  # key-padding row: each sequence's real length


def _random_keys(gen):
    """90% of the keys, each by chance: every tile is partial (the mask is read on all of them)."""
    keep = torch.rand(B, 1, 1, S, device="cuda", generator=gen) < 0.9
    return dict(mask=keep)


def _key_padding(gen):
    """Padded batches: keys past each sequence's length masked (whole tiles empty, the rest full)."""
    keep = torch.arange(S, device="cuda") < torch.tensor(PADDED_LENGTHS, device="cuda")[:, None]
    return dict(mask=keep.view(B, 1, 1, S))


TOPK = 1024  # keys kept per query in the dynamic top-k row
SPARSE_BLOCK, SPARSE_KEEP = 128, 8  # block-sparse row: 8 of the 32 key blocks per query block (25%)


def _topk_bias(gen):
    """A trainable bias and the causal top-k mask it selects (fusedattn.topk_mask, built once
    before timing, as a training step would build it from the detached bias)."""
    bias = torch.randn(B, H, S, S, device="cuda", dtype=torch.bfloat16, generator=gen)
    mask = fusedattn.topk_mask(bias, TOPK, causal=True)
    return dict(bias=bias.requires_grad_(), mask=mask)


def _block_sparse(gen):
    """A block-sparse mask from pooled scores (fusedattn.topk_block_mask): SPARSE_KEEP key blocks
    of SPARSE_BLOCK per query block, no (S, S) mask at all."""
    scores = torch.randn(B, H, S, S, device="cuda", dtype=torch.bfloat16, generator=gen)
    mask = fusedattn.topk_block_mask(scores, SPARSE_KEEP, block_size=(SPARSE_BLOCK, SPARSE_BLOCK))
    del scores
    return dict(mask=mask)


VARIANTS = [
    Variant("bias (B,H,S,S) trainable", False,
            make_extra=lambda gen: dict(bias=torch.randn(B, H, S, S, device="cuda", dtype=torch.bfloat16,
                                                         generator=gen).requires_grad_())),
    Variant("softcap 30", True, kept_fraction=_causal_fraction, softcap=30.0),
    Variant(f"sliding window {WINDOW}", True, kept_fraction=_window_fraction, window=WINDOW),
    Variant("sinks (trainable)", True, kept_fraction=_causal_fraction,
            make_extra=lambda gen: dict(sinks=torch.randn(H, device="cuda", generator=gen).requires_grad_())),
    Variant("GQA 16/2", True, heads_kv=2, kept_fraction=_causal_fraction),
    Variant("random key mask (B,1,1,S) 90%", False, kept_fraction=lambda: 0.9, make_extra=_random_keys),
    Variant("key-padding mask (B,1,1,S) by length", False, kept_fraction=lambda: sum(PADDED_LENGTHS) / (B * S),
            make_extra=_key_padding),
    # kept per row i: min(i + 1, TOPK), as a causal window of TOPK keys
    Variant(f"top-k {TOPK} + trainable bias", True, kept_fraction=lambda: _window_fraction(TOPK),
            make_extra=_topk_bias),
    Variant(f"block-sparse top-{SPARSE_KEEP}/{S // SPARSE_BLOCK} (25%)", False,
            kept_fraction=lambda: SPARSE_KEEP * SPARSE_BLOCK / S, make_extra=_block_sparse),
    Variant("ALiBi (H,) slopes", True, kept_fraction=_causal_fraction, make_extra=_alibi_slopes),
    Variant("dropout 0.1", True, kept_fraction=_causal_fraction, dropout=0.1),
    Variant(f"chunk {CHUNK}", True, kept_fraction=_chunk_fraction, chunk=CHUNK),
    # the chunk row's bar: the same kept fraction as a band
    Variant(f"sliding window {_window_like_chunk()} (chunk {CHUNK}'s kept fraction)", True,
            kept_fraction=lambda: _window_fraction(_window_like_chunk()), window=_window_like_chunk()),
]


def _fused(variant: Variant, plain: bool):
    options = dict(window=(variant.window - 1, 0) if variant.window else None, softcap=variant.softcap,
                   chunk=variant.chunk, dropout_p=variant.dropout)
    block_masks = {}  # a bool mask classified once (fusedattn.BlockMask), as Flex's block mask is built once

    def fn(inp: Inputs):  # the plain kernel's inputs carry no extras
        extra = dict(inp.extra)
        if isinstance(extra.get("mask"), torch.Tensor):
            mask = extra["mask"]
            if id(mask) not in block_masks:
                block_masks[id(mask)] = fusedattn.BlockMask.from_mask(mask)
            extra["mask"] = block_masks[id(mask)]
        return fusedattn.attention(inp.q, inp.k, inp.v, layout="bhsd", causal=variant.causal,
                                   **({} if plain else options), **extra)

    return fn


def _flex(variant: Variant):
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    for knob in ("cache_size_limit", "recompile_limit", "accumulated_cache_size_limit", "accumulated_recompile_limit"):
        if hasattr(torch._dynamo.config, knob):
            setattr(torch._dynamo.config, knob, 4096)
    compiled = torch.compile(flex_attention, dynamic=False)
    if variant.name.startswith("sinks"):
        raise Unavailable("FlexAttention has no sink logit")
    if variant.dropout:
        raise Unavailable("FlexAttention has no dropout (a score_mod changes logits before the softmax, not the "
                          "probabilities after it)")
    cache = {}

    def fn(inp: Inputs):
        mask_mod, score_mod = None, None
        if variant.causal:
            mask_mod = lambda b, h, qi, ki: qi >= ki  # noqa: E731
        if variant.window:
            mask_mod = lambda b, h, qi, ki: (qi >= ki) & (qi - ki < variant.window)  # noqa: E731
        if variant.chunk:  # the chunk block mask: only the tiles of a query's own chunk
            mask_mod = lambda b, h, qi, ki: (qi >= ki) & (qi // variant.chunk == ki // variant.chunk)  # noqa: E731
        if isinstance(inp.extra.get("mask"), fusedattn.BlockMask):  # Flex's block mask of the same blocks
            blocks = inp.extra["mask"].source
            mask_mod = lambda b, h, qi, ki: blocks[b, h, qi // SPARSE_BLOCK, ki // SPARSE_BLOCK]  # noqa: E731
        elif "mask" in inp.extra and inp.extra["mask"].shape[1] == 1:  # one mask row per batch
            keep = inp.extra["mask"]
            mask_mod = lambda b, h, qi, ki: keep[b, 0, 0, ki]  # noqa: E731
        elif "mask" in inp.extra:  # a dense (B, H, S, S) mask (top-k: causal within it)
            keep = inp.extra["mask"]
            mask_mod = lambda b, h, qi, ki: keep[b, h, qi, ki]  # noqa: E731
        if "bias" in inp.extra:
            bias = inp.extra["bias"]
            score_mod = lambda s, b, h, qi, ki: s + bias[b, h, qi, ki]  # noqa: E731
        if variant.softcap:
            score_mod = lambda s, b, h, qi, ki: variant.softcap * torch.tanh(s / variant.softcap)  # noqa: E731
        if "alibi_slopes" in inp.extra:
            slopes = inp.extra["alibi_slopes"]
            score_mod = lambda s, b, h, qi, ki: s - slopes[h] * (qi - ki).abs()  # noqa: E731
        if mask_mod is not None and "block_mask" not in cache:  # built once, outside the timed steps
            batch = B if "mask" in inp.extra else None
            heads = H if "mask" in inp.extra and inp.extra["mask"].shape[1] != 1 else None
            cache["block_mask"] = create_block_mask(mask_mod, batch, heads, S, S, device="cuda")
        block_mask = cache.get("block_mask")
        return compiled(inp.q, inp.k, inp.v, score_mod=score_mod, block_mask=block_mask,
                        enable_gqa=variant.heads_kv != H)

    return fn


def _sdpa(backend_name: str, variant: Variant):
    from torch.nn.attention import SDPBackend, sdpa_kernel

    if variant.name.startswith(("sinks", "softcap")):
        raise Unavailable("SDPA has no " + variant.name.split()[0])
    # By the row's name, not its p: the row's output check builds this system at dropout 0.
    if backend_name == "FLASH_ATTENTION" and not variant.name.startswith("dropout"):
        raise Unavailable("SDPA's flash backend is timed in the dropout row only (no bias or mask; the standard "
                          "rows time plain attention)")
    backend = getattr(SDPBackend, backend_name)
    dense = {}  # the ALiBi bias, made once per input outside the timed steps

    def fn(inp: Inputs):
        attn_mask, causal = None, variant.causal
        mask = inp.extra.get("mask")
        if isinstance(mask, fusedattn.BlockMask):
            mask = mask.to_dense()
        if "bias" in inp.extra and mask is not None:  # the mask as -inf in the (trainable) bias
            attn_mask, causal = inp.extra["bias"].masked_fill(~mask, float("-inf")), False
        elif "bias" in inp.extra:
            attn_mask = inp.extra["bias"]
        elif mask is not None:
            attn_mask = mask
        i = torch.arange(S, device="cuda")
        if variant.window:  # a dense boolean mask: SDPA has no window
            attn_mask, causal = (i[:, None] >= i[None, :]) & (i[:, None] - i[None, :] < variant.window), False
        if variant.chunk:  # nor chunks
            attn_mask, causal = (i[:, None] >= i[None, :]) & (i[:, None] // variant.chunk == i[None, :] // variant.chunk), False
        if "alibi_slopes" in inp.extra:  # a dense (1, H, S, S) bias in the inputs' dtype, causal folded in as -inf
            slopes = inp.extra["alibi_slopes"]
            if id(slopes) not in dense:
                bias = -slopes[:, None, None] * (i[:, None] - i[None, :]).abs()
                dense[id(slopes)] = bias.masked_fill(i[:, None] < i[None, :], float("-inf")).to(inp.q.dtype)[None]
            attn_mask, causal = dense[id(slopes)], False
        with sdpa_kernel(backend):
            return F.scaled_dot_product_attention(inp.q, inp.k, inp.v, attn_mask=attn_mask, is_causal=causal,
                                                  enable_gqa=variant.heads_kv != H, dropout_p=variant.dropout)

    return fn


def _flash_sparse(variant: Variant):
    """flash-sparse-attn's Triton kernels. Its dense ones (``systems.flash_dense_attn_func``): causal,
    fewer key/value heads, and a causal local band (``window_sizes`` columns: sink tokens, distant
    band, gap, near band; the near band of WINDOW keys is this row's window). With a trainable bias:
    its kernel that takes one (``systems.flash_sparse_bias_attn_func``), a mask folded into the bias
    as -inf, as SDPA gets it (it has no mask input: every tile is visited). It has no sink logit or
    softcap, and no mask without a bias; its key lengths (``seqused_k``) reach the forward only, not
    the backward."""
    if "bias" in variant.name:
        return _flash_sparse_bias(variant)
    if not (variant.window or variant.name.startswith("GQA")):
        lacks = "key lengths in the backward (seqused_k reaches its forward only)" if "key-padding" in variant.name \
            else "mask without a bias, sink logit, softcap, ALiBi or chunks"
        raise Unavailable(f"flash-sparse-attn's Triton kernels have no {lacks}")
    fn = flash_dense_attn_func()
    window = None
    if variant.window:
        window = torch.tensor([[0, 0, 0, variant.window]] * variant.heads_kv, dtype=torch.int32, device="cuda")

    # Its layout is (B, S, H, D): its inputs are stored that way (``INPUT_LAYOUT``).
    return lambda inp: fn(inp.q.transpose(1, 2), inp.k.transpose(1, 2), inp.v.transpose(1, 2), is_causal=variant.causal,
                          window_sizes=window).transpose(1, 2)


def _flash_sparse_bias(variant: Variant):
    """Its bias kernel reads a negative bias entry as masked (``where(b >= 0, b, -inf)``: a dynamic
    mask's semantics), so it gets the bias shifted by a constant to non-negative values -- the
    softmax is unchanged, and so is the bias's gradient. The shift (minus the bias's minimum,
    found once per input outside the timed steps) is one elementwise pass in its step, as is the
    -inf fold of a mask."""
    fn = flash_sparse_bias_attn_func()
    shifts = {}

    def call(inp: Inputs):
        bias, mask = inp.extra["bias"], inp.extra.get("mask")
        if id(bias) not in shifts:
            shifts[id(bias)] = -min(bias.min().item(), 0.0)
        bias = bias + shifts[id(bias)]
        if mask is not None:  # in the step: the -inf bias is made from the trainable one every call
            bias = bias.masked_fill(~mask, float("-inf"))
        return fn(inp.q.transpose(1, 2), inp.k.transpose(1, 2), inp.v.transpose(1, 2), bias,
                  is_causal=variant.causal).transpose(1, 2)

    return call


def _flaggems(variant: Variant):
    """FlagGems' SDPA (``flag_gems.ops.attention``): causal and fewer key/value heads only. Its
    forward takes an additive mask, but its backward drops it (``attn_mask=None``): with a bias or
    a mask its gradients would be wrong and the bias gets none, so those rows are not its; no
    window, sink logit or softcap either. Last in the rows' order: it has crashed the process with
    an illegal memory access on some shapes (``systems.FLAGGEMS_CRASHES``), and the rows before it
    are saved as they are measured."""
    if not variant.name.startswith("GQA"):
        raise Unavailable("FlagGems' attention backward drops the mask or bias; it has no window, sinks or softcap")
    fn = flaggems_attention()
    return lambda inp: fn(inp.q, inp.k, inp.v, is_causal=variant.causal, enable_gqa=variant.heads_kv != H)


def _fa4(variant: Variant):
    """FlashAttention-4 (``systems.fa4_attn_func``): causal, fewer key/value heads, a window, softcap
    and sink logits (``learnable_sink``, its gradient returned). Its bias, masks and block sparsity
    come as score_mod / mask_mod functions or its own block tensors, not these rows' dense tensors;
    it has no ALiBi slopes, dropout or chunk argument."""
    if not (variant.window or variant.softcap or variant.name.startswith(("GQA", "sinks"))):
        raise Unavailable("FlashAttention-4 takes no dense bias, mask, ALiBi slopes, dropout or chunk "
                          "(its score_mod / mask_mod are not wired here)")
    fn = fa4_attn_func()
    window = (variant.window - 1, 0) if variant.window else (None, None)
    return lambda inp: fa4_call(fn, inp.q, inp.k, inp.v, causal=variant.causal, window_size=window,
                                softcap=variant.softcap or 0.0, learnable_sink=inp.extra.get("sinks"))


SYSTEMS = {
    "fusedattn": lambda variant: _fused(variant, plain=False),
    "fusedattn-plain": lambda variant: _fused(variant, plain=True),
    "flex": _flex,
    "sdpa-cudnn": lambda variant: _sdpa("CUDNN_ATTENTION", variant),
    "sdpa-efficient": lambda variant: _sdpa("EFFICIENT_ATTENTION", variant),
    "sdpa-flash": lambda variant: _sdpa("FLASH_ATTENTION", variant),
    "flash-sparse-attn": _flash_sparse,
    "fa4": _fa4,
    "flaggems": _flaggems,
}
INPUT_LAYOUT = {"flash-sparse-attn": "bshd", "fa4": "bshd"}  # how a system's q, k, v, dout are stored (else bhsd)


def _inputs(variant: Variant, plain: bool, layout: str = "bhsd") -> Inputs:
    """The variant's inputs, the same values for every system; for the plain kernel, multi-head q,
    k, v and no extras. ``layout`` "bshd": q, k, v, dout stored as (B, S, H, D) (``INPUT_LAYOUT``)."""
    gen = torch.Generator(device="cuda").manual_seed(0)

    def randn(heads):
        return stored_as(torch.randn(B, heads, S, D, device="cuda", dtype=torch.bfloat16, generator=gen), layout)

    heads_kv = H if plain else variant.heads_kv
    q, k, v = (t.requires_grad_() for t in (randn(H), randn(heads_kv), randn(heads_kv)))
    dout = stored_as(torch.randn(q.shape, device="cuda", dtype=torch.bfloat16, generator=gen), layout)
    return Inputs(q, k, v, dout, {} if plain else variant.make_extra(gen))


def time_step(forward, step) -> tuple[float, float, float]:
    """(forward ms without autograd, forward+backward ms, peak GB a step allocates beyond what it
    starts with): medians of triton's do_bench (L2 cleared between calls)."""
    import triton.testing

    with torch.no_grad():
        fwd_ms = triton.testing.do_bench(forward, warmup=25, rep=100, return_mode="median")
    step()
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    step()
    torch.cuda.synchronize()
    peak_gb = (torch.cuda.max_memory_allocated() - before) / 2**30
    return fwd_ms, triton.testing.do_bench(step, warmup=25, rep=100, return_mode="median"), peak_gb


def measure(variant: Variant, system: str, baseline_out: torch.Tensor | None = None) -> tuple[dict, torch.Tensor | None]:
    """One system on one variant: (row, its forward output). ``baseline_out``: fusedattn's output on
    the variant, which the system's must agree with (``output_agrees``, as in the standard rows)."""
    row = dict(variant=variant.name, system=system, B=B, H=H, Hkv=variant.heads_kv, S=S, D=D, causal=variant.causal)
    out = None
    try:
        fn = SYSTEMS[system](variant)
        inp = _inputs(variant, plain=system == "fusedattn-plain", layout=INPUT_LAYOUT.get(system, "bhsd"))
        leaves = inp.leaves()
        with torch.no_grad():  # the output checked: with dropout, each system's at dropout 0 (their masks differ)
            out = (SYSTEMS[system](replace(variant, dropout=0.0)) if variant.dropout else fn)(inp)
        fwd_ms, fwdbwd_ms, peak_gb = time_step(lambda: fn(inp), lambda: torch.autograd.grad(fn(inp), leaves,
                                                                                          inp.dout))
    except Unavailable as e:  # the peer has no such feature
        row["note"] = f"skipped: {e}"
        return row, None
    except Exception as e:  # a peer failing on a variant is a result
        row["note"] = failure_note(e)
        return row, None
    finally:
        torch.cuda.empty_cache()
    if baseline_out is not None:
        row.update(agreement(out, baseline_out))
    plain = system == "fusedattn-plain"
    kept = 1.0 if plain and not variant.causal else (_causal_fraction() if plain else variant.kept_fraction())
    flops = 4 * B * H * S * S * D * kept
    row.update(fwd_ms=fwd_ms, fwdbwd_ms=fwdbwd_ms, fwd_tflops=flops / fwd_ms * 1e-9,
               fwdbwd_tflops=3.5 * flops / fwdbwd_ms * 1e-9, step_peak_gb=peak_gb,
               gpu_state=gpu_state.query())  # the clock the timing ended at
    return row, out


def run(on_row=None, only: list[str] | None = None) -> list[dict]:
    """Every variant on every system (``only``: the variants whose name contains one of the words);
    each peer's output checked against fusedattn's on the same inputs (the plain kernel's inputs
    differ: it is not checked)."""
    chosen = [v for v in VARIANTS if only is None or any(word in v.name for word in only)]
    rows, ours = [], {}
    for variant, system in progress([(v, s) for v in chosen for s in SYSTEMS], "variants"):
        checked = system not in ("fusedattn", "fusedattn-plain")
        row, out = measure(variant, system, ours.get(variant.name) if checked else None)
        if system == "fusedattn":
            ours = {variant.name: out}  # the current variant's only (its systems run one after another)
        rows.append(row)
        if on_row:
            on_row(rows)
    return rows


def table(rows: list[dict]) -> str:
    """Times, TFLOP/s, peak memory, fusedattn's time ratio to its plain kernel and to each peer
    (>1: fusedattn is faster), and the SM clock the fwd+bwd timing ended at ('*': power-capped)."""
    lines = [f"{'variant':<30}{'system':<18}{'fwd ms':>9}{'f+b ms':>9}{'f+b TF/s':>10}{'peak GB':>9}"
             f"{'ours vs this':>14}{'MHz':>7}"]
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
                     f"{r['fwdbwd_tflops']:>10.1f}{r['step_peak_gb']:>9.2f}{ratio:>14}"
                     f"{gpu_state.cell(r):>7}".rstrip() + disagreement(r))
    return "\n".join(lines)
