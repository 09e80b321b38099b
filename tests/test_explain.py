"""``fusedattn.explain``: the plan it prints is the plan a call runs.

Each case is explained, then run forward and backward with spies on the planner's launch points
(the Triton forward, the Gluon forward, the Gluon dK/dV and dQ passes, the Triton backward passes):
the kernels that ran must be the ones the explanation names, and explaining must launch nothing.
Without a GPU the Triton backend runs under the interpreter (its reasons then name the device); on a
Hopper GPU the same cases reach the Gluon kernels.
"""

from __future__ import annotations

import math
import re

import pytest
import torch

import fusedattn
from fusedattn import dispatch
from fusedattn.kernels.triton import bwd as triton_bwd
from fusedattn.kernels.triton import fwd as triton_fwd

ON_GPU = torch.cuda.is_available()
DEVICE = "cuda" if ON_GPU else "cpu"
DTYPE = torch.bfloat16 if ON_GPU else torch.float16  # the interpreter computes bf16 dots wrong


def _inputs(batch, seqlen_q, seqlen_k, heads_q, heads_kv, head_dim, seed=0):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(batch, seqlen_q, heads_q, head_dim, generator=gen)
    k, v = (torch.randn(batch, seqlen_k, heads_kv, head_dim, generator=gen) for _ in range(2))
    return [t.to(DEVICE, DTYPE) for t in (q, k, v)]


def _case_options(name, seqlen_q, seqlen_k, heads_q):
    gen = torch.Generator().manual_seed(1)
    if name == "full bias":
        return dict(bias=torch.randn(1, heads_q, seqlen_q, seqlen_k, generator=gen).to(DEVICE, DTYPE).requires_grad_())
    if name == "row bias":
        return dict(bias=torch.randn(1, heads_q, seqlen_q, 1, generator=gen).to(DEVICE, DTYPE).requires_grad_())
    if name == "sinks":
        return dict(sinks=torch.randn(heads_q, generator=gen).to(DEVICE).requires_grad_())
    if name == "mask":
        keep = torch.rand(seqlen_q, seqlen_k, generator=gen) < 0.7
        return dict(mask=keep.to(DEVICE))
    if name == "block mask":  # whole 128x128 tiles: the Gluon kernels take it by its tile lists
        keep = torch.ones(seqlen_q, seqlen_k, dtype=torch.bool)
        keep[:128, 128:256] = False
        return dict(mask=keep.to(DEVICE))
    if name == "deterministic":
        return dict(deterministic=True)
    if name == "softcap window":
        return dict(softcap=20.0, window=(100, 0))
    return {}


# (name, batch, Sq, Sk, Hq, Hkv, D, causal): small under the interpreter, Gluon-sized on a GPU
SIZE = (1, 300, 300) if ON_GPU else (1, 37, 45)
CASES = [
    ("plain", *SIZE, 4, 4, 128 if ON_GPU else 32, False),
    ("plain", *SIZE, 4, 2, 64 if ON_GPU else 16, True),
    ("deterministic", *SIZE, 4, 2, 128 if ON_GPU else 32, True),
    ("full bias", *SIZE, 4, 4, 128 if ON_GPU else 32, True),
    ("row bias", *SIZE, 4, 2, 64 if ON_GPU else 16, False),
    ("sinks", *SIZE, 4, 2, 128 if ON_GPU else 32, True),
    ("mask", *SIZE, 4, 4, 64 if ON_GPU else 16, False),
    ("softcap window", *SIZE, 4, 2, 128 if ON_GPU else 32, False),
    ("plain", 1, 40, 40, 2, 2, 96, True),  # a head dim no Gluon kernel takes
]
if ON_GPU:
    CASES.append(("block mask", 1, 384, 384, 4, 4, 128, False))


def _spy(monkeypatch, module, name, ran: list, label: str, accepts=lambda result: result is not False):
    real = getattr(module, name)

    def spy(*args, **kwargs):
        result = real(*args, **kwargs)
        if accepts(result):
            ran.append(label)
        return result

    monkeypatch.setattr(module, name, spy)


