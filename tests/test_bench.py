"""The benchmark's shapes and its grouped-query path (CPU: fusedattn's PyTorch path vs SDPA on the CPU)."""

import importlib
import math
import os
import re
import sys
from pathlib import Path

import pytest
import torch

from fusedattn.bench.__main__ import GQA_HEADS, _inputs, measure, merge_rounds, run, standard_shapes, table
from fusedattn.bench.systems import CPU_SYSTEMS, Shape


def test_standard_shapes_hold_spec_shapes_and_the_grouped_query_pair():
    shapes = standard_shapes()
    plain = [s for s in shapes if not s.grouped]
    assert len(plain) == 12 and all(s.batch * s.seqlen == 16384 and s.heads * s.head_dim == 2048 for s in plain)
    grouped = [s for s in shapes if s.grouped]
    assert [(s.heads, s.kv_heads, s.seqlen, s.head_dim, s.causal) for s in grouped] == [
        (*GQA_HEADS, 4096, 128, False), (*GQA_HEADS, 4096, 128, True)]
    assert len({s.name for s in shapes}) == len(shapes)  # rows are matched across systems by name
    assert not any(s.grouped for s in standard_shapes(head_dims=(64,)))


def test_grouped_query_rows_use_fewer_key_value_heads_and_agree_with_sdpa():
    shape = Shape(1, 4, 48, 16, True, torch.float32, heads_kv=2)
    q, k, v, dout = _inputs(shape, "cpu")
    assert q.shape == dout.shape == (1, 4, 48, 16) and k.shape == v.shape == (1, 2, 48, 16)
    ours, sdpa = CPU_SYSTEMS
    our_row, our_out = measure(ours, shape, "cpu")
    peer_row, _ = measure(sdpa, shape, "cpu", baseline_out=our_out)
    assert our_row["Hkv"] == 2 and "fwd_ms" in our_row, our_row
    assert peer_row["output_agrees"] and peer_row["max_diff_vs_fusedattn"] < 1e-4, peer_row
    printed = table([our_row, peer_row]).splitlines()
    assert printed[2].startswith(shape.name) and sdpa.name in printed[2]
    assert re.search(r"\d\.\d\dx", printed[2])  # ours over the peer (a clock column follows on a GPU)


def _row(**times):
    return dict(system="s", case="c", B=2, H=4, Hkv=4, Sq=256, Sk=256, D=64, causal=False, **times)


def test_rounds_merge_into_medians_and_rates_from_them():
    merged = merge_rounds([_row(fwd_ms=1.0, fwdbwd_ms=4.0, graph_fwdbwd_ms=3.0, graph_fwd_ms=0.5),
                           _row(fwd_ms=3.0, fwdbwd_ms=5.0, graph_fwdbwd_ms=2.0, graph_fwd_ms=0.7),
                           _row(fwd_ms=2.0, fwdbwd_ms=9.0, graph_fwdbwd_ms=4.0, graph_fwd_ms=0.6)])
    assert (merged["fwd_ms"], merged["fwdbwd_ms"], merged["graph_fwdbwd_ms"]) == (2.0, 5.0, 3.0)
    assert merged["rounds"] == 3 and merged["fwd_ms_rounds"] == [1.0, 3.0, 2.0]
    assert merged["bwd_ms"] == 3.0 and abs(merged["graph_bwd_ms"] - 2.4) < 1e-12
    flops_fwd = 4 * 2 * 4 * 256 * 256 * 64
    assert abs(merged["fwd_tflops"] - flops_fwd / 2.0 * 1e-9) < 1e-12
    assert abs(merged["graph_fwdbwd_tflops"] - 3.5 * flops_fwd / 3.0 * 1e-9) < 1e-12
    failed = merge_rounds([_row(fwd_ms=1.0, fwdbwd_ms=2.0), _row(note="fails: RuntimeError: x")])
    assert "fwd_ms" not in failed and failed["note"].startswith("fails")  # one failed round fails the row


def test_rounds_give_one_row_per_system_and_shape():
    shapes = [Shape(1, 2, 32, 16, causal, torch.float32) for causal in (False, True)]
    saved = []
    rows = run(shapes, CPU_SYSTEMS, "cpu", on_row=lambda rows: saved.append(len(rows)), rounds=2)
    assert [(r["case"], r["system"]) for r in rows] == [(s.name, system.name) for s in shapes for system in CPU_SYSTEMS]
    assert all(r["rounds"] == 2 and len(r["fwdbwd_ms_rounds"]) == 2 for r in rows)
    assert saved == [2, 4]  # saved after each shape
    assert all(r["output_agrees"] for r in rows if r["system"] != "fusedattn")


def test_parts_of_a_run_merge_without_replacing_a_row():
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
    from merge_results import merge

    env = dict(device="GPU", date="2026-11-22", rounds=3)
    first = dict(environment=env, systems={"fusedattn": "a"}, rows=[dict(_row(), case="A"), dict(_row(), case="B")])
    second = dict(environment=dict(env, rounds=2), systems={"flex": "b"},
                  rows=[dict(_row(), case="C", system="flex")])
    merged = merge([first, second])
    assert [(r["system"], r["case"]) for r in merged["rows"]] == [("s", "A"), ("s", "B"), ("flex", "C")]
    assert merged["systems"] == {"fusedattn": "a", "flex": "b"}
    assert [p["rounds"] for p in merged["environment"]["parts"]] == [3, 2]
    with pytest.raises(ValueError, match="two parts"):
        merge([first, dict(first, rows=[dict(_row(), case="B")])])


def test_packed_rows_documents_fill_the_batch():
    """The varlen row's documents: DOCS lengths >= 1 summing to TOTAL, the same on every run; the
    FLOPs count each document's kept causal pairs."""
    from fusedattn.bench import packed

    lengths = packed.document_lengths()
    assert len(lengths) == packed.DOCS and sum(lengths) == packed.TOTAL and min(lengths) >= 1
    assert lengths == packed.document_lengths()
    assert packed.causal_flops([1, 3]) == 4.0 * packed.H * packed.D * (1 + 6)


