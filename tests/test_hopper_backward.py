"""The warp-specialised Gluon dK/dV pass of kernels/hopper_bwd.py (sm_90 only): every schedule a
config may name (2 or 3 consumer warpgroups, ping-pong 0/1/2, 64- and 128-row query steps, a deeper
ring), on odd lengths, causal with Sq > Sk (rows with no key) and Sq < Sk, GQA in every program
order (chunks of heads), a key length that leaves a warpgroup with no key, both layouts, strided views, a custom
scale, softcap, sliding windows, masks of whole tiles, a trainable bias (read, its gradient stored, in
the 5-matmul form), causal ALiBi, dropout and a gradient on lse -- every gradient against the
float64 reference (SPEC 4). A spy proves
each backward really ran the Gluon pass; problems and tensors it does not take must run the Triton
pass; with atomic_dq it sums dQ too where it can (D=128), elsewhere the dQ pass runs; dK and dV
are bitwise reproducible (dQ too where a dQ pass sums it) wherever one program walks a KV head's
whole group -- with GQA outside deterministic mode, programs per query head add their dK/dV into
fp32 group sums instead (every GQA case above runs that way with two warpgroups)."""

import contextlib
from dataclasses import replace
from unittest import mock

import pytest
import torch

import fusedattn
from fusedattn.kernels.triton import bwd
from fusedattn.tuning.configs import KernelConfig, pinned_configs, select_configs

from attention_runner import check_case, launcher_constexprs, make_inputs, record_launches, set_knobs
from cases import WHOLE_TILE_MASK_CASES, Case

HOPPER = torch.cuda.is_available() and torch.cuda.get_device_capability()[0] == 9
pytestmark = pytest.mark.skipif(not HOPPER, reason="the Gluon dK/dV pass runs on sm_90 GPUs only")

CASES = [
    Case(2, 4, 4, 1000, 1000, 128, layout="bhsd", dtype=torch.bfloat16),
    Case(1, 4, 2, 333, 517, 128, causal=True, dtype=torch.bfloat16),
    Case(1, 4, 2, 517, 333, 64, causal=True, layout="bhsd"),  # Sq > Sk: the first rows see no key
    Case(2, 4, 1, 300, 300, 64, causal=True, dtype=torch.bfloat16),  # GQA 4/1 causal: block-major order
    Case(1, 2, 2, 7, 700, 128, dtype=torch.bfloat16),  # a few queries, many keys
    Case(1, 2, 2, 200, 70, 64, scale=0.3, layout="bhsd", dtype=torch.bfloat16),  # Sk=70: a warpgroup has no key
    Case(1, 3, 3, 129, 129, 64, causal=True, deterministic=True, lse_grad=True),
    # softcap: dS^T takes 1 - tanh^2 (hopper.log2_scores); causal GQA with rows that see no key
    Case(1, 4, 2, 517, 333, 128, causal=True, softcap=20.0, dtype=torch.bfloat16),
    Case(2, 4, 1, 255, 255, 64, softcap=5.0, lse_grad=True),
    # sliding windows: masked steps on both sides of the interior ones, warpgroups skipping steps
    # none of their keys sees; a window narrower than a tile; left alone; with softcap
    Case(1, 4, 2, 1000, 1000, 128, causal=True, window=(300, 0), dtype=torch.bfloat16),
    Case(2, 2, 1, 333, 333, 128, causal=True, window=(20, 0), lse_grad=True),
    Case(1, 2, 2, 517, 700, 64, window=(100, -1), layout="bhsd"),
    Case(1, 2, 2, 700, 300, 64, causal=True, window=(150, 0), softcap=10.0, dtype=torch.bfloat16),
    # causal ALiBi (its key-term form, anchored at each step's first query row): per-head and
    # per-batch slopes, Sq < Sk and Sq > Sk, GQA, with softcap, a left window and an lse gradient
    Case(1, 4, 2, 333, 517, 128, causal=True, alibi="heads", dtype=torch.bfloat16),
    Case(2, 4, 1, 517, 333, 64, causal=True, alibi="batch", layout="bhsd", lse_grad=True),
    Case(1, 4, 2, 700, 700, 128, causal=True, alibi="heads", softcap=20.0, dtype=torch.bfloat16),
    Case(2, 2, 2, 300, 300, 64, causal=True, window=(90, 0), alibi="batch", lse_grad=True, dtype=torch.bfloat16),
    # dropout (the keep tile made per step, keys along rows): odd lengths, GQA, causal and not, softcap,
    # a left window, ALiBi, an lse gradient -- checked against the reference given the call's mask
    Case(1, 4, 2, 333, 517, 128, dropout=0.2, dtype=torch.bfloat16),
    Case(2, 4, 1, 517, 333, 64, causal=True, dropout=0.3, layout="bhsd", lse_grad=True),
    Case(1, 4, 2, 700, 700, 128, causal=True, softcap=20.0, dropout=0.1, dtype=torch.bfloat16),
    Case(2, 2, 2, 300, 300, 64, causal=True, window=(90, 0), alibi="batch", dropout=0.5, dtype=torch.bfloat16),
    Case(1, 4, 2, 1000, 1000, 128, causal=True, window=(300, 0), dropout=0.2, dtype=torch.bfloat16),
    Case(2, 2, 2, 517, 700, 64, causal=True, window=(150, 0), dropout=0.1, lse_grad=True),
]


def dkdv(split: int, pingpong: int, block_m: int = 64, stages: int = 2) -> KernelConfig:
    return KernelConfig(block_m, 64 * split, 4, stages, True, 0, split, pingpong)


