"""The Gluon forwards of kernels/hopper_fwd.py (sm_90 only): every schedule and key-tile width they
may be launched with (8-warp kernel; warp-specialised kernel, 2 or 3 warpgroups, ping-pong), on odd lengths, causal with Sq > Sk (rows with no key) and Sq < Sk, GQA,
decoding, both layouts, a strided view, a custom scale, softcap, sliding windows, masks of whole tiles
(block-sparse, key padding), a 16-bit bias by elements, causal ALiBi, dropout, sinks, every program order -- output, lse and the gradients of the
backward that consumes its lse, against the float64 reference (SPEC 4). A spy proves each
launch really ran the Gluon kernel; unsupported problems must fall back to the Triton kernel."""

from dataclasses import replace

import pytest
import torch

import fusedattn
from fusedattn import dispatch
from fusedattn.spec import resolve_spec
from fusedattn.tuning.configs import KernelConfig, pinned_configs, select_configs

from attention_runner import check_case, make_bias, make_inputs, make_mask, make_sinks, record_launches, set_knobs
from cases import WHOLE_TILE_MASK_CASES, Case

HOPPER = torch.cuda.is_available() and torch.cuda.get_device_capability()[0] == 9
pytestmark = pytest.mark.skipif(not HOPPER, reason="the Gluon forward runs on sm_90 GPUs only")

CASES = [
    Case(2, 4, 4, 1000, 1000, 128, layout="bhsd", dtype=torch.bfloat16),
    Case(1, 4, 2, 333, 517, 128, causal=True, dtype=torch.bfloat16),
    Case(1, 2, 1, 517, 333, 64, causal=True, layout="bhsd"),  # Sq > Sk: the first rows see no key
    Case(2, 4, 2, 1, 700, 64, dtype=torch.bfloat16),  # decoding
    Case(1, 2, 2, 200, 4000, 128, causal=True, scale=0.3, layout="bhsd", dtype=torch.bfloat16),
    Case(1, 3, 3, 129, 129, 64, causal=True, deterministic=True, lse_grad=True),
    # softcap (hopper.log2_scores): capped before the mask, with causal rows that see no key and GQA
    Case(1, 4, 2, 517, 333, 128, causal=True, softcap=20.0, dtype=torch.bfloat16),
    Case(2, 2, 2, 255, 255, 64, softcap=5.0, lse_grad=True),
    # sliding windows (left edge tiles masked, interior ones not): causal + left, left alone, a
    # window narrower than a tile, Sq > Sk with softcap
    Case(1, 4, 2, 1000, 1000, 128, causal=True, window=(300, 0), dtype=torch.bfloat16),
    Case(1, 2, 2, 517, 700, 64, window=(100, -1), layout="bhsd"),
    Case(2, 2, 1, 333, 333, 128, causal=True, window=(20, 0), lse_grad=True),
    Case(1, 2, 2, 700, 300, 128, causal=True, window=(150, 0), softcap=10.0, dtype=torch.bfloat16),
    # windows many key blocks wide: a 192-row tile's last warpgroup sees its first key block one block
    # after the first warpgroup's (their turns count their own blocks), at both alignments of a tile to
    # the key blocks (1024 keys) and with warpgroups of 5 and 6 blocks in one tile (549)
    Case(1, 2, 2, 1500, 1500, 128, causal=True, window=(1023, 0), dtype=torch.bfloat16),
    Case(1, 2, 1, 1100, 1100, 64, causal=True, window=(548, 0), dtype=torch.float16),
    # windows inside one thread's run of 8 columns (the mask as a bit word a row, common.keep_scores):
    # 4 keys with Sq < Sk, the diagonal alone with Sq > Sk (its first rows see no key), a left window
    # alone whose last keys lie past Sk
    Case(1, 2, 2, 259, 263, 128, causal=True, window=(3, 0), dtype=torch.bfloat16),
    Case(1, 2, 1, 200, 190, 64, causal=True, window=(0, 0)),
    Case(1, 2, 2, 301, 250, 128, window=(6, -1), dtype=torch.float16),
]
# Every schedule a config may name: the 8-warp kernel's three (64- and 128-key tiles), the
# warp-specialised kernel with 2 or 3 consumer warpgroups, with and without ping-pong.
SCHEDULES = [KernelConfig(128, n, 8, 2, True, overlap) for overlap in (0, 1, 2) for n in (64, 128)] + [
    KernelConfig(64 * split, 128, 4, 2, True, 0, split, pingpong) for split in (2, 3) for pingpong in (0, 1)]