@pytest.fixture
def ran(monkeypatch):
    """The kernels that ran, in order, by the names ``explain`` gives their families."""
    ran: list = []
    _spy(monkeypatch, triton_fwd, "forward", ran, "forward: Triton")
    _spy(monkeypatch, dispatch, "_gluon_forward", ran, "forward: Gluon")
    _spy(monkeypatch, dispatch, "_gluon_dkdv_pass", ran, "dK/dV: Gluon")
    _spy(monkeypatch, dispatch, "_gluon_dq_pass", ran, "dQ: Gluon", accepts=lambda result: result is not None)
    real_passes = triton_bwd.run_passes

    def passes(*args, **kwargs):
        gluon_dkdv, plan = args[14], args[12]
        ran.append("dK/dV: Triton" if not gluon_dkdv else "dQ: Triton")
        if not gluon_dkdv and not plan.atomic_dq:
            ran.append("dQ: Triton")
        return real_passes(*args, **kwargs)

    monkeypatch.setattr(triton_bwd, "run_passes", passes)
    return ran


def _named(explanation) -> list:
    """The launches an explanation promises, in the spies' terms."""
    family = lambda kernel: "Gluon" if kernel.startswith("Gluon") else "Triton"  # noqa: E731
    steps = {s.name: s.kernel for s in explanation.backward}
    promised = [f"forward: {family(explanation.forward[0].kernel)}", f"dK/dV: {family(steps['dK/dV'])}"]
    if steps["dQ"].startswith("summed by"):
        return promised
    return promised + [f"dQ: {family(steps['dQ'])}"]


@pytest.mark.parametrize("name,batch,seqlen_q,seqlen_k,heads_q,heads_kv,head_dim,causal", CASES,
                         ids=[f"{c[0]}-D{c[6]}{'-causal' if c[7] else ''}" for c in CASES])
def test_explain_names_the_kernels_that_run(name, batch, seqlen_q, seqlen_k, heads_q, heads_kv, head_dim, causal,
                                            ran):
    q, k, v = _inputs(batch, seqlen_q, seqlen_k, heads_q, heads_kv, head_dim)
    options = dict(causal=causal, **_case_options(name, seqlen_q, seqlen_k, heads_q))
    with fusedattn.use_backend("triton"):
        explanation = fusedattn.explain(q, k, v, show=False, **options)
        assert ran == [], "explaining launched a kernel"
        leaves = [t.requires_grad_() for t in (q, k, v)]
        fusedattn.attention(*leaves, **options).float().square().sum().backward()
    assert explanation.backend == "triton"
    assert sorted(ran) == sorted(_named(explanation)), str(explanation)
    steps = {s.name: s for s in explanation.backward}
    if "bias" in options:
        want = "closed form" if name == "row bias" else ""
        assert want in steps["bias gradient"].kernel
    assert ("sinks gradient" in steps) == ("sinks" in options)
    for step in (*explanation.forward, *explanation.backward):  # every Triton fallback says why
        if step.kernel.startswith("Triton") and step.name in ("forward", "dK/dV"):
            assert step.why, step


def test_explain_gives_the_reasons_a_fast_path_is_not_taken():
    q, k, v = _inputs(1, 40, 40, 2, 2, 96)
    with fusedattn.use_backend("triton"):
        explanation = fusedattn.explain(q, k, v, show=False, sinks=torch.zeros(2, device=DEVICE))
    forward = explanation.forward[0]
    assert forward.kernel == "Triton forward"
    if not ON_GPU:
        assert forward.why == "not a CUDA tensor"
    elif torch.cuda.get_device_capability()[0] == 9:
        assert "D=96" in forward.why  # the problem itself: no Gluon kernel takes that head dim
    else:
        assert "sm_90" in forward.why


def test_explain_deterministic_sums_dq_in_a_fixed_order():
    q, k, v = _inputs(1, *SIZE[1:], 4, 4, 128 if ON_GPU else 32)
    with fusedattn.use_backend("triton"):
        explanation = fusedattn.explain(q, k, v, show=False, causal=True, deterministic=True)
    dq = {s.name: s for s in explanation.backward}["dQ"]
    assert "atomics" not in dq.kernel and "fixed order" in dq.why and "deterministic" in dq.why