# The pass without dQ: its warpgroups take turns (ping-pong 1 or 2); the planner gives a config
# without turns turns where the pass does not sum dQ (dispatch.dkdv_without_dq).
SCHEDULES = [dkdv(2, p) for p in (1, 2)] + [dkdv(3, p) for p in (1, 2)] + [dkdv(2, 2, 128), dkdv(2, 1, stages=3)]


def schedule_id(c: KernelConfig) -> str:
    return f"ws{c.hopper_split}-pp{c.hopper_pingpong}-m{c.block_m}-s{c.num_stages}"


@pytest.fixture
def gluon_launches(monkeypatch):
    from fusedattn.kernels.gluon import bwd as hopper_bwd

    return record_launches(monkeypatch, hopper_bwd, "dkdv_pass")


@pytest.fixture
def group_sum_launches(monkeypatch):
    """GROUP_SUM of every Gluon dK/dV launch (True: one program per query head, fp32 group sums)."""
    from fusedattn.kernels.gluon import bwd as hopper_bwd

    return launcher_constexprs(monkeypatch, hopper_bwd._dkdv_ws_kernel, lambda constexprs: constexprs["GROUP_SUM"])


def pinned_dkdv(case: Case, config: KernelConfig, **options):
    """The heuristic's configs with this dK/dV pass; dQ's own pass, where one runs, the Triton one
    (the Gluon dQ pass, and the short causal GQA form that uses it, are tests/test_hopper_dq.py's)."""
    base = select_configs(torch.device("cuda"), case.dtype, case.head_dim, case.dv)
    return pinned_configs(replace(base, dkdv=config, **{"gluon_dq": None, **options}))


def fits(case: Case, config: KernelConfig) -> bool:
    return not (case.head_dim == 128 and config.hopper_split == 3)  # registers: D=128 takes 2 warpgroups


# Every case with every schedule that fits it (three warpgroups cannot hold D=128's accumulators).
CASE_SCHEDULES = [(case, config) for case in CASES for config in SCHEDULES if fits(case, config)]


@pytest.mark.parametrize("case,config", CASE_SCHEDULES,
                         ids=[f"{case.id}-{schedule_id(config)}" for case, config in CASE_SCHEDULES])
def test_gluon_dkdv_matches_reference(case, config, gluon_launches):
    with pinned_dkdv(case, config, atomic_dq=False):  # the dK/dV pass alone (dQ: its own pass)
        check_case(case, "triton", "cuda")
    assert gluon_launches and all(gluon_launches), "the Gluon dK/dV pass did not run"


# Head rows per chunk of the launch order (hopper.launch_order): head-major, 3 (the last chunk is
# partial for 4 or 8 rows), block-major.
ORDERS = {"head-major": 1, "chunks-of-3": 3, "block-major": 0}


@pytest.mark.parametrize("atomic_dq", [False, True], ids=["dq-pass", "dq-reduce-adds"])
@pytest.mark.parametrize("chunk", ORDERS.values(), ids=ORDERS.keys())
def test_every_program_order_gives_the_same_bits(chunk, atomic_dq, gluon_launches, monkeypatch):
    """With one program per KV head's group (the group sums off, as in deterministic mode), every
    launch order, and a second run, gives the default's dK and dV bits, and the same dQ bits where a
    dQ pass sums it (reduce-adds sum in arrival order)."""
    set_knobs(monkeypatch, group_sums=False)
    case = Case(2, 6, 2, 400, 400, 128, causal=True, dtype=torch.bfloat16)
    q, k, v, dout, _ = make_inputs(case, "cuda")

    def grads():
        leaves = [t.detach().clone().requires_grad_() for t in (q, k, v)]
        fusedattn.attention(*leaves, causal=True).backward(dout)
        return [t.grad for t in leaves]

    with pinned_dkdv(case, dkdv(2, 1), atomic_dq=atomic_dq, dq_tma=atomic_dq):
        default = grads()
        set_knobs(monkeypatch, chunk_heads=chunk)
        first, second = grads(), grads()
    reproducible = slice(1 if atomic_dq else 0, 3)
    assert all(torch.equal(a, b) for a, b in zip(first[reproducible], second[reproducible]))
    assert all(torch.equal(a, b) for a, b in zip(first[reproducible], default[reproducible]))
    assert len(gluon_launches) == 3 and all(gluon_launches)


GROUP_SUM_CASES = [
    Case(2, 6, 2, 400, 400, 128, causal=True, dtype=torch.bfloat16),
    Case(1, 8, 1, 333, 517, 64, causal=True, dtype=torch.bfloat16),  # MQA, Sq < Sk, a ragged key block
    Case(1, 4, 2, 517, 333, 128, causal=True, softcap=20.0, lse_grad=True, dtype=torch.float16),  # rows see no key
    Case(2, 4, 2, 300, 300, 64, causal=True, window=(70, 0), layout="bhsd"),
]


@pytest.mark.parametrize("atomic_dq", [False, True], ids=["dq-pass", "dq-reduce-adds"])
@pytest.mark.parametrize("chunk", ORDERS.values(), ids=ORDERS.keys())
@pytest.mark.parametrize("case", GROUP_SUM_CASES, ids=[c.id for c in GROUP_SUM_CASES])
def test_gqa_group_sums_match_reference(case, chunk, atomic_dq, group_sum_launches, monkeypatch):
    """Causal GQA outside deterministic mode: a program per query head adds its dK/dV into fp32
    sums over the group (TMA reduce-adds staged in the K/V tiles and the ring), in every order."""
    set_knobs(monkeypatch, chunk_heads=chunk)
    with pinned_dkdv(case, dkdv(2, 1), atomic_dq=atomic_dq, dq_tma=atomic_dq):
        check_case(case, "triton", "cuda")
    assert group_sum_launches == [True]


