"""kvcache_attention (issue 5): appending into a contiguous or paged cache and attending over it,
against a per-sequence loop of the float64 reference (SPEC 4) on both backends; the cache after the
call must hold exactly the old rows plus the new ones. Bad lengths and pages are errors that write
nothing; under CUDA-graph capture (values unreadable) the kernels guard themselves.

Without a GPU the Triton kernels run under the interpreter on short caches (fp16/fp32); on a GPU the
longer cases run in bf16 as well."""

from __future__ import annotations

import zlib
from dataclasses import dataclass

import pytest
import torch

import fusedattn
from fusedattn import kvcache
from fusedattn.reference import reference_attention

from attention_runner import set_knobs
from numerics import assert_close_to_reference

ON_GPU = torch.cuda.is_available()
TRITON_DEVICE = "cuda" if ON_GPU else "cpu"


@dataclass(frozen=True)
class CacheCase:
    lengths: tuple[int, ...]  # cache_seqlens before the append, one per sequence
    capacity: int  # rows per sequence: S_cache, or pages per sequence x page_size
    seqlen_q: int = 1
    new: int = 0  # rows of k_new / v_new
    page_size: int | None = None  # None: a contiguous cache
    spare_pages: int = 3  # pages no sequence uses (they must stay untouched)
    heads_q: int = 4
    heads_kv: int = 2
    head_dim: int = 32
    head_dim_v: int | None = None
    causal: bool = False
    window: tuple[int, int] | None = None
    softcap: float | None = None
    sinks: bool = False
    num_splits: int | None = None
    dtype: torch.dtype = torch.float16
    alibi: str | None = None  # ALiBi slopes: "heads" (Hq,), "batch" (B, Hq)
    chunk: int | None = None  # chunked local attention (Llama 4's chunked layers decoding)

    @property
    def id(self) -> str:
        parts = [f"len{'-'.join(map(str, self.lengths))}", f"cap{self.capacity}", f"q{self.seqlen_q}",
                 f"new{self.new}", f"page{self.page_size}" if self.page_size else "contiguous",
                 f"h{self.heads_q}-{self.heads_kv}", f"d{self.head_dim}v{self.head_dim_v or self.head_dim}",
                 f"splits{self.num_splits}", str(self.dtype).replace("torch.", "")]
        for flag in ("causal", "sinks"):
            if getattr(self, flag):
                parts.append(flag)
        if self.window:
            parts.append(f"w{self.window[0]}_{self.window[1]}")
        if self.softcap:
            parts.append(f"cap{self.softcap}")
        if self.alibi:
            parts.append(f"alibi-{self.alibi}")
        if self.chunk:
            parts.append(f"chunk{self.chunk}")
        return "-".join(parts)

    def options(self) -> dict:
        return dict(causal=self.causal, window=self.window, softcap=self.softcap, chunk=self.chunk)