def schedule_id(c: KernelConfig) -> str:
    if c.hopper_split:
        return f"ws{c.hopper_split}" + ("-pingpong" if c.hopper_pingpong else "")
    return f"overlap{c.hopper_overlap}-n{c.block_n}"


@pytest.fixture
def gluon_launches(monkeypatch):
    from fusedattn.kernels.gluon import fwd as hopper_fwd

    return record_launches(monkeypatch, hopper_fwd, "attention_forward")


def pinned_forward(case: Case, forward: KernelConfig):
    base = select_configs(torch.device("cuda"), case.dtype, case.head_dim, case.dv)
    return pinned_configs(replace(base, forward=forward))


@pytest.mark.parametrize("forward", SCHEDULES, ids=[schedule_id(c) for c in SCHEDULES])
@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_gluon_forward_matches_reference(case, forward, gluon_launches):
    with pinned_forward(case, forward):
        check_case(case, "triton", "cuda")
    assert gluon_launches and all(gluon_launches), "the Gluon kernel did not run"


# A tile's warpgroups whose rows all lie past Sq (192-row tiles at Sq = 1000, 200, 700, 255, 1;
# 128-row ones at 200 and 1) hand their key blocks back instead of running the last row's keys: what
# the live warpgroups compute must not change by a bit (``Knobs.run_rows_past_end`` runs them as
# before). Full rows, causal with Sq < Sk, a window with Sq > Sk and softcap, GQA, decoding.
PAST_END_CASES = [
    Case(2, 4, 4, 1000, 1000, 128, layout="bhsd", dtype=torch.bfloat16),
    Case(1, 4, 2, 200, 4000, 128, causal=True, dtype=torch.bfloat16),
    Case(1, 2, 2, 700, 300, 128, causal=True, window=(150, 0), softcap=10.0, dtype=torch.bfloat16),
    Case(2, 2, 2, 255, 255, 64, softcap=5.0),
    Case(2, 4, 2, 1, 700, 64, dtype=torch.bfloat16),
]


@pytest.mark.parametrize("forward", [SCHEDULES[-4], SCHEDULES[-1]], ids=schedule_id)
@pytest.mark.parametrize("case", PAST_END_CASES, ids=[c.id for c in PAST_END_CASES])
def test_warpgroups_past_the_last_row_change_nothing(case, forward, gluon_launches, monkeypatch):
    set_knobs(monkeypatch, programs=0)  # one program per tile: the persistent launch keeps such rows
    q, k, v, _, _ = make_inputs(case, "cuda")
    options = dict(layout=case.layout, causal=case.causal, window=case.window, softcap=case.softcap,
                   return_lse=True)
    with pinned_forward(case, forward):
        out, lse = fusedattn.attention(q, k, v, **options)
        set_knobs(monkeypatch, programs=0, run_rows_past_end=True)
        out_run, lse_run = fusedattn.attention(q, k, v, **options)
    assert gluon_launches and all(gluon_launches), "the Gluon kernel did not run"
    assert torch.equal(out, out_run) and torch.equal(lse, lse_run)
    assert torch.isfinite(out).all() and not torch.isnan(lse).any()


# Head rows per chunk of the launch order (hopper.launch_order): head-major, 3 (10 rows: the last
# chunk is partial), block-major.
ORDERS = {"head-major": 1, "chunks-of-3": 3, "block-major": 0}
ORDER_CASES = [Case(2, 5, 5, 700, 700, 128, causal=True, dtype=torch.bfloat16),
               Case(2, 5, 1, 517, 700, 64, causal=True, window=(200, 0), dtype=torch.float16)]


