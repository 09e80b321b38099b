"""Which tiles a program visits when the call has a mask: lists built on the host.

Without a mask, ``block_range.py`` decides in the kernel (ranges of blocks). With one, the
launchers call this module once per pass: the mask's tile states (``block_mask.BlockMask``)
are brought to the pass's tile sizes and merged with the keep rule (causal,
window, sequence bounds), and each program gets a list:

    [number of FULL tiles, number of PARTIAL tiles, the FULL tiles..., the PARTIAL tiles...]

FULL tiles (every pair kept and in bounds) run with no mask math and no mask load; PARTIAL
tiles apply the keep rule and load the mask; EMPTY tiles are not in the list. Full tiles come
first, as the interior stretch does without a mask: a masked loop ahead of the pipelined one
made ptxas serialise the backward's wgmmas. The order is fixed, so
results stay bitwise reproducible.

- ``row_lists``: for the forward and the dQ pass, per (batch, head, query block): key blocks.
- ``column_lists``: for the dK/dV pass, per (batch, KV head, key block): entries
  ``member * query_blocks + query_block`` over the query heads of the KV group, in order.

Lists are cached on the mask's states tensor (weakly: they go when the BlockMask does), keyed by
everything they depend on, so a BlockMask reused by every layer of a step builds each list once
(some 50 small torch ops, all host time). A BlockMask is therefore not to be changed in
place once used.
"""

from __future__ import annotations

import torch
from torch.utils.weak import WeakIdKeyDictionary