WALK_CASES = [  # (case, schedule) where one program walks a KV head's whole group
    (Case(1, 6, 2, 300, 300, 64, causal=True, deterministic=True, dtype=torch.bfloat16), dkdv(2, 1)),
    (Case(1, 6, 2, 300, 300, 128, dtype=torch.bfloat16), dkdv(2, 1)),  # no causal bound: even programs
    (Case(1, 6, 2, 300, 300, 64, causal=True, dtype=torch.bfloat16), dkdv(3, 1)),  # no room to stage fp32 tiles
]


@pytest.mark.parametrize("case,config", WALK_CASES, ids=[f"{c.id}-{schedule_id(s)}" for c, s in WALK_CASES])
def test_gqa_walks_the_whole_group_where_sums_do_not_run(case, config, group_sum_launches):
    """deterministic=True, GQA without a causal bound, or three warpgroups: one program walks the
    group and sums its dK/dV in a fixed order -- the same bits twice, and the reference's values."""
    q, k, v, dout, _ = make_inputs(case, "cuda")

    def grads():
        leaves = [t.detach().clone().requires_grad_() for t in (q, k, v)]
        fusedattn.attention(*leaves, causal=case.causal, deterministic=case.deterministic).backward(dout)
        return [t.grad for t in leaves]

    with pinned_dkdv(case, config, atomic_dq=False):  # dQ by its own pass: reproducible too
        first, second = grads(), grads()
        check_case(case, "triton", "cuda")
    assert all(torch.equal(a, b) for a, b in zip(first, second))
    assert group_sum_launches and not any(group_sum_launches)


@pytest.mark.parametrize("config", [dkdv(2, 1), dkdv(3, 1)], ids=schedule_id)
def test_gluon_dkdv_takes_strided_views(config, gluon_launches):
    """q, k, v as slices of wider tensors (head-dim stride 1, others not contiguous)."""
    case = Case(2, 4, 2, 300, 300, 64, causal=True, dtype=torch.bfloat16)
    wide = [torch.randn(2, 300, h, 3 * 64, device="cuda", dtype=torch.bfloat16) for h in (4, 2, 2)]
    q, k, v = (t[..., 64:128] for t in wide)
    assert not q.is_contiguous()
    _, _, _, dout, dlse = make_inputs(case, "cuda")
    with pinned_dkdv(case, config):
        check_case(case, "triton", "cuda", inputs=(q, k, v, dout, dlse))
    assert gluon_launches and all(gluon_launches)


@pytest.mark.parametrize("options", [dict(window=(-1, 7)), dict(window=(50, 3)), dict(window=(50, 3), softcap=20.0)],
                         ids=["right-window", "both-windows", "both-windows-softcap"])
def test_problems_it_does_not_support_run_the_triton_pass(options, gluon_launches):
    """Declined before launching (hopper.supports): the Triton dK/dV programs run instead."""
    case = Case(1, 2, 2, 200, 200, 128, dtype=torch.bfloat16, layout="bhsd", **options)
    with pinned_dkdv(case, dkdv(2, 1)):
        check_case(case, "triton", "cuda")
    assert not gluon_launches


def test_tensors_tma_cannot_address_run_the_triton_pass(gluon_launches):
    """Rows 65 elements apart (130 bytes, not a multiple of 16): no TMA descriptor, so the Triton
    pass runs, with the fallback's tiles (64-key programs, not the config's 192)."""
    case = Case(1, 2, 2, 150, 150, 64, causal=True, dtype=torch.bfloat16, layout="bhsd")
    q, k, v = (torch.randn(1, 2, 150, 65, device="cuda", dtype=torch.bfloat16)[..., :64] for _ in range(3))
    _, _, _, dout, dlse = make_inputs(case, "cuda")
    with pinned_dkdv(case, dkdv(3, 1)):
        check_case(case, "triton", "cuda", inputs=(q, k, v, dout, dlse))
        plan = fusedattn.explain(q, k, v, layout="bhsd", causal=True, show=False)
    step = {s.name: s for s in plan.backward}["dK/dV"]
    assert not gluon_launches  # declined before any launch
    assert step.kernel.startswith("Triton dK/dV") and "TMA" in step.why


DQ_CASES = CASES + [
    Case(1, 2, 2, 200, 70, 128, layout="bhsd", dtype=torch.bfloat16),  # a ragged key block, a tile past Sk
    Case(2, 4, 1, 300, 300, 128, causal=True, dtype=torch.bfloat16),  # GQA 4/1 causal, block-major
    Case(1, 2, 2, 129, 129, 128, causal=True, lse_grad=True, dtype=torch.float16),
    Case(1, 2, 2, 200, 70, 64, layout="bhsd", dtype=torch.bfloat16),  # D=64: ragged keys, warpgroups past Sk
    Case(1, 3, 3, 129, 129, 64, causal=True, lse_grad=True, dtype=torch.float16),
]
# dQ split by columns at D=128 (two warpgroups), by keys at D=64 with 64-row steps (two or three
# warpgroups), by rows at D=64 with 128-row steps (two warpgroups, each 64 of a step's rows)
DQ_CASE_SCHEDULES = [(case, dkdv(split, pingpong)) for case in DQ_CASES for split in (2, 3) for pingpong in (0, 1)
                     if fits(case, dkdv(split, pingpong))]