QUICK = [
    # decoding: one query, GQA 4/2, an empty cache beside full ones, keys split in 3 (a split can be empty)
    CacheCase((0, 150, 200), 200, num_splits=3),
    # append 2 then causal over Sq=2, a cache filled to capacity by the append, automatic splits
    CacheCase((17, 198, 0), 200, seqlen_q=2, new=2, causal=True),
    # paged (page 16, pages shuffled), MQA, D=40/Dv=24, window + softcap + sinks, fp32, splits 3
    CacheCase((150, 5, 200), 224, new=3, page_size=16, heads_kv=1, head_dim=40, head_dim_v=24, window=(70, 0),
              softcap=20.0, sinks=True, num_splits=3, dtype=torch.float32),
    # paged with page 32, chunked prefill: Sq = S_new = 20 causal over cache + chunk, no split
    CacheCase((40, 0), 96, seqlen_q=20, new=20, page_size=32, causal=True, num_splits=1),
    # more queries than keys (causal rows with no key: out 0, lse -inf), sinks, splits 2
    CacheCase((3, 1), 64, seqlen_q=6, causal=True, sinks=True, num_splits=2),
    # Dv = 80: the split combination's second Dv chunk (of kernels.kvcache.COMBINE_DV = 64) is partly past Dv
    CacheCase((90, 33), 96, heads_q=2, heads_kv=1, head_dim=16, head_dim_v=80, num_splits=3),
]
FULL = QUICK + [
    CacheCase((4000, 1, 2500, 0, 3999), 4096, new=1, page_size=64, heads_q=32, heads_kv=8, head_dim=128,
              causal=True, dtype=torch.bfloat16),
    CacheCase((7000, 300), 8192, seqlen_q=4, new=4, page_size=256, heads_q=16, heads_kv=2, head_dim=128,
              causal=True, sinks=True, dtype=torch.bfloat16),
    CacheCase((1000, 2047), 2048, heads_q=8, heads_kv=8, head_dim=64, window=(256, 0), softcap=30.0,
              dtype=torch.bfloat16),
    CacheCase((3000, 2100, 17), 3072, seqlen_q=300, new=64, page_size=16, heads_q=6, heads_kv=3, head_dim=96,
              causal=True, num_splits=5, dtype=torch.float16),
]
# ALiBi slopes (issue 46): distances |i + Sk - Sq - j| with Sk = cache_seqlens[b] + S_new (the queries
# are the last Sq keys), a slope per packed (query, head) row of the kernel.
ALIBI = [
    # decoding, GQA, an empty cache, splits 3, a slope row per sequence
    CacheCase((0, 150, 200), 200, num_splits=3, alibi="batch"),
    # paged, append 3 + causal over Sq = 4 (more queries than new keys), window + softcap + sinks, fp32
    CacheCase((150, 5, 200), 224, seqlen_q=4, new=3, page_size=16, heads_kv=1, window=(70, 0), softcap=20.0,
              sinks=True, causal=True, num_splits=2, dtype=torch.float32, alibi="heads"),
    # more queries than keys, full attention (distances both sides), no split
    CacheCase((3, 40), 64, seqlen_q=6, new=2, num_splits=1, alibi="batch"),
]
ALIBI_FULL = ALIBI + [
    CacheCase((4000, 1, 2500, 0, 3999), 4096, new=1, page_size=64, heads_q=32, heads_kv=8, head_dim=128,
              causal=True, dtype=torch.bfloat16, alibi="batch"),
    CacheCase((3000, 2100, 17), 3072, seqlen_q=300, new=64, page_size=16, heads_q=6, heads_kv=3, head_dim=96,
              causal=True, num_splits=5, dtype=torch.float16, alibi="heads"),
]
# chunk=C (Llama 4's chunked layers decoding over a cache of the whole sequence): (i + Sk - Sq) // C ==
# j // C with Sk = cache_seqlens[b] + S_new; only the key blocks of the rows' chunks are walked
CHUNK = [
    # decoding, GQA, an empty cache, chunk boundaries inside and at the end of the cache, splits 3
    CacheCase((0, 150, 128, 200), 200, num_splits=3, causal=True, chunk=64),
    # paged, append 5 + causal over Sq = 5 crossing a chunk boundary, softcap + sinks, fp32, C not dividing 16
    CacheCase((60, 5, 90), 112, seqlen_q=5, new=5, page_size=16, heads_kv=1, softcap=20.0, sinks=True, causal=True,
              num_splits=2, dtype=torch.float32, chunk=23),
    # more queries than keys (rows before the keys see none), ALiBi, no split
    CacheCase((3, 40), 64, seqlen_q=6, new=2, num_splits=1, causal=True, alibi="batch", chunk=8),
]
CHUNK_FULL = CHUNK + [
    CacheCase((4000, 1, 2500, 0, 3999), 4096, new=1, page_size=64, heads_q=32, heads_kv=8, head_dim=128,
              causal=True, dtype=torch.bfloat16, chunk=1024),
    CacheCase((3000, 2100, 17), 3072, seqlen_q=300, new=64, page_size=16, heads_q=6, heads_kv=3, head_dim=96,
              causal=True, num_splits=5, dtype=torch.float16, chunk=512),
]
TRITON_CASES = FULL if ON_GPU else QUICK  # QUICK has no bf16: the interpreter's bf16 dot is unusable
TRITON_ALIBI = ALIBI_FULL if ON_GPU else ALIBI
TRITON_CHUNK = CHUNK_FULL if ON_GPU else CHUNK


@dataclass
class CacheInputs:
    q: torch.Tensor
    k_cache: torch.Tensor
    v_cache: torch.Tensor
    cache_seqlens: torch.Tensor
    block_table: torch.Tensor | None
    k_new: torch.Tensor | None
    v_new: torch.Tensor | None
    sinks: torch.Tensor | None
    alibi: torch.Tensor | None = None

    def clone_caches(self) -> "CacheInputs":
        return CacheInputs(self.q, self.k_cache.clone(), self.v_cache.clone(), self.cache_seqlens, self.block_table,
                           self.k_new, self.v_new, self.sinks, self.alibi)