def test_gpu_state_reads_clock_power_and_what_limits_the_clock(monkeypatch):
    from fusedattn.bench import gpu_state

    capped = gpu_state.parse("1575, 1980, 690.14, 700.00, 65, 0x0000000000000004")
    assert capped == dict(sm_clock_mhz=1575.0, max_sm_clock_mhz=1980.0, power_w=690.14, power_limit_w=700.0,
                          temperature_c=65.0, clock_limited_by=["power-cap"])
    boost = gpu_state.parse("1980, 1980, 118.30, 700.00, 37, 0x0000000000000000")
    assert boost["clock_limited_by"] == [] and boost["sm_clock_mhz"] == 1980.0
    assert gpu_state.parse("1410, [N/A], 80.5, 400.00, 40, 0x21")["clock_limited_by"] == ["idle", "sw-thermal"]
    assert "max_sm_clock_mhz" not in gpu_state.parse("1410, [N/A], 80.5, 400.00, 40, 0x21")
    assert gpu_state.parse("No devices were found") == {}
    assert gpu_state.summary([boost, capped, capped]) == "1575*" and gpu_state.summary([boost]) == "1980"
    assert gpu_state.summary([{}]) == ""
    assert gpu_state._smi_ids(0)[-1] == "0"  # nvidia-smi's index last, after the UUID where CUDA gives one
    # a merged row keeps every round's state and the table shows the middle clock
    rounds = [_row(fwd_ms=1.0, fwdbwd_ms=4.0, gpu_state=s) for s in (boost, capped, boost)]
    merged = merge_rounds(rounds)
    assert merged["gpu_state_rounds"] == [boost, capped, boost]
    assert table([merged]).splitlines()[1].endswith("1980*")
    monkeypatch.setattr(gpu_state.shutil, "which", lambda name: None)
    assert gpu_state.query(0) == {}  # no nvidia-smi: no state, and no failure


def test_variant_rows_show_the_clock_their_timing_ended_at():
    from fusedattn.bench import variants

    ours = dict(variant="window", system="fusedattn", fwd_ms=0.3, fwdbwd_ms=1.2, fwdbwd_tflops=300.0, step_peak_gb=0.1,
                gpu_state=dict(sm_clock_mhz=1800.0, clock_limited_by=["power-cap"]))
    flex = dict(ours, system="flex", fwdbwd_ms=1.5, gpu_state=dict(sm_clock_mhz=1980.0, clock_limited_by=[]))
    lines = variants.table([ours, flex]).splitlines()
    assert lines[0].endswith("MHz") and lines[1].endswith("1800*")
    assert lines[2].endswith("1.25x   1980")


def test_a_peer_taking_bshd_gets_the_same_values_stored_as_bshd():
    shape = Shape(2, 4, 24, 16, False, torch.float32, heads_kv=2)
    as_bhsd, as_bshd = _inputs(shape, "cpu"), _inputs(shape, "cpu", "bshd")
    for ours, theirs in zip(as_bhsd, as_bshd):
        assert torch.equal(ours, theirs) and ours.is_contiguous()
        assert theirs.transpose(1, 2).is_contiguous() and not theirs.is_contiguous()  # no copy when transposed back


def _fake_package(tmp_path, monkeypatch, files: dict[str, str]) -> Path:
    """A stand-in for an installed package: ``files`` (paths relative to ``tmp_path`` -> source)
    written, ``tmp_path`` first on sys.path, any module of that name already imported forgotten."""
    for relative, text in files.items():
        (tmp_path / relative).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / relative).write_text(text)
    monkeypatch.syspath_prepend(str(tmp_path))
    top = next(iter(files)).split("/")[0]
    for name in [k for k in sys.modules if k == top or k.startswith(top + ".")]:
        monkeypatch.delitem(sys.modules, name)
    return tmp_path / top


def test_flash_sparse_attn_imports_past_its_missing_projection_dependency(tmp_path, monkeypatch):
    """flash-sparse-attn 2.0.6 imports ``triton_kernels.matmul_ogs`` for its projection ops, which no
    published triton-kernels has: the bench stands in for it (any use raises) and reaches the
    attention function; a package that fails to import for any other reason is unavailable."""
    from fusedattn.bench import systems

    package = _fake_package(tmp_path, monkeypatch, {"flash_sparse_attn/__init__.py": (
        "from triton_kernels.matmul_ogs import matmul_ogs, PrecisionConfig, FlexCtx\n"
        "from triton_kernels.numerics import InFlexData, OutFlexData\n"
        "def flash_dense_attn_func(q, k, v, is_causal=False):\n    return ('dense', is_causal)\n"
        "def project():\n    return matmul_ogs()\n")})
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    for name in ("triton_kernels", "triton_kernels.matmul_ogs", "triton_kernels.numerics"):
        monkeypatch.delitem(sys.modules, name, raising=False)
    # its autotune winners: the folder kept with the results, unless the caller names another
    monkeypatch.chdir(tmp_path)
    (tmp_path / systems.FSA_LAUNCH_CONFIGS).mkdir(parents=True)
    monkeypatch.delenv("FLASH_SPARSE_ATTENTION_LAUNCH_CONFIG_DIR", raising=False)
    try:
        fn = systems.flash_dense_attn_func()
        assert fn(None, None, None, is_causal=True) == ("dense", True)
        assert os.environ["FLASH_SPARSE_ATTENTION_LAUNCH_CONFIG_DIR"] == str(tmp_path / systems.FSA_LAUNCH_CONFIGS)
        with pytest.raises(RuntimeError, match="placeholder"):
            sys.modules["flash_sparse_attn"].project()
    finally:
        for name in ("flash_sparse_attn", "triton_kernels", "triton_kernels.matmul_ogs", "triton_kernels.numerics"):
            sys.modules.pop(name, None)

    (package / "__init__.py").write_text("import a_module_nobody_has\n")
    monkeypatch.setenv("FLASH_SPARSE_ATTENTION_LAUNCH_CONFIG_DIR", "/elsewhere")
    with pytest.raises(systems.Unavailable, match="does not import"):
        systems.flash_dense_attn_func()
    assert os.environ["FLASH_SPARSE_ATTENTION_LAUNCH_CONFIG_DIR"] == "/elsewhere"  # the caller's folder wins
    sys.modules.pop("flash_sparse_attn", None)


