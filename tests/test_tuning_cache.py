"""The on-disk cache of tuned launch configs (tuning/cache.py): an entry is found again, is used
only when every field of its key matches, and lengths of one class share one entry."""

import shutil
from dataclasses import replace

import pytest
import torch

import fusedattn._version
from fusedattn.tuning import cache, configs
from fusedattn.tuning.configs import AttentionConfigs, KernelConfig

KEY_ARGS = dict(gpu_name="NVIDIA H200", capability=(9, 0), dtype=torch.bfloat16, head_dim=128, head_dim_v=128,
                seqlen_k=4096, has_left=False, has_right=True, has_softcap=False)
TUNED = AttentionConfigs(forward=KernelConfig(128, 64, 8, 4, True), dkdv=KernelConfig(32, 128, 8, 3),
                         dq=KernelConfig(64, 64, 4, 2, True), preprocess_block_m=32, fuse_dq_pass=True)


def test_entry_round_trips_through_the_file(tmp_path):
    path = tmp_path / "tuning.json"
    key = cache.config_key(**KEY_ARGS)
    cache.TuningCache(path).put(key, TUNED)
    assert cache.TuningCache(path).get(key) == TUNED
    assert cache.TuningCache(path).get(cache.config_key(**dict(KEY_ARGS, head_dim=64))) is None
    assert cache.TuningCache(tmp_path / "absent.json").get(key) is None


@pytest.mark.parametrize("field,value", [
    ("gpu_name", "NVIDIA H100 80GB HBM3"), ("capability", (9, 1)), ("dtype", torch.float16), ("head_dim", 64),
    ("head_dim_v", 64), ("seqlen_k", 1024), ("has_left", True), ("has_right", False), ("has_softcap", True),
])
def test_key_changes_with_every_field_that_changes_the_choice(field, value):
    assert cache.config_key(**dict(KEY_ARGS, **{field: value})) != cache.config_key(**KEY_ARGS)


def test_key_changes_with_package_triton_and_kernel_sources(monkeypatch, tmp_path):
    base = cache.config_key(**KEY_ARGS)
    with monkeypatch.context() as m:
        m.setattr(fusedattn._version, "__version__", "9.9.9")
        assert cache.config_key(**KEY_ARGS) != base
    with monkeypatch.context() as m:
        m.setattr(cache.triton, "__version__", "0.0.1")
        assert cache.config_key(**KEY_ARGS) != base
    edited = tmp_path / "kernels"
    shutil.copytree(cache.KERNEL_DIR, edited, ignore=shutil.ignore_patterns("__pycache__"))
    with monkeypatch.context() as m:  # the same sources elsewhere: the same key
        m.setattr(cache, "KERNEL_DIR", edited)
        cache.kernel_source_hash.cache_clear()
        assert cache.config_key(**KEY_ARGS) == base
    backward = edited / "triton" / "bwd.py"  # one kernel file one level down, edited
    backward.write_text(backward.read_text() + "\n# edited\n")
    with monkeypatch.context() as m:
        m.setattr(cache, "KERNEL_DIR", edited)
        cache.kernel_source_hash.cache_clear()
        assert cache.config_key(**KEY_ARGS) != base
    cache.kernel_source_hash.cache_clear()
    assert cache.config_key(**KEY_ARGS) == base


def test_lengths_of_one_class_share_an_entry():
    """Kernels take lengths as runtime values: no entry (and no tuning run) per length."""
    assert cache.config_key(**dict(KEY_ARGS, seqlen_k=4096)) == cache.config_key(**dict(KEY_ARGS, seqlen_k=131072))
    assert cache.config_key(**dict(KEY_ARGS, seqlen_k=1)) == cache.config_key(**dict(KEY_ARGS, seqlen_k=2048))


def test_select_uses_a_matching_entry_and_ignores_a_stale_one(monkeypatch, tmp_path):
    """select_configs on a (pretend) H200: the heuristic without a cache, the tuned configs when
    the key matches, the heuristic again when the entry was tuned under other kernel sources."""
    monkeypatch.setenv("FUSEDATTN_TUNING_CACHE", str(tmp_path / "tuning.json"))
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda index=None: KEY_ARGS["gpu_name"])
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda index=None: KEY_ARGS["capability"])
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    device = torch.device("cuda")
    select = dict(device=device, dtype=torch.bfloat16, head_dim=128, head_dim_v=128, seqlen_k=8192, has_right=True)
    configs.reload_tuning_cache()
    try:
        heuristic = configs.select_configs(**select)
        assert heuristic == configs._cuda_configs(torch.bfloat16, 128, 128, 8192, (9, 0), has_right=True)
        cache.TuningCache(tmp_path / "tuning.json").put(cache.config_key(**KEY_ARGS), TUNED)
        configs.reload_tuning_cache()
        assert configs.select_configs(**select) == TUNED
        assert configs.select_configs(**dict(select, has_right=False)) == configs._cuda_configs(
            torch.bfloat16, 128, 128, 8192, (9, 0), has_right=False)  # other flags: no entry, the heuristic
        with monkeypatch.context() as m:  # an entry tuned under other kernel sources
            m.setattr(cache, "kernel_source_hash", lambda: "another-kernel-version")
            stale_key = cache.config_key(**dict(KEY_ARGS, seqlen_k=1024))
        cache.TuningCache(tmp_path / "tuning.json").put(stale_key, replace(TUNED, preprocess_block_m=16))
        configs.reload_tuning_cache()
        assert configs.select_configs(**dict(select, seqlen_k=1024)) == configs._cuda_configs(
            torch.bfloat16, 128, 128, 1024, (9, 0), has_right=True)
    finally:
        configs.reload_tuning_cache()