@pytest.mark.parametrize("forward", [SCHEDULES[3], SCHEDULES[-1]], ids=schedule_id)
@pytest.mark.parametrize("case", ORDER_CASES, ids=[c.id for c in ORDER_CASES])
def test_every_program_order_gives_the_same_bits(case, forward, gluon_launches, monkeypatch):
    """Programs started in chunks of head rows, heaviest query block first in each: every chunk
    size covers every tile once -- the reference's output and lse, and head-major order's bits."""
    q, k, v, _, _ = make_inputs(case, "cuda")
    results = {}
    with pinned_forward(case, forward):
        for name, chunk in ORDERS.items():
            set_knobs(monkeypatch, chunk_heads=chunk)
            results[name] = fusedattn.attention(q, k, v, **case.options(), return_lse=True)
        check_case(case, "triton", "cuda")  # the last order, block-major, against the reference
    want = results["head-major"]
    for name, got in results.items():
        assert all(torch.equal(a, b) for a, b in zip(got, want)), name
    assert gluon_launches and all(gluon_launches)


# Persistent launches of the warp-specialised kernel: fewer programs than tiles, each walking its
# share in rounds (the last one partial), its K/V ring and Q buffer carried from tile to tile.
# (case, schedule): the order cases on ws2 and ws3 ping-pong; a bias and a BlockMask take ws3 ping-pong.
PERSISTENT_CASES = [(case, schedule) for case in ORDER_CASES for schedule in (SCHEDULES[6], SCHEDULES[-1])] + [
    (Case(2, 4, 2, 200, 512, 128, causal=True, bias="full", dtype=torch.bfloat16), SCHEDULES[-1]),
    (Case(2, 4, 4, 640, 640, 128, mask="heads", mask_blocks=(128, 128), dtype=torch.bfloat16), SCHEDULES[-1]),
    # sinks with an lse gradient: without one, this case's sinks gradient from a bf16 output is held to
    # a bound (2 x the bf16 eager reference's error) that even the exact output rounded to bf16 misses
    # (1.2e-2 against 6.5e-3, emulated on the CPU; benchmarks/NOTES.md v65)
    (Case(2, 4, 2, 700, 700, 64, causal=True, sinks=True, lse_grad=True, dtype=torch.bfloat16), SCHEDULES[6])]


@pytest.mark.parametrize("case, forward", PERSISTENT_CASES,
                         ids=[f"{c.id}-{schedule_id(f)}" for c, f in PERSISTENT_CASES])
def test_persistent_launches_give_the_same_bits(case, forward, gluon_launches, monkeypatch):
    """5 and 13 programs over every tile: the same output and lse bits as one program per tile, and
    the reference's values."""
    q, k, v, _, _ = make_inputs(case, "cuda")
    extras = dict(bias=make_bias(case, "cuda"), mask=make_mask(case, "cuda"), sinks=make_sinks(case, "cuda"))
    results = {}
    with pinned_forward(case, forward):
        for programs in (0, 5, 13):
            set_knobs(monkeypatch, programs=programs)
            results[programs] = fusedattn.attention(q, k, v, **case.options(), **extras, return_lse=True)
        check_case(case, "triton", "cuda")  # 13 programs against the reference
    for programs, got in results.items():
        assert all(torch.equal(a, b) for a, b in zip(got, results[0])), programs
    assert gluon_launches and all(gluon_launches)


