"""Semantics beyond the case grid: strided inputs, rows with no key, reproducibility,
empty sequences. Each runs on both backends (Triton: GPU, or the interpreter on CPU)."""

import zlib
from dataclasses import replace

import pytest
import torch

import fusedattn
from attention_runner import check_case, forward_backward, make_bias, make_inputs, make_mask, set_knobs
from cases import Case

ON_GPU = torch.cuda.is_available()
BACKENDS = [("triton", "cuda" if ON_GPU else "cpu"), ("torch", "cpu")]
BACKEND_IDS = [b for b, _ in BACKENDS]


def _dtype(device):
    return torch.bfloat16 if device == "cuda" else torch.float16


@pytest.mark.parametrize("backend,device", BACKENDS, ids=BACKEND_IDS)
def test_fused_qkv_views_and_strided_grad_are_honoured(backend, device):
    """q, k, v as views of one (B, S, 3, H, D) projection; dout with a transposed layout."""
    case = Case(batch=2, heads_q=3, heads_kv=3, seqlen_q=37, seqlen_k=37, head_dim=40, causal=True, dtype=_dtype(device))
    qkv = torch.randn(2, 37, 3, 3, 40, device=device).to(case.dtype)
    q, k, v = qkv.unbind(dim=2)
    assert not q.is_contiguous()
    dout = torch.randn(2, 3, 37, 40, device=device).to(case.dtype).transpose(1, 2)  # bshd view of bhsd storage
    dlse = torch.randn(2, 3, 37, device=device)
    check_case(case, backend, device, inputs=(q, k, v, dout, dlse))


@pytest.mark.parametrize("backend,device", BACKENDS, ids=BACKEND_IDS)
@pytest.mark.parametrize("layout", ["bshd", "bhsd"])
def test_overlapping_views_get_their_gradients(backend, device, layout):
    """q, k, v as overlapping windows of one buffer (batch stride 0, sequence stride 1: each row the
    previous one shifted by an element), the head dim at unit stride. torch.empty_like would give
    their gradients a permuted layout with a non-unit head-dim stride; every path must still return
    them right (through autograd into the shared buffer)."""
    gen = torch.Generator().manual_seed(4)
    base = torch.randn(200, generator=gen, dtype=torch.float64)
    dims = {"bshd": ((1, 9, 2, 16), (0, 1, 16, 1)), "bhsd": ((1, 2, 9, 16), (0, 16, 1, 1))}[layout]
    kv_dims = {"bshd": ((1, 11, 2, 16), (0, 2, 40, 1)), "bhsd": ((1, 2, 11, 16), (0, 40, 2, 1))}[layout]

    def run(fn, dtype):
        leaf = base.to(device, dtype).requires_grad_()
        q = leaf.as_strided(*dims)
        k, v = leaf.as_strided(*kv_dims, 3), leaf.as_strided(*kv_dims, 7)
        out = fn(q, k, v, layout=layout, causal=True)
        return out, *torch.autograd.grad(out.float().square().sum(), leaf)

    def ours(*args, **kwargs):
        with fusedattn.use_backend(backend):
            return fusedattn.attention(*args, **kwargs)

    from fusedattn.reference import reference_attention
    from numerics import assert_close_to_reference

    dtype = _dtype(device)
    for name, a, b, c in zip(["out", "d buffer"], run(ours, dtype), run(reference_attention, dtype),
                             run(reference_attention, torch.float64)):
        assert_close_to_reference(name, a, b, c)


@pytest.mark.parametrize("backend,device", BACKENDS, ids=BACKEND_IDS)
def test_bhsd_transposed_views_and_non_unit_head_stride(backend, device):
    case = Case(heads_q=4, heads_kv=2, seqlen_q=29, seqlen_k=45, head_dim=24, layout="bhsd", window=(8, 8),
                dtype=_dtype(device))
    q = torch.randn(1, 29, 4, 24, device=device).to(case.dtype).transpose(1, 2)  # bhsd view of bshd storage
    k = torch.randn(1, 2, 45, 48, device=device).to(case.dtype)[..., ::2]  # head dim stride 2: copied once
    v = torch.randn(1, 45, 2, 24, device=device).to(case.dtype).transpose(1, 2)
    dout = torch.randn(1, 4, 29, 24, device=device).to(case.dtype)
    check_case(case, backend, device, inputs=(q, k, v, dout, torch.randn(1, 4, 29, device=device)))


