"""varlen_attention (issue 5): packed variable-length sequences against a per-sequence loop of the
float64 reference (SPEC 4), forward and backward, on both backends; bad packings are errors.

Without a GPU the Triton kernels run under the interpreter on short sequences (fp16/fp32); on a GPU
the longer cases run in bf16/fp16 as well."""

from __future__ import annotations

import zlib
from dataclasses import dataclass

import pytest
import torch

import fusedattn
from fusedattn.reference import reference_attention

from attention_runner import forward_backward
from numerics import assert_close_to_reference

ON_GPU = torch.cuda.is_available()
TRITON_DEVICE = "cuda" if ON_GPU else "cpu"


@dataclass(frozen=True)
class VarlenCase:
    lengths_q: tuple[int, ...]
    lengths_k: tuple[int, ...] | None = None  # None: as lengths_q
    heads_q: int = 2
    heads_kv: int = 2
    head_dim: int = 32
    head_dim_v: int | None = None
    causal: bool = False
    window: tuple[int, int] | None = None
    softcap: float | None = None
    sinks: bool = False
    deterministic: bool = False
    lse_grad: bool = False
    dtype: torch.dtype = torch.float16
    extra_max: int = 0  # max_seqlen given above the longest length (FlashAttention callers often round up)
    alibi: str | None = None  # ALiBi slopes: "heads" (Hq,), "sequences" (sequences, Hq)
    chunk: int | None = None  # chunked local attention, aligned per sequence

    @property
    def keys(self) -> tuple[int, ...]:
        return self.lengths_q if self.lengths_k is None else self.lengths_k

    @property
    def id(self) -> str:
        parts = [f"q{'-'.join(map(str, self.lengths_q))}", f"k{'-'.join(map(str, self.keys))}",
                 f"h{self.heads_q}-{self.heads_kv}", f"d{self.head_dim}v{self.head_dim_v or self.head_dim}",
                 str(self.dtype).replace("torch.", "")]
        for flag in ("causal", "sinks", "deterministic", "lse_grad"):
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
        return dict(causal=self.causal, window=self.window, softcap=self.softcap, deterministic=self.deterministic,
                    chunk=self.chunk)


