"""Issue 5's decoding rows: one new query token per sequence over a KV cache, side by side in one process.

    python -m fusedattn.bench --decode

bf16, GQA 32 query heads / 8 KV heads, D=128, every cache full (cache_seqlens = its size). Systems:
``fusedattn.kvcache_attention`` on a contiguous cache and on paged caches (pages of 16, 64, 256
tokens, the block table a random permutation of the same memory); SDPA (its own backend choice,
``enable_gqa``) and FlexAttention (torch.compile; a one-token query takes its decoding kernel) on the
contiguous cache, at the cache sizes in ``PEER_CACHES``. Times are CUDA-graph replays (the GPU's time,
no launch overhead: how a serving loop runs a decoding step).

Bandwidth = bytes of K and V read / time. The bar (issue 5): at least 70% of the device-to-device copy
bandwidth at caches of 8k and more, the copy counted as bytes read plus bytes written (a large
``copy_`` measured in the same run).
"""

from __future__ import annotations

import torch

import fusedattn

from .__main__ import _graph_ms, _progress

HQ, HKV, D = 32, 8, 128
BATCHES = (1, 8, 64)
CACHES = (4096, 8192, 32768, 131072)
PAGES = (None, 16, 64, 256)  # None: contiguous
PEER_CACHES = (8192, 32768)
BAR, BAR_FROM = 0.7, 8192


def copy_bandwidth(gib: int = 2) -> float:
    """Device-to-device copy bandwidth in GB/s, bytes read + bytes written (a graph of one copy_)."""
    src = torch.empty(gib * 2**30, dtype=torch.uint8, device="cuda").random_()
    dst = torch.empty_like(src)
    ms = _graph_ms(lambda: dst.copy_(src))
    del src, dst
    torch.cuda.empty_cache()
    return 2 * gib * 2**30 / ms / 1e6


class Cache:
    """q (B, 1, HQ, D) and a full cache (B, S, HKV, D) of random K and V; ``paged(page)`` views the
    same memory as pages with a shuffled block table."""

    def __init__(self, batch: int, size: int):
        gen = torch.Generator(device="cuda").manual_seed(batch * size)
        self.batch, self.size = batch, size
        self.q = torch.randn(batch, 1, HQ, D, device="cuda", dtype=torch.bfloat16, generator=gen)
        self.k, self.v = (torch.randn(batch, size, HKV, D, device="cuda", dtype=torch.bfloat16, generator=gen)
                          for _ in range(2))
        self.lengths = torch.full((batch,), size, dtype=torch.int32, device="cuda")
        self.kv_bytes = 2 * self.k.numel() * self.k.element_size()

    def paged(self, page: int):
        pages = self.batch * self.size // page
        table = torch.randperm(pages, device="cuda").to(torch.int32).view(self.batch, -1)
        return self.k.view(pages, page, HKV, D), self.v.view(pages, page, HKV, D), table


def _ours(cache: Cache, page: int | None):
    if page is None:
        k, v, table = cache.k, cache.v, None
    else:
        k, v, table = cache.paged(page)
    return lambda: fusedattn.kvcache_attention(cache.q, k, v, cache.lengths, block_table=table)


def _sdpa(cache: Cache):
    import torch.nn.functional as F

    q, k, v = (t.transpose(1, 2) for t in (cache.q, cache.k, cache.v))
    return lambda: F.scaled_dot_product_attention(q, k, v, enable_gqa=True).transpose(1, 2)


def _flex(cache: Cache):
    from torch.nn.attention.flex_attention import flex_attention

    compiled = torch.compile(flex_attention, dynamic=False)
    q, k, v = (t.transpose(1, 2) for t in (cache.q, cache.k, cache.v))
    return lambda: compiled(q, k, v, enable_gqa=True).transpose(1, 2)


def measure(name: str, make, cache: Cache, copy_gbps: float, reference: torch.Tensor | None, layout: str) -> dict:
    row = dict(row="decode", system=name, B=cache.batch, cache=cache.size, layout=layout, Hq=HQ, Hkv=HKV, D=D)
    try:
        step = make()
        out = step()
        if reference is not None:
            row["max_diff_vs_ours"] = (out.float() - reference.float()).abs().max().item()
        ms = _graph_ms(step)
    except Exception as e:  # a peer failing on a shape is a result
        first_line = str(e).splitlines()[0][:160] if str(e) else ""
        row["note"] = f"fails: {type(e).__name__}: {first_line}"
        return row
    finally:
        torch.cuda.empty_cache()
    gbps = cache.kv_bytes / ms / 1e6
    row.update(us=ms * 1e3, kv_gbps=gbps, copy_fraction=gbps / copy_gbps)
    if cache.size >= BAR_FROM:
        row["meets_bar"] = gbps / copy_gbps >= BAR
    return row


def run(on_row=None) -> list[dict]:
    copy_gbps = copy_bandwidth()
    rows = []
    jobs = [(b, s) for s in CACHES for b in BATCHES]
    for batch, size in _progress(jobs, "decode"):
        cache = Cache(batch, size)
        ours = None
        for page in PAGES:
            layout = "contiguous" if page is None else f"page {page}"
            row = measure("fusedattn", lambda: _ours(cache, page), cache, copy_gbps, None, layout)
            row["copy_gbps"] = copy_gbps
            rows.append(row)
            if page is None:
                ours = _ours(cache, None)()
        if size in PEER_CACHES:
            for name, make in (("sdpa", _sdpa), ("flex", _flex)):
                rows.append(measure(name, lambda: make(cache), cache, copy_gbps, ours, "contiguous"))
        del cache, ours
        torch.cuda.empty_cache()
        if on_row:
            on_row(rows)
    return rows


def table(rows: list[dict]) -> str:
    copy = next((r["copy_gbps"] for r in rows if "copy_gbps" in r), float("nan"))
    lines = [f"decode, bf16, Hq={HQ} Hkv={HKV} D={D}; device-to-device copy {copy:.0f} GB/s (read + write); "
             f"bar: K/V bytes / time >= {BAR:.0%} of it at caches >= {BAR_FROM // 1024}k",
             f"{'B':>3}{'cache':>8} {'layout':<11}{'system':<11}{'us':>9}{'K/V GB/s':>10}{'of copy':>9}"
             f"{'bar':>6}{'ours vs this':>14}"]
    ours = {(r["B"], r["cache"]): r for r in rows if r["system"] == "fusedattn" and r["layout"] == "contiguous"}
    for r in rows:
        head = f"{r['B']:>3}{r['cache']:>8} {r['layout']:<11}{r['system']:<11}"
        if "us" not in r:
            lines.append(head + "  " + r.get("note", ""))
            continue
        bar = {True: "met", False: "NOT", None: ""}[r.get("meets_bar")]
        mine = ours.get((r["B"], r["cache"]))
        ratio = f"{r['us'] / mine['us']:.2f}x" if r["system"] != "fusedattn" and mine and "us" in mine else ""
        lines.append(head + f"{r['us']:>9.1f}{r['kv_gbps']:>10.0f}{r['copy_fraction']:>9.2f}{bar:>6}{ratio:>14}")
    return "\n".join(lines)