def test_even_tile_lists_run_the_forward_persistent(gluon_launches, monkeypatch):
    """A block-sparse top-k mask gives every query block the same number of tiles: the forward then
    runs persistent (tile_lists.rows_even, NOTES.md v52) -- the reference's output, lse and
    gradients, and the bits of one program per tile. A causal-shaped block mask's lists and a
    bias keep one program per tile."""
    from fusedattn.kernels.gluon import fwd as hopper_fwd
    from fusedattn.reference import reference_attention
    from attention_runner import forward_backward, launcher_constexprs
    from numerics import assert_close_to_reference

    batch, heads, seqlen, head_dim = 2, 8, 2048, 128  # 256 query blocks of 128 rows: more than the SMs
    gen = torch.Generator(device="cuda").manual_seed(7)
    q, k, v, dout = (torch.randn(batch, heads, seqlen, head_dim, device="cuda", generator=gen) for _ in range(4))
    dlse = torch.randn(batch, heads, seqlen, device="cuda", generator=gen)
    scores = torch.randn(batch, heads, seqlen, seqlen, device="cuda", generator=gen)
    top_k = fusedattn.topk_block_mask(scores, 5, block_size=(128, 128))
    blocks = seqlen // 128
    lower = torch.ones(blocks, blocks, dtype=torch.bool, device="cuda").tril()
    causal_shaped = fusedattn.BlockMask.from_blocks(lower, (128, 128), seqlen, seqlen)
    bias = torch.randn(batch, heads, seqlen, seqlen, device="cuda", generator=gen, dtype=torch.bfloat16)
    persistent = launcher_constexprs(monkeypatch, hopper_fwd._attn_fwd_ws_kernel, lambda o: o["PERSISTENT"])
    bf16 = [t.to(torch.bfloat16) for t in (q, k, v)]
    for mask, extra, expected in ((top_k, {}, True), (causal_shaped, {}, False), (top_k, dict(bias=bias), False)):
        persistent.clear()
        fusedattn.attention(*bf16, layout="bhsd", mask=mask, **extra)
        assert persistent == [expected], (expected, persistent)

    def ours(q_, k_, v_):
        return fusedattn.attention(q_, k_, v_, layout="bhsd", mask=top_k, return_lse=True)

    def reference(q_, k_, v_):
        return reference_attention(q_, k_, v_, layout="bhsd", mask=top_k.to_dense(), return_lse=True)

    got = forward_backward(ours, q, k, v, dout, dlse, dtype=torch.bfloat16, lse_grad=True)
    lowp = forward_backward(reference, q, k, v, dout, dlse, dtype=torch.bfloat16, lse_grad=True)
    ref64 = forward_backward(reference, q, k, v, dout, dlse, dtype=torch.float64, lse_grad=True)
    for name, ours_t, lowp_t, ref_t in zip(["out", "lse", "dq", "dk", "dv"], got, lowp, ref64):
        assert_close_to_reference(f"top-k blocks {name}", ours_t, lowp_t, ref_t)
    persistent.clear()
    persistent_launch = ours(*bf16)
    set_knobs(monkeypatch, programs=0)  # one program per tile: the same bits
    one_per_tile = ours(*bf16)
    assert persistent == [True, False]
    assert all(torch.equal(a, b) for a, b in zip(persistent_launch, one_per_tile))
    assert gluon_launches and all(gluon_launches)


# Masks none of whose 128x128 tiles is partial: the warp-specialised kernel walks their tile lists
# -- full tiles without mask math, partial ones (the keep rule) with it, empty ones never loaded.
MASK_CASES = WHOLE_TILE_MASK_CASES


@pytest.mark.parametrize("case", MASK_CASES, ids=[c.id for c in MASK_CASES])
def test_gluon_forward_walks_the_tile_lists_of_whole_tile_masks(case, gluon_launches):
    with pinned_forward(case, SCHEDULES[-1]):  # any Gluon schedule: a mask's lists take ws2 ping-pong
        check_case(case, "triton", "cuda")
    assert gluon_launches and all(gluon_launches), "the Gluon kernel did not run"