# (head dim, left window or None, takes the window configs): configs.WIDE_LEFT_WINDOW's bounds
BAND_CASES = [(64, None, False), (64, 127, True), (64, 254, True), (64, 255, False), (64, 2047, False),
              (128, 0, True), (128, 255, True), (128, 510, True), (128, 511, False), (128, 1023, False),
              (96, 10 ** 6, True)]


@pytest.mark.parametrize("head_dim,left,band", BAND_CASES)
def test_wide_left_windows_take_the_configs_of_problems_without_one(head_dim, left, band):
    from fusedattn.spec import UNBOUNDED, AttentionSpec

    spec = AttentionSpec("bshd", UNBOUNDED if left is None else left, 0, 1.0, 0.0, False)
    assert configs.band_window(spec, head_dim) is band
    if head_dim in (64, 128):  # the Gluon forwards: the band's 2 warpgroups, else 3 taking turns at long keys
        chosen = configs._cuda_configs(torch.bfloat16, head_dim, head_dim, 8192, (9, 0), has_left=band, has_right=True)
        assert chosen.forward.hopper_split == (2 if band else 3)


# (dK/dV config, the config the pass runs where it does not sum dQ): ping-pong 0 is the lockstep
# form, whose warpgroups meet at dQ's barrier; without dQ they take turns (dispatch.dkdv_without_dq)
NO_DQ_CASES = [
    (KernelConfig(128, 128, 4, 2, True, 0, 2, 0), KernelConfig(128, 128, 4, 2, True, 0, 2, 2)),
    (KernelConfig(64, 128, 4, 2, True, 0, 2, 0), KernelConfig(64, 128, 4, 2, True, 0, 2, 1)),
    (KernelConfig(64, 192, 4, 2, True, 0, 3, 0), KernelConfig(64, 192, 4, 2, True, 0, 3, 1)),
    (KernelConfig(64, 128, 4, 2, True, 0, 2, 1), KernelConfig(64, 128, 4, 2, True, 0, 2, 1)),
    (KernelConfig(128, 128, 4, 2, True, 0, 2, 2), KernelConfig(128, 128, 4, 2, True, 0, 2, 2)),
    (KernelConfig(64, 64, 4, 2, True), KernelConfig(64, 64, 4, 2, True)),  # the Triton pass: no schedule
]


@pytest.mark.parametrize("config,without_dq", NO_DQ_CASES)
def test_lockstep_dkdv_configs_take_turns_without_dq(config, without_dq):
    from fusedattn import dispatch

    assert dispatch.dkdv_without_dq(config) == without_dq


@pytest.mark.parametrize("head_dim", [64, 128])
def test_hopper_heuristic_dkdv_runs_in_lockstep_except_with_softcap(head_dim):
    """The Hopper dK/dV+dQ pass: no turns (lockstep) at both head dims; softcap takes turns."""
    for softcap in (False, True):
        for causal in (False, True):
            chosen = configs._cuda_configs(torch.bfloat16, head_dim, head_dim, 8192, (9, 0), has_right=causal,
                                           has_softcap=softcap)
            assert (chosen.dkdv.hopper_pingpong == 0) == (not softcap)
            assert chosen.atomic_dq == (head_dim == 128 or not softcap)


@pytest.mark.parametrize("head_dim", [64, 128])
def test_hopper_heuristic_orders_deterministic_dq_where_measured_faster(head_dim):
    """Deterministic mode: dQ summed by the dK/dV pass in a fixed order, causal or not; D=128 causal
    at short keys (and D=64 softcap, whose pass sums no dQ) keeps the dQ pass."""
    for seqlen_k in (1024, 8192):
        for softcap in (False, True):
            for causal in (False, True):
                chosen = configs._cuda_configs(torch.bfloat16, head_dim, head_dim, seqlen_k, (9, 0),
                                               has_right=causal, has_softcap=softcap)
                want = (head_dim == 128 or not softcap) and not (head_dim == 128 and causal and seqlen_k <= 2048)
                assert chosen.ordered_dq == want
