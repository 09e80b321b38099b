"""The host's maps of the blocks packed sequences have (kernels/packed_tiles.py), which the Gluon
kernels take their tiles from: every block of every sequence exactly once with its sequence's
offsets and lengths, heaviest first by the SPEC 3.2 rule (checked against ``spec.keep_mask``, not
against the map's own arithmetic). Pure host code: runs without a GPU."""

from __future__ import annotations

import itertools

import pytest
import torch

from fusedattn.kernels.shared import packed_tiles
from fusedattn.spec import Packing, keep_mask, resolve_spec

CASES = [
    # lengths of queries, of keys (None: the same), causal, window, block
    ((17, 1, 0, 33), None, True, None, 16),
    ((5, 20, 3), (19, 7, 0), False, (8, 2), 16),  # a sequence with queries and no keys
    ((9, 0, 20), (12, 17, 5), True, None, 8),  # a sequence with keys and no queries
    ((1000, 1, 0, 255, 129, 2048, 113), None, True, None, 192),
    ((513, 64, 1500), (400, 64, 1600), False, (100, 0), 128),
    ((65, 300, 1), (300, 1, 77), False, None, 64),
]


@pytest.fixture(autouse=True)
def _no_maps_of_earlier_tests():
    """Each test makes its own maps (packed_tiles keeps earlier calls' maps by their lengths)."""
    packed_tiles._shared.clear()
    yield
    packed_tiles._shared.clear()


def _packing(lengths_q, lengths_k) -> Packing:
    offsets_q = tuple(itertools.accumulate(lengths_q, initial=0))
    offsets_k = tuple(itertools.accumulate(lengths_k, initial=0))
    return Packing(torch.tensor(offsets_q, dtype=torch.int32), torch.tensor(offsets_k, dtype=torch.int32),
                   max(lengths_q), max(lengths_k), offsets_q, offsets_k)


