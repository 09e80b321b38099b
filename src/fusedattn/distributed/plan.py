"""How a sequence is cut over the ranks of a context-parallel group (``shard_plan``).

Every rank holds the same number of tokens: a list of runs of consecutive global positions,
concatenated in order. Balances:

- ``"zigzag"`` (causal load balance, as ring-flash-attention's zigzag and TransformerEngine's
  "head-tail" shard): each sequence (each document, for packed batches) is cut into 2N equal chunks;
  rank r holds chunks r and 2N - 1 - r, so every rank gets one early and one late chunk and the same
  causal work. Needs every sequence length (document length) divisible by 2N.
- ``"contiguous"``: rank r holds tokens [r T / N, (r + 1) T / N) of the T tokens (packed documents
  may cross rank boundaries). Needs T divisible by N. Causal work is unbalanced: the last rank's
  queries see the most keys.
- ``"documents"`` (packed batches): whole documents on one rank where the causal work stays
  balanced, zigzag for the documents that must be split. A whole document's keys are all on its
  rank: its queries need no communication. The largest documents are zigzagged first (their
  work, L^2, is the hardest to balance whole); the rest are placed longest first on the rank with
  the least work that still has room, and the first choice that fills every rank exactly with
  work within ``DOCUMENT_IMBALANCE`` of the mean is taken (zigzagging every document, which is
  always balanced, is the last choice). Documents that are zigzagged need lengths divisible by 2N.
- ``"auto"``: zigzag where its divisibility holds, contiguous otherwise.

The plan is a pure function of (lengths, N, balance): every rank knows every rank's runs, which the
strategies use to place the keys they receive.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch

from .comm import all_gather_concat

BALANCES = ("auto", "zigzag", "contiguous", "documents")

# A rank with more causal work than the mean holds the whole group back by that fraction; one more
# zigzagged document costs the transfer of its keys, less than a few percent of the step.
DOCUMENT_IMBALANCE = 0.03


@dataclass(frozen=True)
class ShardPlan:
    """This rank's share of the sequence and everyone else's (``shard_plan``)."""

    world_size: int
    rank: int
    seqlen: int  # tokens along the sharded dim: per batch row, or all packed tokens
    balance: str  # "zigzag" or "contiguous" (resolved)
    runs: tuple  # runs[r]: ((global start, length), ...) of rank r, in local order
    documents: tuple  # ((start, end), ...): the sequences attention stays inside (one without cu_seqlens)
    packed: bool  # built from cu_seqlens: tensors are (tokens, heads, head dim)
    group: object = None  # the torch.distributed process group (None: the default group)

    @property
    def local_len(self) -> int:
        return sum(length for _, length in self.runs[self.rank])

    def global_index(self, rank: int | None = None, device=None) -> torch.Tensor:
        """The global positions of ``rank``'s tokens (default: this rank's), in local order."""
        runs = self.runs[self.rank if rank is None else rank]
        return torch.cat([torch.arange(start, start + length, device=device) for start, length in runs])

    def positions(self, device=None) -> torch.Tensor:
        """This rank's tokens' positions inside their own sequence (document): the positions RoPE
        rotates by."""
        index = self.global_index(device=device)
        starts = torch.tensor([s for s, _ in self.documents], device=device)
        document = torch.searchsorted(starts, index, right=True) - 1
        return index - starts[document]

    def shard(self, x: torch.Tensor, dim: int | None = None) -> torch.Tensor:
        """This rank's tokens of ``x``, the whole sequence along ``dim`` (default: 0 for packed
        plans, else 1: the S of (B, S, H, D)), in local order."""
        dim = self._dim(x, dim)
        if x.shape[dim] != self.seqlen:
            raise ValueError(f"ShardPlan.shard: `x` has {x.shape[dim]} tokens along dim {dim}; the plan cuts "
                             f"{self.seqlen}")
        return torch.cat([x.narrow(dim, start, length) for start, length in self.runs[self.rank]], dim)

    def unshard(self, x: torch.Tensor, dim: int | None = None) -> torch.Tensor:
        """The whole sequence from every rank's shard ``x`` (a collective over the plan's group:
        every rank calls it), in global order. Not differentiable."""
        dim = self._dim(x, dim)
        if x.shape[dim] != self.local_len:
            raise ValueError(f"ShardPlan.unshard: `x` has {x.shape[dim]} tokens along dim {dim}; this rank "
                             f"holds {self.local_len}")
        moved = x.movedim(dim, 0).contiguous()
        gathered = moved.new_empty((self.world_size * moved.shape[0], *moved.shape[1:]))
        all_gather_concat(gathered, moved, self.group)
        order = torch.cat([self.global_index(r, device=x.device) for r in range(self.world_size)])
        whole = torch.empty_like(gathered)
        whole[order] = gathered
        return whole.movedim(0, dim)

    def _dim(self, x: torch.Tensor, dim: int | None) -> int:
        if dim is None:
            dim = 0 if self.packed else 1
        return dim % x.dim()


def _group_size_rank(group, world_size, rank) -> tuple[int, int]:
    if world_size is not None or rank is not None:
        if world_size is None or rank is None:
            raise ValueError("shard_plan: give both `world_size` and `rank`, or neither (then the group's)")
        return int(world_size), int(rank)
    import torch.distributed as dist

    if not dist.is_available() or not dist.is_initialized():
        raise RuntimeError("shard_plan: torch.distributed is not initialised; call init_process_group first (or "
                           "pass world_size and rank)")
    return dist.get_world_size(group), dist.get_rank(group)


def shard_plan(seqlen: int | None = None, *, cu_seqlens: torch.Tensor | Sequence[int] | None = None, group=None,
               balance: str = "auto", world_size: int | None = None, rank: int | None = None) -> ShardPlan:
    """The plan that cuts a sequence of ``seqlen`` tokens (each batch row of (B, S, H, D) tensors)
    or the packed documents ``cu_seqlens`` ((docs + 1,) offsets into (tokens, H, D) tensors) over
    the ranks of ``group``. ``balance``: "zigzag", "contiguous" or "auto" (module docstring).
    ``world_size`` and ``rank`` stand in for the group's (plans built without a process group)."""
    if (seqlen is None) == (cu_seqlens is None):
        raise ValueError("shard_plan: give exactly one of `seqlen` and `cu_seqlens`")
    if balance not in BALANCES:
        raise ValueError(f"shard_plan: `balance` must be one of {BALANCES}, got {balance!r}")
    world, me = _group_size_rank(group, world_size, rank)
    if world < 1 or not 0 <= me < world:
        raise ValueError(f"shard_plan: rank {me} of a group of {world}")
    if cu_seqlens is None:
        if isinstance(seqlen, bool) or not isinstance(seqlen, int) or seqlen < 1:
            raise ValueError(f"shard_plan: `seqlen` must be an int >= 1, got {seqlen!r}")
        offsets = [0, seqlen]
    else:
        offsets = [int(x) for x in (cu_seqlens.tolist() if isinstance(cu_seqlens, torch.Tensor) else cu_seqlens)]
        if len(offsets) < 2 or offsets[0] != 0 or any(b < a for a, b in zip(offsets, offsets[1:])):
            raise ValueError(f"shard_plan: `cu_seqlens` must start at 0 and not decrease, got {offsets}")
    total = offsets[-1]
    lengths = [b - a for a, b in zip(offsets, offsets[1:])]
    documents = tuple((a, b) for a, b in zip(offsets, offsets[1:]) if b > a)
    zigzag_fits = all(n % (2 * world) == 0 for n in lengths)
    if balance == "auto":
        balance = "zigzag" if zigzag_fits else "contiguous"
    if balance == "zigzag" and not zigzag_fits:
        what = "the sequence length" if cu_seqlens is None else "every document's length"
        raise ValueError(f"shard_plan: the zigzag balance needs {what} divisible by 2 x {world} ranks, got "
                         f"{lengths}; pad the documents or use balance='contiguous'")
    if balance in ("contiguous", "documents") and total % world:
        raise ValueError(f"shard_plan: {total} tokens do not divide over {world} ranks; pad the batch")
    if balance == "documents":
        runs = _whole_documents(documents, world)
        if runs is None:
            raise ValueError(f"shard_plan: the documents balance found no placement of {lengths} over {world} "
                             f"ranks (documents it must split need lengths divisible by 2 x {world}); use "
                             f"balance='contiguous'")
        return ShardPlan(world, me, total, balance, runs, documents, cu_seqlens is not None, group)
    runs = []
    for r in range(world):
        if balance == "contiguous":
            mine = [(r * total // world, total // world)]
        else:
            mine = []
            for start, end in documents:
                mine += _zigzag_chunks(start, end, world, r)
        runs.append(_joined(mine))
    return ShardPlan(world, me, total, balance, tuple(runs), documents, cu_seqlens is not None, group)


def _zigzag_chunks(start: int, end: int, world: int, rank: int) -> list:
    """Rank ``rank``'s two chunks of [start, end) cut into 2N: chunk r and chunk 2N - 1 - r."""
    chunk = (end - start) // (2 * world)
    return [(start + rank * chunk, chunk), (start + (2 * world - 1 - rank) * chunk, chunk)]


def _whole_documents(documents: tuple, world: int) -> tuple | None:
    """The ``"documents"`` balance (module docstring): every rank's runs, or None where no choice
    fills the ranks (a document too long for a rank that cannot be zigzagged)."""
    capacity = sum(end - start for start, end in documents) // world
    # longest first; ties in document order, so every rank computes the same plan
    by_length = sorted(range(len(documents)), key=lambda i: (documents[i][0] - documents[i][1], i))
    splittable = [i for i in by_length if (documents[i][1] - documents[i][0]) % (2 * world) == 0]
    for zigzagged in range(len(splittable) + 1):
        split = set(splittable[:zigzagged])
        placed = _placed_whole([i for i in by_length if i not in split], documents, world, capacity -
                               sum(documents[i][1] - documents[i][0] for i in split) // world)
        if placed is None:
            continue
        shared = sum((documents[i][1] - documents[i][0]) ** 2 for i in split) / world  # zigzag: equal shares
        work = [shared + sum((documents[i][1] - documents[i][0]) ** 2 for i in mine) for mine in placed]
        mean = sum(work) / world
        if zigzagged == len(splittable) or max(work) <= (1 + DOCUMENT_IMBALANCE) * mean:
            runs = []
            for r in range(world):
                mine = [(a, b - a) for a, b in (documents[i] for i in placed[r])]
                mine += [c for i in split for c in _zigzag_chunks(*documents[i], world, r)]
                runs.append(_joined(sorted(mine)))
            return tuple(runs)
    return None


def _placed_whole(order: list, documents: tuple, world: int, capacity: int) -> list | None:
    """Documents ``order`` (longest first) placed whole, each on the rank with the least work that
    has room for it; every rank then exactly full, or None."""
    placed, room, work = [[] for _ in range(world)], [capacity] * world, [0] * world
    for i in order:
        length = documents[i][1] - documents[i][0]
        fits = [r for r in range(world) if room[r] >= length]
        if not fits:
            return None
        r = min(fits, key=lambda r: (work[r], r))
        placed[r].append(i)
        room[r] -= length
        work[r] += length * length
    return placed if not any(room) else None


def _joined(runs: list) -> tuple:
    """Adjacent runs joined (rank N - 1's two zigzag chunks are one run)."""
    out = []
    for start, length in runs:
        if length == 0:
            continue
        if out and out[-1][0] + out[-1][1] == start:
            out[-1] = (out[-1][0], out[-1][1] + length)
        else:
            out.append((start, length))
    return tuple(out)
