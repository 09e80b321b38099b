"""The opt-in tuning run (tuning/search.py, python -m fusedattn.tune), on the interpreter with a
scripted timer: it keeps the fastest candidate of each kernel, never one that computes a wrong
result, and the entry it writes is the one a later launch selects."""

import pytest
import torch

from fusedattn import tune as tune_cli
from fusedattn.tuning import cache, configs, search
from fusedattn.tuning.configs import INTERPRETER_CONFIGS, KernelConfig

requires_interpreter = pytest.mark.skipif(torch.cuda.is_available(), reason="scripted timings: runs on the CPU")

PROBLEM = search.TuningProblem(16, 16, seqlen=40, dtype=torch.float16, causal=True, tokens=80, hidden=32)
SMALL, TALL, WIDE = KernelConfig(16, 16, 1, 1, True), KernelConfig(32, 16, 1, 1, True), KernelConfig(16, 32, 1, 1, True)
CANDIDATES = dict(forward=[SMALL, TALL], dkdv=[SMALL, WIDE], dq=[TALL, SMALL])
CHECK_LENGTHS = (37, 53)


def scripted_timer(fast: dict[str, KernelConfig], atomic_dq_ms: float = 2.0, gluon_dq_ms: float = 3.0):
    """A model GPU: each kernel takes 1 ms with its 'fast' config, else 2 ms; a backward is the
    dK/dV pass plus the dQ pass, or plus ``atomic_dq_ms`` when the dK/dV pass sums dQ by atomics.
    A Gluon dQ pass, where one is named, replaces the Triton one: 0.5 ms with its 'fast' config, else
    ``gluon_dq_ms`` (on the CPU the Triton pass really runs in its place)."""
    def cost(configs_, kernel):
        return 1.0 if getattr(configs_, kernel) == fast.get(kernel) else 2.0

    def timer(phase, candidate_configs, fn):
        fn()  # the launch must work, whatever the script says
        if phase == "forward":
            return cost(candidate_configs, "forward")
        if candidate_configs.atomic_dq:
            dq_ms = atomic_dq_ms
        elif candidate_configs.gluon_dq is not None:
            dq_ms = 0.5 if candidate_configs.gluon_dq == fast.get("gluon_dq") else gluon_dq_ms
        else:
            dq_ms = cost(candidate_configs, "dq")
        return cost(candidate_configs, "dkdv") + dq_ms
    return timer


@requires_interpreter
def test_keeps_the_fastest_correct_candidate_of_each_kernel():
    timer = scripted_timer(dict(forward=TALL, dkdv=WIDE))  # dq: no candidate beats the start
    result = search.tune(PROBLEM, INTERPRETER_CONFIGS, "cpu", candidates=CANDIDATES, timer=timer,
                         check_lengths=CHECK_LENGTHS)
    assert result.configs.forward == TALL and result.configs.dkdv == WIDE
    assert result.configs.dq == INTERPRETER_CONFIGS.dq  # a tie with the start keeps the start
    assert not result.configs.atomic_dq and not result.configs.fuse_dq_pass  # atomics tie: reproducible schedule
    assert result.before_ms == dict(forward=2.0, backward=4.0) and result.after_ms == dict(forward=1.0, backward=3.0)
    assert all(isinstance(ms, float) for trials in result.trials.values() for _, ms in trials)


@requires_interpreter
def test_dq_by_atomics_is_kept_when_faster_with_the_tuned_dq_pass_for_deterministic_mode():
    timer = scripted_timer(dict(dkdv=WIDE, dq=TALL), atomic_dq_ms=0.5)  # 1 + 0.5 ms against 1 + 1 ms
    result = search.tune(PROBLEM, INTERPRETER_CONFIGS, "cpu", candidates=CANDIDATES, timer=timer,
                         check_lengths=CHECK_LENGTHS)
    assert result.configs.atomic_dq and not result.configs.dq_tma  # no TMA reduce-add on the CPU
    assert (result.configs.dkdv, result.configs.dq) == (WIDE, TALL)  # deterministic calls run this dQ pass
    (candidate, outcome), = result.trials[search.DQ_SCHEME]
    assert candidate == WIDE and outcome == 1.5
    assert result.after_ms["backward"] == 1.5


@requires_interpreter
def test_a_candidate_with_a_wrong_result_is_never_chosen(monkeypatch):
    real_forward = search.attention_forward

    def forward_broken_for_tall_tiles(q, k, v, spec, config):
        out, lse = real_forward(q, k, v, spec, config)
        return (out * 1.01, lse) if config == TALL else (out, lse)

    monkeypatch.setattr(search, "attention_forward", forward_broken_for_tall_tiles)
    timer = scripted_timer(dict(forward=TALL))  # the broken config would be the fastest
    result = search.tune(PROBLEM, INTERPRETER_CONFIGS, "cpu", candidates=dict(CANDIDATES, dkdv=[], dq=[]),
                         timer=timer, check_lengths=CHECK_LENGTHS)
    outcomes = dict(result.trials["forward"])
    assert outcomes[TALL].startswith("wrong result (out:"), outcomes
    assert isinstance(outcomes[SMALL], float) and result.configs.forward == SMALL