DQ_CASE_SCHEDULES += [(case, dkdv(2, pingpong, 128)) for case in DQ_CASES if case.head_dim == 64
                      for pingpong in (0, 1, 2)]


@pytest.mark.parametrize("case,config", DQ_CASE_SCHEDULES,
                         ids=[f"{case.id}-{schedule_id(config)}" for case, config in DQ_CASE_SCHEDULES])
def test_gluon_pass_with_dq_by_reduce_adds_matches_reference(case, config, gluon_launches):
    """atomic_dq: the 5-matmul Gluon pass sums dQ too (TMA reduce-adds), no Triton pass."""
    with pinned_dkdv(case, config, atomic_dq=True, dq_tma=True):
        check_case(case, "triton", "cuda")
    assert gluon_launches and all(gluon_launches)


@pytest.fixture
def dq_forms(monkeypatch):
    """For every dQ accumulator the Gluon pass sums into: whether it stages dQ in register order."""
    from fusedattn.kernels.gluon import bwd as hopper_bwd

    forms, real = [], hopper_bwd.dq_accumulator_descriptor

    def spy(dq_accum, block_m, register_order=False):
        forms.append(register_order)
        return real(dq_accum, block_m, register_order)

    monkeypatch.setattr(hopper_bwd, "dq_accumulator_descriptor", spy)
    return forms


# Query lengths that are multiples of 64: dQ staged and summed in register order (64 x 64 runs; key
# lengths anything) with every feature the pass sums dQ with -- GQA (with group sums), causal with
# rows that see no key, softcap, a window, ALiBi, dropout, deterministic mode (dQ in a fixed order), a
# bias and its gradient, a mask's lists -- at D=128 (split by columns), D=64 with 64-row steps (by
# keys, 2 or 3 warpgroups) and 128-row steps (by rows).
REGISTER_ORDER_CASES = [
    Case(2, 4, 4, 256, 300, 128, layout="bhsd", dtype=torch.bfloat16),
    Case(1, 4, 2, 384, 384, 128, causal=True, dtype=torch.bfloat16),
    Case(1, 2, 2, 512, 200, 64, causal=True, dtype=torch.float16),
    Case(2, 4, 1, 128, 128, 64, softcap=5.0, lse_grad=True),
    Case(1, 4, 2, 640, 640, 128, causal=True, window=(300, 0), dtype=torch.bfloat16),
    Case(1, 4, 2, 320, 517, 128, causal=True, alibi="heads", dtype=torch.bfloat16),
    Case(2, 4, 1, 256, 333, 64, causal=True, dropout=0.3, layout="bhsd", lse_grad=True),
    Case(1, 4, 4, 1088, 1088, 64, causal=True, deterministic=True, dtype=torch.bfloat16),
    Case(1, 3, 3, 192, 192, 128, deterministic=True, dtype=torch.bfloat16),
    Case(1, 2, 2, 256, 256, 128, bias="full", dtype=torch.bfloat16),
    Case(1, 2, 2, 256, 300, 128, mask="full", mask_blocks=(128, 128), dtype=torch.bfloat16),
]
REGISTER_ORDER_SCHEDULES = [(case, config) for case in REGISTER_ORDER_CASES
                            for config in ((dkdv(2, 0), dkdv(2, 1)) if case.head_dim == 128 else
                                           (dkdv(2, 0), dkdv(3, 1), dkdv(2, 0, 128), dkdv(2, 2, 128)))]


@pytest.mark.parametrize("case,config", REGISTER_ORDER_SCHEDULES,
                         ids=[f"{case.id}-{schedule_id(config)}" for case, config in REGISTER_ORDER_SCHEDULES])
def test_dq_in_register_order_matches_reference(case, config, gluon_launches, dq_forms, monkeypatch):
    from fusedattn import dispatch

    # the deterministic causal case's fixed order at its few programs an SM (the planner would give
    # such a launch the dQ pass, ``dispatch.ordered_dq_balances``)
    monkeypatch.setattr(dispatch, "ORDERED_CAUSAL_PROGRAMS_PER_SM", 0)
    with pinned_dkdv(case, config, atomic_dq=True, dq_tma=True):
        check_case(case, "triton", "cuda")
    assert gluon_launches and all(gluon_launches)
    assert dq_forms and all(dq_forms), "dQ was not staged in register order"


def test_dq_rows_past_a_whole_tile_keep_the_plain_layout(gluon_launches, dq_forms):
    """Register order needs whole 64-row tiles: Sq = 300 sums dQ in the accumulator's own tiles."""
    case = Case(1, 2, 2, 300, 300, 128, causal=True, dtype=torch.bfloat16)
    with pinned_dkdv(case, dkdv(2, 0), atomic_dq=True, dq_tma=True):
        check_case(case, "triton", "cuda")
    assert gluon_launches == [True] and dq_forms == [False]


@pytest.mark.parametrize("head_dim", [64, 128])
def test_dq_by_atomics_with_128_row_steps(head_dim, gluon_launches, monkeypatch):
    """With 128-row steps the Gluon pass sums dQ at D=64 only (split by rows; at D=128 its tiles
    would not fit shared memory): there atomic_dq gives way, the Gluon pass computes dK, dV and the
    dQ pass dQ."""
    triton_dq = launcher_constexprs(monkeypatch, bwd._backward_kernel, lambda constexprs: constexprs["RUN_DQ"])
    config = dkdv(2, 2, 128)
    case = Case(1, 2, 2, 300, 300, head_dim, causal=True, dtype=torch.bfloat16, layout="bhsd")
    with pinned_dkdv(case, config, atomic_dq=True, dq_tma=True):
        check_case(case, "triton", "cuda")
    assert gluon_launches == [True]
    assert triton_dq == ([] if head_dim == 64 else [True])