def test_a_peer_whose_output_differs_is_marked_in_both_tables():
    from fusedattn.bench import variants

    ours = dict(variant="window", system="fusedattn", fwd_ms=0.3, fwdbwd_ms=1.2, fwdbwd_tflops=300.0, step_peak_gb=0.1)
    good = dict(ours, system="flex", fwdbwd_ms=1.5, output_agrees=True, max_diff_vs_fusedattn=0.004)
    wrong = dict(ours, system="other", fwdbwd_ms=0.9, output_agrees=False, max_diff_vs_fusedattn=1.75)
    lines = variants.table([ours, good, wrong]).splitlines()
    assert "DIFFERS" not in lines[2] and lines[3].endswith("OUTPUT DIFFERS from fusedattn's (max |diff| 1.75)")
    mine = dict(_row(fwd_ms=1.0, fwdbwd_ms=4.0), system="fusedattn")
    peer = dict(_row(fwd_ms=1.0, fwdbwd_ms=2.0), output_agrees=False, max_diff_vs_fusedattn=0.5)
    printed = table([merge_rounds([mine]), merge_rounds([peer])]).splitlines()
    assert "DIFFERS" not in printed[1] and "OUTPUT DIFFERS" in printed[2] and "0.5)" in printed[2]


def test_backward_on_caller_is_recorded_in_the_json_and_undone_after_the_run(tmp_path, monkeypatch):
    import json

    from fusedattn.bench import __main__ as bench

    seen = []
    # the CPU run's one tiny shape, on a GPU machine too (there the bench would take SPEC 5's shapes)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(bench, "cpu_shapes", lambda: [Shape(1, 2, 32, 16, True, torch.float32)])
    real_run = bench.run
    monkeypatch.setattr(bench, "run", lambda *a, **kw: seen.append(torch._C._is_multithreading_enabled())
                        or real_run(*a, **kw))
    for flag, thread in ((["--backward-on-caller"], "caller"), ([], "engine")):
        bench.main(["--out", str(tmp_path), *flag])
        written, = (p for p in tmp_path.glob("*.json") if p.name.endswith("-backward-on-caller.json") == bool(flag))
        assert json.loads(written.read_text())["environment"]["backward_thread"] == thread
    assert seen == [False, True]  # the run itself saw the setting
    assert torch._C._is_multithreading_enabled()  # and it is the default again after the run
    env = dict(device="NVIDIA H100 80GB", date="2026-11-26", backward_thread="caller")
    assert bench.result_stem(env, "variants") == "variants-NVIDIA-H100-80GB-2026-11-26-backward-on-caller"
    assert bench.result_stem(dict(env, backward_thread="engine")) == "NVIDIA-H100-80GB-2026-11-26"


def test_flash_sparse_attn_takes_the_bias_rows_with_the_mask_folded_into_its_bias(tmp_path, monkeypatch):
    """The bias rows run flash-sparse-attn's kernel with a trainable bias (kept under its
    ``deprecated`` package): (B, S, H, D) views, the causal flag, and a mask as -inf in the bias;
    rows with a mask and no bias, sinks or softcap are unavailable to it."""
    from fusedattn.bench import systems, variants

    _fake_package(tmp_path, monkeypatch, {
        "flash_sparse_attn/__init__.py": "", "flash_sparse_attn/deprecated/__init__.py": "",
        "flash_sparse_attn/deprecated/flash_sparse_attn_triton.py": (
            "calls = []\n"
            "def triton_sparse_attn_func(q, k, v, attn_bias=None, is_causal=False, softmax_scale=None):\n"
            "    calls.append((q, attn_bias, is_causal))\n"
            "    return q\n")})
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setenv("FLASH_SPARSE_ATTENTION_LAUNCH_CONFIG_DIR", str(tmp_path))
    try:
        by_name = {v.name: v for v in variants.VARIANTS}
        topk = by_name[f"top-k {variants.TOPK} + trainable bias"]
        gen = torch.Generator().manual_seed(0)
        q = torch.randn(1, 2, 8, 4, generator=gen)
        bias = torch.randn(1, 2, 8, 8, generator=gen, requires_grad=True)
        mask = torch.rand(1, 2, 8, 8, generator=gen) < 0.5
        fn = variants.SYSTEMS["flash-sparse-attn"](topk)
        out = fn(variants.Inputs(q, q, q, q, dict(bias=bias, mask=mask)))
        from flash_sparse_attn.deprecated.flash_sparse_attn_triton import calls
        (seen_q, seen_bias, causal), = calls
        assert causal is True and seen_q.shape == (1, 8, 2, 4) and torch.equal(out, q)
        # its kernel masks negative entries: it gets the bias shifted to >= 0, then the -inf fold
        shifted = bias.detach() - bias.detach().min()
        assert torch.equal(seen_bias, shifted.masked_fill(~mask, float("-inf")))
        assert seen_bias.requires_grad  # the bias's gradient flows through the shift and the fold
        full_bias = variants.SYSTEMS["flash-sparse-attn"](by_name["bias (B,H,S,S) trainable"])
        full_bias(variants.Inputs(q, q, q, q, dict(bias=bias)))
        assert torch.equal(calls[-1][1], shifted) and calls[-1][2] is False
        for name in ("block-sparse", "random key mask", "sinks", "softcap"):
            variant = next(v for v in variants.VARIANTS if v.name.startswith(name))
            with pytest.raises(systems.Unavailable):
                variants.SYSTEMS["flash-sparse-attn"](variant)
    finally:
        for name in [k for k in sys.modules if k.startswith("flash_sparse_attn")]:
            sys.modules.pop(name, None)


