"""The backward's dQ pass run by the warp-specialised Gluon forward's kernel (kernels/hopper_fwd.py,
GRAD_Q; sm_90 only): where dQ has a pass of its own (deterministic mode; at D=64 every mode) and a
config names it (the default does at D=128), every schedule a config may name (2 or 3 consumer
warpgroups, taking turns or not, 64- or 128-key steps) on odd lengths, causal with Sq > Sk (rows
with no key) and Sq < Sk, a ragged last key block, GQA, sliding windows, softcap, dropout, both layouts,
a custom scale and a gradient on lse -- every gradient against the float64 reference (SPEC 4). A spy
proves the Gluon dQ pass ran (or, for problems it does not take, that the Triton dQ programs did);
dQ is bitwise reproducible, in every launch order."""

from dataclasses import replace

import pytest
import torch

import fusedattn
from fusedattn.kernels.triton import bwd
from fusedattn.tuning.configs import KernelConfig, pinned_configs, select_configs

from attention_runner import check_case, launcher_constexprs, make_inputs, record_launches, set_knobs
from cases import Case

HOPPER = torch.cuda.is_available() and torch.cuda.get_device_capability()[0] == 9
pytestmark = pytest.mark.skipif(not HOPPER, reason="the Gluon kernels run on sm_90 GPUs only")


def dq_config(split: int, pingpong: int, block_n: int = 64, stages: int = 3) -> KernelConfig:
    return KernelConfig(64 * split, block_n, 4, stages, True, 0, split, pingpong)


SCHEDULES = [dq_config(2, 1), dq_config(2, 0), dq_config(2, 1, 128, 2), dq_config(3, 1)]


def schedule_id(c: KernelConfig) -> str:
    return f"ws{c.hopper_split}-pp{c.hopper_pingpong}-n{c.block_n}-s{c.num_stages}"


CASES = [
    Case(2, 4, 4, 1000, 1000, 128, layout="bhsd", deterministic=True, dtype=torch.bfloat16),
    Case(1, 4, 2, 333, 517, 128, causal=True, deterministic=True, dtype=torch.bfloat16),
    Case(1, 4, 2, 517, 333, 64, causal=True, layout="bhsd", deterministic=True),  # Sq > Sk: rows see no key
    Case(2, 4, 1, 300, 300, 64, causal=True, dtype=torch.bfloat16),  # GQA 4/1, D=64 default mode
    Case(1, 2, 2, 7, 700, 128, deterministic=True, dtype=torch.bfloat16),  # a few queries, many keys
    Case(1, 2, 2, 200, 70, 64, scale=0.3, layout="bhsd", dtype=torch.bfloat16),  # a ragged, lone key block
    Case(1, 3, 3, 129, 129, 128, causal=True, deterministic=True, lse_grad=True),
    # sliding windows: masked key blocks on both sides of the interior ones; narrower than a tile
    Case(1, 4, 2, 1000, 1000, 128, causal=True, window=(300, 0), deterministic=True, dtype=torch.bfloat16),
    Case(2, 2, 1, 333, 333, 128, causal=True, window=(20, 0), deterministic=True, lse_grad=True),
    Case(1, 2, 2, 517, 700, 64, window=(100, -1), layout="bhsd"),
    # softcap: the capped scores, dS times 1 - tanh^2, dQ scaled by qk_scale * softcap
    Case(1, 4, 2, 517, 333, 128, causal=True, softcap=20.0, deterministic=True, dtype=torch.bfloat16),
    Case(2, 2, 2, 255, 255, 64, softcap=5.0, lse_grad=True),
    Case(1, 2, 2, 700, 300, 128, causal=True, window=(150, 0), softcap=10.0, deterministic=True, layout="bhsd"),
    # dropout: dP of a dropped probability is 0 (the forward's keep tile, rows = queries)
    Case(1, 4, 2, 333, 517, 128, causal=True, dropout=0.2, deterministic=True, dtype=torch.bfloat16),
    Case(2, 2, 2, 255, 255, 64, softcap=5.0, dropout=0.5, lse_grad=True),
]


def fits(case: Case, config: KernelConfig) -> bool:
    # 128-key steps with three warpgroups spill at D=64 and do not fit shared memory at D=128
    return config.hopper_split == 2 or config.block_n == 64


CASE_SCHEDULES = [(case, config) for case in CASES for config in SCHEDULES if fits(case, config)]


@pytest.fixture
def dq_launches(monkeypatch):
    from fusedattn.kernels.gluon import fwd as hopper_fwd

    return record_launches(monkeypatch, hopper_fwd, "dq_pass")