QUICK = [
    # empty and one-token sequences inside a batch; GQA; lengths crossing 16-row tiles
    VarlenCase((17, 1, 0, 33), heads_q=4, heads_kv=2, causal=True),
    # Sq != Sk per sequence both ways, a sequence with queries and no keys, window + softcap + sinks, fp32
    VarlenCase((5, 20, 3), (19, 7, 0), window=(8, 2), softcap=20.0, sinks=True, dtype=torch.float32),
    # deterministic, a gradient through lse, head dims not powers of two (D != Dv), max_seqlen rounded up
    VarlenCase((30, 9), head_dim=40, head_dim_v=24, causal=True, deterministic=True, lse_grad=True, extra_max=7),
    # full attention, MQA, a one-token query sequence against many keys (decoding-like)
    VarlenCase((1, 40, 2), (37, 40, 0), heads_q=2, heads_kv=1, sinks=True, lse_grad=True),
]
FULL = QUICK + [
    VarlenCase((1000, 1, 0, 255, 129, 2048, 113), heads_q=8, heads_kv=2, head_dim=128, causal=True,
               dtype=torch.bfloat16),
    VarlenCase((1000, 1, 0, 255, 129, 2048, 113), heads_q=4, heads_kv=4, head_dim=64, window=(100, 0),
               softcap=30.0, sinks=True, lse_grad=True, dtype=torch.bfloat16),
    VarlenCase((127, 300, 17), (500, 129, 1), heads_q=6, heads_kv=3, head_dim=96, causal=True, deterministic=True,
               dtype=torch.float16),
]
# ALiBi slopes (issue 46): each sequence's distances |i + Sk - Sq - j| are its own (bottom-right aligned
# within it), and "sequences" slopes give each sequence its own row.
ALIBI = [
    # causal GQA, an empty sequence and a one-token one, a slope row per sequence
    VarlenCase((17, 1, 0, 33), heads_q=4, heads_kv=2, causal=True, alibi="sequences"),
    # Sq != Sk per sequence both ways, a sequence with queries and no keys, window + softcap + sinks, fp32
    VarlenCase((5, 20, 3), (19, 7, 0), window=(8, 2), softcap=20.0, sinks=True, dtype=torch.float32, alibi="heads"),
    # full attention (distances on both sides of the diagonal), MQA, Sq != Sk, a gradient through lse
    VarlenCase((30, 9, 4), (12, 40, 4), heads_q=2, heads_kv=1, lse_grad=True, alibi="sequences"),
]
ALIBI_FULL = ALIBI + [
    VarlenCase((1000, 1, 0, 255, 129, 2048, 113), heads_q=8, heads_kv=2, head_dim=128, causal=True,
               dtype=torch.bfloat16, alibi="sequences"),
    VarlenCase((127, 300, 17), (500, 129, 1), heads_q=6, heads_kv=3, head_dim=64, window=(100, 20), softcap=30.0,
               deterministic=True, lse_grad=True, dtype=torch.bfloat16, alibi="heads"),
]
# chunk=C (issue 46): each sequence's rule (i + Sk - Sq) // C == j // C with its own i, j, Sq, Sk.
CHUNK = [
    # causal GQA, an empty sequence and a one-token one, lengths crossing chunks and 16-row tiles
    VarlenCase((17, 1, 0, 33), heads_q=4, heads_kv=2, causal=True, chunk=8),
    # Sq != Sk per sequence both ways (rows at negative aligned positions keep nothing), a sequence with
    # queries and no keys, window + softcap + sinks, fp32, C not dividing any length
    VarlenCase((5, 20, 3), (19, 7, 0), window=(8, 2), softcap=20.0, sinks=True, dtype=torch.float32, chunk=6),
    # full attention (both sides of the diagonal within a chunk), MQA, a gradient through lse, ALiBi
    VarlenCase((30, 9, 4), (12, 40, 4), heads_q=2, heads_kv=1, lse_grad=True, alibi="sequences", chunk=5),
    # C = 1 (each row its own key) and C beyond every length (no chunk), deterministic
    VarlenCase((9, 14), causal=True, deterministic=True, chunk=1),
    VarlenCase((9, 14), (12, 3), causal=True, chunk=64),
]
TRITON_CASES = FULL if ON_GPU else QUICK  # QUICK has no bf16: the interpreter's bf16 dot is unusable
TRITON_ALIBI = ALIBI_FULL if ON_GPU else ALIBI
# What the Gluon kernels take (Hopper, 16-bit, D = Dv in {64, 128}; sinks in the forward): each path of the packed
# forward and dK/dV pass -- dQ summed in the pass (D=128) or by the Triton dQ pass (D=64,
# deterministic), dK/dV stored by pointers or summed over a GQA group (causal GQA), causal, none,
# a left window -- with sequences of 0 and 1 tokens, Sq != Sk both ways, lengths off every tile.
GLUON = [
    VarlenCase((1000, 1, 0, 255, 129, 2048, 113), heads_q=8, heads_kv=2, head_dim=128, causal=True,
               dtype=torch.bfloat16),
    VarlenCase((300, 17, 0, 511, 2), (129, 400, 33, 64, 0), heads_q=4, heads_kv=4, head_dim=128, lse_grad=True,
               dtype=torch.float16),
    VarlenCase((700, 1, 190, 64), heads_q=4, heads_kv=1, head_dim=128, causal=True, deterministic=True,
               dtype=torch.bfloat16),
    VarlenCase((1000, 1, 0, 255, 129, 2048, 113), heads_q=4, heads_kv=2, head_dim=64, causal=True, softcap=30.0,
               lse_grad=True, dtype=torch.bfloat16),
    VarlenCase((513, 64, 1500), (400, 64, 1600), heads_q=4, heads_kv=2, head_dim=128, window=(100, 0),
               softcap=30.0, lse_grad=True, dtype=torch.bfloat16),
    VarlenCase((65, 300, 1), (300, 1, 77), heads_q=6, heads_kv=2, head_dim=64, dtype=torch.float16),
    VarlenCase((191, 193, 385), heads_q=4, heads_kv=2, head_dim=128, dtype=torch.bfloat16),
    VarlenCase((300, 0, 1, 517), (200, 5, 0, 600), heads_q=4, heads_kv=2, head_dim=128, causal=True, sinks=True,
               lse_grad=True, dtype=torch.bfloat16),
]


def _offsets(lengths, device) -> torch.Tensor:
    return torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32, device=device)


def make_inputs(case: VarlenCase, device):
    gen = torch.Generator().manual_seed(zlib.crc32(case.id.encode()))
    total_q, total_k = sum(case.lengths_q), sum(case.keys)
    dv = case.head_dim_v or case.head_dim

    def randn(*size):
        return torch.randn(*size, generator=gen).to(device=device, dtype=case.dtype)

    q, k, v = randn(total_q, case.heads_q, case.head_dim), randn(total_k, case.heads_kv, case.head_dim), \
        randn(total_k, case.heads_kv, dv)
    dout = randn(total_q, case.heads_q, dv)
    dlse = torch.randn(case.heads_q, total_q, generator=gen).to(device)
    sinks = (2.0 * torch.randn(case.heads_q, generator=gen) + 1.0).to(device) if case.sinks else None
    return q, k, v, dout, dlse, sinks


def make_slopes(case: VarlenCase, device) -> torch.Tensor | None:
    """The case's float32 ALiBi slopes: (Hq,) or (sequences, Hq), in (0.05, 0.55)."""
    if case.alibi is None:
        return None
    gen = torch.Generator().manual_seed(zlib.crc32(case.id.encode()) + 1)
    shape = (case.heads_q,) if case.alibi == "heads" else (len(case.lengths_q), case.heads_q)
    return (0.05 + 0.5 * torch.rand(shape, generator=gen)).to(device)