# Masks none of whose 128x128 tiles is partial: the pass walks their column lists (full tiles
# unmasked, partial ones with the keep rule), with and without the dQ reduce-adds.
MASK_CASES = WHOLE_TILE_MASK_CASES + [
    Case(1, 2, 2, 400, 300, 128, mask="full", mask_blocks=(128, 128), deterministic=True, dtype=torch.bfloat16),
]


@pytest.mark.parametrize("atomic_dq", [False, True], ids=["dq-pass", "dq-reduce-adds"])
@pytest.mark.parametrize("case", MASK_CASES, ids=[c.id for c in MASK_CASES])
def test_gluon_pass_walks_the_tile_lists_of_whole_tile_masks(case, atomic_dq, gluon_launches):
    with pinned_dkdv(case, dkdv(3 if case.head_dim == 64 else 2, 1), atomic_dq=atomic_dq, dq_tma=atomic_dq):
        check_case(case, "triton", "cuda")  # a mask's lists take two warpgroups, 128-key programs
    assert gluon_launches and all(gluon_launches), "the Gluon dK/dV pass did not run"


# dQ split by rows (128-row steps at D=64) on the other paths that take the dK/dV config: group sums
# over a GQA group (causal), a mask's tile lists (at the config's 128-row steps)
ROW_SPLIT_PATH_CASES = [c for c in GROUP_SUM_CASES + MASK_CASES if c.head_dim == 64]


@pytest.mark.parametrize("pingpong", [0, 2], ids=["no-turns", "pingpong2"])
@pytest.mark.parametrize("case", ROW_SPLIT_PATH_CASES, ids=[c.id for c in ROW_SPLIT_PATH_CASES])
def test_dq_split_by_rows_with_group_sums_and_tile_lists(case, pingpong, gluon_launches, monkeypatch):
    triton_dq = launcher_constexprs(monkeypatch, bwd._backward_kernel, lambda constexprs: constexprs["RUN_DQ"])
    with pinned_dkdv(case, dkdv(2, pingpong, 128), atomic_dq=True, dq_tma=True):
        check_case(case, "triton", "cuda")
    assert gluon_launches and all(gluon_launches) and not triton_dq  # dQ summed by the pass


# deterministic=True where the pass sums dQ itself (dispatch.ordered_dq_form): its programs take
# turns on each query block's reduce-adds -- causal ones in descending key-block order, walking their
# masked steps first. Sq < Sk and Sq > Sk (rows that see no key), GQA walking its group (no causal
# bound), ragged key blocks, ALiBi, dropout, softcap (turns over S^T), an lse gradient, both head
# dims and both dQ splits (columns at D=128, rows at D=64).
ORDERED_CASES = [
    Case(2, 4, 4, 1000, 1000, 128, deterministic=True, layout="bhsd", dtype=torch.bfloat16),
    Case(1, 4, 4, 333, 517, 128, causal=True, deterministic=True, dtype=torch.bfloat16),
    Case(1, 4, 2, 517, 333, 64, causal=True, deterministic=True, dtype=torch.bfloat16),
    Case(2, 4, 1, 700, 700, 64, deterministic=True, dtype=torch.bfloat16),
    Case(1, 2, 2, 200, 70, 64, deterministic=True, layout="bhsd", dtype=torch.bfloat16),
    Case(1, 3, 3, 129, 129, 128, causal=True, deterministic=True, lse_grad=True, dtype=torch.float16),
    Case(1, 4, 4, 1100, 1100, 64, causal=True, deterministic=True, dtype=torch.bfloat16),
    Case(1, 4, 4, 333, 517, 128, causal=True, alibi="heads", deterministic=True, dtype=torch.bfloat16),
    Case(2, 4, 4, 517, 333, 64, causal=True, dropout=0.3, deterministic=True, dtype=torch.bfloat16),
    Case(1, 4, 4, 700, 700, 128, causal=True, softcap=20.0, deterministic=True, dtype=torch.bfloat16),
    # D=128 under a causal bound walks from the last query block down, a GQA group's members a block
    # at a time: more query rows than keys, a group, dropout (past SHORT_KEYS keys, where short causal
    # GQA takes its own form, ``dispatch.walks_group_with_dq_pass``)
    Case(1, 4, 2, 2177, 2100, 128, causal=True, deterministic=True, dtype=torch.bfloat16),
    Case(1, 4, 2, 2100, 2100, 128, causal=True, dropout=0.2, deterministic=True, dtype=torch.bfloat16),
]


@contextlib.contextmanager
def ordered_configs(case: Case):
    """The heuristic's configs for the case, asking for dQ in a fixed order (the heuristic leaves D=128
    causal at short keys, which these cases have, to the dQ pass; a tuned config may ask for the order
    there too),
    whatever the launch's program count (the planner keeps causal launches of few programs an SM on
    the dQ pass, ``dispatch.ordered_dq_balances``: these cases' are small)."""
    from fusedattn import dispatch

    base = select_configs(torch.device("cuda"), case.dtype, case.head_dim, case.dv, seqlen_k=case.seqlen_k,
                          has_right=case.causal, has_softcap=case.softcap is not None)
    with pinned_configs(replace(base, ordered_dq=True)), \
            mock.patch.object(dispatch, "ORDERED_CAUSAL_PROGRAMS_PER_SM", 0):
        yield