def test_explain_names_the_causal_fixed_orders_launch():
    """Deterministic mode's fixed dQ order under a causal bound: its launch depends on the shape
    (``gluon.bwd.fixed_order_launch``), so dQ's reason points at the dK/dV step, whose launch form names
    it -- heaviest or lightest programs first, the chunk, interleaved or not; without a bound there is
    no such choice to name."""
    from fusedattn.spec import UNBOUNDED, AttentionSpec
    from fusedattn.tuning.configs import INTERPRETER_CONFIGS

    causal = AttentionSpec("bhsd", UNBOUNDED, 0, 0.125, 0.0, True)  # deterministic
    full = AttentionSpec("bhsd", UNBOUNDED, UNBOUNDED, 0.125, 0.0, True)
    route = dict(atomic_dq=True, gluon_dkdv=True, gluon_dq=False, group_walk=False, mask=None, bias=None,
                 packing=None)
    assert "launched as the dK/dV step says" in dispatch._dq_route(causal, INTERPRETER_CONFIGS, **route)
    assert "launched" not in dispatch._dq_route(full, INTERPRETER_CONFIGS, **route)
    interleaved = dispatch._launch_form(0, 512, (True, 8, True))
    assert interleaved.startswith("one program per tile (512 tiles), heaviest programs first")
    assert "chunks of 8 head rows" in interleaved and "lighter half launched among" in interleaved
    lightest = dispatch._launch_form(0, 2048, (False, 4, False))
    assert "lightest programs first" in lightest and "chunks of 4 head rows" in lightest
    assert "among" not in lightest
    assert dispatch._launch_form(0, 512) == "one program per tile (512 tiles)"


def test_explain_says_why_a_causal_launch_of_few_programs_keeps_the_dq_pass():
    """The fixed order refused for its launch (``dispatch.ordered_dq_balances``): the reason names it,
    and only then."""
    from fusedattn.spec import UNBOUNDED, AttentionSpec
    from fusedattn.tuning.configs import INTERPRETER_CONFIGS

    causal = AttentionSpec("bhsd", UNBOUNDED, 0, 0.125, 0.0, True)  # deterministic
    route = dict(atomic_dq=False, gluon_dkdv=True, gluon_dq=True, group_walk=False, mask=None, bias=None,
                 packing=None)
    refused = dispatch._dq_route(causal, INTERPRETER_CONFIGS, unbalanced=True, **route)
    assert "too few programs an SM" in refused and "deterministic" in refused
    assert "too few" not in dispatch._dq_route(causal, INTERPRETER_CONFIGS, **route)


def test_explain_prints_the_plan_and_checks_arguments_like_attention(capsys):
    q, k, v = _inputs(1, 8, 8, 2, 2, 16)
    explanation = fusedattn.explain(q, k, v, causal=True)
    printed = capsys.readouterr().out
    assert printed.strip() == str(explanation)
    assert printed.startswith(f"backend: {dispatch.resolve_backend(q.device)}")
    assert "forward:" in printed and "backward:" in printed
    with pytest.raises(ValueError, match="layout"):
        fusedattn.explain(q, k, v, layout="sbhd")
    with pytest.raises(ValueError):
        fusedattn.attention(q, k, v, layout="sbhd")


def test_explain_on_the_pytorch_backend_names_the_cpu_path():
    q, k, v = (t.cpu() for t in _inputs(1, 8, 8, 2, 2, 16))
    with fusedattn.use_backend("torch"):
        plain = fusedattn.explain(q, k, v, show=False)
        capped = fusedattn.explain(q, k, v, show=False, softcap=10.0)
    assert plain.backend == capped.backend == "torch"
    assert "chunks of keys" in capped.forward[0].kernel and "softcap" in capped.forward[0].why
    fused = dispatch.cpu.fused_kernel_available()
    assert ("fused" in plain.forward[0].kernel) == fused


HOPPER = ON_GPU and torch.cuda.get_device_capability()[0] == 9
# (batch, S, heads, D, causal, the passes the rounds model runs persistent on 132 SMs): short causal rows
# with more tiles than SMs at head counts where one program per SM would balance badly, the forward's
# rounds modelled slower than one program per tile, and no causal bound
LAUNCH_CASES = [(1, 1024, 32, 64, True, {"dK/dV"}), (1, 2048, 16, 128, True, {"forward"}),
                (2, 1024, 18, 128, True, set()), (1, 1024, 8, 64, False, set())]