def reference_loop(q, k, v, case: VarlenCase, sinks_=None, slopes=None):
    """The SPEC 3 reference on each sequence, packed back: (out (total_q, Hq, Dv), lse (Hq, total_q)).
    ``slopes``: ALiBi slopes, (Hq,) or a row per sequence."""
    bounds_q = [0, *torch.tensor(case.lengths_q).cumsum(0).tolist()]
    bounds_k = [0, *torch.tensor(case.keys).cumsum(0).tolist()]
    outs, lses = [], []
    for index, ((q0, q1), (k0, k1)) in enumerate(zip(zip(bounds_q, bounds_q[1:]), zip(bounds_k, bounds_k[1:]))):
        if q1 == q0:
            continue
        if k1 == k0:  # no key: out 0; lse the sink's logit, or -inf (SPEC 3.1)
            outs.append(q.new_zeros(q1 - q0, q.shape[1], v.shape[-1]))
            empty = torch.full((q.shape[1], q1 - q0), float("-inf"), dtype=torch.float64 if q.dtype == torch.float64
                               else torch.float32, device=q.device)
            lses.append(empty if sinks_ is None else sinks_.to(empty.dtype)[:, None].expand_as(empty))
            continue
        alibi = None if slopes is None else slopes if slopes.dim() == 1 else slopes[index]
        out, lse = reference_attention(q[q0:q1][None], k[k0:k1][None], v[k0:k1][None], sinks=sinks_,
                                       alibi_slopes=alibi, return_lse=True, **{key: val for key, val in case.options().items()
                                                           if key != "deterministic"})
        outs.append(out[0])
        lses.append(lse[0])
    return torch.cat(outs), torch.cat(lses, dim=1)


def check_varlen_case(case: VarlenCase, backend: str, device, host_offsets: bool = False) -> None:
    """``host_offsets``: the offsets passed on the CPU (q on the GPU), read without a device sync."""
    q, k, v, dout, dlse, sinks = make_inputs(case, device)
    offsets_device = "cpu" if host_offsets else device
    cu_q, cu_k = _offsets(case.lengths_q, offsets_device), _offsets(case.keys, offsets_device)
    slopes = make_slopes(case, device)

    def ours(q_, k_, v_, sinks_=None):
        with fusedattn.use_backend(backend):
            return fusedattn.varlen_attention(q_, k_, v_, cu_q, cu_k, max(case.lengths_q) + case.extra_max,
                                              max(case.keys) + case.extra_max, sinks=sinks_, alibi_slopes=slopes,
                                              return_lse=True, **case.options())

    def reference(q_, k_, v_, sinks_=None):
        return reference_loop(q_, k_, v_, case, sinks_, slopes)

    extras = dict(lse_grad=case.lse_grad, sinks=sinks)
    got = forward_backward(ours, q, k, v, dout, dlse, **extras)
    lowp = forward_backward(reference, q, k, v, dout, dlse, **extras)
    ref64 = forward_backward(reference, q, k, v, dout, dlse, dtype=torch.float64, **extras)
    assert got[0].shape == (sum(case.lengths_q), case.heads_q, case.head_dim_v or case.head_dim)
    assert got[1].shape == (case.heads_q, sum(case.lengths_q)) and got[1].dtype == torch.float32
    names = ["out", "lse", "dq", "dk", "dv"] + ["dsinks"] * case.sinks
    for name, ours_t, lowp_t, ref_t in zip(names, got, lowp, ref64):
        assert_close_to_reference(f"{case.id} {name}", ours_t, lowp_t, ref_t)


@pytest.mark.parametrize("case", TRITON_CASES, ids=lambda c: c.id)
def test_varlen_kernels_match_per_sequence_reference(case):
    check_varlen_case(case, "triton", TRITON_DEVICE)


@pytest.mark.skipif(not ON_GPU or torch.cuda.get_device_capability()[0] != 9, reason="Gluon kernels: Hopper only")
@pytest.mark.parametrize("case", GLUON, ids=lambda c: c.id)
def test_varlen_gluon_kernels_match_per_sequence_reference(case, monkeypatch):
    """The Gluon forward and dK/dV pass over packed sequences (each program's tile from the host's
    map of the blocks that exist) against the per-sequence reference; both must have run."""
    from fusedattn.kernels.gluon import bwd as hopper_bwd
    from fusedattn.kernels.gluon import fwd as hopper_fwd

    from attention_runner import record_launches

    forwards = record_launches(monkeypatch, hopper_fwd, "_packed_forward")
    passes = record_launches(monkeypatch, hopper_bwd, "_packed_dkdv")
    check_varlen_case(case, "triton", "cuda")
    assert forwards and all(forwards) and passes and all(passes)