def pinned_dq(case: Case, config: KernelConfig | None):
    """The heuristic's configs with ``config`` as the Gluon dQ pass, dQ by its own pass in every mode
    (where the heuristic sums dQ in the dK/dV pass, non-deterministic calls would not run it)."""
    base = select_configs(torch.device("cuda"), case.dtype, case.head_dim, case.dv)
    return pinned_configs(replace(base, gluon_dq=config, atomic_dq=False, dq_tma=False))


@pytest.mark.parametrize("case,config", CASE_SCHEDULES,
                         ids=[f"{case.id}-{schedule_id(config)}" for case, config in CASE_SCHEDULES])
def test_gluon_dq_pass_matches_reference(case, config, dq_launches):
    with pinned_dq(case, config):
        check_case(case, "triton", "cuda")
    assert dq_launches == [True], "the Gluon dQ pass did not run"


ORDERS = {"head-major": 1, "chunks-of-3": 3, "block-major": 0}


@pytest.mark.parametrize("chunk", ORDERS.values(), ids=ORDERS.keys())
def test_gluon_dq_pass_gives_the_same_bits_in_every_order(chunk, dq_launches, monkeypatch):
    """Each dQ row is summed by one warpgroup in key order: a second run, and any launch order of
    the programs, gives the same bits (deterministic=True's promise); the Triton dQ pass, summing
    in another order and tiling, agrees within the tolerance only."""
    case = Case(2, 6, 2, 400, 400, 128, causal=True, deterministic=True, dtype=torch.bfloat16)
    q, k, v, dout, _ = make_inputs(case, "cuda")

    def dq():
        leaves = [t.detach().clone().requires_grad_() for t in (q, k, v)]
        fusedattn.attention(*leaves, causal=True, deterministic=True).backward(dout)
        return leaves[0].grad

    with pinned_dq(case, dq_config(2, 1)):
        default = dq()
        set_knobs(monkeypatch, chunk_heads=chunk)
        first, second = dq(), dq()
    assert torch.equal(first, second) and torch.equal(first, default)
    assert dq_launches == [True] * 3


@pytest.mark.parametrize("options", [dict(mask="full", mask_blocks=(128, 128)), dict(bias="full")],
                         ids=["mask", "bias"])
def test_problems_it_does_not_take_run_the_triton_dq_pass(options, dq_launches, monkeypatch):
    """A mask, a bias: dQ from the Triton dQ programs (the Gluon pass is not launched)."""
    triton_dq = launcher_constexprs(monkeypatch, bwd._backward_kernel, lambda constexprs: constexprs["RUN_DQ"])
    case = Case(1, 2, 2, 256, 256, 128, causal=True, deterministic=True, dtype=torch.bfloat16, **options)
    with pinned_dq(case, dq_config(2, 1)):
        check_case(case, "triton", "cuda")
    assert not dq_launches and True in triton_dq


def test_without_a_gluon_dq_config_the_triton_dq_pass_runs(dq_launches, monkeypatch):
    triton_dq = launcher_constexprs(monkeypatch, bwd._backward_kernel, lambda constexprs: constexprs["RUN_DQ"])
    case = Case(1, 2, 2, 300, 300, 128, causal=True, deterministic=True, dtype=torch.bfloat16)
    with pinned_dq(case, None):
        check_case(case, "triton", "cuda")
    assert not dq_launches and triton_dq == [True]


@pytest.fixture
def group_sum_launches(monkeypatch):
    """GROUP_SUM of every Gluon dK/dV launch (True: one program per query head, fp32 group sums)."""
    from fusedattn.kernels.gluon import bwd as hopper_bwd

    return launcher_constexprs(monkeypatch, hopper_bwd._dkdv_ws_kernel, lambda constexprs: constexprs["GROUP_SUM"])


def test_short_causal_gqa_takes_the_deterministic_form_by_default(dq_launches, group_sum_launches):
    """Causal GQA with keys up to SHORT_KEYS at D=128, default mode: one dK/dV program walks each KV
    head's whole group and the Gluon dQ pass sums dQ (bwd.walks_group_with_dq_pass) -- correct, and
    every gradient the same bits twice; longer keys keep the 5-matmul pass with group sums."""
    short = Case(2, 6, 2, 333, 517, 128, causal=True, dtype=torch.bfloat16)
    check_case(short, "triton", "cuda")
    assert dq_launches == [True] and group_sum_launches == [False]
    q, k, v, dout, _ = make_inputs(short, "cuda")

    def grads():
        leaves = [t.detach().clone().requires_grad_() for t in (q, k, v)]
        fusedattn.attention(*leaves, causal=True).backward(dout)
        return [t.grad for t in leaves]

    first, second = grads(), grads()
    assert all(torch.equal(a, b) for a, b in zip(first, second))
    long = Case(1, 4, 2, 600, 2100, 128, causal=True, dtype=torch.bfloat16)
    check_case(long, "triton", "cuda")
    assert dq_launches == [True] * 3 and group_sum_launches[-1] is True