@pytest.fixture
def ordered_launches(monkeypatch):
    """ORDERED of every Gluon dK/dV launch (True: dQ summed by the pass in a fixed order)."""
    from fusedattn.kernels.gluon import bwd as hopper_bwd

    return launcher_constexprs(monkeypatch, hopper_bwd._dkdv_ws_kernel, lambda c: c.get("ORDERED", False))


@pytest.mark.parametrize("case", ORDERED_CASES, ids=[c.id for c in ORDERED_CASES])
def test_deterministic_dq_summed_by_the_pass_in_a_fixed_order(case, ordered_launches, monkeypatch):
    triton_dq = launcher_constexprs(monkeypatch, bwd._backward_kernel, lambda constexprs: constexprs["RUN_DQ"])
    with ordered_configs(case):
        check_case(case, "triton", "cuda")
    assert ordered_launches == [True] and not triton_dq


# Where the pass's turns could not be counted by the causal rule (a left window, a mask's lists, a
# bias) or the short causal GQA form walks the group: deterministic mode keeps dQ's own pass.
UNORDERED_CASES = [
    Case(1, 4, 2, 1000, 1000, 128, causal=True, window=(300, 0), deterministic=True, dtype=torch.bfloat16),
    Case(1, 2, 2, 400, 300, 128, mask="full", mask_blocks=(128, 128), deterministic=True, dtype=torch.bfloat16),
    Case(1, 2, 2, 256, 256, 128, bias="full", deterministic=True, dtype=torch.bfloat16),
    Case(2, 4, 1, 300, 300, 128, causal=True, deterministic=True, dtype=torch.bfloat16),
]


@pytest.mark.parametrize("case", UNORDERED_CASES, ids=[c.id for c in UNORDERED_CASES])
def test_deterministic_problems_the_order_cannot_count_keep_the_dq_pass(case, ordered_launches):
    with ordered_configs(case):
        check_case(case, "triton", "cuda")
    assert True not in ordered_launches


@pytest.mark.parametrize("head_dim, heads_kv, ordered", [(128, 16, True), (128, 2, True), (64, 2, False)],
                         ids=["mha", "gqa-16-2", "d64-gqa-16-2"])