@pytest.mark.skipif(not ON_GPU or torch.cuda.get_device_capability()[0] != 9, reason="Gluon kernels: Hopper only")
@pytest.mark.parametrize("case", [c for c in GLUON if c.head_dim == 64 and not c.deterministic], ids=lambda c: c.id)
def test_varlen_gluon_dq_split_by_rows_matches_per_sequence_reference(case, monkeypatch):
    """The D=64 dK/dV pass with 128-row steps, summing dQ split by rows, over packed sequences."""
    from dataclasses import replace

    from fusedattn.kernels.gluon import bwd as hopper_bwd
    from fusedattn.tuning.configs import KernelConfig, pinned_configs, select_configs

    from attention_runner import record_launches

    passes = record_launches(monkeypatch, hopper_bwd, "_packed_dkdv")
    base = select_configs(torch.device("cuda"), case.dtype, case.head_dim, case.head_dim)
    rows = KernelConfig(128, 128, 4, 2, tma_loads=True, hopper_overlap=0, hopper_split=2, hopper_pingpong=2)
    with pinned_configs(replace(base, dkdv=rows, atomic_dq=True, dq_tma=True)):
        check_varlen_case(case, "triton", "cuda")
    assert passes and all(passes)


@pytest.mark.skipif(not ON_GPU, reason="offsets on the CPU with q on a GPU")
@pytest.mark.parametrize("case", [GLUON[0], GLUON[1], FULL[-1]], ids=lambda c: c.id)
def test_varlen_offsets_on_the_host_match_per_sequence_reference(case):
    check_varlen_case(case, "triton", "cuda", host_offsets=True)


@pytest.mark.parametrize("case", QUICK, ids=lambda c: c.id)
def test_varlen_torch_path_matches_per_sequence_reference(case):
    check_varlen_case(case, "torch", "cpu")


@pytest.mark.parametrize("case", TRITON_ALIBI, ids=lambda c: c.id)
def test_varlen_alibi_kernels_match_per_sequence_reference(case):
    check_varlen_case(case, "triton", TRITON_DEVICE)


@pytest.mark.parametrize("case", ALIBI, ids=lambda c: c.id)
def test_varlen_alibi_torch_path_matches_per_sequence_reference(case):
    check_varlen_case(case, "torch", "cpu")


@pytest.mark.parametrize("case", CHUNK, ids=lambda c: c.id)
def test_varlen_chunk_kernels_match_per_sequence_reference(case):
    check_varlen_case(case, "triton", TRITON_DEVICE)


@pytest.mark.parametrize("case", CHUNK, ids=lambda c: c.id)
def test_varlen_chunk_torch_path_matches_per_sequence_reference(case):
    check_varlen_case(case, "torch", "cpu")


def check_compiled_and_second_derivatives(run, reference, q, k, v, dout, device) -> None:
    """``run`` (q, k, v) -> (out, lse) through torch.compile(fullgraph=True) gives eager's values and
    gradients (lse in the loss too), and a backward with create_graph the second derivatives of
    ``reference`` in float64."""
    torch._dynamo.reset()
    compiled = torch.compile(run, fullgraph=True, backend="aot_eager" if device == "cpu" else "inductor")
    dlse = torch.randn(4, q.shape[0], generator=torch.Generator().manual_seed(5)).to(device)
    eager = forward_backward(run, q, k, v, dout, dlse, lse_grad=True)
    got = forward_backward(compiled, q, k, v, dout, dlse, lse_grad=True)
    for name, a, b in zip(["out", "lse", "dq", "dk", "dv"], got, eager):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5, msg=name)

    def second(fn, dtype):
        q_, k_, v_ = (t.detach().to(dtype).requires_grad_() for t in (q, k, v))
        out = fn(q_, k_, v_)[0]
        dq, = torch.autograd.grad(out, q_, dout.to(dtype), create_graph=True)
        return torch.autograd.grad(dq.square().sum(), (k_, v_))

    ours, ref = second(run, torch.float32), second(reference, torch.float64)
    for name, a, b in zip(["d2k", "d2v"], ours, ref):
        torch.testing.assert_close(a.double(), b, atol=2e-3, rtol=2e-3, msg=name)


@pytest.mark.parametrize("backend,device", [("triton", TRITON_DEVICE), ("torch", "cpu")], ids=["triton", "torch"])
def test_varlen_chunk_compiles_and_differentiates_twice(backend, device):
    """chunk through torch.compile(fullgraph=True) (the custom ops carry it) gives eager's values, and a
    backward with create_graph (each sequence by plain torch ops) the float64 reference's second
    derivatives."""
    case = VarlenCase((7, 0, 12), (9, 3, 12), heads_q=4, heads_kv=2, head_dim=16, causal=True, dtype=torch.float32,
                      chunk=4)
    q, k, v, dout, _, _ = make_inputs(case, device)
    cu_q, cu_k = _offsets(case.lengths_q, device), _offsets(case.keys, device)

    def run(q_, k_, v_):
        with fusedattn.use_backend(backend):
            return fusedattn.varlen_attention(q_, k_, v_, cu_q, cu_k, 12, 12, causal=True, chunk=4, return_lse=True)

    check_compiled_and_second_derivatives(run, lambda *t: reference_loop(*t, case), q, k, v, dout, device)