@pytest.mark.parametrize("backend,device", BACKENDS, ids=BACKEND_IDS)
@pytest.mark.parametrize("seqlen_q,seqlen_k,options", [
    (40, 17, dict(causal=True)),  # bottom-right: the first 23 queries see no key
    (33, 33, dict(window=(0, 0))),  # diagonal only: every row keeps exactly one key
    (50, 20, dict(window=(2, 1))),  # rows far above the shifted diagonal see nothing
], ids=["causal-sq>sk", "diagonal", "window-sq>sk"])
def test_rows_with_no_key_give_zero_output_minus_inf_lse_and_zero_grads(backend, device, seqlen_q, seqlen_k, options):
    case = Case(heads_q=2, heads_kv=1, seqlen_q=seqlen_q, seqlen_k=seqlen_k, dtype=_dtype(device), **options)
    q, k, v, dout, dlse = make_inputs(case, device)
    with fusedattn.use_backend(backend):
        out, lse, dq, dk, dv = forward_backward(
            lambda a, b, c: fusedattn.attention(a, b, c, return_lse=True, **case.options()),
            q, k, v, dout, dlse, lse_grad=True)
    for name, t in (("out", out), ("lse", lse), ("dq", dq), ("dk", dk), ("dv", dv)):
        assert not torch.isnan(t).any(), f"NaN in {name}"
    diag = seqlen_k - seqlen_q
    left, right = case.window if case.window else (-1, 0)
    rows = torch.arange(seqlen_q)
    lo = (rows + diag - left).clamp(min=0) if left >= 0 else torch.zeros_like(rows)
    hi = (rows + diag + right).clamp(max=seqlen_k - 1)
    empty = (hi < lo).to(device)
    if options.get("window") == (0, 0):
        assert not empty.any()
    else:
        assert empty.any(), "the case must contain rows with no key"
    assert torch.equal(out[:, empty], torch.zeros_like(out[:, empty]))
    assert torch.isneginf(lse[:, :, empty]).all() and torch.isfinite(lse[:, :, ~empty]).all()
    assert torch.equal(dq[:, empty], torch.zeros_like(dq[:, empty]))
    check_case(case, backend, device, inputs=(q, k, v, dout, dlse))


@pytest.mark.parametrize("backend,device", BACKENDS, ids=BACKEND_IDS)
@pytest.mark.parametrize("case", [
    Case(batch=2, heads_q=4, heads_kv=2, seqlen_q=77, seqlen_k=93, head_dim=64, causal=True),
    Case(batch=1, heads_q=4, heads_kv=1, seqlen_q=65, seqlen_k=65, head_dim=40, window=(9, 9), softcap=4.0),
    Case(batch=3, heads_q=4, heads_kv=2, seqlen_q=77, seqlen_k=93, head_dim=64, causal=True, bias="heads"),
    Case(batch=2, heads_q=4, heads_kv=2, seqlen_q=77, seqlen_k=93, head_dim=64, bias="full"),
    Case(batch=2, heads_q=4, heads_kv=2, seqlen_q=77, seqlen_k=93, head_dim=64, causal=True, mask="full",
         mask_cells=16),
], ids=lambda c: c.id)
def test_repeated_calls_are_bitwise_identical(backend, device, case):
    """Forward, dK/dV and a full-shape bias's gradient are always reproducible -- except dK/dV of
    causal GQA, which the Hopper pass may sum over each group by fp32 reduce-adds; with
    deterministic=True dQ, those dK/dV and a broadcast bias's gradient are too. A result that
    changes between runs on the same input would be a race."""
    case = replace(case, dtype=_dtype(device))
    q, k, v, dout, dlse = make_inputs(case, device)
    bias, mask = make_bias(case, device), make_mask(case, device)
    for deterministic in (True, False):
        runs = []
        for _ in range(2):
            with fusedattn.use_backend(backend):
                runs.append(forward_backward(
                    lambda a, b, c, bias_=None: fusedattn.attention(
                        a, b, c, bias=bias_, mask=mask, return_lse=True, deterministic=deterministic,
                        **case.options()),
                    q, k, v, dout, dlse, bias=bias))
        names = ("out", "lse", "dq", "dk", "dv", "dbias")
        for name, first, second in zip(names, *runs):
            group_sums = case.heads_kv < case.heads_q and case.causal and not (case.bias or case.mask)
            summed_by_atomics = (name == "dq" or (name == "dbias" and case.bias != "full")
                                 or (name in ("dk", "dv") and group_sums))
            if summed_by_atomics and not deterministic:
                continue  # fp32 atomics: reproducible only up to summation order
            assert torch.equal(first, second), f"{name} differs between runs (deterministic={deterministic})"