def test_a_lost_json_is_rebuilt_from_the_printed_tables():
    """benchmarks/rows_from_log.py: the standard and variant tables a run prints give back its rows'
    times (3 decimals) and the rates from them; failed and skipped rows keep their notes."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
    from rows_from_log import standard_rows, variant_rows

    from fusedattn.bench import variants

    ours = merge_rounds([dict(_row(fwd_ms=0.2466, fwdbwd_ms=0.9331, graph_fwdbwd_ms=0.9262), system="fusedattn",
                              case="D64-S1024-causal", B=16, H=32, Hkv=32, Sq=1024, Sk=1024, causal=True)])
    peer = dict(ours, system="sdpa-cudnn", fwd_ms=0.2071, fwdbwd_ms=0.9402, graph_fwdbwd_ms=0.9391)
    failed = dict(_row(note="fails: RuntimeError: No available kernel."), system="sdpa-efficient",
                  case="D128-S4096-gqa16/2-full")
    printed = ["header"] + table([ours, merge_rounds([peer]), failed]).splitlines()
    mine, theirs, gone = standard_rows(printed)
    assert (mine["system"], mine["B"], mine["H"], mine["causal"]) == ("fusedattn", 16, 32, True)
    assert (mine["fwd_ms"], mine["fwdbwd_ms"], mine["graph_fwdbwd_ms"]) == (0.247, 0.933, 0.926)
    assert abs(theirs["fwdbwd_tflops"] / merge_rounds([peer])["fwdbwd_tflops"] - 1) < 1e-3
    assert (gone["H"], gone["Hkv"], gone["note"]) == (16, 2, "fails: RuntimeError: No available kernel.")
    assert all(r["from_printed_table"] for r in (mine, theirs, gone))

    name = "key-padding mask (B,1,1,S) by length"  # longer than its column: runs into the system's
    row = dict(variant=name, system="fusedattn-plain", fwd_ms=0.8449, fwdbwd_ms=3.5331, fwdbwd_tflops=544.6,
               step_peak_gb=0.38)
    skipped = dict(variant=name, system="flash-sparse-attn", note="skipped: no key lengths")
    rebuilt, note = variant_rows(variants.table([row, skipped]).splitlines())
    assert (rebuilt["variant"], rebuilt["system"], rebuilt["fwdbwd_ms"], rebuilt["fwdbwd_tflops"]) == (
        name, "fusedattn-plain", 3.533, 544.6)
    assert note["system"] == "flash-sparse-attn" and note["note"] == "skipped: no key lengths"


def test_ncu_summary_reads_the_first_launch_and_counts_bank_conflicts(tmp_path):
    """benchmarks/ncu_sass_summary.py: per kernel the first launch only (a report lists a kernel once
    per launch), opcodes grouped, shared wavefronts and their excess summed by opcode, stall reasons
    as shares of the samples."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
    from ncu_sass_summary import kernels, summary

    header = ["Address", "Source", "Warp Stall Sampling (All Samples)", "Instructions Executed",
              "L1 Wavefronts Shared", "L1 Wavefronts Shared Excessive", "stall_barrier", "stall_long_sb"]
    lines = [["Kernel Name", "k"], header,
             ["0x10", "STS.64 [R1+0x10], R2", "30", "2000000", "8000000", "4000000", "0", "30"],
             ["0x20", "@!P0 BAR.SYNC.DEFER_BLOCKING 0x2, 0x80", "10", "1000000", "0", "0", "10", "0"],
             ["0x30", "MUFU.EX2 R3, R3", "60", "3000000", "0", "0", "0", "0"],
             ["Kernel Name", "k"], header,  # a second launch: not read
             ["0x10", "STS.64 [R1+0x10], R2", "999", "9", "9", "9", "999", "0"]]
    path = tmp_path / "report.csv"
    path.write_text("\n".join(",".join(f'"{cell}"' for cell in line) for line in lines) + "\n")
    found = kernels(str(path))
    assert list(found) == ["k"] and len(found["k"]) == 3
    text = summary("k", found["k"], top=2)
    assert "long_sb 30.0%" in text and "barrier 10.0%" in text
    assert "STS 2.0M" in text and "BAR.SYNC 1.0M" in text and "MUFU.EX2 3.0M" in text
    assert "STS.64 8.0M (4.0M)" in text
    assert text.splitlines()[4].strip().startswith("60.0% MUFU.EX2")


def test_ncu_metrics_reads_the_first_kernel_and_drops_idle_stalls(tmp_path, capsys, monkeypatch):
    """benchmarks/ncu_metrics.py: of a raw page the first kernel's row (the row under the names holds
    units), only the metrics it lists, and a stall reason only where some page has it at 0.05 or more
    per issued instruction."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
    import ncu_metrics

    names = ["ID", "Kernel Name", "gpu__time_duration.sum", "sm__cycles_active.max", "dram__bytes.sum",
             "smsp__average_warps_issue_stalled_barrier_per_issue_active.ratio",
             "smsp__average_warps_issue_stalled_sleeping_per_issue_active.ratio"]
    pages = {"a": ["0", "k", "269.18", "459,668", "7", "4.93", "0.01"],
             "b": ["0", "k", "243.68", "408,140", "9", "0.74", "0.02"]}
    paths = []
    for name, values in pages.items():
        lines = [["==PROF== header"], names, ["", "", "usecond", "cycle", "byte", "", ""], values,
                 ["1", "k", "999", "1", "1", "9", "9"]]  # a second launch: not read
        path = tmp_path / f"{name}-raw.csv"
        path.write_text("\n".join(",".join(f'"{cell}"' for cell in line) for line in lines) + "\n")
        paths.append(str(path))
    assert ncu_metrics.first_kernel(paths[0]) == {
        "gpu__time_duration.sum": "269.18", "sm__cycles_active.max": "459,668",
        "smsp__average_warps_issue_stalled_barrier_per_issue_active.ratio": "4.93",
        "smsp__average_warps_issue_stalled_sleeping_per_issue_active.ratio": "0.01"}
    monkeypatch.setattr(sys, "argv", ["ncu_metrics.py", *paths])
    ncu_metrics.main()
    printed = capsys.readouterr().out
    assert "stalled_barrier" in printed and "stalled_sleeping" not in printed and "dram__bytes" not in printed
    assert "459,668" in printed and "408,140" in printed


def test_flaggems_takes_only_the_grouped_query_variant(tmp_path, monkeypatch):
    """FlagGems' attention backward drops the mask (its gradients with a bias or mask would be
    wrong): of the variant rows it runs GQA alone, causal, with fewer key/value heads."""
    from fusedattn.bench import systems, variants

    _fake_package(tmp_path, monkeypatch, {
        "flag_gems/__init__.py": "", "flag_gems/ops/__init__.py": "",
        "flag_gems/ops/attention.py": ("def scaled_dot_product_attention(q, k, v, is_causal=False, enable_gqa=False):\n"
                                       "    return (is_causal, enable_gqa)\n")})
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    try:
        for variant in variants.VARIANTS:
            if variant.name.startswith("GQA"):
                q = torch.zeros(1)
                assert variants.SYSTEMS["flaggems"](variant)(variants.Inputs(q, q, q, q)) == (True, True)
            else:
                with pytest.raises(systems.Unavailable):
                    variants.SYSTEMS["flaggems"](variant)
    finally:
        for name in [k for k in sys.modules if k.startswith("flag_gems")]:
            sys.modules.pop(name, None)


def test_hf_rows_run_the_tiny_model_check_each_system_against_sdpa_and_save_the_json(tmp_path, monkeypatch):
    """``--hf`` without CUDA: the tiny float32 Llama through the GPU run's code path -- a causal row and
    the packed row (sdpa's padded batch, the reference, and every system padding-free) -- each system's
    step checked against sdpa's before it is timed, the JSON and the plot written."""
    pytest.importorskip("transformers")
    import json

    from fusedattn.bench import __main__ as bench
    from fusedattn.bench import hf

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)  # the tiny model on a GPU machine too
    systems = ["sdpa", "eager"]
    try:
        importlib.import_module("fusedattn.integrations.transformers")
        systems.append("fusedattn")
    except ImportError:
        pass
    bench.main(["--hf", "--systems", ",".join(systems), "--out", str(tmp_path)])
    written, = tmp_path.glob("hf-*.json")
    saved = json.loads(written.read_text())
    assert saved["model"]["num_hidden_layers"] == 2 and saved["model"]["hidden_size"] == 64
    assert saved["environment"]["transformers"] and saved["packed"]["total"] == 128
    rows = {(r["row"], r["system"], r["layout"]): r for r in saved["rows"]}
    expected = [("S=128", s, "single") for s in systems] + [("packed", s, "padded") for s in ("sdpa", "eager")]
    expected += [("packed", s, "padding-free") for s in systems]
    assert sorted(rows) == sorted(expected)
    for key, r in rows.items():
        assert r["real_tokens"] == 128 and r["step_ms"] > 0 and r["tokens_per_s"] > 0, (key, r)
        assert r["reference"] == ("sdpa (padded)" if key[0] == "packed" else "sdpa (single)")
        if key in (("S=128", "sdpa", "single"), ("packed", "sdpa", "padded")):
            continue  # the references
        diffs = [r[k] for k in ("loss_rel_diff", "hidden_rel_diff", "logits_rel_diff", "grad_rel_diff")]
        assert all(math.isfinite(d) and d <= r["rel_tol"] == 1e-4 for d in diffs) and r["output_agrees"], (key, r)
    padded = rows["packed", "sdpa", "padded"]
    assert padded["computed_tokens"] == padded["docs"] * padded["longest"] > 128
    assert sum(saved["packed"]["lengths"]) == 128 and padded["docs"] == len(saved["packed"]["lengths"])
    if "fusedattn" in systems:
        assert hf.table(saved["rows"]).count("x ") >= 1  # the ours/this column
    pytest.importorskip("matplotlib")
    assert written.with_suffix(".png").exists()


