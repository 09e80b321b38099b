"""Which programs run over packed sequences (``varlen_attention``), and in which order: the host's
map of (sequence, block) entries that the Gluon kernels take their tiles from.

A grid that covered the longest sequence for every sequence would start mostly empty programs (16
documents of 61-3589 tokens: most of a 192-row forward grid, each empty warp-specialised program
still allocating its barriers and exiting). The host reads the offsets once a call anyway
(``varlen.check_packing``), so it lists the blocks that exist instead, heaviest first -- the
longest-processing-time order: with documents of very different lengths a grid in sequence order
would end on the longest document's diagonal tail.

A map is int32 (``FIELDS``, entries), field-major (field f of entry e at ``f * entries + e``):
the sequence, the block within it, the sequence's first query row, its Sq, its first key row, its
Sk. The kernels read the fields they need with one load each (no second trip to ``cu_seqlens``).
NumPy on the host, so it is tested without a GPU.
"""

from __future__ import annotations

from collections import OrderedDict

import numpy as np
import torch

from ...spec import AttentionSpec, Packing

SEQUENCE, BLOCK, Q_START, SEQ_Q, K_START, SEQ_K = range(6)
FIELDS = 6


def query_block_map(packing: Packing, block_m: int, spec: AttentionSpec, device: torch.device) -> torch.Tensor:
    """Every query block of every sequence with a query (a sequence without keys too: its rows get
    out = 0, lse = -inf), heaviest first (the keys its rows see, ``_visited``)."""
    return prepare(packing, spec, device, query_block=block_m)[0]


def key_block_map(packing: Packing, block_n: int, spec: AttentionSpec, device: torch.device) -> torch.Tensor:
    """Every key block of every sequence with a key (a sequence without queries too: its dK, dV
    rows are zeros the program must write), heaviest first (the queries that see it)."""
    return prepare(packing, spec, device, key_block=block_n)[0]


# Maps made for earlier calls, by the lengths they were made from: every layer of a training step
# (and the backward of each) takes the same packing, so the first call makes the maps and the
# others find them (making two took a large share of a forward call's host time). Keyed by the
# stream too: a map is copied to the device on the stream current when
# it is made, and a kernel on another stream could read it before that copy lands.
_shared: OrderedDict = OrderedDict()
MAP_ALIGN = 4  # int32 entries: 16 bytes
SHARED_MAPS = 64  # maps kept (each a few KB: 6 x (tokens / block + sequences) int32)


def prepare(packing: Packing, spec: AttentionSpec, device: torch.device, query_block: int | None = None,
            key_block: int | None = None) -> list[torch.Tensor]:
    """The maps asked for (query blocks of ``query_block`` rows, key blocks of ``key_block`` keys),
    kept on ``packing`` for the rest of the call (the backward reads the forward's) and among the
    maps of earlier calls (``_shared``); those found in neither are made together and copied to
    the device in one non-blocking copy -- from pageable memory it is staged at once, with no wait
    for the stream (a blocking copy would wait for the GPU in the middle of the backward)."""
    wanted = [(kind, block, spec.window_left, spec.window_right)
              for kind, block in (("query", query_block), ("key", key_block)) if block is not None]
    missing = [key for key in wanted if key not in packing.tile_maps]
    # Not while a CUDA graph is being captured: the graph would keep reading a kept map's memory
    # after it left ``_shared`` and was reused (there the maps are made in the call, as before).
    shared = bool(missing) and (device.type != "cuda" or not torch.cuda.is_current_stream_capturing())
    if shared:
        lengths = (device, _stream(device), packing.offsets_q, packing.offsets_k)
        for key in missing:
            found = _shared.get((*lengths, *key))
            if found is not None:
                _shared.move_to_end((*lengths, *key))
                packing.tile_maps[key] = found
        missing = [key for key in missing if key not in packing.tile_maps]
    if missing:
        built = [_block_map(packing, key[1], spec, by_queries=key[0] == "query") for key in missing]
        # Each map starts on a 16-byte boundary: kernels are compiled for their pointers' alignment,
        # and a map placed after another of any size would otherwise compile them again.
        starts = np.cumsum([0] + [-(-m.size // MAP_ALIGN) * MAP_ALIGN for m in built])
        host = np.zeros(starts[-1], dtype=np.int32)
        for start, m in zip(starts, built):
            host[start:start + m.size] = m.ravel()
        flat = torch.from_numpy(host).to(device, non_blocking=True)
        for key, m, start in zip(missing, built, starts):
            packing.tile_maps[key] = flat[start:start + m.size].view(m.shape)
            if shared:
                _shared[(*lengths, *key)] = packing.tile_maps[key]
        while len(_shared) > SHARED_MAPS:
            _shared.popitem(last=False)
    return [packing.tile_maps[key] for key in wanted]


def _stream(device: torch.device) -> int:
    if device.type != "cuda":
        return 0
    return torch._C._cuda_getCurrentRawStream(torch.cuda.current_device() if device.index is None else device.index)


def _block_map(packing: Packing, block: int, spec: AttentionSpec, by_queries: bool) -> np.ndarray:
    # NumPy on a few hundred entries: measured several times faster than the same in torch CPU ops (a
    # varlen call pays it between its offsets' host read and its first launch).
    if packing.offsets_q is None:
        raise ValueError("packed_tiles: the packing carries no host offsets (varlen.check_packing reads them)")
    offsets_q = np.asarray(packing.offsets_q, dtype=np.int64)
    offsets_k = np.asarray(packing.offsets_k, dtype=np.int64)
    lengths_q, lengths_k = np.diff(offsets_q), np.diff(offsets_k)
    lengths = lengths_q if by_queries else lengths_k
    blocks = -(-lengths // block)
    sequence = np.repeat(np.arange(lengths.size), blocks)
    index = np.arange(sequence.size) - np.repeat(np.cumsum(blocks) - blocks, blocks)
    seq_q, seq_k = lengths_q[sequence], lengths_k[sequence]
    work = _visited(index, block, seq_q, seq_k, spec, by_queries)
    order = np.argsort(-work, kind="stable")  # heaviest first; equal work keeps sequence order
    fields = np.stack([sequence, index, offsets_q[:-1][sequence], seq_q, offsets_k[:-1][sequence], seq_k])
    return np.ascontiguousarray(fields[:, order], dtype=np.int32)


def _visited(index: np.ndarray, block: int, sq: np.ndarray, sk: np.ndarray, spec: AttentionSpec,
             by_queries: bool) -> np.ndarray:
    """How many keys a query block's rows see (``by_queries``), or how many queries see a key
    block's keys: the span between the window's bounds (bottom-right aligned) clipped to
    the sequence -- the block's work, up to the diagonal's partial tiles."""
    diag = sk - sq
    first = index * block
    if by_queries:
        last = np.minimum(first + block, sq) - 1
        hi = sk if not spec.has_window_right else np.clip(last + diag + spec.window_right + 1, 0, sk)
        lo = 0 if not spec.has_window_left else np.maximum(first + diag - spec.window_left, 0)
    else:
        last = np.minimum(first + block, sk) - 1
        lo = 0 if not spec.has_window_right else np.maximum(first - diag - spec.window_right, 0)
        hi = sq if not spec.has_window_left else np.clip(last - diag + spec.window_left + 1, 0, sq)
    return np.maximum(hi - lo, 0)