@pytest.mark.parametrize("deterministic", [True, False])
def test_tiles_a_mask_empties_are_never_read(deterministic):
    """Keys a mask hides from every query, in whole tiles, are read by no pass of the kernels (the
    forward, dK/dV, dQ and, with deterministic=True and a broadcast bias, the bias-gradient pass):
    NaN there leaves every result as it is with those keys zeroed (their own dK, dV: 0)."""
    device = "cuda" if ON_GPU else "cpu"
    case = Case(batch=2, heads_q=4, heads_kv=2, seqlen_q=70, seqlen_k=320, head_dim=32, causal=False,
                dtype=_dtype(device))
    q, k, v, dout, dlse = make_inputs(case, device)
    hidden = slice(128, 256)  # whole tiles at every tile width the kernels use (16 to 128 keys)
    mask = torch.ones(case.seqlen_q, case.seqlen_k, dtype=torch.bool, device=device)
    mask[:, hidden] = False
    mask[5, 300] = False  # and a partial tile elsewhere
    bias = torch.randn(1, case.heads_q, case.seqlen_q, case.seqlen_k, device=device)  # summed over the batch

    def run(k_, v_):
        with fusedattn.use_backend("triton"):
            return forward_backward(
                lambda a, b, c, bias_=None: fusedattn.attention(a, b, c, bias=bias_, mask=mask, return_lse=True,
                                                               deterministic=deterministic),
                q, k_, v_, dout, dlse, bias=bias)

    def with_hidden(value):
        k_, v_ = k.clone(), v.clone()
        k_[:, hidden], v_[:, hidden] = value, value
        return k_, v_

    names = ("out", "lse", "dq", "dk", "dv", "dbias")
    zeroed, poisoned = run(*with_hidden(0.0)), run(*with_hidden(float("nan")))
    for name, a, b in zip(names, zeroed, poisoned):
        assert torch.isfinite(b).all(), f"{name}: a hidden key was read"
        if deterministic or name not in ("dq", "dbias"):  # fp32 atomics sum in no fixed order otherwise
            assert torch.equal(a, b), name


@pytest.mark.parametrize("backend,device", BACKENDS, ids=BACKEND_IDS)
def test_calls_with_nothing_to_differentiate_build_no_graph_and_give_the_same_bits(backend, device):
    """No input requires grad, or grad mode is off: the forward runs without an autograd node
    (less host time), with the bits the differentiable call gives."""
    case = Case(batch=2, heads_q=4, heads_kv=2, seqlen_q=37, seqlen_k=45, head_dim=32, causal=True,
                softcap=8.0, dtype=_dtype(device))
    q, k, v = make_inputs(case, device)[:3]
    sinks = torch.randn(case.heads_q, device=device)
    with fusedattn.use_backend(backend):
        def call(*qkv, sinks_=sinks):
            return fusedattn.attention(*qkv, sinks=sinks_, return_lse=True, **case.options())
        plain = call(q, k, v)
        with torch.no_grad():
            no_grad = call(*(t.detach().requires_grad_() for t in (q, k, v)), sinks_=sinks.requires_grad_())
        tracked = call(q, k, v.detach().requires_grad_())
    assert all(t.grad_fn is None for t in (*plain, *no_grad)) and tracked[0].grad_fn is not None
    for name, a, b, c in zip(("out", "lse"), plain, no_grad, tracked):
        assert torch.equal(a, b) and torch.equal(a, c.detach()), name