def test_hf_agreement_check_catches_documents_that_see_each_other(monkeypatch):
    """The check is not vacuous: the padding-free row with transformers' packed-document detection
    switched off (every token then sees the earlier documents) fails it, on the loss-insensitive
    hidden states, logits and gradients; the documents of the GPU's packed row fill 16k tokens."""
    pytest.importorskip("transformers")
    from transformers import masking_utils

    from fusedattn.bench import hf

    setup = hf.cpu_setup()
    model = hf.build_model(setup, "sdpa")
    flat, padded = hf.packed_batches(hf.document_lengths(setup.packed_total, *setup.doc_range), 256, "cpu")
    samples = torch.arange(0, 128, 3)
    reference = hf.capture(model, padded, samples)
    assert hf.compare(hf.capture(model, flat, samples), reference, torch.float32)["output_agrees"]
    monkeypatch.setattr(masking_utils, "find_packed_sequence_indices", lambda position_ids: None)
    leaked = hf.compare(hf.capture(model, flat, samples), reference, torch.float32)
    assert not leaked["output_agrees"] and min(leaked["hidden_rel_diff"], leaked["grad_rel_diff"]) > 0.1, leaked

    lengths = hf.document_lengths(16384, 256, 4096)
    assert sum(lengths) == 16384 and min(lengths) >= 256 and max(lengths) <= 4096
    assert lengths == hf.document_lengths(16384, 256, 4096)  # seeded


def test_sdpa_flash_is_built_for_the_dropout_row_and_its_check_at_dropout_0():
    """SDPA's flash backend is a peer of the dropout row only; that row's output check builds each
    system at dropout 0, so the rule cannot read p (it once skipped the row it was meant for)."""
    from dataclasses import replace

    from fusedattn.bench import systems, variants

    built = []
    for variant in variants.VARIANTS:
        for form in (variant, replace(variant, dropout=0.0)):
            try:
                variants.SYSTEMS["sdpa-flash"](form)
                built.append(form.name)
            except systems.Unavailable:
                pass
    assert built and all(name.startswith("dropout") for name in built)
    assert len(built) == 2 * sum(v.name.startswith("dropout") for v in variants.VARIANTS)


def test_fa4_peer_gets_bshd_views_and_each_rows_options(tmp_path, monkeypatch):
    """FlashAttention-4 as a peer: (B, S, H, D) views of its inputs (stored that way, no copy), the
    shape's causal flag, window as (keys - 1, 0), deterministic, and in the variant rows softcap and
    learnable sinks; its (out, lse) pair's out back as (B, H, S, D); the rows it has no argument for
    are unavailable, and so is FlashAttention 2's package (no ``cute`` module)."""
    from fusedattn.bench import systems, variants

    _fake_package(tmp_path, monkeypatch, {
        "flash_attn/__init__.py": "",
        "flash_attn/cute/__init__.py": (
            "calls = []\n"
            "def flash_attn_func(q, k, v, causal=False, window_size=(None, None), softcap=0.0, learnable_sink=None,\n"
            "                    deterministic=False):\n"
            "    calls.append(dict(shape=tuple(q.shape), causal=causal, window_size=window_size, softcap=softcap,\n"
            "                      sink=learnable_sink, deterministic=deterministic))\n"
            "    return q * 2, None\n")})
    try:
        _check_fa4_peer(tmp_path, monkeypatch, systems, variants)
    finally:  # the stand-in leaves no module behind (transformers looks for flash_attn)
        for name in [k for k in sys.modules if k == "flash_attn" or k.startswith("flash_attn.")]:
            sys.modules.pop(name, None)