@pytest.mark.parametrize("backend,device", [("triton", TRITON_DEVICE), ("torch", "cpu")], ids=["triton", "torch"])
def test_varlen_alibi_per_head_slopes_are_a_row_per_sequence_repeated(backend, device):
    """(Hq,) slopes are the (sequences, Hq) slopes of equal rows; distinct rows give each sequence its own."""
    lengths = (7, 0, 12)
    gen = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(sum(lengths), 2, 16, generator=gen).to(device) for _ in range(3))
    cu = _offsets(lengths, device)
    slopes = torch.tensor([0.5, 0.125], device=device)

    def run(alibi):
        with fusedattn.use_backend(backend):
            return fusedattn.varlen_attention(q, k, v, cu, cu, 12, 12, causal=True, alibi_slopes=alibi)

    torch.testing.assert_close(run(slopes), run(slopes.expand(3, 2).clone()), atol=0, rtol=0)
    rows = torch.stack([slopes, slopes, 4 * slopes])  # the last sequence's slopes differ
    mixed, same = run(rows), run(slopes)
    torch.testing.assert_close(mixed[:7], same[:7], atol=0, rtol=0)
    assert (mixed[7:] - same[7:]).abs().max() > 1e-2


@pytest.mark.parametrize("backend,device", [("triton", TRITON_DEVICE), ("torch", "cpu")], ids=["triton", "torch"])
def test_varlen_alibi_slopes_get_no_gradient(backend, device):
    lengths = (5, 9)
    gen = torch.Generator().manual_seed(4)
    q, k, v = (torch.randn(sum(lengths), 2, 16, generator=gen).to(device).requires_grad_() for _ in range(3))
    slopes = torch.rand(2, 2, generator=gen).to(device).requires_grad_()
    cu = _offsets(lengths, device)
    with fusedattn.use_backend(backend):
        out = fusedattn.varlen_attention(q, k, v, cu, cu, 9, 9, alibi_slopes=slopes)
    out.sum().backward()
    assert slopes.grad is None and q.grad is not None


def test_varlen_keys_of_a_sequence_without_queries_get_zero_gradients():
    """Keys whose sequence has no query row contribute nothing: dk, dv exactly 0 there (the
    kernels store them, never leave them unwritten)."""
    case = VarlenCase((9, 0, 20), (12, 17, 5), causal=True)
    q, k, v, dout, _, _ = make_inputs(case, TRITON_DEVICE)
    cu_q, cu_k = _offsets(case.lengths_q, TRITON_DEVICE), _offsets(case.keys, TRITON_DEVICE)
    k_, v_ = k.clone().requires_grad_(), v.clone().requires_grad_()
    with fusedattn.use_backend("triton"):
        out = fusedattn.varlen_attention(q, k_, v_, cu_q, cu_k, 20, 17, causal=True)
    dk, dv = torch.autograd.grad(out, (k_, v_), dout)
    assert torch.all(dk[12:29] == 0) and torch.all(dv[12:29] == 0)
    assert dk[:12].abs().sum() > 0 and dk[29:].abs().sum() > 0


@pytest.mark.skipif(not ON_GPU, reason="the maps' device copies: a GPU")
def test_varlen_maps_kept_across_calls_are_not_used_under_graph_capture(monkeypatch):
    """The maps of the blocks that exist are kept across calls by their lengths
    (kernels/packed_tiles.py), but not while a CUDA graph is being captured: the graph would go on
    reading a kept map's memory after it left the cache and was reused. With capture reported, a
    call for lengths whose maps are kept must neither read nor add to them, and make the same maps."""
    from fusedattn.kernels.shared import packed_tiles
    from fusedattn.spec import Packing, resolve_spec

    lengths = (300, 17, 1000)
    offsets = tuple(int(x) for x in _offsets(lengths, "cpu").tolist())
    spec = resolve_spec(64, layout="bshd", causal=True, window=None, scale=None, softcap=None, deterministic=False)
    device = torch.device("cuda", torch.cuda.current_device())

    def packing():
        cu = _offsets(lengths, "cuda")
        return Packing(cu, cu, max(lengths), max(lengths), offsets, offsets)

    kept_maps = packed_tiles.prepare(packing(), spec, device, query_block=128, key_block=128)
    kept = dict(packed_tiles._shared)

    class Watched(dict):
        touched = 0

        def get(self, *args):
            Watched.touched += 1
            return super().get(*args)

        def __setitem__(self, key, value):
            Watched.touched += 1
            super().__setitem__(key, value)

    monkeypatch.setattr(packed_tiles, "_shared", Watched(kept))
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: True)
    made = packed_tiles.prepare(packing(), spec, device, query_block=128, key_block=128)
    assert Watched.touched == 0
    assert all(m is not k and torch.equal(m, k) for m, k in zip(made, kept_maps))