@pytest.mark.parametrize("backend,device", BACKENDS, ids=BACKEND_IDS)
@pytest.mark.parametrize("batch,seqlen_q,seqlen_k", [(2, 0, 5), (2, 5, 0), (0, 5, 5)])
def test_empty_sequences(backend, device, batch, seqlen_q, seqlen_k):
    """Sq = 0 gives an empty output; Sk = 0 leaves every row without a key (out 0, lse -inf)."""
    q = torch.randn(batch, seqlen_q, 2, 16, device=device, requires_grad=True)
    k = torch.randn(batch, seqlen_k, 2, 16, device=device, requires_grad=True)
    v = torch.randn(batch, seqlen_k, 2, 16, device=device, requires_grad=True)
    with fusedattn.use_backend(backend):
        out, lse = fusedattn.attention(q, k, v, return_lse=True)
        (out.sum() + torch.where(torch.isinf(lse), 0.0, lse).sum()).backward()
    assert out.shape == (batch, seqlen_q, 2, 16) and lse.shape == (batch, 2, seqlen_q)
    assert torch.equal(out, torch.zeros_like(out)) and torch.isneginf(lse).all()
    for t in (q, k, v):
        assert torch.equal(t.grad, torch.zeros_like(t))


@pytest.mark.parametrize("backend,device", BACKENDS, ids=BACKEND_IDS)
@pytest.mark.parametrize("batch,seqlen_q,seqlen_k", [(2, 0, 5), (2, 5, 0), (0, 5, 5)])
def test_empty_sequences_with_sinks(backend, device, batch, seqlen_q, seqlen_k):
    """With sinks, a row without a key has out 0 and lse = its head's sink (SPEC 3.5): the sinks'
    gradient is then the lse gradient summed over the rows (no kernel runs), and 0 without rows."""
    q = torch.randn(batch, seqlen_q, 2, 16, device=device, requires_grad=True)
    k = torch.randn(batch, seqlen_k, 2, 16, device=device, requires_grad=True)
    v = torch.randn(batch, seqlen_k, 2, 16, device=device, requires_grad=True)
    sinks = torch.randn(2, device=device, requires_grad=True)
    lse_weights = torch.randn(batch, 2, seqlen_q, device=device)
    with fusedattn.use_backend(backend):
        out, lse = fusedattn.attention(q, k, v, sinks=sinks, return_lse=True)
        (out.sum() + (lse * lse_weights).sum()).backward()
    assert torch.equal(out, torch.zeros_like(out))
    if seqlen_k == 0:
        assert torch.equal(lse, sinks.detach().view(1, 2, 1).expand_as(lse))
    torch.testing.assert_close(sinks.grad, lse_weights.sum((0, 2)) if seqlen_k == 0 else torch.zeros_like(sinks))


SCHEDULES = {
    # name: the AttentionConfigs fields that select a backward schedule
    "dq-pass-split": dict(atomic_dq=False, fuse_dq_pass=False),
    "dq-pass-fused": dict(atomic_dq=False, fuse_dq_pass=True),
    "dq-atomics": dict(atomic_dq=True, dq_tma=False),
    "dq-tma-reduce": dict(atomic_dq=True, dq_tma=True),  # Hopper only: the interpreter has no TMA
}


HOPPER = ON_GPU and torch.cuda.get_device_capability()[0] >= 9
SCHEDULE_PARAMS = [
    pytest.param(name, marks=pytest.mark.skipif(name == "dq-tma-reduce" and not HOPPER,
                                                reason="TMA reduce-add needs a Hopper (or newer) GPU"))
    for name in SCHEDULES
]


def _with_loads(configs, tma_loads: bool):
    """Every kernel's inner-loop tiles through TMA descriptors, or through pointers."""
    return replace(configs, **{name: replace(getattr(configs, name), tma_loads=tma_loads)
                               for name in ("forward", "dkdv", "dq")})