def test_deterministic_causal_takes_the_fixed_order_where_its_launch_ends_evenly(head_dim, heads_kv, ordered):
    """The heuristic at 4k keys, causal, deterministic: at D=128 (launched heaviest first) 16 heads
    (2048 dK/dV programs) and GQA 16/2 (256 programs) sum dQ in the fixed order; at D=64 (launched
    lightest first) GQA 16/2's 256 programs keep the dQ pass (``dispatch.ordered_dq_balances``).
    Explaining launches nothing."""
    q = torch.randn(4, 4096, 16, head_dim, device="cuda", dtype=torch.bfloat16)
    k, v = (torch.randn(4, 4096, heads_kv, head_dim, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    plan = fusedattn.explain(q, k, v, causal=True, deterministic=True, show=False)
    steps = {step.name: step for step in plan.backward}
    assert ("fixed order" in steps["dQ"].kernel) == ordered
    assert ("dQ pass" in steps["dQ"].kernel or "dQ programs" in steps["dQ"].kernel) == (not ordered)
    assert ("too few programs an SM" in steps["dQ"].why) == (not ordered)


def test_ordered_dq_on_tensors_tma_cannot_address_falls_back_to_a_fixed_order(gluon_launches, ordered_launches):
    """Where the Gluon pass cannot take the tensors (rows 130 bytes apart: no TMA descriptor), the
    Triton programs compute dQ in their own pass (their atomics would add in arrival order): right,
    and bitwise repeatable."""
    case = Case(1, 2, 2, 150, 150, 64, causal=True, deterministic=True, dtype=torch.bfloat16, layout="bhsd")
    q, k, v = (torch.randn(1, 2, 150, 65, device="cuda", dtype=torch.bfloat16)[..., :64] for _ in range(3))
    _, _, _, dout, dlse = make_inputs(case, "cuda")

    def grads():  # on the strided views themselves (a clone would be contiguous, and TMA-addressable)
        leaves = [t.detach().requires_grad_() for t in (q, k, v)]
        out = fusedattn.attention(*leaves, layout="bhsd", causal=True, deterministic=True)
        return torch.autograd.grad(out, leaves, dout)

    assert q.stride(2) * q.element_size() % 16 != 0  # what TMA cannot address
    with ordered_configs(case):
        check_case(case, "triton", "cuda", inputs=(q, k, v, dout, dlse))
        first, second = grads(), grads()
    assert True not in gluon_launches and True not in ordered_launches
    assert all(torch.equal(a, b) for a, b in zip(first, second))


def deterministic_grads(case: Case):
    """A function computing dQ, dK, dV of ``case``'s fresh inputs (the same ones each call) with
    ``deterministic=True``."""
    q, k, v, dout, _ = make_inputs(case, "cuda")

    def grads():
        leaves = [t.detach().clone().requires_grad_() for t in (q, k, v)]
        fusedattn.attention(*leaves, causal=case.causal, deterministic=True).backward(dout)
        return [t.grad for t in leaves]

    return grads


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("chunk", ORDERS.values(), ids=ORDERS.keys())
def test_ordered_dq_gives_the_same_bits_in_every_launch_order(chunk, causal, ordered_launches, monkeypatch):
    """dQ summed by the pass in a fixed order: a second run and every launch order of the programs
    give the same dQ, dK and dV bits."""
    case = Case(2, 6, 6, 1000, 1000, 128, causal=causal, deterministic=True, dtype=torch.bfloat16)
    grads = deterministic_grads(case)
    with ordered_configs(case):
        default = grads()
        set_knobs(monkeypatch, chunk_heads=chunk)
        first, second = grads(), grads()
    assert all(torch.equal(a, b) and torch.equal(a, c) for a, b, c in zip(first, second, default))
    assert ordered_launches == [True] * 3


@pytest.mark.parametrize("head_dim", [128, 64])
def test_the_interleaved_fixed_order_is_right_and_adds_in_the_heaviest_first_order(head_dim, monkeypatch):
    """Deterministic, causal: each chunk's lighter half launched among the next chunk's heavier half
    (``interleaved_order``, CHUNKED 3; chunks of 2 head rows forced here, 4 chunks, ragged key blocks).
    Right against the reference and the same bits in a second run; at D=128 the same bits as the
    launch without the interleave, whose programs add in the same order (heaviest first)."""
    from fusedattn.kernels.gluon import bwd as hopper_bwd

    launches = launcher_constexprs(monkeypatch, hopper_bwd._dkdv_ws_kernel,
                                   lambda c: (c["ORDERED"], c["CHUNKED"], c["WALK"]))
    case = Case(2, 4, 4, 1100, 1100, head_dim, causal=True, deterministic=True, dtype=torch.bfloat16)
    grads = deterministic_grads(case)
    with ordered_configs(case):
        set_knobs(monkeypatch, chunk_heads=2)
        check_case(case, "triton", "cuda")
        first, second = grads(), grads()
        assert launches == [(True, 3, hopper_bwd.WALK_DESCENDING)] * 3, launches
        set_knobs(monkeypatch, ordered_interleave=False)
        plain = grads()
    assert all(torch.equal(a, b) for a, b in zip(first, second))
    if head_dim == 128:
        assert launches[-1] == (True, 2, hopper_bwd.WALK_DESCENDING)
        assert all(torch.equal(a, b) for a, b in zip(first, plain))
    else:  # lightest first: another order of adds
        assert launches[-1] == (True, 2, hopper_bwd.WALK_MASKED_FIRST)


def test_masks_with_partial_tiles_run_the_triton_pass(gluon_launches):
    case = Case(1, 2, 2, 300, 300, 128, mask="full", mask_blocks=(64, 64), dtype=torch.bfloat16)
    with pinned_dkdv(case, dkdv(2, 1)):
        check_case(case, "triton", "cuda")
    assert not gluon_launches


@pytest.fixture
def bias_launches(monkeypatch):
    """(BIAS, DBIAS) of every Gluon dK/dV launch."""
    from fusedattn.kernels.gluon import bwd as hopper_bwd

    return launcher_constexprs(monkeypatch, hopper_bwd._dkdv_ws_kernel,
                               lambda constexprs: (constexprs["BIAS"], constexprs["DBIAS"]))


# A trainable 16-bit bias of the full (B, Hq, Sq, Sk) shape at D=128: the 5-matmul pass reads it
# and stores its gradient (bwd.gluon_dkdv_takes_bias) -- ragged query and key blocks, GQA (group
# sums when causal), causal rows that see no key, a window, a mask of whole tiles (its emptied
# tiles keep the zeros the gradient starts with), a gradient on lse, and the bias's own -inf
# entries (a whole row of them: an empty row).
BIAS_CASES = [
    Case(2, 4, 4, 300, 256, 128, bias="full", dtype=torch.bfloat16),
    Case(1, 4, 2, 333, 520, 128, causal=True, bias="full", dtype=torch.bfloat16, layout="bhsd"),
    Case(2, 2, 2, 400, 264, 128, causal=True, bias="full", lse_grad=True, dtype=torch.float16),
    Case(1, 2, 2, 1000, 1000, 128, causal=True, window=(300, 0), bias="full", dtype=torch.bfloat16),
    Case(1, 2, 2, 256, 384, 128, bias="full", mask="full", mask_blocks=(128, 128), dtype=torch.bfloat16),
    # a fixed bias shared by the batch (ALiBi-like): read, no gradient
    Case(2, 4, 2, 300, 256, 128, causal=True, bias="heads", bias_trainable=False, dtype=torch.bfloat16),
]


@pytest.mark.parametrize("case", BIAS_CASES, ids=[c.id for c in BIAS_CASES])
def test_gluon_pass_reads_a_bias_and_stores_its_gradient(case, bias_launches, monkeypatch):
    triton_launches = launcher_constexprs(monkeypatch, bwd._backward_kernel, lambda constexprs: True)
    with pinned_dkdv(case, dkdv(2, 1), atomic_dq=True, dq_tma=True):
        check_case(case, "triton", "cuda")
    # the whole backward in one pass
    assert bias_launches == [(True, case.bias_trainable)] and not triton_launches


@pytest.mark.parametrize("case", [
    Case(2, 2, 2, 200, 256, 128, bias="heads", causal=True, dtype=torch.bfloat16),  # a gradient summed over B
    Case(1, 2, 2, 200, 256, 128, bias="full", softcap=20.0, dtype=torch.bfloat16),  # dS^T carries 1 - tanh^2
    Case(1, 2, 2, 200, 256, 128, bias="full", deterministic=True, dtype=torch.bfloat16),  # no 5-matmul form
    Case(1, 2, 2, 200, 256, 64, bias="full", dtype=torch.bfloat16),  # D=64: the pass reads a bias at D=128 only
    Case(1, 2, 2, 200, 256, 128, bias="full", bias_dtype=torch.float32, dtype=torch.bfloat16),
], ids=["broadcast", "softcap", "deterministic", "d64", "fp32-bias"])
def test_biases_the_gluon_pass_does_not_take_run_the_triton_passes(case, bias_launches):
    check_case(case, "triton", "cuda")
    assert (True, True) not in bias_launches and (True, False) not in bias_launches


def test_the_default_backward_runs_the_gluon_pass(gluon_launches, monkeypatch):
    """The heuristic's dK/dV config on sm_90 names the Gluon pass (D=64 and 128, causal or not).
    It sums dQ too (no Triton launch; in deterministic mode in a fixed order), except at D=64 with
    softcap, where the Triton dQ pass runs, and in deterministic mode at D=128 under a causal bound
    at these short keys, where the Gluon dQ pass (hopper_fwd.dq_pass) runs."""
    from fusedattn.kernels.gluon import fwd as hopper_fwd

    triton_launches = launcher_constexprs(monkeypatch, bwd._backward_kernel,
                                          lambda constexprs: (constexprs["RUN_DKDV"], constexprs["RUN_DQ"]))
    gluon_dq_launches = record_launches(monkeypatch, hopper_fwd, "dq_pass")
    seqlen = 250  # the short length class
    for head_dim, causal, softcap, deterministic in [(64, False, None, False), (64, True, None, False),
                                                     (64, True, 30.0, False), (64, False, None, True),
                                                     (128, True, None, False), (128, False, None, True),
                                                     (128, True, None, True)]:
        configs = select_configs(torch.device("cuda"), torch.bfloat16, head_dim, head_dim, seqlen_k=seqlen,
                                 has_right=causal, has_softcap=softcap is not None)
        assert configs.dkdv.hopper_overlap is not None and configs.dkdv.hopper_split in (2, 3)
        assert configs.atomic_dq == configs.dq_tma == (softcap is None)
        check_case(Case(1, 2, 2, seqlen, seqlen, head_dim, causal=causal, softcap=softcap,
                        deterministic=deterministic, dtype=torch.bfloat16), "triton", "cuda")
    assert gluon_launches == [True] * 7
    assert triton_launches == [(False, True)]  # the dQ pass alone: D=64 softcap
    assert gluon_dq_launches == [True]  # deterministic mode at D=128, causal


@pytest.fixture
def persistent_launches(monkeypatch):
    """PERSISTENT of every Gluon dK/dV launch (True: a program per SM walking tiles)."""
    from fusedattn.kernels.gluon import bwd as hopper_bwd

    return launcher_constexprs(monkeypatch, hopper_bwd._dkdv_ws_kernel, lambda constexprs: constexprs["PERSISTENT"])


# The persistent pass (D=64's default: 128-row steps over two warpgroups, dQ split by rows and summed
# by the pass), each program walking several tiles -- so that a tile's K/V load, dK/dV staging and
# stores overlap its neighbours': odd lengths (a ragged last key block, Sk=70 leaving a warpgroup
# no key), causal with Sq > Sk (tiles whose rows see few keys) and Sq < Sk, a KV group walked whole,
# left windows (key blocks no query sees: tiles without steps), an lse gradient; 1, 3 and 5
# programs for 8 to 24 tiles.
PERSISTENT_CASES = [
    Case(2, 4, 4, 1000, 1000, 64, causal=True, dtype=torch.bfloat16),
    Case(1, 4, 2, 517, 333, 64, causal=True, layout="bhsd", lse_grad=True),
    Case(1, 4, 2, 333, 517, 64, causal=True, dtype=torch.bfloat16),
    Case(2, 2, 2, 700, 700, 64, dtype=torch.bfloat16),
    Case(2, 4, 4, 200, 70, 64, scale=0.3, layout="bhsd", dtype=torch.bfloat16),
    Case(1, 4, 2, 1000, 1000, 64, causal=True, window=(300, 0), dtype=torch.bfloat16),
    Case(1, 2, 2, 100, 1200, 64, window=(100, -1), layout="bhsd"),
]


@pytest.mark.parametrize("programs", [1, 3, 5])
@pytest.mark.parametrize("case", PERSISTENT_CASES, ids=[c.id for c in PERSISTENT_CASES])
def test_persistent_dkdv_matches_reference_and_the_one_tile_launch(case, programs, persistent_launches,
                                                                   monkeypatch):
    """Every gradient against the float64 reference, and dK, dV bit for bit those of one program per
    tile (each key's sums run in the same order; only dQ's reduce-adds may come in another)."""
    set_knobs(monkeypatch, group_sums=False)
    config = KernelConfig(128, 128, 4, 2, True, 0, 2, 0)
    q, k, v, dout, dlse = make_inputs(case, "cuda")

    def grads():
        leaves = [t.detach().clone().requires_grad_() for t in (q, k, v)]
        out = fusedattn.attention(*leaves, **case.options())
        out.backward(dout)
        return [t.grad for t in leaves]

    with pinned_dkdv(case, config, atomic_dq=True, dq_tma=True):
        set_knobs(monkeypatch, group_sums=False, dkdv_programs=0)
        one_tile = grads()
        set_knobs(monkeypatch, group_sums=False, dkdv_programs=programs)
        check_case(case, "triton", "cuda")
        walked = grads()
    assert persistent_launches == [False, True, True]
    assert torch.equal(walked[1], one_tile[1]) and torch.equal(walked[2], one_tile[2])