@pytest.mark.skipif(not ON_GPU, reason="compiles only on a GPU")
def test_varlen_new_lengths_compile_nothing_new():
    """A new set of lengths (and a new longest one, in the same length class: configs.SHORT_KEYS)
    reuses the compiled kernels."""
    from fusedattn.kernels.triton import bwd
    from fusedattn.kernels.triton import fwd

    kernels = (fwd._forward_kernel, bwd._preprocess_kernel, bwd._backward_kernel)
    if torch.cuda.get_device_capability()[0] == 9:  # the Gluon kernels run the packed problem there
        from fusedattn.kernels.gluon import bwd as hopper_bwd
        from fusedattn.kernels.gluon import fwd as hopper_fwd

        kernels += (hopper_fwd._attn_fwd_ws_kernel, hopper_bwd._dkdv_ws_kernel)

    def compiled() -> set:
        return {(kernel.fn.__name__, key) for kernel in kernels
                for key in kernel.device_caches[torch.cuda.current_device()][0]}

    def step(lengths):
        gen = torch.Generator(device="cuda").manual_seed(len(lengths))
        total = sum(lengths)
        q, k, v = (torch.randn(total, 4, 64, device="cuda", dtype=torch.bfloat16, generator=gen).requires_grad_()
                   for _ in range(3))
        cu = _offsets(lengths, "cuda")
        fusedattn.varlen_attention(q, k, v, cu, cu, max(lengths), max(lengths), causal=True).sum().backward()

    step([300, 17, 1000])
    before = compiled()
    step([5, 2000, 0, 77, 640])
    step([33])
    new = compiled() - before
    assert not new, "compiled again: " + "; ".join(
        f"{name}: {key} (before: {[k for n, k in before if n == name]})" for name, key in new)


def _bad_call(**changes):
    q = torch.randn(10, 2, 16)
    args = dict(q=q, k=q.clone(), v=q.clone(), cu_seqlens_q=torch.tensor([0, 4, 10], dtype=torch.int32),
                cu_seqlens_k=torch.tensor([0, 4, 10], dtype=torch.int32), max_seqlen_q=6, max_seqlen_k=6)
    args.update(changes)
    return lambda: fusedattn.varlen_attention(**args)


@pytest.mark.parametrize("changes, error, match", [
    (dict(cu_seqlens_q=torch.tensor([0, 4, 10])), TypeError, "`cu_seqlens_q` must be int32"),
    (dict(cu_seqlens_k=[0, 4, 10]), TypeError, "`cu_seqlens_k` must be an int32 torch.Tensor"),
    (dict(cu_seqlens_q=torch.tensor([0, 7, 4, 10], dtype=torch.int32)), ValueError, "entries"),
    (dict(cu_seqlens_q=torch.tensor([0, 7, 4], dtype=torch.int32), max_seqlen_q=7), ValueError, "never decrease"),
    (dict(cu_seqlens_k=torch.tensor([1, 4, 10], dtype=torch.int32)), ValueError, "start at 0"),
    (dict(cu_seqlens_k=torch.tensor([0, 4, 9], dtype=torch.int32)), ValueError, "ends at 9 but the packed tensor has 10"),
    (dict(max_seqlen_q=5), ValueError, "`max_seqlen_q` is 5 but a sequence has 6 tokens"),
    (dict(max_seqlen_k=-1), TypeError, "`max_seqlen_k` must be an int >= 0"),
    (dict(cu_seqlens_q=torch.tensor([[0, 4, 10]], dtype=torch.int32)), ValueError, "must be 1-D"),
    (dict(q=torch.randn(1, 10, 2, 16)), ValueError, "`q` must be 3-D"),
    (dict(v=torch.randn(9, 2, 16)), ValueError, "`k` has 10 keys but `v` has 9"),
    (dict(q=torch.randn(10, 3, 16)), ValueError, r"multiple of k/v heads"),
    (dict(alibi_slopes=torch.ones(2, dtype=torch.float16)), TypeError, "`alibi_slopes` must be float32"),
    (dict(alibi_slopes=torch.ones(3, 2)), ValueError, r"\(sequences, Hq\) = \(2, 2\), got \(3, 2\)"),
    (dict(alibi_slopes=torch.ones(3)), ValueError, r"`alibi_slopes` must have shape \(Hq,\) = \(2,\)"),
    (dict(alibi_slopes=[0.5, 0.25]), TypeError, "`alibi_slopes` must be a torch.Tensor"),
    (dict(chunk=0), ValueError, r"varlen_attention: `chunk` must be >= 1"),
    (dict(chunk=2.0), TypeError, r"varlen_attention: `chunk` must be an int >= 1 or None"),
])
def test_varlen_bad_input_is_a_clear_error(changes, error, match):
    with pytest.raises(error, match=match):
        _bad_call(**changes)()