@pytest.mark.parametrize("loads", ["pointer-loads", "tma-loads"])
@pytest.mark.parametrize("schedule", SCHEDULE_PARAMS, ids=list(SCHEDULES))
@pytest.mark.parametrize("case", [
    Case(batch=2, heads_q=4, heads_kv=2, seqlen_q=77, seqlen_k=93, head_dim=40, causal=True, lse_grad=True),
    Case(batch=1, heads_q=3, heads_kv=1, seqlen_q=129, seqlen_k=65, head_dim=64, window=(20, 7), softcap=8.0,
         layout="bhsd"),
], ids=lambda c: c.id)
def test_every_backward_schedule_matches_reference(schedule, loads, case):
    """The heuristic picks one dQ schedule and one way of loading tiles per head dim; each must
    stay correct on its own (the interpreter runs TMA descriptor loads too)."""
    from fusedattn.tuning.configs import pinned_configs, select_configs

    device = "cuda" if ON_GPU else "cpu"
    case = replace(case, dtype=_dtype(device))
    base = select_configs(torch.device(device), case.dtype, case.head_dim, case.dv)
    with pinned_configs(_with_loads(replace(base, **SCHEDULES[schedule]), loads == "tma-loads")):
        check_case(case, "triton", device)


@pytest.mark.parametrize("layout", ["bshd", "bhsd"])
def test_tma_loads_fall_back_to_pointers_where_tma_cannot_address(layout):
    """TMA needs 16-byte aligned bases and strides: a view one element into its storage, and a
    head dim of 12 (24-byte rows), must still give the right answer with TMA loads switched on."""
    from fusedattn.kernels.triton.memory import block_descriptor
    from fusedattn.tuning.configs import pinned_configs, select_configs

    device = "cuda" if ON_GPU else "cpu"
    dtype = _dtype(device)
    case = Case(batch=1, heads_q=2, heads_kv=2, seqlen_q=33, seqlen_k=47, head_dim=16, layout=layout, causal=True,
                dtype=dtype)
    shape = (1, 33, 2, 16) if layout == "bshd" else (1, 2, 33, 16)
    q = torch.randn(shape[0] * 33 * 2 * 16 + 1, device=device).to(dtype)[1:].view(shape)  # base off by 2 bytes
    kv_shape = (1, 47, 2, 16) if layout == "bshd" else (1, 2, 47, 16)
    k, v = (torch.randn(kv_shape, device=device).to(dtype) for _ in range(2))
    dout = torch.randn(shape, device=device).to(dtype)
    assert block_descriptor(q if layout == "bhsd" else q.transpose(1, 2), 16, 16) is None
    assert block_descriptor(k if layout == "bhsd" else k.transpose(1, 2), 16, 16) is not None
    base = select_configs(torch.device(device), dtype, 16, 16)
    with pinned_configs(_with_loads(base, True)):
        check_case(case, "triton", device, inputs=(q, k, v, dout, torch.randn(1, 2, 33, device=device)))
    narrow = Case(heads_q=1, heads_kv=1, seqlen_q=21, seqlen_k=30, head_dim=12, layout=layout, dtype=dtype)
    with pinned_configs(_with_loads(base, True)):
        check_case(narrow, "triton", device)


def _alternating_lengths(device):
    """(Sq, Sk) pairs that want different compiled specialisations: single-block and multi-block
    lengths (tiles are 16 rows under the interpreter, 64-128 on the GPU), length 1 (decoding),
    Sq > Sk and Sq < Sk, and lengths that are / are not multiples of 16."""
    long = 300 if device == "cuda" else 53
    return [(1, 1), (long, 7), (7, long), (1, long), (long, long), (16, 16), (long, 1), (32, 48)]


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_alternating_shapes_in_one_process_match_reference(causal):
    """Kernels compiled for one shape must not be reused wrongly for the next: alternate shapes
    that need different specialisations, each twice in different company, and check every result
    (output, lse, all gradients) against the float64 reference."""
    device = "cuda" if ON_GPU else "cpu"
    lengths = _alternating_lengths(device)
    order = lengths + lengths[::-1]  # every shape is preceded by a different one the second time
    for seqlen_q, seqlen_k in order:
        case = Case(batch=1, heads_q=2, heads_kv=1, seqlen_q=seqlen_q, seqlen_k=seqlen_k, head_dim=32,
                    causal=causal, lse_grad=True, dtype=_dtype(device))
        check_case(case, "triton", device)