def _check_fa4_peer(tmp_path, monkeypatch, systems, variants):
    import flash_attn.cute as fake

    q = torch.randn(1, 3, 5, 4)  # (B, H, S, D), a view of (B, S, H, D) storage
    stored = systems.stored_as(q, "bshd")
    shape = systems.Shape(1, 3, 5, 4, True, window=3)
    fa4 = next(s for s in systems.SYSTEMS if s.name == "fa4-deterministic")
    assert fa4.layout == "bshd"
    out = fa4.make(shape)(stored, stored, stored)
    assert torch.equal(out, stored * 2) and out.shape == q.shape
    assert fake.calls[-1] == dict(shape=(1, 5, 3, 4), causal=True, window_size=(2, 0), softcap=0.0, sink=None,
                                  deterministic=True)
    by_name = {v.name: v for v in variants.VARIANTS}
    sinks = torch.randn(3)
    variants.SYSTEMS["fa4"](by_name["sinks (trainable)"])(variants.Inputs(stored, stored, stored, stored,
                                                                          dict(sinks=sinks)))
    assert fake.calls[-1]["sink"] is sinks and fake.calls[-1]["causal"]
    variants.SYSTEMS["fa4"](by_name["softcap 30"])(variants.Inputs(stored, stored, stored, stored))
    assert fake.calls[-1]["softcap"] == 30.0
    for name in ("bias (B,H,S,S) trainable", "ALiBi (H,) slopes", "dropout 0.1", "chunk 1024"):
        with pytest.raises(systems.Unavailable, match="FlashAttention-4 takes no"):
            variants.SYSTEMS["fa4"](by_name[name])
    assert variants.INPUT_LAYOUT["fa4"] == "bshd"

    _fake_package(tmp_path / "fa2", monkeypatch, {"flash_attn/__init__.py": ""})
    with pytest.raises(systems.Unavailable, match="does not import"):
        systems.fa4_attn_func()


def test_program_cost_fits_against_the_keys_a_row_sees():
    """benchmarks/program_cost.py's x: the keys a query row sees on average, so that full, causal and
    window lines share a step cost (a window's first W rows see fewer than W keys), and a line through
    exact points gives back its intercept and slope."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
    from program_cost import fit, keys_per_row

    assert keys_per_row(4096, None, False) == 4096
    assert keys_per_row(4096, None, True) == 2048.5
    assert keys_per_row(4096, 1024, True) == (4096 * 1024 - 1024 * 1023 / 2) / 4096  # 896.125
    assert keys_per_row(1000, 4096, True) == keys_per_row(1000, None, True)  # a window past S is causal
    # brute force: row i sees min(i + 1, W) keys
    assert abs(keys_per_row(300, 70, True) - sum(min(i + 1, 70) for i in range(300)) / 300) < 1e-9
    xs = [keys_per_row(4096, w, True) for w in (512, 1024, 2048)]
    intercept, slope = fit(xs, [100.0 + 0.25 * x for x in xs])
    assert abs(intercept - 100.0) < 1e-9 and abs(slope - 0.25) < 1e-12


def test_gluon_modules_ab_routes_to_the_other_revisions_modules(tmp_path, monkeypatch):
    """benchmarks/gluon_modules_ab.py: the other revision's fwd and bwd import its own common (not this
    tree's), one line down; routing swaps the modules the dispatcher imports at call time and the
    ptxas that compiles them, and back."""
    monkeypatch.delenv("TRITON_PTXAS_PATH", raising=False)  # restored after the test
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
    import gluon_modules_ab as ab
    import fusedattn.kernels.gluon as package

    source = Path(package.__file__).parent
    for name in ("common", "fwd", "bwd"):
        text = (source / f"{name}.py").read_text()
        if name == "common":
            text += "\nOTHER_REVISION = True\n"
        (tmp_path / f"{name}.py").write_text(text)
    this = {"fwd": sys.modules["fusedattn.kernels.gluon.fwd"], "bwd": sys.modules["fusedattn.kernels.gluon.bwd"]}
    other = ab.load_other(str(tmp_path))
    try:
        common_other = sys.modules["fusedattn.kernels.gluon.common_other"]
        assert common_other.OTHER_REVISION
        assert other["fwd"].keep_scores is common_other.keep_scores
        assert other["bwd"].keep_scores is common_other.keep_scores
        assert this["fwd"].keep_scores is not common_other.keep_scores
        # one line down: a kernel identical to this tree's hashes apart from it
        kernel = "_attn_fwd_ws_kernel"
        assert (getattr(other["fwd"], kernel).starting_line_number
                == getattr(this["fwd"], kernel).starting_line_number + 1)
        ab.route_to(other, "/opt/other/ptxas")
        assert os.environ["TRITON_PTXAS_PATH"] == "/opt/other/ptxas"
        from fusedattn.kernels.gluon import bwd, fwd
        assert (fwd, bwd) == (other["fwd"], other["bwd"])
    finally:
        ab.route_to(this)
    assert "TRITON_PTXAS_PATH" not in os.environ
    from fusedattn.kernels.gluon import bwd, fwd
    assert (fwd, bwd) == (this["fwd"], this["bwd"])

    # a directory holding fwd.py alone: common and bwd are this tree's
    (tmp_path / "common.py").unlink()
    (tmp_path / "bwd.py").unlink()
    ab.load_other(str(tmp_path))
    assert not hasattr(sys.modules["fusedattn.kernels.gluon.common_other"], "OTHER_REVISION")


def test_gluon_modules_ab_reads_a_change_against_a_reference_kernel_round_by_round():
    """benchmarks/gluon_modules_ab.py --reference: a kernel that moves with the reference in every
    round (the clocks) reads as no change; one 5% slower in each round while the reference is 2% slower
    reads as 5 / 2 = 2.9%; the median over rounds, so one odd round does not move it."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
    from gluon_modules_ab import against_reference

    other = [{"bwd": 100.0, "fwd": 50.0}] * 3
    clocks = {"other": other, "this": [{"bwd": 102.0, "fwd": 51.0}, {"bwd": 97.0, "fwd": 48.5},
                                       {"bwd": 100.0, "fwd": 50.0}]}
    assert abs(against_reference(clocks, "bwd", "fwd")) < 1e-12
    slower = {"other": other, "this": [{"bwd": 105.0, "fwd": 51.0}, {"bwd": 105.0, "fwd": 51.0},
                                       {"bwd": 150.0, "fwd": 51.0}]}
    assert abs(against_reference(slower, "bwd", "fwd") - (1.05 / 1.02 - 1)) < 1e-12


