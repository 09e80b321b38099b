"""The decoding rows: one new query token per sequence over a KV cache, side by side in one process.

    python -m fusedattn.bench --decode

bf16, GQA 32 query heads / 8 KV heads, D=128, every cache full (cache_seqlens = its size). Systems:
``fusedattn.kvcache_attention`` on a contiguous cache and on paged caches (pages of 16, 64, 256
tokens, the block table a random permutation of the same memory); SDPA (its own backend choice,
``enable_gqa``) and FlexAttention (torch.compile; a one-token query takes its decoding kernel) on the
contiguous cache, at the cache sizes in ``PEER_CACHES``.

Time of a step (``step_us``): the GPU's time from a clean L2, as a serving loop's graph runs it --
the difference between a CUDA graph of 10 x (L2 flush, step) and one of 10 x (L2 flush), over 10.
The flush *reads* 256 MB, leaving L2 full of clean lines. Two things this keeps out of a small
step's time (B=1 at 8k reads only 34 MB): a whole graph's launch latency (paid once per model
step, not per layer), and the write-back of the ~50 MB of dirty lines that a
writing flush (``triton.testing.do_bench``'s ``zero_``) leaves in L2. The do_bench figure of a
one-step graph is reported beside it (``us_dobench``) for every row.

Bandwidth = bytes of K and V read / time. The bar: at least 70% of the device-to-device copy
bandwidth at caches of 8k and more, the copy counted as bytes read plus bytes written (a large
``copy_`` measured in the same run).
"""

from __future__ import annotations

import statistics

import torch

import fusedattn

from .systems import failure_note
from .timing import capture_graph, graph_ms, progress

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
    ms = graph_ms(lambda: dst.copy_(src))
    del src, dst
    torch.cuda.empty_cache()
    return 2 * gib * 2**30 / ms / 1e6


FLUSH_BYTES = 256 * 2**20  # five times the H100's / H200's 50 MB of L2


class L2Flush:
    """Evicts L2 by reading a buffer larger than it: the lines left behind are clean."""

    def __init__(self):
        self.buffer = torch.randn(FLUSH_BYTES // 4, device="cuda")
        self.total = torch.empty((), device="cuda")

    def __call__(self):
        torch.sum(self.buffer, dim=0, out=self.total)


def step_us(step, flush: L2Flush, repeats: int = 10, rounds: int = 40) -> float:
    """Microseconds of one ``step`` from a clean L2 inside a graph (module docstring): medians over
    ``rounds`` replays of a graph of ``repeats`` x (flush, step), minus the same of flushes alone."""
    def graph_of(with_step: bool):
        def body():
            for _ in range(repeats):
                flush()
                if with_step:
                    step()
        return capture_graph(body, warmups=2)

    graphs = graph_of(True), graph_of(False)
    times = ([], [])
    for _ in range(rounds):  # alternated, so a drift in clocks hits both alike
        for graph, spent in zip(graphs, times):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            graph.replay()
            end.record()
            end.synchronize()
            spent.append(start.elapsed_time(end) * 1e3)
    return (statistics.median(times[0]) - statistics.median(times[1])) / repeats


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


def measure(name: str, make, cache: Cache, copy_gbps: float, reference: torch.Tensor | None, layout: str,
            flush: L2Flush) -> dict:
    row = dict(row="decode", system=name, B=cache.batch, cache=cache.size, layout=layout, Hq=HQ, Hkv=HKV, D=D)
    try:
        step = make()
        out = step()
        if reference is not None:
            row["max_diff_vs_ours"] = (out.float() - reference.float()).abs().max().item()
        us = step_us(step, flush)
        row["us_dobench"] = graph_ms(step) * 1e3
    except Exception as e:  # a peer failing on a shape is a result
        row["note"] = failure_note(e)
        return row
    finally:
        torch.cuda.empty_cache()
    gbps = cache.kv_bytes / us / 1e3
    row.update(us=us, kv_gbps=gbps, copy_fraction=gbps / copy_gbps,
               copy_fraction_dobench=cache.kv_bytes / row["us_dobench"] / 1e3 / copy_gbps)
    if cache.size >= BAR_FROM:
        row["meets_bar"] = gbps / copy_gbps >= BAR
    return row


def run(on_row=None) -> list[dict]:
    copy_gbps = copy_bandwidth()
    flush = L2Flush()
    rows = []
    jobs = [(b, s) for s in CACHES for b in BATCHES]
    for batch, size in progress(jobs, "decode"):
        cache = Cache(batch, size)
        ours = None
        for page in PAGES:
            layout = "contiguous" if page is None else f"page {page}"
            row = measure("fusedattn", lambda: _ours(cache, page), cache, copy_gbps, None, layout, flush)
            row["copy_gbps"] = copy_gbps
            rows.append(row)
            if page is None:
                ours = _ours(cache, None)()
        if size in PEER_CACHES:
            for name, make in (("sdpa", _sdpa), ("flex", _flex)):
                rows.append(measure(name, lambda: make(cache), cache, copy_gbps, ours, "contiguous", flush))
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
             f"{'bar':>6}{'ours vs this':>14}{'do_bench us':>13}{'of copy':>9}"]
    ours = {(r["B"], r["cache"]): r for r in rows if r["system"] == "fusedattn" and r["layout"] == "contiguous"}
    for r in rows:
        head = f"{r['B']:>3}{r['cache']:>8} {r['layout']:<11}{r['system']:<11}"
        if "us" not in r:
            lines.append(head + "  " + r.get("note", ""))
            continue
        bar = {True: "met", False: "NOT", None: ""}[r.get("meets_bar")]
        mine = ours.get((r["B"], r["cache"]))
        ratio = f"{r['us'] / mine['us']:.2f}x" if r["system"] != "fusedattn" and mine and "us" in mine else ""
        lines.append(head + f"{r['us']:>9.1f}{r['kv_gbps']:>10.0f}{r['copy_fraction']:>9.2f}{bar:>6}{ratio:>14}"
                     f"{r['us_dobench']:>13.1f}{r['copy_fraction_dobench']:>9.2f}")
    return "\n".join(lines)