# A 16-bit bias by elements over queries and keys, TMA-addressable (fwd.gluon_reads_bias): the
# warp-specialised kernel reads its tiles through a ring of their own. Every head form, with GQA,
# causal rows that see no key (Sq > Sk), a ragged last query block, windows, softcap, a mask of
# whole tiles and the bias's own -inf entries (one whole row of them: an empty row).
BIAS_CASES = [
    Case(2, 4, 2, 200, 512, 128, causal=True, bias="full", dtype=torch.bfloat16),
    Case(1, 4, 2, 333, 264, 128, bias="kv-heads", softcap=20.0, dtype=torch.float16),
    Case(2, 4, 4, 300, 256, 64, causal=True, window=(50, 0), bias="heads", lse_grad=True, dtype=torch.bfloat16),
    Case(1, 2, 1, 300, 200, 64, causal=True, bias="full", dtype=torch.float16, layout="bhsd"),
    Case(1, 2, 2, 256, 384, 128, bias="shared", mask="full", mask_blocks=(128, 128), dtype=torch.bfloat16),
    Case(1, 4, 4, 1000, 1000, 128, causal=True, window=(300, 0), softcap=30.0, bias="full", dtype=torch.bfloat16),
]


@pytest.mark.parametrize("case", BIAS_CASES, ids=[c.id for c in BIAS_CASES])
def test_gluon_forward_reads_a_bias(case, gluon_launches):
    with pinned_forward(case, SCHEDULES[-1]):  # any Gluon schedule: a bias takes ws2 ping-pong
        check_case(case, "triton", "cuda")
    assert gluon_launches and all(gluon_launches), "the Gluon kernel did not run"


@pytest.mark.parametrize("case", [
    Case(1, 2, 2, 200, 256, 128, bias="full", bias_dtype=torch.float32, dtype=torch.bfloat16),  # fp32 bias
    Case(2, 2, 2, 200, 256, 128, bias="keys", dtype=torch.bfloat16),  # one row for every query
    Case(1, 2, 2, 200, 256, 128, bias="rows", dtype=torch.bfloat16),  # one column for every key
    Case(1, 2, 2, 200, 255, 128, bias="full", dtype=torch.bfloat16),  # rows of 510 bytes: no TMA
], ids=["fp32", "keys", "rows", "unaligned"])
def test_biases_it_cannot_read_run_the_triton_kernel(case, gluon_launches):
    with pinned_forward(case, SCHEDULES[-1]):
        check_case(case, "triton", "cuda")
    assert not gluon_launches


def test_masks_with_partial_tiles_run_the_triton_kernel(gluon_launches):
    """A mask of 64x64 blocks leaves mixed 128x128 tiles, which the Gluon kernels would have to read."""
    case = Case(1, 2, 2, 300, 300, 128, mask="full", mask_blocks=(64, 64), dtype=torch.bfloat16)
    with pinned_forward(case, SCHEDULES[-1]):
        check_case(case, "triton", "cuda")
    assert not gluon_launches


def test_cached_launches_run_the_kernel_each_problem_compiled():
    """launch.launch keeps compiled kernels by their specialisation and launches them directly
    (the Gluon forward and dK/dV pass, the Triton pre-pass): problems of different kernels, flags
    and head dims, interleaved, each give the bits of their first launch (the one through Triton),
    forward and dK/dV, add no compiled kernel after their first step and match the reference."""
    from fusedattn.kernels.triton import bwd
    from fusedattn.kernels.gluon import bwd as hopper_bwd
    from fusedattn.kernels.gluon import fwd as hopper_fwd
    from fusedattn.kernels.shared import launch

    cases = [Case(1, 2, 2, 300, 300, 128, causal=True, dtype=torch.bfloat16),
             Case(1, 4, 2, 200, 333, 64, softcap=5.0, dtype=torch.bfloat16),
             Case(1, 2, 2, 300, 300, 128, window=(50, 0), causal=True, dtype=torch.float16)]
    inputs = [make_inputs(case, "cuda") for case in cases]

    def step(case, q, k, v, dout):
        q, k, v = (t.detach().requires_grad_() for t in (q, k, v))
        out = fusedattn.attention(q, k, v, **case.options())
        return (out, *torch.autograd.grad(out, (q, k, v), dout))

    launch.forget_compiled()
    first = [step(case, *qkv[:4]) for case, qkv in zip(cases, inputs)]
    kernels = {entry[3] for entry in launch._compiled.values()}
    assert {hopper_fwd._attn_fwd_ws_kernel, hopper_fwd._attn_fwd_kernel} & kernels
    assert {hopper_bwd._dkdv_ws_kernel, bwd._preprocess_kernel} <= kernels
    compiled = len(launch._compiled)
    for _ in range(2):
        for case, qkv, expected in zip(cases, inputs, first):
            for name, got, want in zip(("out", "dq", "dk", "dv"), step(case, *qkv[:4]), expected):
                if name == "dq":  # summed by fp32 reduce-adds in no fixed order: one rounding apart at most
                    torch.testing.assert_close(got, want, rtol=2**-7, atol=1e-3, msg=f"{case.id} dq")
                else:
                    assert torch.equal(got, want), f"{case.id} {name}"
    assert len(launch._compiled) == compiled  # none added after each problem's first step
    for case, qkv in zip(cases, inputs):
        check_case(case, "triton", "cuda", inputs=qkv)
    # Every kernel the cache keeps launches through Triton's C launcher directly (launch._DirectLaunch).
    assert all(entry[2] is not None for entry in launch._compiled.values())


