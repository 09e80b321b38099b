"""The benchmark's shapes and its grouped-query path (CPU: fusedattn's PyTorch path vs SDPA math)."""

import torch

from fusedattn.bench.__main__ import GQA_HEADS, _inputs, measure, standard_shapes, table
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
    ours, sdpa_math = CPU_SYSTEMS
    our_row, our_out = measure(ours, shape, "cpu")
    peer_row, _ = measure(sdpa_math, shape, "cpu", baseline_out=our_out)
    assert our_row["Hkv"] == 2 and "fwd_ms" in our_row, our_row
    assert peer_row["output_agrees"] and peer_row["max_diff_vs_fusedattn"] < 1e-4, peer_row
    printed = table([our_row, peer_row]).splitlines()
    assert printed[2].startswith(shape.name) and "sdpa-math" in printed[2] and printed[2].endswith("x")