@pytest.mark.parametrize("backend,device", [("triton", TRITON_DEVICE), ("torch", "cpu")], ids=["triton", "torch"])
@pytest.mark.parametrize("lengths_q,lengths_k,max_q", [((0,), (5,), 0), ((0, 0), (4, 9), 3), ((3, 4), (0, 0), 4)],
                         ids=["one-empty", "all-queries-empty-max-3", "no-keys"])
def test_varlen_with_no_query_or_no_key_takes_part_in_autograd(backend, device, lengths_q, lengths_k, max_q):
    """An empty problem (no query anywhere, or no key anywhere, whatever ``max_seqlen`` says) is a result,
    not a crash: outputs of the right shape that take part in autograd, zero gradients (rows without a
    key: output 0, lse -inf, or the sink)."""
    gen = torch.Generator().manual_seed(1)
    q = torch.randn(sum(lengths_q), 4, 32, generator=gen).to(device, torch.float16).requires_grad_()
    k, v = (torch.randn(sum(lengths_k), 2, 32, generator=gen).to(device, torch.float16).requires_grad_()
            for _ in range(2))
    sinks = torch.randn(4, generator=gen).to(device).requires_grad_()
    cu_q, cu_k = _offsets(lengths_q, device), _offsets(lengths_k, device)
    with fusedattn.use_backend(backend):
        out, lse = fusedattn.varlen_attention(q, k, v, cu_q, cu_k, max_q, max(lengths_k), sinks=sinks,
                                              return_lse=True)
    assert out.shape == (sum(lengths_q), 4, 32) and lse.shape == (4, sum(lengths_q))
    assert out.grad_fn is not None and lse.grad_fn is not None
    (out.float().sum() + lse.sum()).backward()
    for name, t in (("q", q), ("k", k), ("v", v)):
        assert t.grad is not None and t.grad.shape == t.shape and torch.all(t.grad == 0), name
    # rows that see no key: output 0 and lse = the sink, so d(sum lse) / d sink[h] counts the rows
    assert torch.all(out == 0) and torch.equal(lse, sinks.detach()[:, None].expand_as(lse))
    assert torch.equal(sinks.grad, torch.full_like(sinks, float(q.shape[0])))


def _packed_inputs(device, dtype, lengths_q=(5, 0, 19, 8), lengths_k=(7, 3, 17, 8), heads=(4, 2), d=16, seed=11):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(sum(lengths_q), heads[0], d, generator=gen).to(device, dtype)
    k, v = (torch.randn(sum(lengths_k), heads[1], d, generator=gen).to(device, dtype) for _ in range(2))
    dout = torch.randn(sum(lengths_q), heads[0], d, generator=gen).to(device, dtype)
    sinks = torch.randn(heads[0], generator=gen).to(device)
    return q, k, v, dout, sinks, _offsets(lengths_q, device), _offsets(lengths_k, device)


def _per_sequence_reference(q, k, v, cu_q, cu_k, sinks, **options):
    outs, lses = [], []
    bounds_q, bounds_k = cu_q.tolist(), cu_k.tolist()
    for (q0, q1), (k0, k1) in zip(zip(bounds_q, bounds_q[1:]), zip(bounds_k, bounds_k[1:])):
        out, lse = reference_attention(q[None, q0:q1], k[None, k0:k1], v[None, k0:k1], sinks=sinks, return_lse=True,
                                       **options)
        outs.append(out[0])
        lses.append(lse[0])
    return torch.cat(outs), torch.cat(lses, dim=1)


def _check_against_reference(run, device, dtype, label):
    q, k, v, dout, sinks, cu_q, cu_k = _packed_inputs(device, dtype)

    def ours(q_, k_, v_, sinks_=None):
        return run(q_, k_, v_, cu_q, cu_k, sinks_)

    def reference(q_, k_, v_, sinks_=None):
        return _per_sequence_reference(q_, k_, v_, cu_q, cu_k, sinks_, causal=True, softcap=8.0)

    dlse = torch.randn(4, q.shape[0], generator=torch.Generator().manual_seed(3)).to(device)
    extras = dict(lse_grad=True, sinks=sinks)
    got = forward_backward(ours, q, k, v, dout, dlse, **extras)
    lowp = forward_backward(reference, q, k, v, dout, dlse, **extras)
    ref64 = forward_backward(reference, q, k, v, dout, dlse, dtype=torch.float64, **extras)
    for name, a, b, c in zip(["out", "lse", "dq", "dk", "dv", "dsinks"], got, lowp, ref64):
        assert_close_to_reference(f"{label} {name}", a, b, c)