def test_ptx_override_drops_only_barriers_that_order_nothing():
    """benchmarks/ptx_override.py's PTX edit: a warpgroup bar.sync right before a try_wait loop goes
    (and before a one-thread arrive only in the "all" form, where a completed wgmma wait precedes it);
    one after an ordinary shared-memory store, or with a wgmma still in flight, stays, as do barriers
    before anything else."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
    from ptx_override import edit

    ptx = """
	wgmma.mma_async.sync.aligned.m64n128k16.f32.bf16.bf16 {%r1}, %rd1, %rd2, 1, 1, 1, 1, 1;
	wgmma.commit_group.sync.aligned;
	wgmma.wait_group.sync.aligned 0;
	bar.sync 	0, 128;
	@%p1 mbarrier.arrive.shared::cta.b64 _, [%r2];
	.loc	1 2 3
	bar.sync 	0, 128;
{
	.reg .pred complete;
	waitLoop:
	mbarrier.try_wait.parity.shared.b64 complete, [%r3], %r4;
	@!complete bra.uni waitLoop;
}
	st.shared.b32 [%r5], %r6;
	bar.sync 	0, 128;
	@%p1 mbarrier.arrive.shared::cta.b64 _, [%r7];
	wgmma.mma_async.sync.aligned.m64n128k16.f32.bf16.bf16 {%r1}, %rd1, %rd2, 1, 1, 1, 1, 1;
	bar.sync 	0, 128;
	@%p1 mbarrier.arrive.shared::cta.b64 _, [%r8];
	bar.sync 	0, 128;
	wgmma.fence.sync.aligned;
	bar.sync 	1, 256;
	mbarrier.try_wait.parity.shared.b64 complete, [%r3], %r4;
""".split("\n")
    barriers = [i for i, line in enumerate(ptx) if "bar.sync" in line]
    waits_only, counts = edit(ptx, remove_arrive=False)
    assert sum("bar.sync" in line for line in waits_only) == len(barriers) - 1
    assert counts == {"removed_before_wait": 1, "kept_before_arrive": 3, "other": 1}
    every, counts = edit(ptx, remove_arrive=True)
    assert counts == {"removed_before_wait": 1, "removed_before_arrive": 1, "kept_before_arrive": 2, "other": 1}
    kept = [line.strip() for line in every if "bar.sync" in line]
    assert kept == ["bar.sync \t0, 128;"] * 3 + ["bar.sync \t1, 256;"]
    # the first arrive (after the completed wgmma wait) lost its barrier; the store's and the
    # in-flight wgmma's kept theirs
    first_arrive = every.index("\t@%p1 mbarrier.arrive.shared::cta.b64 _, [%r2];")
    assert "bar.sync" not in every[first_arrive - 1]
    for address in ("%r7", "%r8"):
        arrive = every.index(f"\t@%p1 mbarrier.arrive.shared::cta.b64 _, [{address}];")
        assert "bar.sync" in every[arrive - 1]


def test_ptx_override_prefetches_each_descriptor_parameter_where_it_is_converted():
    """benchmarks/ptx_override.py's "prefetch" edit: a prefetch of the generic address right after each
    ``cvta.param`` of a 128-byte, 64-aligned parameter (a TMA descriptor), none for other parameters
    or for a descriptor the kernel never converts."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
    from ptx_override import prefetch_descriptors

    ptx = """
	.param .align 64 .b8 k_param_0[128],
	.param .u32 k_param_1,
	.param .align 64 .b8 k_param_2[128],
	.param .align 64 .b8 k_param_3[128],
	.param .u64 .ptr .global .align 1 k_param_4
	mov.b64 	%rd10, k_param_0;
	mov.b64 	%rd11, k_param_4;
	cvta.param.u64 	%rd1, %rd11;
	mov.b64 	%rd12, k_param_2;
	cvta.param.u64 	%rd2, %rd12;
	cvta.param.u64 	%rd3, %rd10;
""".split("\n")
    edited, counts = prefetch_descriptors(ptx)
    assert counts == {"prefetched": 2, "descriptors": 3}
    prefetches = [line.strip() for line in edited if "prefetch" in line]
    assert prefetches == ["prefetch.tensormap [%rd2];", "prefetch.tensormap [%rd3];"]
    # each right after its conversion, the rest of the text unchanged
    assert edited[edited.index("\tcvta.param.u64 \t%rd2, %rd12;") + 1] == "\tprefetch.tensormap [%rd2];"
    assert [line for line in edited if "prefetch" not in line] == ptx