def _leaves(q, k, v, storage: str, layout: str):
    """q, k, v (in ``layout``) as leaves stored ``contiguous``, as ``transposed`` views of the other
    layout's contiguous storage (dense, not contiguous), or ``sliced`` out of a wider head dim (not
    dense)."""
    if storage == "transposed":
        return [t.transpose(1, 2).contiguous().transpose(1, 2).requires_grad_() for t in (q, k, v)]
    if storage == "sliced":
        return [torch.cat([t, t], dim=-1)[..., :t.shape[-1]].detach().requires_grad_() for t in (q, k, v)]
    return [t.detach().requires_grad_() for t in (q, k, v)]


@pytest.mark.parametrize("backend,device", BACKENDS, ids=BACKEND_IDS)
@pytest.mark.parametrize("layout", ["bshd", "bhsd"])
@pytest.mark.parametrize("storage", ["contiguous", "transposed", "sliced"])
@pytest.mark.parametrize("deterministic", [False, True], ids=["default", "deterministic"])
def test_gradients_come_back_in_the_inputs_strides(backend, device, layout, storage, deterministic):
    """dq, dk, dv come back in their inputs' strides where those are dense, else contiguous -- what
    the custom op's fake declares (torch.compile plans with it) and what AccumulateGrad takes
    without copying it (a dQ with the (B, H, S, D) accumulator's strides in bshd layout was cloned
    every step, v41; dK, dV contiguous in the layout were cloned for leaves that are transposed
    views, v42) -- and the values match the reference's."""
    case = Case(batch=2, heads_q=4, heads_kv=2, seqlen_q=37, seqlen_k=45, head_dim=32, causal=True, layout=layout,
                deterministic=deterministic, dtype=_dtype(device))
    q, k, v, dout, dlse = make_inputs(case, device)
    leaves = _leaves(q, k, v, storage, layout)
    with fusedattn.use_backend(backend):
        out = fusedattn.attention(*leaves, layout=layout, causal=True, deterministic=deterministic)
        grads = torch.autograd.grad(out, leaves, dout)
    for name, grad, leaf in zip(("dq", "dk", "dv"), grads, leaves):
        expected = torch.empty_like(leaf).stride()
        assert grad.shape == leaf.shape and grad.stride() == expected, (name, grad.stride(), expected)
        if storage == "sliced":
            assert grad.is_contiguous(), name
    check_case(case, backend, device, inputs=(*(t.detach() for t in leaves), dout, dlse))


@pytest.mark.parametrize("deterministic", [False, True], ids=["default", "deterministic"])
def test_one_problem_with_alternating_strides_matches_reference(deterministic):
    """The backward keeps its launches per problem (bwd.BackwardPlan.triton_passes), by the inputs'
    strides: the same shapes alternate between contiguous tensors and views of wider ones (other
    strides, the same kept plan), each checked against the float64 reference."""
    device = "cuda" if ON_GPU else "cpu"
    case = Case(batch=2, heads_q=4, heads_kv=2, seqlen_q=45, seqlen_k=45, head_dim=32, causal=True,
                deterministic=deterministic, dtype=_dtype(device))
    q, k, v, dout, dlse = make_inputs(case, device)

    def wide_views(t):  # (B, S, H, D) inside a (B, S, H, 2D) tensor: row and head strides double
        wide = torch.randn(*t.shape[:-1], 2 * t.shape[-1], device=device).to(t.dtype)
        wide[..., 16:16 + t.shape[-1]] = t
        return wide[..., 16:16 + t.shape[-1]]

    strided = tuple(wide_views(t) for t in (q, k, v))
    assert strided[0].stride() != q.stride()
    for inputs in ((q, k, v), strided, (q, k, v), strided):
        check_case(case, "triton", device, inputs=(*inputs, dout, dlse))