@pytest.mark.parametrize("backend,device", [("triton", TRITON_DEVICE), ("torch", "cpu")], ids=["triton", "torch"])
def test_varlen_compiles_without_graph_breaks(backend, device):
    """torch.compile(fullgraph=True) traces varlen_attention (the offsets are read inside its custom ops,
    where the compiler does not trace); forward and backward match the per-sequence reference."""
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    torch._dynamo.reset()

    def run(q_, k_, v_, cu_q, cu_k, sinks_):
        with fusedattn.use_backend(backend):
            return fusedattn.varlen_attention(q_, k_, v_, cu_q, cu_k, 19, 17, causal=True, softcap=8.0, sinks=sinks_,
                                              return_lse=True)

    compiled = torch.compile(run, fullgraph=True, backend="aot_eager" if device == "cpu" else "inductor")
    _check_against_reference(compiled, device, dtype, f"compiled {backend}")


def test_varlen_offsets_checked_on_the_device_match_reference(monkeypatch):
    """Where the host cannot read the offsets (CUDA-graph capture; forced here) they are checked by device
    ops and the kernels read clamped copies: valid offsets give the same results."""
    from fusedattn import varlen

    monkeypatch.setattr(varlen, "_unreadable", lambda offsets: True)
    dtype = torch.bfloat16 if ON_GPU else torch.float32

    def run(q_, k_, v_, cu_q, cu_k, sinks_):
        with fusedattn.use_backend("triton"):
            return fusedattn.varlen_attention(q_, k_, v_, cu_q, cu_k, 19, 17, causal=True, softcap=8.0, sinks=sinks_,
                                              return_lse=True)

    _check_against_reference(run, TRITON_DEVICE, dtype, "device-checked")


BAD_OFFSETS = [
    ("ends past the tokens", (0, 5, 5, 24, 40), (0, 7, 10, 27, 35)),
    ("decreasing", (0, 5, 3, 24, 32), (0, 7, 10, 27, 35)),
    ("longer than max_seqlen_q", (0, 1, 1, 31, 32), (0, 7, 10, 27, 35)),
    ("not starting at 0", (0, 5, 5, 24, 32), (2, 7, 10, 27, 35)),
    ("negative", (0, -9, 5, 24, 32), (0, 7, 10, 27, 35)),
]


@pytest.mark.parametrize("label,offsets_q,offsets_k", BAD_OFFSETS, ids=[b[0] for b in BAD_OFFSETS])
def test_bad_offsets_checked_on_the_device_give_nan_not_a_bad_access(label, offsets_q, offsets_k, monkeypatch):
    """Bad offsets the host cannot read: every output and gradient is NaN, and nothing is read or
    written outside the tensors (the kernels read the clamped offsets)."""
    from fusedattn import varlen

    monkeypatch.setattr(varlen, "_unreadable", lambda offsets: True)
    q, k, v, dout, sinks, _, _ = _packed_inputs(TRITON_DEVICE, torch.float32 if not ON_GPU else torch.bfloat16)
    cu_q, cu_k = (torch.tensor(o, dtype=torch.int32, device=TRITON_DEVICE) for o in (offsets_q, offsets_k))
    leaves = [t.clone().requires_grad_() for t in (q, k, v, sinks)]
    with fusedattn.use_backend("triton"):
        out, lse = fusedattn.varlen_attention(*leaves[:3], cu_q, cu_k, 19, 17, causal=True, sinks=leaves[3],
                                              return_lse=True)
    grads = torch.autograd.grad((out, lse), leaves, (dout, torch.ones_like(lse)))
    for name, t in zip(["out", "lse", "dq", "dk", "dv", "dsinks"], (out, lse, *grads)):
        assert torch.isnan(t).all(), f"{label}: {name} is not NaN throughout"


@pytest.mark.parametrize("backend,device", [("triton", TRITON_DEVICE), ("torch", "cpu")], ids=["triton", "torch"])
def test_varlen_alibi_compiles_and_differentiates_twice(backend, device):
    """ALiBi slopes through torch.compile(fullgraph=True) (the custom ops carry them) give eager's
    values, and a backward with create_graph (each sequence by plain torch ops) the float64
    reference's second derivatives."""
    case = VarlenCase((6, 0, 11), (9, 3, 11), heads_q=4, heads_kv=2, head_dim=16, causal=True, softcap=8.0,
                      dtype=torch.float32, alibi="sequences")
    q, k, v, dout, _, _ = make_inputs(case, device)
    slopes = make_slopes(case, device)
    cu_q, cu_k = _offsets(case.lengths_q, device), _offsets(case.keys, device)

    def run(q_, k_, v_):
        with fusedattn.use_backend(backend):
            return fusedattn.varlen_attention(q_, k_, v_, cu_q, cu_k, 11, 11, causal=True, softcap=8.0,
                                              alibi_slopes=slopes, return_lse=True)

    check_compiled_and_second_derivatives(run, lambda *t: reference_loop(*t, case, None, slopes), q, k, v, dout,
                                          device)