def test_program_timeline_stamps_this_trees_dkdv_pass_and_reads_its_phases(tmp_path):
    """benchmarks/program_timeline.py: every anchor of its stamps is found in this tree's dK/dV pass
    (a changed kernel fails loudly, naming the anchor), the stamped module imports beside the real one,
    and the phases and the gap between programs come out of a buffer of stamps as the differences
    of its slots (the 32-bit clock's wrap included)."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
    import gluon_modules_ab as ab
    import program_timeline as timeline
    import fusedattn.kernels.gluon.bwd as bwd

    source = Path(bwd.__file__).read_text()
    stamped = timeline.stamped_source(source)
    assert stamped.count("_stamp(") == 18 + 1  # the 18 slots' stamps and the function itself
    with pytest.raises(RuntimeError, match="anchor found 0 times"):
        timeline.stamped_source(source.replace("KEYS_PER_WG = WG_ROWS  # keys per consumer warpgroup: one wgmma M\n",
                                               "KEYS_PER_WG = WG_ROWS\n"))
    (tmp_path / "bwd.py").write_text(stamped)
    this = {"fwd": sys.modules["fusedattn.kernels.gluon.fwd"], "bwd": bwd}
    try:
        other = ab.load_other(str(tmp_path))
        assert other["bwd"].TIMELINE == [] and hasattr(other["bwd"], "_stamp")
    finally:
        ab.route_to(this)

    slots = timeline.SLOTS
    # two programs on SM 7, the second starting 500 cycles after the first's last stamp; the first's
    # clock wraps past 2**32 between its entry and its end
    first = [7, 2**32 - 1000] + [0] * (slots - 2)
    for slot, after in {2: 600, 3: 1400, 4: 9000, 5: 3600, 15: 6000, 6: 8000, 7: 8200, 8: 9000, 9: 8050,
                        10: 11000, 11: 10000, 12: 11100, 14: 1300}.items():
        first[slot] = (first[1] + after) % 2**32
    first[13] = 4
    second = [7, (first[1] + 11100 + 500) % 2**32] + [0] * (slots - 2)
    for slot in range(2, slots):
        second[slot] = first[slot] if slot == 13 else (first[slot] - first[1] + second[1]) % 2**32
    stamps = torch.tensor([v - 2**32 if v >= 2**31 else v for v in first + second], dtype=torch.int32)
    summary = timeline.summarise(stamps, 2)
    assert summary["phases"]["wg0 interior steps"] == 2400
    assert summary["phases"]["wg0 masked steps"] == 2000
    assert summary["phases"]["done -> producer's stores read"] == 2000
    assert summary["phases"]["wg1 steps over - wg0's"] == 50
    assert summary["gap_between_programs"] == 500
    assert summary["steps_median"] == 4 and summary["cycles_per_step_median"] == 4400 / 4


def test_fa4_program_timeline_writes_each_stamp_at_its_anchor_and_reads_fa4s_phases():
    """benchmarks/fa4_program_timeline.py: each stamp goes in at its own anchor of FA4's backward
    source, once (FA4's source is not here: a stand-in holding every anchor once between other
    lines); a missing or repeated anchor fails loudly; FA4's phases and cycles a step (its first step
    stamped apart) come out of a buffer of stamps."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
    import fa4_program_timeline as fa4
    import program_timeline as timeline

    anchors = [anchor for anchor, _ in fa4.EDITS]
    source = "".join(f"line {i}\n{anchor}" for i, anchor in enumerate(anchors)) + "end\n"
    stamped = fa4.stamped_fa4_source(source)
    for anchor, replacement in fa4.EDITS:
        assert stamped.count(replacement) == 1
    # the stand-in's own lines all kept, in order
    kept = [line for line in stamped.split("\n") if line.startswith("line ")]
    assert kept == [f"line {i}" for i in range(len(anchors))]
    events = sorted(int(e) for e in re.findall(r"_stamp\((\d+),", stamped))
    assert events == [0, 1, 2, 3, 4, 5, 6, 8, 9, 10, 11, 13, 15, 16, 17]
    with pytest.raises(RuntimeError, match="anchor found 0 times"):
        fa4.stamped_fa4_source(source.replace(anchors[3], ""))
    with pytest.raises(RuntimeError, match="anchor found 2 times"):
        fa4.stamped_fa4_source(source + anchors[5])

    slots = timeline.SLOTS
    row = [3, 1000] + [0] * (slots - 2)
    for slot, after in {2: 500, 3: 900, 4: 5000, 5: 1200, 15: 4000, 6: 13000, 8: 13600, 9: 13100,
                        10: 15000, 11: 14000}.items():
        row[slot] = row[1] + after
    row[13] = 4  # the first step and three more of 3000 cycles
    row[16], row[17] = 50_000, 50_000 + 10_000  # 15000 cycles (entry -> stores read) in 10 us
    summary = timeline.summarise(torch.tensor(row, dtype=torch.int32), 1, fa4.PHASES, end_slots=(10, 11),
                                 step_span=(15, 6), steps_less=1, clock_span=(1, 10))
    assert summary["phases"]["producer start -> wg0's first step over"] == 3100
    assert summary["phases"]["stores issued -> stores read"] == 1400
    assert summary["cycles_per_step_median"] == 3000 and summary["entry_to_end_median"] == 15000
    assert summary["step_cycles_mean"] == 3000 and summary["clock_mhz_median"] == 1500


def test_step_phases_writes_its_clock_reads_into_both_kernels_and_averages_them(tmp_path):
    """benchmarks/step_phases.py: every anchor of its phase sums is found once in this tree's dK/dV
    pass (the sums' address baked in) and the stamped module imports beside the real one; FA4's
    edits go in once each (a stand-in for FA4's source holding each anchor once), a missing anchor
    fails loudly; the sums and the step count give each phase's mean cycles a step."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
    import gluon_modules_ab as ab
    import step_phases as phases
    import fusedattn.kernels.gluon.bwd as bwd

    stamped = phases.stamped_ours(Path(bwd.__file__).read_text(), 123456789)
    assert "PHASE_ADDRESS" not in stamped and "gl.constexpr(123456789)" in stamped
    slots = sorted(int(m) for m in re.findall(r"_phase\(_c, (\d+), WG", stamped))
    assert slots == list(range(len(phases.PHASES)))
    with pytest.raises(RuntimeError, match="anchor found 0 times"):
        phases.stamped_ours(Path(bwd.__file__).read_text().replace("deps=[dp_tok])", "deps=[dp_tok] )"), 0)

    (tmp_path / "bwd.py").write_text(stamped)
    this = {"fwd": sys.modules["fusedattn.kernels.gluon.fwd"], "bwd": bwd}
    try:
        other = ab.load_other(str(tmp_path))
        assert hasattr(other["bwd"], "_phase")
    finally:
        ab.route_to(this)

    anchors = [anchor for anchor, _ in phases.FA4_EDITS]
    source = "".join(f"line {i}\n{anchor}" for i, anchor in enumerate(anchors))
    fa4 = phases.stamped_fa4(source)
    assert [int(m) for m in re.findall(r"_phase\(_c, (\d+)", fa4)] == list(range(len(phases.PHASES)))
    assert [line for line in fa4.split("\n") if line.startswith("line ")] == [f"line {i}" for i in range(len(anchors))]
    with pytest.raises(RuntimeError, match="anchor found 0 times"):
        phases.stamped_fa4(source.replace(anchors[4], ""))

    sums = [100 * (i + 1) * 10 for i in range(len(phases.PHASES))] + [10]  # 10 steps
    summary = phases.summarise(sums)
    assert summary["steps"] == 10 and summary["phases"]["Q, dO landed"] == 100
    assert summary["phases"]["dK retired"] == 800 and summary["step"] == sum(100 * (i + 1) for i in range(8))


def test_backward_forms_reads_launch_chunks_and_the_fixed_order_from_a_forms_name():
    """benchmarks/backward_forms.py: ``[det-][ordered-]chunks-N`` pins the launch order's chunk, the
    deterministic flag and the fixed dQ order; ``ordered`` without ``det`` and other names are refused."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
    from backward_forms import parsed_form

    from fusedattn.tuning.configs import INTERPRETER_CONFIGS

    assert parsed_form("chunks-4", INTERPRETER_CONFIGS) == (INTERPRETER_CONFIGS, False, dict(chunk_heads=4))
    assert parsed_form("det-chunks-16", INTERPRETER_CONFIGS) == (INTERPRETER_CONFIGS, True, dict(chunk_heads=16))
    configs, deterministic, launch = parsed_form("det-ordered-chunks-2", INTERPRETER_CONFIGS)
    assert configs.ordered_dq and not INTERPRETER_CONFIGS.ordered_dq
    assert deterministic and launch == dict(chunk_heads=2)
    assert parsed_form("ordered-chunks-2", INTERPRETER_CONFIGS) is None
    assert parsed_form("det-heuristic", INTERPRETER_CONFIGS) is None