@pytest.mark.parametrize("block_major", [False, True], ids=["head-major", "block-major"])
def test_dkdv_program_order_changes_no_result(block_major, monkeypatch):
    """GQA causal: either order of the dK/dV programs matches the reference, and the gradients are
    bitwise those of the other order (each program sums its own key block; order only schedules)."""
    device = "cuda" if ON_GPU else "cpu"
    case = Case(1, 4, 2, 37, 53, 32, causal=True, dtype=_dtype(device))
    inputs = make_inputs(case, device)
    set_knobs(monkeypatch, dkdv_block_major=block_major)
    check_case(case, "triton", device, inputs=inputs)

    def grads(major):
        set_knobs(monkeypatch, dkdv_block_major=major)
        with fusedattn.use_backend("triton"):
            return forward_backward(lambda *t: fusedattn.attention(*t, causal=True, return_lse=True), *inputs)[2:]

    assert all(torch.equal(a, b) for a, b in zip(grads(block_major), grads(not block_major)))


@pytest.fixture
def poisoned_allocations(monkeypatch):
    """``torch.empty`` and ``torch.empty_like`` filled with NaN (floating dtypes) or -1: a result read
    from memory nothing wrote -- an accumulator nobody zeroed, rows of a gradient no program stored --
    is NaN, not a stale right answer an earlier call left in the same block of the allocator."""
    real_empty, real_empty_like = torch.empty, torch.empty_like

    def poison(t):
        return t.fill_(float("nan")) if t.is_floating_point() else t.fill_(-1)

    monkeypatch.setattr(torch, "empty", lambda *a, **kw: poison(real_empty(*a, **kw)))
    monkeypatch.setattr(torch, "empty_like", lambda *a, **kw: poison(real_empty_like(*a, **kw)))


POISON_CASES = [  # every buffer the passes allocate uninitialised: dQ's fp32 sums (atomics), the row
    # statistics' padding rows, dK/dV of keys no query sees, the bias gradient's unvisited tiles
    Case(batch=2, heads_q=4, heads_kv=2, seqlen_q=77, seqlen_k=45, head_dim=40, causal=True, lse_grad=True),
    Case(batch=1, heads_q=2, heads_kv=1, seqlen_q=45, seqlen_k=77, head_dim=64, window=(9, 3), bias="full",
         deterministic=True, layout="bhsd"),
    Case(batch=2, heads_q=2, heads_kv=2, seqlen_q=33, seqlen_k=47, head_dim=32, sinks=True, softcap=5.0,
         mask="keys"),
]


@pytest.mark.parametrize("case", POISON_CASES, ids=lambda c: c.id)
def test_no_result_reads_memory_nothing_wrote(case, poisoned_allocations):
    device = "cuda" if ON_GPU else "cpu"
    case = replace(case, dtype=_dtype(device))
    if ON_GPU:  # the shapes the Gluon kernels take on Hopper: D=128, several tiles a head
        case = replace(case, head_dim=128, seqlen_q=case.seqlen_q * 5, seqlen_k=case.seqlen_k * 5)
    check_case(case, "triton", device)


def test_softcap_tanh_form_follows_dtype_and_device():
    """The cap's tanh: tanh.approx.f32 for bf16 on the GPU -- the Triton kernels by this flag, the
    Gluon ones by their inputs' dtype (hopper.log2_scores), so that a call mixing the two kinds
    recomputes in its backward the scores its forward normalised --, the exact form for fp16
    (whose rounding is as fine as the approximation's error), fp32 and the CPU interpreter."""
    from fusedattn.kernels.triton.fwd import softcap_mode
    from fusedattn.kernels.triton.softmax import TANH_APPROX
    from fusedattn.spec import resolve_spec

    def spec(softcap):
        return resolve_spec(64, layout="bshd", causal=True, window=None, scale=None, softcap=softcap,
                            deterministic=False)

    gpu, cpu = torch.device("cuda"), torch.device("cpu")
    assert softcap_mode(spec(30.0), torch.bfloat16, gpu) == TANH_APPROX
    assert [softcap_mode(spec(30.0), dtype, gpu) for dtype in (torch.float16, torch.float32)] == [1, 1]
    assert softcap_mode(spec(30.0), torch.bfloat16, cpu) == 1
    assert softcap_mode(spec(None), torch.bfloat16, gpu) == 0