from ...block_mask import EMPTY, FULL, PARTIAL, BlockMask, reduce_chunks
from ...spec import AttentionSpec


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def _regrid(states: torch.Tensor, dim: int, cell: int, block: int, blocks: int) -> torch.Tensor:
    """States on cells of ``cell`` along ``dim`` brought to tiles of ``block`` (``blocks`` of them).
    Coarser: a tile is EMPTY / FULL if all its cells are, else PARTIAL. Finer: a tile takes its
    cell's state (PARTIAL is then conservative: the mask decides per element)."""
    if states.shape[dim] == 1:  # broadcast (or a single cell): the same state for every tile
        return states
    if block >= cell:
        factor = block // cell
        all_empty = reduce_chunks(states == EMPTY, dim, factor, lambda t, d: t.all(dim=d))
        all_full = reduce_chunks(states == FULL, dim, factor, lambda t, d: t.all(dim=d))
        return torch.where(all_full, FULL, torch.where(all_empty, EMPTY, PARTIAL)).to(torch.int8)
    return states.repeat_interleave(cell // block, dim=dim).narrow(dim, 0, blocks)


def rule_states(seqlen_q: int, seqlen_k: int, spec: AttentionSpec, block_q: int, block_k: int,
                device) -> torch.Tensor:
    """int8 (query blocks, key blocks): the causal/window keep rule per tile. Over a tile, the
    offset from the diagonal ``j - i - (Sk - Sq)`` takes every value of [dmin, dmax], so a tile is
    EMPTY iff that range misses [-window_left, window_right], and FULL iff it lies inside it and
    the tile is whole (not cut by Sq or Sk). With ``chunk``: EMPTY also where the chunks of its
    queries' aligned positions and of its keys do not meet, FULL only where all lie in one chunk."""
    rows0 = torch.arange(_cdiv(seqlen_q, block_q), device=device) * block_q
    cols0 = torch.arange(_cdiv(seqlen_k, block_k), device=device) * block_k
    rows1 = torch.clamp(rows0 + block_q, max=seqlen_q) - 1
    cols1 = torch.clamp(cols0 + block_k, max=seqlen_k) - 1
    diag = seqlen_k - seqlen_q
    offset_min = cols0[None, :] - rows1[:, None] - diag
    offset_max = cols1[None, :] - rows0[:, None] - diag
    empty = torch.zeros(offset_min.shape, dtype=torch.bool, device=device)
    full = (rows0 + block_q <= seqlen_q)[:, None] & (cols0 + block_k <= seqlen_k)[None, :]
    if spec.has_window_right:
        empty |= offset_min > spec.window_right
        full &= offset_max <= spec.window_right
    if spec.has_window_left:
        empty |= offset_max < -spec.window_left
        full &= offset_min >= -spec.window_left
    if spec.has_chunk:  # the tile's query chunks [first, last] against its key chunks (floor division)
        chunk = spec.chunk
        q_first, q_last = (rows0 + diag) // chunk, (rows1 + diag) // chunk
        k_first, k_last = cols0 // chunk, cols1 // chunk
        empty |= (q_last[:, None] < k_first[None, :]) | (q_first[:, None] > k_last[None, :])
        full &= ((q_first == q_last)[:, None] & (k_first == k_last)[None, :]
                 & (q_first[:, None] == k_first[None, :]))
    return torch.where(empty, EMPTY, torch.where(full, FULL, PARTIAL)).to(torch.int8)


def _mask_states(block_mask: BlockMask, seqlen_q: int, seqlen_k: int, block_q: int, block_k: int) -> torch.Tensor:
    """The mask's own states (no keep rule) at (block_q, block_k) tiles; broadcast dims stay 1."""
    user = _regrid(block_mask.states, 2, block_mask.cell[0], block_q, _cdiv(seqlen_q, block_q))
    return _regrid(user, 3, block_mask.cell[1], block_k, _cdiv(seqlen_k, block_k))


def tile_states(block_mask: BlockMask, spec: AttentionSpec, seqlen_q: int, seqlen_k: int, block_q: int,
                block_k: int) -> torch.Tensor:
    """int8 (B|1, H|1, query blocks, key blocks): the mask's states at these tile sizes, merged
    with the keep rule: EMPTY if either is, FULL if both are, else PARTIAL."""
    user = _mask_states(block_mask, seqlen_q, seqlen_k, block_q, block_k)
    user = user.expand(user.shape[0], user.shape[1], _cdiv(seqlen_q, block_q), _cdiv(seqlen_k, block_k))
    rule = rule_states(seqlen_q, seqlen_k, spec, block_q, block_k, user.device)
    empty = (user == EMPTY) | (rule == EMPTY)
    full = (user == FULL) & (rule == FULL)
    return torch.where(empty, EMPTY, torch.where(full, FULL, PARTIAL)).to(torch.int8)


def _lists(states: torch.Tensor) -> torch.Tensor:
    """int32 (..., 2 + n) from int8 (..., n): counts of FULL and PARTIAL, then their indices."""
    rank = torch.where(states == FULL, 0, torch.where(states == PARTIAL, 1, 2))
    order = torch.sort(rank, dim=-1, stable=True).indices.to(torch.int32)
    counts = torch.stack([(states == FULL).sum(-1), (states == PARTIAL).sum(-1)], dim=-1).to(torch.int32)
    return torch.cat([counts, order], dim=-1).contiguous()


_cache: WeakIdKeyDictionary = WeakIdKeyDictionary()


def _key(block_mask: BlockMask, key: tuple) -> tuple:
    return key + (block_mask.cell, block_mask.source_shift)


def _cached(block_mask: BlockMask, key: tuple, build) -> torch.Tensor:
    per_mask = _cache.setdefault(block_mask.states, {})
    key = _key(block_mask, key)
    if key not in per_mask:
        per_mask[key] = build()
    return per_mask[key]


def _partial_any(block_mask: BlockMask, seqlen_q: int, seqlen_k: int, block_q: int, block_k: int) -> torch.Tensor:
    return (_mask_states(block_mask, seqlen_q, seqlen_k, block_q, block_k) == PARTIAL).any()


def tiles_whole(block_mask: BlockMask, seqlen_q: int, seqlen_k: int, block_q: int, block_k: int) -> bool:
    """Whether every (block_q, block_k) tile of the mask is EMPTY or FULL (the mask itself, without
    the keep rule): a kernel walking its lists then never reads the mask (the Gluon kernels need
    that; block-sparse masks and key padding at tile-aligned lengths have it). One host sync, once
    per BlockMask and tile size (none where ``whole_and_even`` read it already)."""
    return _cached(block_mask, ("whole", seqlen_q, seqlen_k, block_q, block_k),
                   lambda: not bool(_partial_any(block_mask, seqlen_q, seqlen_k, block_q, block_k)))


def row_lists(block_mask: BlockMask, spec: AttentionSpec, seqlen_q: int, seqlen_k: int, block_q: int,
              block_k: int) -> torch.Tensor:
    """int32 (B|1, H|1, query blocks, 2 + key blocks): the key blocks each forward / dQ program
    visits (module doc)."""
    key = ("rows", spec.window_left, spec.window_right, spec.chunk, seqlen_q, seqlen_k, block_q, block_k)
    return _cached(block_mask, key,
                   lambda: _lists(tile_states(block_mask, spec, seqlen_q, seqlen_k, block_q, block_k)))


EVEN_LISTS = 1.15  # rows_even: the longest list at most this many times the mean


def rows_even(block_mask: BlockMask, spec: AttentionSpec, seqlen_q: int, seqlen_k: int, block_q: int,
              block_k: int) -> bool:
    """Whether the forward programs' lists (``row_lists``) are about equally long: the longest at
    most EVEN_LISTS times the mean (a block-sparse top-k mask: all equal). Static rounds of a
    persistent launch then balance (hopper_fwd.forward_programs); a causal-shaped mask's do not."""
    return whole_and_even(block_mask, spec, seqlen_q, seqlen_k, block_q, block_k)[1]


def whole_and_even(block_mask: BlockMask, spec: AttentionSpec, seqlen_q: int, seqlen_k: int, block_q: int,
                   block_k: int) -> tuple[bool, bool]:
    """(``tiles_whole``, ``rows_even``) at these tiles from one host sync, once per BlockMask and
    problem: the Gluon forward asks both of a mask (a dynamic top-k block mask is a new one each
    training step)."""
    per_mask = _cache.setdefault(block_mask.states, {})
    whole_key = _key(block_mask, ("whole", seqlen_q, seqlen_k, block_q, block_k))
    even_key = _key(block_mask, ("even", spec.window_left, spec.window_right, spec.chunk, seqlen_q, seqlen_k, block_q, block_k))
    if whole_key not in per_mask or even_key not in per_mask:
        # a list's length is its row's non-empty tiles: counted from the states, so that a mask the
        # Gluon forward declines (partial tiles) builds and keeps no list at its tiles
        states = tile_states(block_mask, spec, seqlen_q, seqlen_k, block_q, block_k)
        lengths = (states != EMPTY).sum(-1).float()
        partial = _partial_any(block_mask, seqlen_q, seqlen_k, block_q, block_k)
        partial, longest, mean = torch.stack([partial.float(), lengths.max(), lengths.mean()]).tolist()
        per_mask.setdefault(whole_key, not partial)
        per_mask[even_key] = longest <= EVEN_LISTS * mean
    return per_mask[whole_key], per_mask[even_key]


def column_lists(block_mask: BlockMask, spec: AttentionSpec, seqlen_q: int, seqlen_k: int, block_q: int,
                 block_k: int, heads_q: int, heads_kv: int) -> torch.Tensor:
    """int32 (B|1, Hkv|1, key blocks, 2 + group * query blocks): the (query head of the group,
    query block) tiles each dK/dV program visits, as ``member * query_blocks + query_block``."""
    key = ("columns", spec.window_left, spec.window_right, spec.chunk, seqlen_q, seqlen_k, block_q, block_k, heads_q, heads_kv)
    return _cached(block_mask, key, lambda: _column_lists(block_mask, spec, seqlen_q, seqlen_k, block_q, block_k,
                                                          heads_q, heads_kv))


def _column_lists(block_mask: BlockMask, spec: AttentionSpec, seqlen_q: int, seqlen_k: int, block_q: int,
                  block_k: int, heads_q: int, heads_kv: int) -> torch.Tensor:
    states = tile_states(block_mask, spec, seqlen_q, seqlen_k, block_q, block_k)
    batches, heads, blocks_q, blocks_k = states.shape
    group = heads_q // heads_kv
    if heads == heads_q and group > 1:  # one mask per query head: each member has its own tiles
        grouped = states.view(batches, heads_kv, group, blocks_q, blocks_k)
    else:  # shared by the group's members (one per KV head, or one for all heads)
        grouped = states.unsqueeze(2).expand(batches, heads, group, blocks_q, blocks_k)
    per_key_block = grouped.permute(0, 1, 4, 2, 3).reshape(batches, grouped.shape[1], blocks_k, group * blocks_q)
    return _lists(per_key_block)