@pytest.mark.skipif(not HOPPER, reason="the Gluon kernels run on sm_90 GPUs only")
@pytest.mark.parametrize("batch,seqlen,heads,head_dim,causal,persistent", LAUNCH_CASES)
def test_explain_reports_the_launch_form_that_runs(batch, seqlen, heads, head_dim, causal, persistent, monkeypatch):
    from fusedattn.kernels.gluon import bwd as gluon_bwd
    from fusedattn.kernels.gluon import fwd as gluon_fwd

    grids = {}

    def spy(module, name, step, when=lambda kwargs: True):
        real = getattr(module, name)

        def launcher(*args, **kwargs):
            built = real(*args, **kwargs)
            if when(kwargs):
                grids[step] = built.grid
            return built

        monkeypatch.setattr(module, name, launcher)

    spy(gluon_fwd, "_forward_launcher", "forward", when=lambda kwargs: kwargs.get("stats_stride") is None)
    spy(gluon_bwd, "_dkdv_launcher", "dK/dV")
    q, k, v = _inputs(batch, seqlen, seqlen, heads, heads, head_dim)
    with fusedattn.use_backend("triton"):
        explanation = fusedattn.explain(q, k, v, causal=causal, show=False)
        leaves = [t.requires_grad_() for t in (q, k, v)]
        fusedattn.attention(*leaves, causal=causal).float().square().sum().backward()
    steps = {s.name: s for s in (*explanation.forward, *explanation.backward)}
    assert set(grids) == {"forward", "dK/dV"}, str(explanation)
    for step, grid in grids.items():
        launch = steps[step].launch
        if launch.startswith("persistent"):
            programs, tiles = map(int, re.fullmatch(r"persistent: (\d+) programs walk (\d+) tiles in rounds",
                                                    launch).groups())
            assert grid == (programs,) and programs < tiles, (step, grid, launch)
        else:
            assert launch == f"one program per tile ({math.prod(grid)} tiles)", (step, grid, launch)
    if torch.cuda.get_device_properties(0).multi_processor_count == 132:
        assert {step for step in grids if steps[step].launch.startswith("persistent")} == persistent, str(explanation)


@pytest.mark.skipif(not HOPPER, reason="the Gluon kernels run on sm_90 GPUs only")
@pytest.mark.parametrize("batch,heads,head_dim", [(1, 16, 128), (2, 32, 64)])
def test_explain_names_the_fixed_orders_launch_that_runs(batch, heads, head_dim, monkeypatch):
    """Deterministic, causal, 4k keys: the dK/dV step's launch form names the launch the launcher
    builds -- its grid, its chunk of head rows, and the interleave exactly where the launch is
    ``interleaved_order``'s (CHUNKED 3)."""
    from fusedattn.kernels.gluon import bwd as gluon_bwd

    built = []
    real = gluon_bwd._dkdv_launcher

    def launcher(*args, **kwargs):
        built.append(real(*args, **kwargs))
        return built[-1]

    monkeypatch.setattr(gluon_bwd, "_dkdv_launcher", launcher)
    q, k, v = _inputs(batch, 4096, 4096, heads, heads, head_dim)
    explanation = fusedattn.explain(q, k, v, causal=True, deterministic=True, show=False)
    leaves = [t.requires_grad_() for t in (q, k, v)]
    fusedattn.attention(*leaves, causal=True, deterministic=True).float().square().sum().backward()
    launch = {s.name: s for s in explanation.backward}["dK/dV"].launch
    assert len(built) == 1 and built[0].options["ORDERED"], str(explanation)
    tiles, key_blocks = math.prod(built[0].grid), 4096 // 128
    rows = next(b for a, b, c in zip(built[0].template, built[0].template[1:], built[0].template[2:])
                if (a, c) == (key_blocks, tiles))
    assert launch.startswith(f"one program per tile ({tiles} tiles), heaviest programs first"), launch
    assert f"chunks of {rows} head rows" in launch, launch
    assert ("among the next chunk's heavier half" in launch) == (built[0].options["CHUNKED"] == 3), launch
    if torch.cuda.get_device_properties(0).L2_cache_size >= 48 * 2 ** 20:  # the rule's chunks fit twice
        assert built[0].options["CHUNKED"] == 3, launch