ROW_BIAS_SHAPES = {"B,Hkv,1,1": lambda b, hq, hkv, sq: (b, hkv, 1, 1), "B,1,1,1": lambda b, hq, hkv, sq: (b, 1, 1, 1),
                   "1,Hq,Sq,1": lambda b, hq, hkv, sq: (1, hq, sq, 1), "B,Hq,1,1": lambda b, hq, hkv, sq: (b, hq, 1, 1)}


@pytest.mark.parametrize("backend,device", BACKENDS, ids=BACKEND_IDS)
@pytest.mark.parametrize("shape", list(ROW_BIAS_SHAPES), ids=list(ROW_BIAS_SHAPES))
@pytest.mark.parametrize("sinks", [False, True], ids=["no-sinks", "sinks"])
def test_gradient_of_a_bias_constant_along_the_keys(backend, device, shape, sinks):
    """A bias with one value per row shifts the whole softmax row: the output does not change, and the
    bias's gradient is the lse gradient of the rows with a key plus what the sink takes
    (dout . out * p_sink) -- 0 for a loss on the output alone. Summed from the softmax gradient
    entry by entry it came out as rounding noise (1.5x SPEC 4's bound on large GPU problems); it must
    match the float64 reference within fp32 rounding without sinks and by SPEC 4's rule with them."""
    from fusedattn.reference import reference_attention
    from numerics import assert_close_to_reference

    b, hq, hkv, sq, sk, d = 2, 4, 2, 37, 45, 16
    gen = torch.Generator().manual_seed(zlib.crc32(shape.encode()) % 1000 + sinks)  # hash() differs per process
    dtype = _dtype(device)
    q, k, v, dout = (torch.randn(b, s, h, d, generator=gen) for s, h in ((sq, hq), (sk, hkv), (sk, hkv), (sq, hq)))
    dlse = torch.randn(b, hq, sq, generator=gen)
    bias = torch.randn(ROW_BIAS_SHAPES[shape](b, hq, hkv, sq), generator=gen)
    bias.view(-1)[1] = float("-inf")  # a row (or all of them) masked by the bias itself
    sink_logits = torch.randn(hq, generator=gen) + 1.0 if sinks else None
    mask = torch.rand(sq, sk, generator=gen) < 0.8
    mask[3] = False  # a row with no key

    def grads(fn, dt, with_lse):
        leaves = [t.to(device, dt).requires_grad_() for t in (q, k, v, bias)]
        extra = dict(sinks=sink_logits.to(device, torch.float64 if dt == torch.float64 else torch.float32)) \
            if sinks else {}
        out, lse = fn(*leaves[:3], bias=leaves[3], mask=mask.to(device), causal=True, return_lse=True, **extra)
        outputs, cotangents = [out], [dout.to(device, dt)]
        if with_lse:
            outputs.append(lse)
            cotangents.append(dlse.to(device, lse.dtype))
        return torch.autograd.grad(outputs, leaves[3], cotangents)[0]

    def ours(*args, **kwargs):
        with fusedattn.use_backend(backend):
            return fusedattn.attention(*args, **kwargs)

    def reference(*args, mask=None, **kwargs):
        return reference_attention(*args, mask=mask.reshape(1, 1, *mask.shape), **kwargs)

    for with_lse in (False, True):
        got, ref64 = grads(ours, dtype, with_lse), grads(reference, torch.float64, with_lse)
        if not sinks:  # exact up to fp32 rounding (and the bias dtype's rounding of the result)
            tolerance = 1e-5 + 2.0 ** -8 * ref64.abs().max().item()
            assert (got.double() - ref64).abs().max().item() <= tolerance, (with_lse, got, ref64)
        else:
            assert_close_to_reference(f"dbias lse={with_lse}", got, grads(reference, dtype, with_lse), ref64)