def make_inputs(case: CacheCase, device) -> CacheInputs:
    gen = torch.Generator().manual_seed(zlib.crc32(case.id.encode()))
    batch, dv = len(case.lengths), case.head_dim_v or case.head_dim

    def randn(*size):
        return torch.randn(*size, generator=gen).to(device=device, dtype=case.dtype)

    if case.page_size is None:
        k_cache, v_cache, table = randn(batch, case.capacity, case.heads_kv, case.head_dim), \
            randn(batch, case.capacity, case.heads_kv, dv), None
    else:
        per_sequence = case.capacity // case.page_size
        pages = batch * per_sequence + case.spare_pages
        table = torch.randperm(pages, generator=gen)[:batch * per_sequence].view(batch, per_sequence)
        table = table.to(device=device, dtype=torch.int32)
        k_cache, v_cache = randn(pages, case.page_size, case.heads_kv, case.head_dim), \
            randn(pages, case.page_size, case.heads_kv, dv)
    k_new = randn(batch, case.new, case.heads_kv, case.head_dim) if case.new else None
    v_new = randn(batch, case.new, case.heads_kv, dv) if case.new else None
    sinks = (2.0 * torch.randn(case.heads_q, generator=gen) + 1.0).to(device) if case.sinks else None
    q = randn(batch, case.seqlen_q, case.heads_q, case.head_dim)
    alibi = None
    if case.alibi:
        shape = (case.heads_q,) if case.alibi == "heads" else (batch, case.heads_q)
        alibi = (0.05 + 0.5 * torch.rand(shape, generator=gen)).to(device)
    return CacheInputs(q, k_cache, v_cache, torch.tensor(case.lengths, dtype=torch.int32, device=device), table,
                       k_new, v_new, sinks, alibi)