@requires_interpreter
def test_the_written_entry_is_what_a_later_launch_selects(monkeypatch, tmp_path):
    """tune_entry on the CPU stands in for the GPU run: the entry it stores under a pretend GPU's
    key is what select_configs returns on that GPU for any length of the class."""
    gpu, capability = "NVIDIA H200", (9, 0)
    tuning_file = tmp_path / "tuning.json"
    result = tune_cli.tune_entry(PROBLEM, "cpu", gpu, capability, cache.TuningCache(tuning_file),
                                 start=INTERPRETER_CONFIGS, candidates=CANDIDATES,
                                 timer=scripted_timer(dict(forward=TALL, dkdv=WIDE, dq=TALL)),
                                 check_lengths=CHECK_LENGTHS)
    assert (result.configs.forward, result.configs.dkdv, result.configs.dq) == (TALL, WIDE, TALL)
    monkeypatch.setenv("FUSEDATTN_TUNING_CACHE", str(tuning_file))
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda index=None: gpu)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda index=None: capability)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    configs.reload_tuning_cache()
    try:
        for seqlen_k in (1, 40, 2048):
            assert configs.select_configs(torch.device("cuda"), torch.float16, 16, 16, seqlen_k,
                                          has_right=True) == result.configs
        assert configs.select_configs(torch.device("cuda"), torch.float16, 16, 16, 40) != result.configs  # not causal
    finally:
        configs.reload_tuning_cache()


@requires_interpreter
def test_command_says_it_needs_a_gpu(capsys):
    assert tune_cli.main([]) == 2
    assert "CUDA GPU" in capsys.readouterr().err


@requires_interpreter
def test_a_gain_inside_timing_noise_keeps_the_current_config():
    def timer(phase, candidate_configs, fn):
        fn()
        return 2.0 * (1 - search.MIN_GAIN / 2) if candidate_configs.forward == TALL else 2.0

    result = search.tune(PROBLEM, INTERPRETER_CONFIGS, "cpu", candidates=dict(forward=[TALL], dkdv=[], dq=[]),
                         timer=timer, check_lengths=CHECK_LENGTHS)
    assert result.configs.forward == INTERPRETER_CONFIGS.forward and dict(result.trials["forward"])[TALL] < 2.0


GLUON_A = KernelConfig(128, 64, 4, 3, True, 0, 2, 1)
GLUON_B = KernelConfig(128, 128, 4, 2, True, 0, 2, 1)


@requires_interpreter
@pytest.mark.parametrize("start_gluon, fast, chosen, backward_ms", [
    (None, GLUON_B, GLUON_B, 2.5),  # a Gluon dQ pass faster than the Triton one is chosen
    (GLUON_A, None, None, 3.0),  # both Gluon candidates slower: the Triton dQ pass (None) replaces the start's
    (GLUON_A, GLUON_A, GLUON_A, 2.5),  # the start's is the fastest: kept
], ids=["gluon-wins", "triton-wins", "start-kept"])
def test_the_gluon_dq_pass_is_searched_against_the_triton_one(start_gluon, fast, chosen, backward_ms):
    """The Triton dQ pass is tuned with the Gluon one off (TALL: 1 ms, else 2), then None (the
    Triton pass) and the Gluon candidates are timed: 0.5 ms for the 'fast' Gluon config, else 3."""
    from dataclasses import replace

    start = replace(INTERPRETER_CONFIGS, gluon_dq=start_gluon)
    timer = scripted_timer(dict(dq=TALL, gluon_dq=fast))
    result = search.tune(PROBLEM, start, "cpu", candidates=dict(CANDIDATES, gluon_dq=[GLUON_A, GLUON_B]),
                         timer=timer, check_lengths=CHECK_LENGTHS)
    assert result.configs.dq == TALL  # timed with the Gluon pass off, whatever the start named
    assert result.configs.gluon_dq == chosen
    tried = [c for c, _ in result.trials["gluon_dq"]]
    assert tried == [None, GLUON_A, GLUON_B] and all(isinstance(ms, float) for _, ms in result.trials["gluon_dq"])
    assert result.after_ms["backward"] == backward_ms  # the dK/dV pass (2 ms) and the chosen dQ pass


@requires_interpreter
def test_a_candidate_fast_only_once_is_not_chosen():
    """The stage's fastest candidate is timed again against the current config, alternately: one
    that was fast in its trial (a cold card, say) but not again keeps the current config."""
    timings = []

    def timer(phase, candidate_configs, fn):
        fn()
        if phase == "forward" and candidate_configs.forward == TALL:
            timings.append(candidate_configs.forward)
            return 1.0 if len(timings) == 1 else 2.0  # fast in its trial only
        return 2.0

    result = search.tune(PROBLEM, INTERPRETER_CONFIGS, "cpu", candidates=dict(forward=[TALL], dkdv=[], dq=[]),
                         timer=timer, check_lengths=CHECK_LENGTHS)
    assert dict(result.trials["forward"])[TALL] == 1.0
    assert result.confirmed_ms["forward"] == (2.0, 2.0) and len(timings) == 1 + search.CONFIRM_PAIRS
    assert result.configs.forward == INTERPRETER_CONFIGS.forward