def test_launch_hooks_send_cached_launches_through_triton():
    """With a launch hook set (Triton's profilers set one), cached kernels launch through Triton's
    runner, which calls the hook, and still compute the same bits as direct launches."""
    from triton import knobs

    case = Case(1, 2, 2, 300, 300, 128, causal=True, dtype=torch.bfloat16)
    q, k, v, dout = make_inputs(case, "cuda")[:4]

    def step():
        leaves = [t.detach().requires_grad_() for t in (q, k, v)]
        out = fusedattn.attention(*leaves, **case.options())
        return (out, *torch.autograd.grad(out, leaves, dout))

    direct = step()
    entered = []
    hook = entered.append
    knobs.runtime.launch_enter_hook.add(hook)  # Triton 3.6: a chain of hooks
    try:
        hooked = step()
    finally:
        knobs.runtime.launch_enter_hook.remove(hook)
    assert len(entered) >= 3  # forward, pre-pass, dK/dV pass
    for name, got, want in zip(("out", "dq", "dk", "dv"), hooked, direct):
        if name == "dq":  # summed by fp32 reduce-adds in no fixed order: one rounding apart at most
            torch.testing.assert_close(got, want, rtol=2**-7, atol=1e-3)
        else:
            assert torch.equal(got, want), name


@pytest.mark.parametrize("forward", [SCHEDULES[3], SCHEDULES[-1]], ids=schedule_id)
def test_gluon_forward_takes_strided_views(forward, gluon_launches):
    """q, k, v as slices of wider tensors (head-dim stride 1, others not contiguous)."""
    case = Case(2, 4, 2, 300, 300, 64, causal=True, dtype=torch.bfloat16)
    wide = [torch.randn(2, 300, h, 3 * 64, device="cuda", dtype=torch.bfloat16) for h in (4, 2, 2)]
    q, k, v = (t[..., 64:128] for t in wide)
    assert not q.is_contiguous()
    _, _, _, dout, dlse = make_inputs(case, "cuda")
    with pinned_forward(case, forward):
        check_case(case, "triton", "cuda", inputs=(q, k, v, dout, dlse))
    assert gluon_launches and all(gluon_launches)


# Sinks: the warp-specialised forward adds each head's sink logit to its rows' denominators at the
# end (rows that see no key: output 0, lse = the sink); Sq > Sk causal, GQA, a window with softcap,
# a mask's tile lists, decoding, an lse gradient, fp16 sinks.
SINK_CASES = [
    Case(1, 4, 2, 517, 333, 128, causal=True, sinks=True, lse_grad=True, dtype=torch.bfloat16),
    Case(2, 2, 1, 300, 300, 64, causal=True, window=(90, 0), softcap=20.0, sinks=True, layout="bhsd"),
    Case(2, 4, 2, 1, 700, 128, sinks=True, dtype=torch.bfloat16),
    Case(2, 4, 4, 640, 640, 128, mask="heads", mask_blocks=(128, 128), sinks=True, dtype=torch.bfloat16),
]