def _check_map(lengths_q, lengths_k, causal, window, block, by_queries: bool):
    lengths_k = lengths_q if lengths_k is None else lengths_k
    packing = _packing(lengths_q, lengths_k)
    spec = resolve_spec(64, layout="bshd", causal=causal, window=window, scale=None, softcap=None,
                        deterministic=False)
    build = packed_tiles.query_block_map if by_queries else packed_tiles.key_block_map
    tile_map = build(packing, block, spec, torch.device("cpu"))
    assert tile_map.dtype == torch.int32 and tile_map.shape[0] == packed_tiles.FIELDS and tile_map.is_contiguous()
    entries = [tuple(column) for column in tile_map.t().tolist()]
    expected, work = set(), {}
    for seq, (sq, sk) in enumerate(zip(lengths_q, lengths_k)):
        keep = keep_mask(sq, sk, spec.window_left, spec.window_right)
        for index in range(-(-(sq if by_queries else sk) // block)):
            expected.add((seq, index, packing.offsets_q[seq], sq, packing.offsets_k[seq], sk))
            rows = slice(index * block, (index + 1) * block)
            part = keep[rows] if by_queries else keep[:, rows].t()
            work[(seq, index)] = int(part.any(0).sum())  # keys its rows see / queries that see its keys
    assert len(entries) == len(set(entries)) and set(entries) == expected
    order = [work[entry[:2]] for entry in entries]
    assert order == sorted(order, reverse=True), "heaviest first"
    assert build(packing, block, spec, torch.device("cpu")) is tile_map  # kept for the backward


@pytest.mark.parametrize("lengths_q, lengths_k, causal, window, block", CASES)
def test_query_block_map_lists_every_query_block_once_heaviest_first(lengths_q, lengths_k, causal, window, block):
    _check_map(lengths_q, lengths_k, causal, window, block, by_queries=True)


@pytest.mark.parametrize("lengths_q, lengths_k, causal, window, block", CASES)
def test_key_block_map_lists_every_key_block_once_heaviest_first(lengths_q, lengths_k, causal, window, block):
    _check_map(lengths_q, lengths_k, causal, window, block, by_queries=False)


def test_a_packing_without_host_offsets_is_refused():
    cu = torch.tensor([0, 4], dtype=torch.int32)
    spec = resolve_spec(64, layout="bshd", causal=True, window=None, scale=None, softcap=None, deterministic=False)
    with pytest.raises(ValueError, match="host offsets"):
        packed_tiles.query_block_map(Packing(cu, cu, 4, 4), 16, spec, torch.device("cpu"))


def test_maps_made_together_are_the_maps_made_alone():
    """The forward makes the backward's map with its own (one copy to the device): the same maps."""
    lengths = (1000, 1, 0, 255, 129, 2048, 113)
    spec = resolve_spec(128, layout="bshd", causal=True, window=None, scale=None, softcap=None, deterministic=False)
    together, alone = _packing(lengths, lengths), _packing(lengths, lengths)
    query_map, key_map = packed_tiles.prepare(together, spec, torch.device("cpu"), query_block=192, key_block=128)
    packed_tiles._shared.clear()
    assert torch.equal(query_map, packed_tiles.query_block_map(alone, 192, spec, torch.device("cpu")))
    assert torch.equal(key_map, packed_tiles.key_block_map(alone, 128, spec, torch.device("cpu")))
    assert packed_tiles.key_block_map(together, 128, spec, torch.device("cpu")) is key_map


@pytest.mark.parametrize("lengths", [(1000, 1, 0, 255, 129, 2048, 113), (5, 2000, 0, 77, 640), (33,), (300, 17, 1000)])
def test_maps_made_together_each_start_on_16_bytes(lengths):
    """Kernels are compiled for their pointers' alignment: a map that starts mid-word after another
    map of the same copy would compile them again for it."""
    spec = resolve_spec(64, layout="bshd", causal=True, window=None, scale=None, softcap=None, deterministic=False)
    maps = packed_tiles.prepare(_packing(lengths, lengths), spec, torch.device("cpu"), query_block=192, key_block=128)
    packed_tiles._shared.clear()
    assert len(maps) == 2 and all(m.data_ptr() % 16 == 0 for m in maps), [m.data_ptr() % 16 for m in maps]


def test_maps_of_earlier_calls_are_found_by_everything_they_are_made_from():
    """Every layer of a step passes the same lengths: a later call's packing (a new object) finds
    the maps made for the first; lengths that differ in the queries only, in the keys only, or a
    different window or block must not find them. Each map found is checked against one made
    with nothing kept."""
    cpu = torch.device("cpu")
    causal = resolve_spec(64, layout="bshd", causal=True, window=None, scale=None, softcap=None, deterministic=False)
    window = resolve_spec(64, layout="bshd", causal=False, window=(8, 2), scale=None, softcap=None,
                          deterministic=False)
    calls = [((17, 1, 0, 33), (17, 1, 0, 33), causal, 16), ((17, 1, 0, 33), (20, 1, 0, 30), causal, 16),
             ((18, 0, 0, 33), (17, 1, 0, 33), causal, 16), ((17, 1, 0, 33), (17, 1, 0, 33), window, 16),
             ((17, 1, 0, 33), (17, 1, 0, 33), causal, 32), ((17, 1, 0, 33), (17, 1, 0, 33), causal, 16)]
    first = None
    for lengths_q, lengths_k, spec, block in calls:
        query_map, key_map = packed_tiles.prepare(_packing(lengths_q, lengths_k), spec, cpu, block, block)
        kept = dict(packed_tiles._shared)
        packed_tiles._shared.clear()
        fresh = packed_tiles.prepare(_packing(lengths_q, lengths_k), spec, cpu, block, block)
        packed_tiles._shared.clear()
        packed_tiles._shared.update(kept)
        assert torch.equal(query_map, fresh[0]) and torch.equal(key_map, fresh[1])
        first = first or (query_map, key_map)
    assert query_map is first[0] and key_map is first[1], "the last call repeats the first: its maps are found"
    assert len(packed_tiles._shared) == 2 * (len(calls) - 1)


def test_maps_kept_are_bounded():
    spec = resolve_spec(64, layout="bshd", causal=True, window=None, scale=None, softcap=None, deterministic=False)
    for n in range(1, packed_tiles.SHARED_MAPS + 10):
        packed_tiles.prepare(_packing((n, 3), (n, 3)), spec, torch.device("cpu"), query_block=16)
    assert len(packed_tiles._shared) == packed_tiles.SHARED_MAPS
