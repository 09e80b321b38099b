"""Test cases as data.

QUICK is sized for Triton's interpreter (every program runs serially on the CPU, tiles
are 16x16): lengths are short but odd and cross several blocks, so ragged tails, the
diagonal and both window edges land inside tiles. FULL is the GPU grid: the lengths and
head dims SPEC 4 names, in bf16 and fp16, on the tuned tile sizes.

Each list covers every feature alone and combined with the others: lengths x mask forms,
head dims (non powers of two, D != Dv), GQA/MQA, softcap, layouts, deterministic mode,
a gradient through lse.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch


@dataclass(frozen=True)
class Case:
    batch: int = 1
    heads_q: int = 2
    heads_kv: int = 2
    seqlen_q: int = 17
    seqlen_k: int = 17
    head_dim: int = 32
    head_dim_v: int | None = None  # None: same as head_dim
    causal: bool = False
    window: tuple[int, int] | None = None
    softcap: float | None = None
    scale: float | None = None  # None: 1/sqrt(head_dim)
    layout: str = "bshd"
    deterministic: bool = False
    lse_grad: bool = False  # put lse into the loss as well
    sinks: bool = False  # learnable per-head sink logits (SPEC 3.5), with their gradient
    mask: str | None = None  # a boolean mask of one of the BROADCAST_SHAPES forms (SPEC 3.3)
    # The mask made of square cells of this many rows and keys, each dropped, kept or random: whole
    # tiles then classify as empty, full or partial (None: random entries, every tile partial).
    mask_cells: int | None = None
    mask_cells_partial: bool = True  # False: every cell is dropped or kept (no random one)
    # The mask as a BlockMask of whole (block_q, block_k) blocks (fusedattn.BlockMask.from_blocks).
    mask_blocks: tuple[int, int] | None = None
    bias: str | None = None  # a trainable float bias of one of the BROADCAST_SHAPES forms, with its gradient
    bias_dtype: torch.dtype | None = None  # None: the dtype of q, k, v
    bias_trainable: bool = True  # False: a fixed bias (no gradient asked for)
    # ALiBi slopes (SPEC 10): "heads" one per query head (Hq,), "batch" one per batch and head (B, Hq)
    alibi: str | None = None
    chunk: int | None = None  # chunked local attention (chunk=C, SPEC 3.10)
    dropout: float | None = None  # attention dropout's p (SPEC 3.11): checked given the call's own mask
    dtype: torch.dtype = torch.float16

    @property
    def dv(self) -> int:
        return self.head_dim if self.head_dim_v is None else self.head_dim_v

    @property
    def id(self) -> str:
        parts = [f"b{self.batch}h{self.heads_q}-{self.heads_kv}", f"s{self.seqlen_q}x{self.seqlen_k}",
                 f"d{self.head_dim}" + (f"v{self.head_dim_v}" if self.head_dim_v else ""),
                 str(self.dtype).replace("torch.", ""), self.layout]
        if self.causal:
            parts.append("causal")
        if self.window is not None:
            parts.append(f"win{self.window[0]}_{self.window[1]}")
        if self.softcap is not None:
            parts.append(f"cap{self.softcap:g}")
        if self.scale is not None:
            parts.append(f"scale{self.scale:g}")
        if self.deterministic:
            parts.append("det")
        if self.lse_grad:
            parts.append("dlse")
        if self.sinks:
            parts.append("sinks")
        if self.mask:
            parts.append(f"mask-{self.mask}" + (f"-cells{self.mask_cells}" if self.mask_cells else "")
                         + ("-whole" if self.mask_cells and not self.mask_cells_partial else "")
                         + (f"-blocks{self.mask_blocks[0]}x{self.mask_blocks[1]}" if self.mask_blocks else ""))
        if self.bias:
            parts.append(f"bias-{self.bias}" + (str(self.bias_dtype).replace("torch.", "-") if self.bias_dtype else "")
                         + ("" if self.bias_trainable else "-fixed"))
        if self.alibi:
            parts.append(f"alibi-{self.alibi}")
        if self.chunk:
            parts.append(f"chunk{self.chunk}")
        if self.dropout:
            parts.append(f"drop{self.dropout:g}")
        return "-".join(parts)

    def options(self) -> dict:
        options = dict(layout=self.layout, causal=self.causal, window=self.window, softcap=self.softcap,
                       scale=self.scale)
        if self.chunk is not None:  # only where set: some callers take no chunk
            options["chunk"] = self.chunk
        return options


# Mask and bias shapes (SPEC 3.3), by name: every broadcast the API allows.
BROADCAST_SHAPES = {
    "full": lambda c: (c.batch, c.heads_q, c.seqlen_q, c.seqlen_k),
    "kv-heads": lambda c: (c.batch, c.heads_kv, c.seqlen_q, c.seqlen_k),
    "heads": lambda c: (1, c.heads_q, c.seqlen_q, c.seqlen_k),  # one per head, shared by the batch (ALiBi-like)
    "keys": lambda c: (c.batch, 1, 1, c.seqlen_k),  # key padding
    "shared": lambda c: (c.seqlen_q, c.seqlen_k),  # 2-D: one (Sq, Sk) tensor for every batch and head
    "rows": lambda c: (1, c.heads_q, c.seqlen_q, 1),  # whole query rows
}

MASK_FORMS = [
    dict(),
    dict(causal=True),
    dict(window=(9, 4)),
    dict(window=(-1, 5)),
    dict(causal=True, window=(20, -1)),
]
QUICK_LENGTHS = [(1, 1), (1, 17), (17, 1), (17, 33), (33, 17), (113, 127), (129, 113)]

QUICK: list[Case] = [
    # every mask form on ragged lengths, Sq < Sk and Sq > Sk, alternating layout/dtype/mode
    *[
        Case(seqlen_q=sq, seqlen_k=sk, layout=("bshd", "bhsd")[i % 2],
             dtype=(torch.float16, torch.float32)[(i // 2) % 2], deterministic=bool((i // 3) % 2), **form)
        for i, ((sq, sk), form) in enumerate((lengths, form) for lengths in QUICK_LENGTHS for form in MASK_FORMS)
    ],
    # head dims: tiny, non powers of two, the largest, D != Dv both ways
    *[Case(seqlen_q=33, seqlen_k=47, head_dim=d, head_dim_v=dv, causal=(d % 3 == 0))
      for d, dv in [(8, None), (40, None), (80, None), (96, 64), (192, None), (256, None), (64, 24), (24, 96),
                    (40, 24)]],
    # grouped-query and multi-query attention, with every other feature
    Case(heads_q=4, heads_kv=2, seqlen_q=47, seqlen_k=65, causal=True, softcap=5.0, deterministic=True),
    Case(heads_q=6, heads_kv=1, seqlen_q=65, seqlen_k=47, window=(12, 7), layout="bhsd"),
    Case(batch=2, heads_q=4, heads_kv=1, seqlen_q=33, seqlen_k=33, causal=True, lse_grad=True, dtype=torch.float32),
    # softcap alone (large enough to bend scores), with a window, in fp32
    Case(seqlen_q=47, seqlen_k=47, softcap=2.0, head_dim=64),
    Case(seqlen_q=47, seqlen_k=80, softcap=3.0, window=(16, 16), dtype=torch.float32, lse_grad=True),
    # explicit scale (with and without softcap), batch > 1, lse in the loss
    Case(batch=3, seqlen_q=31, seqlen_k=31, scale=0.3, lse_grad=True, deterministic=True),
    Case(seqlen_q=31, seqlen_k=45, scale=0.9, softcap=4.0, causal=True, dtype=torch.float32),
    Case(batch=2, heads_q=4, heads_kv=2, seqlen_q=17, seqlen_k=129, window=(3, 0), lse_grad=True, layout="bhsd"),
    # sinks alone, with GQA + causal rows that see no key (Sq > Sk) + lse in the loss, with
    # softcap + window, and deterministic in fp32
    Case(seqlen_q=33, seqlen_k=47, sinks=True),
    Case(batch=2, heads_q=4, heads_kv=2, seqlen_q=47, seqlen_k=17, causal=True, sinks=True, lse_grad=True,
         layout="bhsd"),
    Case(seqlen_q=65, seqlen_k=65, softcap=5.0, window=(9, 4), sinks=True, dtype=torch.float32, deterministic=True),
    # boolean masks: every broadcast shape, alone and with causal/window/softcap/GQA/sinks/lse
    Case(seqlen_q=33, seqlen_k=47, mask="full"),
    Case(batch=2, heads_q=4, heads_kv=2, seqlen_q=47, seqlen_k=33, causal=True, mask="kv-heads", layout="bhsd",
         lse_grad=True),
    Case(batch=2, seqlen_q=17, seqlen_k=65, mask="keys", softcap=5.0, dtype=torch.float32, deterministic=True),
    Case(heads_q=6, heads_kv=1, seqlen_q=65, seqlen_k=47, window=(12, 7), mask="shared", sinks=True),
    Case(batch=2, heads_q=4, heads_kv=2, seqlen_q=33, seqlen_k=33, mask="rows", lse_grad=True),
    # masks made of whole cells (tiles classify empty / full / partial: empty ones skipped, full ones
    # run without the mask) and BlockMasks of whole blocks, with every feature
    Case(batch=2, heads_q=4, heads_kv=2, seqlen_q=47, seqlen_k=70, mask="full", mask_cells=16, causal=True,
         bias="heads"),
    Case(seqlen_q=65, seqlen_k=47, mask="keys", mask_cells=16, window=(20, 9), softcap=5.0, dtype=torch.float32,
         deterministic=True),
    Case(batch=2, heads_q=4, heads_kv=1, seqlen_q=33, seqlen_k=65, mask="kv-heads", mask_cells=32, sinks=True,
         lse_grad=True, layout="bhsd"),
    Case(heads_q=4, heads_kv=2, seqlen_q=47, seqlen_k=70, mask="full", mask_blocks=(16, 32), causal=True, bias="full",
         deterministic=True),
    Case(batch=2, seqlen_q=40, seqlen_k=50, mask="shared", mask_blocks=(32, 16), window=(12, 7), dtype=torch.float32),
    # trainable bias: every broadcast shape (the gradient stored, summed by atomics, or summed by
    # the deterministic pass), bias dtypes, with causal/window/softcap/GQA/sinks/mask/lse
    Case(seqlen_q=33, seqlen_k=47, bias="full"),
    Case(batch=2, heads_q=4, heads_kv=2, seqlen_q=47, seqlen_k=33, causal=True, bias="full", bias_dtype=torch.float32,
         softcap=5.0, layout="bhsd", deterministic=True),
    Case(batch=2, heads_q=4, heads_kv=2, seqlen_q=33, seqlen_k=47, bias="kv-heads", window=(9, 4), lse_grad=True),
    Case(batch=2, heads_q=4, heads_kv=2, seqlen_q=33, seqlen_k=47, bias="heads", causal=True, deterministic=True,
         dtype=torch.float32),
    Case(batch=2, heads_q=4, heads_kv=2, seqlen_q=33, seqlen_k=47, bias="heads", sinks=True, mask="keys"),
    Case(batch=2, seqlen_q=17, seqlen_k=65, bias="keys", bias_dtype=torch.float32, deterministic=True),
    Case(batch=2, seqlen_q=17, seqlen_k=65, bias="keys", softcap=5.0, mask="rows"),
    Case(heads_q=6, heads_kv=1, seqlen_q=65, seqlen_k=47, window=(12, 7), bias="shared", deterministic=True,
         lse_grad=True),
    Case(batch=2, heads_q=4, heads_kv=2, seqlen_q=33, seqlen_k=33, bias="rows", causal=True, dtype=torch.float32),
    Case(batch=2, heads_q=4, heads_kv=2, seqlen_q=33, seqlen_k=33, bias="rows", deterministic=True, sinks=True),
    Case(batch=2, heads_q=4, heads_kv=2, seqlen_q=33, seqlen_k=47, bias="kv-heads", bias_trainable=False, causal=True),
    # ALiBi slopes, (Hq,) and (B, Hq): alone, with causal / window / softcap, GQA and MQA, Sq != Sk both
    # ways (rows with no key), odd lengths, a full bias (gradient stored), a broadcast bias (atomics; the
    # deterministic pass), masks (elements and whole cells), sinks, lse in the loss
    Case(seqlen_q=33, seqlen_k=47, alibi="heads"),
    Case(batch=2, heads_q=4, heads_kv=2, seqlen_q=47, seqlen_k=33, causal=True, alibi="batch", layout="bhsd",
         lse_grad=True),
    Case(seqlen_q=65, seqlen_k=47, window=(9, 4), softcap=5.0, alibi="heads", dtype=torch.float32, deterministic=True),
    Case(seqlen_q=1, seqlen_k=17, causal=True, alibi="heads"),
    Case(batch=2, seqlen_q=129, seqlen_k=113, alibi="batch", lse_grad=True, dtype=torch.float32),
    Case(heads_q=6, heads_kv=1, seqlen_q=17, seqlen_k=129, causal=True, alibi="heads", mask="full", mask_cells=16,
         dtype=torch.float32),
    Case(seqlen_q=33, seqlen_k=47, bias="full", alibi="heads", window=(-1, 5)),
    Case(batch=2, heads_q=4, heads_kv=2, seqlen_q=33, seqlen_k=47, bias="heads", alibi="batch", sinks=True,
         mask="keys"),
    Case(batch=2, heads_q=4, heads_kv=2, seqlen_q=33, seqlen_k=47, bias="heads", causal=True, deterministic=True,
         alibi="batch", dtype=torch.float32),
    # the key-term form (every kept key left of the diagonal): causal with sinks (rows with no key among
    # them), a left window and lse in the loss, Sq != Sk both ways
    Case(heads_q=4, heads_kv=2, seqlen_q=65, seqlen_k=47, causal=True, sinks=True, alibi="heads", lse_grad=True),
    Case(batch=2, seqlen_q=47, seqlen_k=129, window=(20, 0), alibi="batch", lse_grad=True, deterministic=True,
         dtype=torch.float32),
    Case(seqlen_q=113, seqlen_k=97, causal=True, window=(30, 0), alibi="heads", sinks=True, dtype=torch.float32),
    # chunk=C: alone, with causal (Llama 4's form), window, softcap, GQA/MQA, a full bias (gradient
    # stored: skipped tiles keep their zeros), a broadcast bias, masks (elements and whole cells), sinks,
    # ALiBi; odd lengths, Sq != Sk both ways (Sq > Sk: rows at negative aligned positions see no key),
    # C not dividing the lengths or the 16-wide tiles, C = 1, C >= Sk (as no chunk where Sq <= Sk)
    Case(seqlen_q=47, seqlen_k=47, chunk=16),
    Case(seqlen_q=47, seqlen_k=47, chunk=13, causal=True, dtype=torch.float32),
    Case(batch=2, heads_q=4, heads_kv=2, seqlen_q=33, seqlen_k=65, chunk=20, causal=True, layout="bhsd",
         lse_grad=True),
    Case(seqlen_q=65, seqlen_k=33, chunk=7, lse_grad=True, dtype=torch.float32),
    Case(seqlen_q=65, seqlen_k=47, chunk=24, causal=True, deterministic=True),
    Case(seqlen_q=47, seqlen_k=65, chunk=11, window=(9, 4), softcap=5.0, dtype=torch.float32),
    Case(heads_q=6, heads_kv=1, seqlen_q=33, seqlen_k=47, chunk=10, causal=True, sinks=True),
    Case(seqlen_q=33, seqlen_k=33, chunk=1, dtype=torch.float32),
    Case(seqlen_q=17, seqlen_k=33, chunk=40),
    Case(seqlen_q=33, seqlen_k=47, chunk=9, bias="full", window=(-1, 5)),
    Case(batch=2, heads_q=4, heads_kv=2, seqlen_q=33, seqlen_k=47, chunk=16, bias="heads", deterministic=True,
         dtype=torch.float32),
    Case(heads_q=4, heads_kv=2, seqlen_q=47, seqlen_k=47, chunk=12, causal=True, mask="full", mask_cells=16),
    Case(batch=2, heads_q=4, heads_kv=2, seqlen_q=47, seqlen_k=65, chunk=12, mask="full", mask_cells=16,
         mask_cells_partial=False, dtype=torch.float32),
    Case(batch=2, seqlen_q=33, seqlen_k=47, chunk=15, mask="keys", alibi="batch", dtype=torch.float32),
    Case(seqlen_q=1, seqlen_k=33, chunk=8, causal=True, alibi="heads"),
    # dropout: alone and with every other feature, odd lengths (keys not a multiple of 16: the
    # random bytes come 16 keys at a time), Sq != Sk both ways, deterministic, lse in the loss
    Case(seqlen_q=33, seqlen_k=47, dropout=0.3),
    Case(seqlen_q=47, seqlen_k=47, dropout=0.1, causal=True, dtype=torch.float32),
    Case(batch=2, heads_q=4, heads_kv=2, seqlen_q=65, seqlen_k=33, dropout=0.5, causal=True, layout="bhsd",
         lse_grad=True),
    Case(seqlen_q=65, seqlen_k=47, window=(9, 4), softcap=5.0, dropout=0.2, dtype=torch.float32, deterministic=True),
    Case(heads_q=6, heads_kv=1, seqlen_q=33, seqlen_k=129, causal=True, sinks=True, dropout=0.25),
    Case(seqlen_q=33, seqlen_k=47, bias="full", dropout=0.3, window=(-1, 5)),
    Case(batch=2, heads_q=4, heads_kv=2, seqlen_q=33, seqlen_k=47, bias="heads", deterministic=True, dropout=0.4,
         dtype=torch.float32),
    Case(batch=2, heads_q=4, heads_kv=2, seqlen_q=33, seqlen_k=47, bias="kv-heads", sinks=True, dropout=0.15),
    Case(heads_q=4, heads_kv=2, seqlen_q=47, seqlen_k=65, mask="full", mask_cells=16, dropout=0.3,
         dtype=torch.float32),
    Case(batch=2, seqlen_q=33, seqlen_k=47, mask="keys", alibi="batch", chunk=15, dropout=0.2, causal=True),
    Case(seqlen_q=1, seqlen_k=33, dropout=0.9, dtype=torch.float32),
    Case(seqlen_q=129, seqlen_k=113, dropout=0.05, lse_grad=True, dtype=torch.float32),
]

FULL_LENGTHS = [(1, 1), (17, 17), (113, 255), (255, 113), (127, 129), (1000, 1000), (1, 1000), (1000, 17)]
FULL_HEAD_DIMS = [(40, None), (64, None), (80, None), (96, None), (128, None), (192, None), (256, None), (128, 64),
                  (40, 24)]  # both dims padded, V narrower: a Triton miscompile (fwd.padded_dims)

FULL: list[Case] = [
    *[
        Case(batch=2, heads_q=4, heads_kv=(4, 2, 1)[i % 3], seqlen_q=sq, seqlen_k=sk,
             head_dim=(64, 128)[i % 2], dtype=(torch.bfloat16, torch.float16)[(i // 2) % 2],
             layout=("bshd", "bhsd")[(i // 3) % 2], deterministic=bool((i // 5) % 2), **form)
        for i, ((sq, sk), form) in enumerate((lengths, form) for lengths in FULL_LENGTHS for form in MASK_FORMS)
    ],
    *[
        Case(batch=2, heads_q=4, heads_kv=2, seqlen_q=255, seqlen_k=257, head_dim=d, head_dim_v=dv,
             causal=bool(i % 2), softcap=(None, 30.0)[(i // 2) % 2], dtype=dt, deterministic=bool(i % 3 == 0))
        for i, (d, dv) in enumerate(FULL_HEAD_DIMS) for dt in (torch.bfloat16, torch.float16)
    ],
    *[Case(batch=2, heads_q=4, heads_kv=2, seqlen_q=129, seqlen_k=127, head_dim=d, dtype=torch.float32, causal=True)
      for d in (40, 64, 128, 256)],
    Case(batch=2, heads_q=8, heads_kv=2, seqlen_q=1000, seqlen_k=1000, head_dim=128, causal=True, softcap=30.0,
         window=(256, -1), lse_grad=True, dtype=torch.bfloat16),
    Case(batch=1, heads_q=16, heads_kv=1, seqlen_q=777, seqlen_k=2048, head_dim=64, window=(100, 100),
         softcap=15.0, scale=0.2, deterministic=True, dtype=torch.bfloat16, layout="bhsd"),
    Case(batch=2, heads_q=4, heads_kv=4, seqlen_q=300, seqlen_k=300, head_dim=96, scale=0.05, dtype=torch.float16),
    # sinks: on the Gluon shapes (the warp-specialised forward's sink term, the Gluon dK/dV pass),
    # with GQA, causal Sq > Sk, softcap + window, and D=128 dQ by reduce-adds
    Case(batch=2, heads_q=8, heads_kv=2, seqlen_q=1000, seqlen_k=1000, head_dim=128, causal=True, sinks=True,
         lse_grad=True, dtype=torch.bfloat16),
    Case(batch=2, heads_q=4, heads_kv=4, seqlen_q=255, seqlen_k=113, head_dim=64, causal=True, sinks=True,
         dtype=torch.bfloat16, layout="bhsd"),
    Case(batch=1, heads_q=4, heads_kv=1, seqlen_q=300, seqlen_k=517, head_dim=80, softcap=20.0, window=(64, 8),
         sinks=True, deterministic=True, dtype=torch.float16),
    # boolean masks on the Gluon shapes (both passes fall back to the Triton kernels) and beyond
    Case(batch=2, heads_q=8, heads_kv=2, seqlen_q=1000, seqlen_k=1000, head_dim=128, causal=True, mask="full",
         dtype=torch.bfloat16),
    Case(batch=2, heads_q=4, heads_kv=2, seqlen_q=255, seqlen_k=257, head_dim=64, mask="kv-heads", sinks=True,
         lse_grad=True, dtype=torch.bfloat16, layout="bhsd"),
    Case(batch=3, heads_q=4, heads_kv=4, seqlen_q=113, seqlen_k=1000, head_dim=128, mask="keys", deterministic=True,
         dtype=torch.float16),
    Case(batch=1, heads_q=4, heads_kv=1, seqlen_q=300, seqlen_k=300, head_dim=96, mask="shared", window=(64, 8),
         softcap=20.0, dtype=torch.bfloat16),
    Case(batch=2, heads_q=4, heads_kv=2, seqlen_q=129, seqlen_k=127, head_dim=64, mask="rows", dtype=torch.float32),
    # masks of whole cells and BlockMasks on the GPU tile sizes (64-128)
    Case(batch=2, heads_q=8, heads_kv=2, seqlen_q=1000, seqlen_k=1000, head_dim=128, mask="full", mask_cells=64,
         causal=True, dtype=torch.bfloat16),
    Case(batch=3, heads_q=4, heads_kv=4, seqlen_q=300, seqlen_k=1000, head_dim=64, mask="keys", mask_cells=128,
         bias="keys", dtype=torch.float16),
    Case(batch=2, heads_q=4, heads_kv=2, seqlen_q=1000, seqlen_k=777, head_dim=128, mask="heads",
         mask_blocks=(128, 128), bias="full", deterministic=True, dtype=torch.bfloat16),
    Case(batch=1, heads_q=8, heads_kv=1, seqlen_q=513, seqlen_k=513, head_dim=96, mask="shared", mask_blocks=(64, 64),
         window=(100, 30), softcap=20.0, sinks=True, dtype=torch.bfloat16),
    Case(batch=2, heads_q=4, heads_kv=2, seqlen_q=257, seqlen_k=300, head_dim=64, mask="full", mask_cells=32,
         window=(50, 50), dtype=torch.float32),
    # trainable bias on the Gluon shapes (both passes fall back to the Triton kernels) and beyond
    Case(batch=2, heads_q=8, heads_kv=2, seqlen_q=1000, seqlen_k=1000, head_dim=128, bias="full",
         dtype=torch.bfloat16),
    Case(batch=2, heads_q=8, heads_kv=2, seqlen_q=1000, seqlen_k=1000, head_dim=128, causal=True, bias="full",
         bias_dtype=torch.float32, deterministic=True, dtype=torch.bfloat16),
    Case(batch=2, heads_q=4, heads_kv=2, seqlen_q=255, seqlen_k=257, head_dim=64, bias="heads", causal=True,
         sinks=True, dtype=torch.bfloat16, layout="bhsd"),
    Case(batch=2, heads_q=4, heads_kv=2, seqlen_q=255, seqlen_k=257, head_dim=128, bias="heads", deterministic=True,
         softcap=30.0, dtype=torch.float16),
    Case(batch=2, heads_q=4, heads_kv=2, seqlen_q=300, seqlen_k=517, head_dim=80, bias="kv-heads",
         window=(64, 8), lse_grad=True, dtype=torch.bfloat16),
    Case(batch=3, heads_q=4, heads_kv=4, seqlen_q=113, seqlen_k=1000, head_dim=128, bias="keys", mask="keys",
         deterministic=True, dtype=torch.float16),
    Case(batch=1, heads_q=4, heads_kv=1, seqlen_q=300, seqlen_k=300, head_dim=96, bias="shared", causal=True,
         bias_dtype=torch.float32, dtype=torch.bfloat16),
    Case(batch=2, heads_q=4, heads_kv=2, seqlen_q=129, seqlen_k=127, head_dim=64, bias="rows", dtype=torch.float32,
         deterministic=True),
    # aligned key lengths: a mask by elements is read through TMA (fwd.mask_descriptor), with every
    # tile state, head forms and the features; with a full-shape bias (the top-k + bias row's form)
    Case(batch=2, heads_q=4, heads_kv=2, seqlen_q=200, seqlen_k=512, head_dim=128, mask="full", causal=True,
         bias="full", dtype=torch.bfloat16),
    Case(batch=2, heads_q=4, heads_kv=2, seqlen_q=333, seqlen_k=256, head_dim=64, mask="kv-heads", mask_cells=32,
         softcap=20.0, dtype=torch.float16),
    Case(batch=1, heads_q=4, heads_kv=1, seqlen_q=320, seqlen_k=272, head_dim=96, mask="shared", window=(40, 7),
         sinks=True, deterministic=True, dtype=torch.bfloat16, layout="bhsd"),
    Case(batch=2, heads_q=4, heads_kv=4, seqlen_q=256, seqlen_k=256, head_dim=128, mask="heads", mask_cells=64,
         causal=True, bias="heads", deterministic=True, lse_grad=True, dtype=torch.float16),
    # aligned key lengths: the bias is read, and its gradient stored or added, through TMA
    Case(batch=2, heads_q=4, heads_kv=2, seqlen_q=200, seqlen_k=512, head_dim=128, bias="heads", causal=True,
         dtype=torch.bfloat16),
    Case(batch=2, heads_q=4, heads_kv=2, seqlen_q=333, seqlen_k=256, head_dim=64, bias="kv-heads", softcap=20.0,
         bias_dtype=torch.float32, dtype=torch.float16),
    Case(batch=2, heads_q=4, heads_kv=2, seqlen_q=320, seqlen_k=264, head_dim=96, bias="full", window=(40, 7),
         lse_grad=True, dtype=torch.bfloat16),
]


def for_dtypes(cases: list[Case], dtypes: tuple[torch.dtype, ...]) -> list[Case]:
    """The cases with any dtype outside ``dtypes`` moved to the first of them."""
    return [c if c.dtype in dtypes else replace(c, dtype=dtypes[0]) for c in cases]


# GPU: masks none of whose 128x128 tiles is partial (fwd.GLUON_MASK_TILE), which the Gluon kernels
# take by their tile lists: full tiles without mask math, partial ones (the keep rule: causal,
# window, ragged lengths) with it, empty ones never loaded; query blocks with no kept tile give
# rows with no key (output 0, lse -inf). Block masks and whole-cell key padding in every broadcast
# form, GQA (a mask per query head, per KV head, shared), with causal, window, softcap, lse.
WHOLE_TILE_MASK_CASES: list[Case] = [
    Case(2, 4, 2, 1000, 1000, 128, mask="full", mask_blocks=(128, 128), dtype=torch.bfloat16),
    Case(1, 4, 2, 517, 700, 64, causal=True, mask="kv-heads", mask_blocks=(128, 256), layout="bhsd"),
    Case(2, 4, 4, 640, 600, 128, mask="keys", mask_cells=128, mask_cells_partial=False, dtype=torch.bfloat16),
    Case(1, 4, 1, 333, 333, 128, causal=True, mask="heads", mask_blocks=(256, 128), softcap=10.0, lse_grad=True),
    Case(1, 2, 2, 700, 700, 64, causal=True, window=(200, 0), mask="shared", mask_blocks=(128, 128),
         dtype=torch.bfloat16),
]