# two warpgroups without turns (the persistent launches' schedule) and three taking turns (the default)
@pytest.mark.parametrize("forward", [SCHEDULES[6], SCHEDULES[-1]], ids=schedule_id)
@pytest.mark.parametrize("case", SINK_CASES, ids=[c.id for c in SINK_CASES])
def test_gluon_forward_takes_sinks(case, forward, gluon_launches):
    with pinned_forward(case, forward):
        check_case(case, "triton", "cuda")
    assert gluon_launches and all(gluon_launches), "the Gluon kernel did not run"


def test_sinks_on_the_eight_warp_schedule_run_the_triton_kernel(gluon_launches):
    case = SINK_CASES[0]
    with pinned_forward(case, SCHEDULES[0]):
        check_case(case, "triton", "cuda")
    assert not gluon_launches


@pytest.mark.parametrize("forward", [SCHEDULES[3], SCHEDULES[-1]], ids=schedule_id)
@pytest.mark.parametrize("options", [dict(window=(-1, 7)), dict(window=(50, 3)), dict(window=(50, 3), softcap=20.0)],
                         ids=["right-window", "both-windows", "both-windows-softcap"])
def test_problems_it_does_not_support_run_the_triton_kernel(options, forward, gluon_launches):
    case = Case(1, 2, 2, 200, 200, 128, dtype=torch.bfloat16, layout="bhsd", **options)
    q, k, v, _, _ = make_inputs(case, "cuda")
    spec_supported = dispatch.gluon_support(q, k, v, resolve_spec(
        128, layout="bhsd", causal=False, window=options.get("window"), scale=None,
        softcap=options.get("softcap"), deterministic=False))
    assert not spec_supported
    with pinned_forward(case, forward):  # the Triton kernel takes the config's tiles (192 rows: 128)
        check_case(case, "triton", "cuda")
    assert not gluon_launches  # fell back before launching


@pytest.mark.parametrize("forward", [SCHEDULES[3], SCHEDULES[-1]], ids=schedule_id)
def test_tensors_tma_cannot_address_run_the_triton_kernel(forward, gluon_launches):
    """Rows 65 elements apart (130 bytes, not a multiple of 16): no TMA descriptor, so the planner
    sends the problem to the Triton kernel (pointer loads) with the fallback tiles, and says why."""
    case = Case(1, 2, 2, 150, 150, 64, causal=True, dtype=torch.bfloat16, layout="bhsd")
    q, k, v = (torch.randn(1, 2, 150, 65, device="cuda", dtype=torch.bfloat16)[..., :64] for _ in range(3))
    _, _, _, dout, dlse = make_inputs(case, "cuda")
    with pinned_forward(case, forward):
        check_case(case, "triton", "cuda", inputs=(q, k, v, dout, dlse))
        step = fusedattn.explain(q, k, v, layout="bhsd", causal=True, show=False).forward[0]
    assert not gluon_launches  # declined before any launch
    assert step.kernel == "Triton forward" and "TMA" in step.why


# ALiBi's causal (key-term) form in the warp-specialised forward: a slope per (batch, head); the
# backward is tests/test_hopper_backward.py's. Sq > Sk (rows that see no key), a left window, GQA, lse in the loss.
ALIBI_CASES = [
    Case(1, 4, 2, 333, 517, 128, causal=True, alibi="heads", dtype=torch.bfloat16),
    Case(2, 2, 2, 517, 333, 64, causal=True, alibi="batch", lse_grad=True),
    Case(1, 4, 2, 1000, 1000, 128, causal=True, window=(300, 0), alibi="heads", dtype=torch.bfloat16),
    Case(2, 4, 4, 700, 700, 128, causal=True, alibi="batch", softcap=20.0, dtype=torch.bfloat16),
]