def sequence_rows(cache: torch.Tensor, table, b: int, positions: torch.Tensor) -> torch.Tensor:
    """Cache rows of sequence b at ``positions`` (the test's own statement of the paging rule)."""
    if table is None:
        return cache[b, positions]
    page_size = cache.shape[1]
    return cache[table[b, positions // page_size].long(), positions % page_size]


def expected(case: CacheCase, inputs: CacheInputs, dtype):
    """Per sequence: the reference over (old cache rows, new rows), in ``dtype``; (out, lse)."""
    outs, lses = [], []
    for b, length in enumerate(case.lengths):
        old = torch.arange(length, device=inputs.q.device)
        keys, values = sequence_rows(inputs.k_cache, inputs.block_table, b, old), \
            sequence_rows(inputs.v_cache, inputs.block_table, b, old)
        if case.new:
            keys, values = torch.cat([keys, inputs.k_new[b]]), torch.cat([values, inputs.v_new[b]])
        sinks = inputs.sinks.to(dtype) if inputs.sinks is not None else None
        q = inputs.q[b:b + 1].to(dtype)
        alibi = None if inputs.alibi is None else inputs.alibi if inputs.alibi.dim() == 1 else inputs.alibi[b]
        if keys.shape[0] == 0:  # no key: out 0; lse the sink's logit, or -inf (SPEC 3.1)
            lse_dtype = torch.float64 if dtype == torch.float64 else torch.float32
            lse = torch.full((1, case.heads_q, case.seqlen_q), float("-inf"), dtype=lse_dtype, device=q.device)
            outs.append(q.new_zeros(1, case.seqlen_q, case.heads_q, values.shape[-1]))
            lses.append(lse if sinks is None else sinks.to(lse_dtype).view(1, -1, 1).expand_as(lse))
            continue
        out, lse = reference_attention(q, keys[None].to(dtype), values[None].to(dtype), sinks=sinks,
                                       alibi_slopes=alibi, return_lse=True, **case.options())
        outs.append(out)
        lses.append(lse)
    return torch.cat(outs), torch.cat(lses)


def assert_cache_updated(case: CacheCase, before: CacheInputs, after: CacheInputs) -> None:
    """The new rows sit at cache_seqlens[b]...; every other row (old ones, rows past the new ones,
    pages no sequence uses) is bit-for-bit what it was."""
    for cache_before, cache_after, new in ((before.k_cache, after.k_cache, before.k_new),
                                           (before.v_cache, after.v_cache, before.v_new)):
        touched = torch.zeros(cache_before.shape[:2], dtype=torch.bool, device=cache_before.device)
        for b, length in enumerate(case.lengths):
            positions = torch.arange(length, length + case.new, device=cache_before.device)
            if case.new:
                assert torch.equal(sequence_rows(cache_after, before.block_table, b, positions), new[b]), \
                    f"{case.id}: sequence {b}'s new rows are not where cache_seqlens puts them"
            if before.block_table is None:
                touched[b, positions] = True
            else:
                touched[before.block_table[b, positions // case.page_size].long(), positions % case.page_size] = True
        assert torch.equal(cache_after[~touched], cache_before[~touched]), f"{case.id}: rows outside the append changed"


def check_cache_case(case: CacheCase, backend: str, device) -> None:
    inputs = make_inputs(case, device)
    run = inputs.clone_caches()
    with fusedattn.use_backend(backend):
        out, lse = fusedattn.kvcache_attention(
            run.q, run.k_cache, run.v_cache, run.cache_seqlens, block_table=run.block_table, k_new=run.k_new,
            v_new=run.v_new, sinks=run.sinks, alibi_slopes=run.alibi, return_lse=True, num_splits=case.num_splits,
            **case.options())
    assert_cache_updated(case, inputs, run)
    assert out.shape == (len(case.lengths), case.seqlen_q, case.heads_q, case.head_dim_v or case.head_dim)
    assert lse.shape == (len(case.lengths), case.heads_q, case.seqlen_q) and lse.dtype == torch.float32
    lowp, ref64 = expected(case, inputs, case.dtype), expected(case, inputs, torch.float64)
    for name, ours, lowp_t, ref_t in zip(("out", "lse"), (out, lse), lowp, ref64):  # NaN / inf checked there too
        assert_close_to_reference(f"{case.id} {name}", ours, lowp_t, ref_t)


@pytest.mark.parametrize("case", TRITON_CASES + TRITON_ALIBI + TRITON_CHUNK, ids=lambda c: c.id)
def test_kvcache_kernels_match_per_sequence_reference(case):
    check_cache_case(case, "triton", TRITON_DEVICE)


@pytest.mark.parametrize("case", QUICK + ALIBI + CHUNK, ids=lambda c: c.id)
def test_kvcache_torch_path_matches_per_sequence_reference(case):
    check_cache_case(case, "torch", "cpu")


def test_kvcache_chunk_changes_the_result_and_bad_chunks_are_errors():
    case = CacheCase((70, 9), 96, seqlen_q=2, new=1, causal=True)
    inputs = make_inputs(case, TRITON_DEVICE)
    args = (inputs.q, inputs.k_cache.clone(), inputs.v_cache.clone(), inputs.cache_seqlens)
    plain = fusedattn.kvcache_attention(*args, causal=True)
    chunked = fusedattn.kvcache_attention(*args, causal=True, chunk=32)
    assert not torch.allclose(plain[0], chunked[0])  # sequence 0's rows (position 70) lose keys 0..63
    assert torch.allclose(plain[1], chunked[1])  # sequence 1 lies inside its first chunk
    for bad, error in ((0, ValueError), (2.5, TypeError)):
        with pytest.raises(error, match="chunk"):
            fusedattn.kvcache_attention(*args, causal=True, chunk=bad)


@pytest.mark.parametrize("backend,device", [("triton", TRITON_DEVICE), ("torch", "cpu")], ids=["triton", "torch"])
def test_kvcache_alibi_changes_the_result_and_bad_slopes_are_errors(backend, device):
    case = CacheCase((20, 9), 32, seqlen_q=2, new=1, causal=True, alibi="batch")
    inputs = make_inputs(case, device)

    def run(alibi):
        call = inputs.clone_caches()
        with fusedattn.use_backend(backend):
            return fusedattn.kvcache_attention(call.q, call.k_cache, call.v_cache, call.cache_seqlens, k_new=call.k_new,
                                               v_new=call.v_new, causal=True, alibi_slopes=alibi)

    plain, zero = run(None), run(torch.zeros(case.heads_q, device=device))
    torch.testing.assert_close(zero, plain, atol=2e-3, rtol=0)
    assert (run(inputs.alibi) - plain).abs().max() > 1e-2
    with pytest.raises(TypeError, match="`alibi_slopes` must be float32"):
        run(inputs.alibi.half())
    with pytest.raises(ValueError, match=r"`alibi_slopes` must have shape \(Hq,\) = \(4,\) or \(B, Hq\)"):
        run(torch.ones(3, 4, device=device))


def test_kvcache_splits_agree_with_no_split():
    """Split-KV is a change of summation order only: every split count gives the unsplit result to
    within fp32 rounding of the combination (and each matches the reference, above)."""
    case = CacheCase((250, 97, 1), 256, seqlen_q=3, new=2, page_size=16, causal=True, sinks=True)
    inputs = make_inputs(case, TRITON_DEVICE)
    results = []
    for splits in (1, 2, 4):
        run = inputs.clone_caches()
        with fusedattn.use_backend("triton"):
            results.append(fusedattn.kvcache_attention(
                run.q, run.k_cache, run.v_cache, run.cache_seqlens, block_table=run.block_table, k_new=run.k_new,
                v_new=run.v_new, sinks=run.sinks, return_lse=True, num_splits=splits, causal=True))
    for out, lse in results[1:]:
        torch.testing.assert_close(out.float(), results[0][0].float(), atol=2e-3, rtol=0)
        torch.testing.assert_close(lse, results[0][1], atol=1e-5, rtol=1e-5)


@pytest.mark.skipif(not ON_GPU or torch.cuda.get_device_capability()[0] < 9, reason="dependent launch: sm_90+")
def test_kvcache_combination_launched_early_waits_for_the_splits(monkeypatch):
    """The split combination is launched while the decoding grid runs (programmatic dependent
    launch) and must wait for its stores: across repeated steps, with and without the early launch,
    the bits are the same every time -- a race would read some split's part before it is written."""
    gen = torch.Generator(device="cuda").manual_seed(3)
    batch, size, page = 2, 8192, 16
    q = torch.randn(batch, 1, 32, 128, device="cuda", dtype=torch.bfloat16, generator=gen)
    k, v = (torch.randn(batch * size // page, page, 8, 128, device="cuda", dtype=torch.bfloat16, generator=gen)
            for _ in range(2))
    table = torch.randperm(batch * size // page, device="cuda", generator=gen).to(torch.int32).view(batch, -1)
    lengths = torch.tensor([size, size - 77], dtype=torch.int32, device="cuda")
    outputs = {}
    for early in (False, True):
        set_knobs(monkeypatch, pdl=early)
        outputs[early] = [fusedattn.kvcache_attention(q, k, v, lengths, block_table=table, causal=True,
                                                      return_lse=True) for _ in range(20)]
    first_out, first_lse = outputs[False][0]
    for out, lse in outputs[False] + outputs[True]:
        assert torch.equal(out, first_out) and torch.equal(lse, first_lse)


@pytest.mark.skipif(not ON_GPU or torch.cuda.get_device_capability()[0] < 9, reason="dependent launch: sm_90+")
def test_kvcache_decoding_launched_early_waits_for_the_previous_kernels(monkeypatch):
    """The decoding kernel is launched early too (programmatic dependent launch) and waits first
    thing for the kernels before it: here steps whose query and cache lengths kernels write just
    before the call and whose new key / value rows the append kernel writes, in a CUDA graph (an
    eager call reads the lengths on the host to check them, which waits for the GPU). With and
    without the early launch, 20 steps give the same bits -- a race would read the query, the
    lengths or the appended rows unwritten."""
    gen = torch.Generator(device="cuda").manual_seed(4)
    batch, size, page, steps = 2, 4096, 16, 20
    base_q = torch.randn(batch, 1, 32, 128, device="cuda", dtype=torch.bfloat16, generator=gen)
    news = [torch.randn(batch, 1, 8, 128, device="cuda", dtype=torch.bfloat16, generator=gen) for _ in range(steps)]
    pages = batch * size // page
    table = torch.randperm(pages, device="cuda", generator=gen).to(torch.int32).view(batch, -1)
    k, v = (torch.randn(pages, page, 8, 128, device="cuda", dtype=torch.bfloat16, generator=gen) for _ in range(2))
    first_lengths = torch.tensor([size - 2 * steps, size - 3 * steps], dtype=torch.int32, device="cuda")
    lengths = first_lengths.clone()

    def steps_of_a_layer():
        results = []
        for step in range(steps):
            q = base_q * (step + 1)  # written by a kernel right before the call
            results.append(fusedattn.kvcache_attention(q, k, v, lengths, block_table=table, k_new=news[step],
                                                       v_new=news[step] * 2, return_lse=True))
            lengths.add_(1)
        return results

    outputs = {}
    for early in (False, True):
        set_knobs(monkeypatch, early_start=early)
        lengths.copy_(first_lengths)
        steps_of_a_layer()  # compiles outside the capture
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            results = steps_of_a_layer()
        lengths.copy_(first_lengths)
        graph.replay()
        torch.cuda.synchronize()
        outputs[early] = [(out.clone(), lse.clone()) for out, lse in results]
    for (out, lse), (out_early, lse_early) in zip(outputs[False], outputs[True]):
        assert torch.equal(out, out_early) and torch.equal(lse, lse_early)
    assert not torch.equal(outputs[False][0][0], outputs[False][1][0])  # the steps differ


# ----------------------------------------------------------------------------- bad input


def _small(paged: bool, device="cpu", dtype=torch.float32) -> dict:
    gen = torch.Generator().manual_seed(5)
    args = dict(q=torch.randn(2, 1, 4, 16, generator=gen).to(device, dtype),
                cache_seqlens=torch.tensor([3, 40], dtype=torch.int32, device=device),
                k_new=torch.randn(2, 2, 2, 16, generator=gen).to(device, dtype),
                v_new=torch.randn(2, 2, 2, 16, generator=gen).to(device, dtype))
    if paged:
        args.update(k_cache=torch.randn(7, 16, 2, 16, generator=gen).to(device, dtype),
                    v_cache=torch.randn(7, 16, 2, 16, generator=gen).to(device, dtype),
                    block_table=torch.tensor([[4, 0, 6], [1, 2, 3]], dtype=torch.int32, device=device))
    else:
        args.update(k_cache=torch.randn(2, 48, 2, 16, generator=gen).to(device, dtype),
                    v_cache=torch.randn(2, 48, 2, 16, generator=gen).to(device, dtype))
    return args


BAD_SHAPES = [
    (False, dict(cache_seqlens=torch.tensor([3, 40])), TypeError, "`cache_seqlens` must be an int32"),
    (False, dict(cache_seqlens=torch.tensor([3], dtype=torch.int32)), ValueError, "1 entries; expected B = 2"),
    (False, dict(cache_seqlens=2.0), TypeError, "`cache_seqlens` must be an int32 tensor"),
    (False, dict(v_new=None), ValueError, "give both or neither"),
    (False, dict(k_new=torch.randn(2, 2, 1, 16)), ValueError, r"`k_new` has shape \(2, 2, 1, 16\)"),
    (False, dict(k_cache=torch.randn(3, 48, 2, 16), v_cache=torch.randn(3, 48, 2, 16)), ValueError,
     "holds 3 sequences but q has batch 2"),
    (False, dict(k_cache=torch.randn(2, 48, 2, 32)[..., ::2]), ValueError, "unit stride"),
    (False, dict(v_cache=torch.randn(2, 40, 2, 16)), ValueError, "must agree"),
    (False, dict(q=torch.randn(2, 1, 3, 16)), ValueError, "multiple of k/v heads"),
    (False, dict(k_cache=torch.randn(2, 48, 2, 16, dtype=torch.float16)), TypeError, "must share a dtype"),
    (False, dict(num_splits=0), ValueError, "`num_splits` must be an int >= 1"),
    (True, dict(block_table=torch.tensor([[4, 0, 6], [1, 2, 3]])), TypeError, "`block_table` must be an int32"),
    (True, dict(block_table=torch.tensor([4, 0, 6], dtype=torch.int32)), ValueError, "`block_table` must be 2-D"),
    (True, dict(k_cache=torch.randn(7, 24, 2, 16), v_cache=torch.randn(7, 24, 2, 16)), ValueError,
     "`block_table`.*multiple of 16, got 24"),
]


@pytest.mark.parametrize("paged, changes, error, match", BAD_SHAPES)
def test_kvcache_bad_shapes_are_clear_errors(paged, changes, error, match):
    args = _small(paged)
    args.update(changes)
    with pytest.raises(error, match=match):
        fusedattn.kvcache_attention(**args)


ALIASES = [(paged, new, cache) for paged in (False, True) for new in ("k_new", "v_new")
           for cache in ("k_cache", "v_cache")]


@pytest.mark.parametrize("backend", ["torch", "triton"])
@pytest.mark.parametrize("paged, new, cache", ALIASES)
def test_kvcache_new_tokens_that_alias_the_cache_are_a_clear_error(paged, new, cache, backend):
    """k_new / v_new written into the cache in place must not be views of it: a ValueError naming both."""
    args = _small(paged, TRITON_DEVICE if backend == "triton" else "cpu")
    view = args[cache][:2, :2] if not paged else args[cache][2:4, :2]
    args[new] = view
    with fusedattn.use_backend(backend), pytest.raises(ValueError, match=f"`{new}` overlaps `{cache}`"):
        fusedattn.kvcache_attention(**args)


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_kvcache_takes_numpy_scalars(backend):
    """np.int32 lengths and num_splits, an np.float32 scale and softcap and an np.int64 window: what the
    same Python numbers give, bit for bit."""
    import numpy as np

    args = _small(False, TRITON_DEVICE if backend == "triton" else "cpu")
    as_numpy = dict(cache_seqlens=np.int32(37), scale=np.float32(0.3), softcap=np.float32(20.0),
                    window=(np.int64(9), np.int64(0)), num_splits=np.int32(2))
    as_python = dict(cache_seqlens=37, scale=float(as_numpy["scale"]), softcap=float(as_numpy["softcap"]),
                     window=(9, 0), num_splits=2)
    with fusedattn.use_backend(backend):
        results = [fusedattn.kvcache_attention(args["q"], args["k_cache"], args["v_cache"], return_lse=True, **options)
                   for options in (as_python, as_numpy)]
    assert torch.equal(results[0][0], results[1][0]) and torch.equal(results[0][1], results[1][1])


BAD_VALUES = [
    # a sequence whose append runs past the cache: 47 + 2 > 48
    (False, dict(cache_seqlens=torch.tensor([3, 47], dtype=torch.int32)), "needs 49 cache rows"),
    (False, dict(cache_seqlens=torch.tensor([-1, 4], dtype=torch.int32)), "must be >= 0"),
    (True, dict(cache_seqlens=torch.tensor([3, 47], dtype=torch.int32)), "needs 49 cache rows.*`block_table`"),
    # a page in use outside the cache (7 pages), and a negative one
    (True, dict(block_table=torch.tensor([[4, 0, 6], [1, 7, 3]], dtype=torch.int32)), "points outside the cache"),
    (True, dict(block_table=torch.tensor([[-1, 0, 6], [1, 2, 3]], dtype=torch.int32)), "points outside the cache"),
]


@pytest.mark.parametrize("backend", ["torch", "triton"])
@pytest.mark.parametrize("paged, changes, match", BAD_VALUES)
def test_kvcache_bad_lengths_and_pages_are_errors_that_write_nothing(paged, changes, match, backend):
    args = _small(paged, TRITON_DEVICE if backend == "triton" else "cpu")
    args.update({key: value.to(args["q"].device) for key, value in changes.items()})
    k_before, v_before = args["k_cache"].clone(), args["v_cache"].clone()
    with fusedattn.use_backend(backend), pytest.raises(ValueError, match=match):
        fusedattn.kvcache_attention(**args)
    assert torch.equal(args["k_cache"], k_before) and torch.equal(args["v_cache"], v_before)


def test_kvcache_pages_past_the_lengths_are_not_checked_or_read():
    """Block-table entries past a sequence's pages in use may hold anything (-1 padding): only the
    pages the lengths reach are checked and read."""
    args = _small(True, TRITON_DEVICE)
    args["block_table"] = torch.tensor([[4, -1, 99], [1, 2, 3]], dtype=torch.int32, device=TRITON_DEVICE)
    with fusedattn.use_backend("triton"):
        out = fusedattn.kvcache_attention(**args)
    assert torch.isfinite(out).all()


def test_kvcache_kernels_guard_themselves_when_values_are_unchecked(monkeypatch):
    """Under CUDA-graph capture the host cannot read the lengths (``kvcache._capturing``, faked here
    so the interpreter runs the same path): an out-of-range length or page must not write or read
    outside the cache; that sequence's rows come out NaN, and the other sequence is still right."""
    monkeypatch.setattr(kvcache, "_capturing", lambda device: True)
    for paged, changes in ((False, dict(cache_seqlens=torch.tensor([3, 47], dtype=torch.int32))),
                           (True, dict(cache_seqlens=torch.tensor([3, 47], dtype=torch.int32))),
                           (True, dict(block_table=torch.tensor([[4, 0, 6], [1, 70, 3]], dtype=torch.int32)))):
        args = _small(paged, TRITON_DEVICE)
        args.update({key: value.to(TRITON_DEVICE) for key, value in changes.items()})
        k_before, v_before = args["k_cache"].clone(), args["v_cache"].clone()
        with fusedattn.use_backend("triton"):
            out = fusedattn.kvcache_attention(**args, num_splits=2)
        assert torch.isnan(out[1]).all(), f"{changes}: the bad sequence's rows must be NaN"
        if "cache_seqlens" in changes:  # a length out of range: nothing of that sequence is written
            rows_of_1 = args["k_cache"][1] if not paged else args["k_cache"][args["block_table"][1].long()]
            before_1 = k_before[1] if not paged else k_before[args["block_table"][1].long()]
            assert torch.equal(rows_of_1, before_1)
        good_case = CacheCase((3,), 48, new=2, page_size=16 if paged else None, heads_q=4, heads_kv=2, head_dim=16,
                              dtype=torch.float32)
        table = args["block_table"][:1] if paged else None
        good = CacheInputs(args["q"][:1], k_before if paged else k_before[:1], v_before if paged else v_before[:1],
                           args["cache_seqlens"][:1], table, args["k_new"][:1], args["v_new"][:1], None)
        lowp, ref64 = expected(good_case, good, torch.float32), expected(good_case, good, torch.float64)
        assert_close_to_reference(f"{changes} good sequence", out[:1], lowp[0], ref64[0])


@pytest.mark.skipif(not ON_GPU, reason="CUDA graphs need a GPU")
def test_kvcache_decoding_in_a_cuda_graph_follows_the_lengths():
    """Capture one decoding step, then replay it with new lengths written into the same tensor: the
    result follows the lengths (no value was baked in at capture), appends land at the new place."""
    case = CacheCase((1000, 20), 2048, new=1, page_size=64, heads_q=8, heads_kv=2, head_dim=64, causal=True,
                     dtype=torch.bfloat16)
    inputs = make_inputs(case, "cuda")
    run = inputs.clone_caches()

    def step():
        return fusedattn.kvcache_attention(run.q, run.k_cache, run.v_cache, run.cache_seqlens,
                                           block_table=run.block_table, k_new=run.k_new, v_new=run.v_new,
                                           causal=True, return_lse=True)

    step()  # compile outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out, lse = step()
    for lengths in ((1500, 7), (2047, 0)):
        replay_case = CacheCase(lengths, **{key: getattr(case, key) for key in
                                            ("capacity", "new", "page_size", "heads_q", "heads_kv", "head_dim",
                                             "causal", "dtype")})
        before = CacheInputs(run.q, run.k_cache.clone(), run.v_cache.clone(), run.cache_seqlens, run.block_table,
                             run.k_new, run.v_new, None)
        run.cache_seqlens.copy_(torch.tensor(lengths, dtype=torch.int32))
        graph.replay()
        before.cache_seqlens = run.cache_seqlens
        assert_cache_updated(replay_case, before, run)
        lowp, ref64 = expected(replay_case, before, case.dtype), expected(replay_case, before, torch.float64)
        assert_close_to_reference(f"graph {lengths} out", out, lowp[0], ref64[0])
        assert_close_to_reference(f"graph {lengths} lse", lse, lowp[1], ref64[1])


@pytest.mark.parametrize("backend", ["torch", "triton"])
@pytest.mark.parametrize("paged", [False, True], ids=["contiguous", "paged"])
def test_kvcache_compiles_without_graph_breaks(backend, paged):
    """torch.compile(fullgraph=True) traces kvcache_attention (its value checks run inside a custom op);
    the compiled call appends to the cache in place and matches the reference over the grown cache."""
    device = TRITON_DEVICE if backend == "triton" else "cpu"
    args = _small(paged, device)
    args["cache_seqlens"] = torch.tensor([3, 29], dtype=torch.int32, device=device)
    before = [args[name].clone() for name in ("k_cache", "v_cache")]
    torch._dynamo.reset()

    def call(q, cache_seqlens, k_new, v_new):
        with fusedattn.use_backend(backend):
            return fusedattn.kvcache_attention(q, args["k_cache"], args["v_cache"], cache_seqlens, k_new=k_new,
                                               v_new=v_new, block_table=args.get("block_table"), causal=True,
                                               softcap=10.0, return_lse=True)

    compiled = torch.compile(call, fullgraph=True, backend="aot_eager" if device == "cpu" else "inductor")
    out, lse = compiled(args["q"], args["cache_seqlens"], args["k_new"], args["v_new"])
    table = args.get("block_table")
    for b, cached in enumerate((3, 29)):
        length = cached + 2
        positions = torch.arange(length, device=device)
        rows = (lambda c: c[b, :length]) if table is None else \
            (lambda c: c[table[b, positions // c.shape[1]].long(), positions % c.shape[1]])
        new_rows = (lambda c: c[b, cached:length]) if table is None else \
            (lambda c: c[table[b, positions[cached:] // c.shape[1]].long(), positions[cached:] % c.shape[1]])
        old_rows = (lambda c: c[b, :cached]) if table is None else \
            (lambda c: c[table[b, positions[:cached] // c.shape[1]].long(), positions[:cached] % c.shape[1]])
        for name, new, old in (("k_cache", args["k_new"], before[0]), ("v_cache", args["v_new"], before[1])):
            assert torch.equal(new_rows(args[name]), new[b]) and torch.equal(old_rows(args[name]), old_rows(old))
        lowp, ref64 = (reference_attention(args["q"][b:b + 1].to(t), rows(args["k_cache"])[None].to(t),
                                           rows(args["v_cache"])[None].to(t), causal=True, softcap=10.0,
                                           return_lse=True) for t in (args["q"].dtype, torch.float64))
        assert_close_to_reference(f"out {b}", out[b:b + 1], lowp[0], ref64[0])
        assert_close_to_reference(f"lse {b}", lse[b:b + 1], lowp[1], ref64[1])