# Dropout in the warp-specialised forward: the keep tile made per key block (kernels/gluon/common.py),
# checked against the reference given the call's own mask. Causal and not, Sq > Sk, GQA, a left
# window, softcap, ALiBi, lse in the loss.
DROPOUT_CASES = [
    Case(1, 4, 2, 333, 517, 128, dropout=0.2, dtype=torch.bfloat16),
    Case(2, 2, 2, 517, 333, 64, causal=True, dropout=0.3, lse_grad=True),
    Case(1, 4, 2, 1000, 1000, 128, causal=True, window=(300, 0), dropout=0.1, dtype=torch.bfloat16),
    Case(2, 4, 4, 700, 700, 128, causal=True, alibi="batch", softcap=20.0, dropout=0.5, dtype=torch.bfloat16),
]


@pytest.mark.parametrize("forward", SCHEDULES[6:], ids=[schedule_id(c) for c in SCHEDULES[6:]])
@pytest.mark.parametrize("case", ALIBI_CASES + DROPOUT_CASES, ids=[c.id for c in ALIBI_CASES + DROPOUT_CASES])
def test_gluon_forward_computes_causal_alibi_and_dropout(case, forward, gluon_launches):
    with pinned_forward(case, forward):
        check_case(case, "triton", "cuda")
    assert gluon_launches and all(gluon_launches), "the Gluon kernel did not run"


@pytest.mark.parametrize("forward", [SCHEDULES[6]], ids=schedule_id)
def test_persistent_alibi_launches_give_the_same_bits(forward, gluon_launches, monkeypatch):
    """Persistent programs carry each tile's own slope: the bits of one program per tile."""
    case = Case(2, 5, 5, 700, 700, 128, causal=True, alibi="batch", dtype=torch.bfloat16)
    q, k, v, _, _ = make_inputs(case, "cuda")
    slopes = 0.02 + 0.5 * torch.rand(case.batch, case.heads_q, device="cuda")
    results = {}
    with pinned_forward(case, forward):
        for programs in (0, 5, 13):
            set_knobs(monkeypatch, programs=programs)
            results[programs] = fusedattn.attention(q, k, v, causal=True, alibi_slopes=slopes, return_lse=True)
    for programs, got in results.items():
        assert all(torch.equal(a, b) for a, b in zip(got, results[0])), programs
    assert gluon_launches and all(gluon_launches)


@pytest.mark.parametrize("case", [Case(1, 4, 2, 333, 517, 128, alibi="heads", dtype=torch.bfloat16),
                                  Case(1, 4, 2, 333, 517, 128, causal=True, alibi="heads", mask="keys",
                                       dtype=torch.bfloat16)], ids=["not-causal", "with-a-mask"])
def test_alibi_the_gluon_forward_has_no_form_for_runs_the_triton_kernel(case, gluon_launches):
    with pinned_forward(case, SCHEDULES[6]):
        check_case(case, "triton", "cuda")
    assert not any(gluon_launches)




@pytest.mark.parametrize("forward", [SCHEDULES[6]], ids=schedule_id)
def test_persistent_dropout_launches_give_the_same_bits(forward, gluon_launches, monkeypatch):
    """Persistent programs make each tile's own keep bits: the bits of one program per tile."""
    case = Case(2, 5, 5, 700, 700, 128, causal=True, dropout=0.2, dtype=torch.bfloat16)
    q, k, v, _, _ = make_inputs(case, "cuda")
    results = {}
    with pinned_forward(case, forward):
        for programs in (0, 5, 13):
            set_knobs(monkeypatch, programs=programs)
            torch.manual_seed(7)  # the same seed each call: the same mask
            results[programs] = fusedattn.attention(q, k, v, causal=True, dropout_p=0.2, return_lse=True)
    for programs, got in results.items():
        assert all(torch.equal(a, b) for a, b in zip(got, results[0])), programs
    assert gluon_launches and all(gluon_launches)


def test_dropout_with_a_mask_runs_the_triton_kernel(gluon_launches):
    case = Case(1, 4, 2, 333, 517, 128, causal=True, dropout=0.2, mask="keys", dtype=torch.bfloat16)
    with pinned_forward(case, SCHEDULES[6]):
        check_case(case, "triton", "cuda")
    assert not any(gluon_launches)
