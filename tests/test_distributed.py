"""Context parallelism (fusedattn.distributed): the sharding plan, the decomposition into kernel
calls, and every strategy on 2, 3 and 4 CPU processes (gloo) against single-process float64
attention on the whole sequence: outputs, lse and every gradient within SPEC 4's rule."""

from __future__ import annotations

import os
import random
import socket
import sys
from dataclasses import dataclass, field

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from fusedattn.distributed import shard_plan
from fusedattn.distributed.pieces import pieces
from fusedattn.reference import reference_attention
from fusedattn.spec import UNBOUNDED, keep_mask

sys.path.insert(0, os.path.dirname(__file__))
from numerics import assert_close_to_reference  # noqa: E402

# ----------------------------------------------------------------------------- the plan


def test_zigzag_gives_each_rank_an_early_and_a_late_chunk():
    plans = [shard_plan(24, world_size=3, rank=r, balance="zigzag") for r in range(3)]
    assert [p.runs[p.rank] for p in plans] == [((0, 4), (20, 4)), ((4, 4), (16, 4)), ((8, 8),)]
    every = torch.cat([p.global_index() for p in plans]).sort().values
    assert torch.equal(every, torch.arange(24))
    assert plans[1].balance == "zigzag" and plans[1].local_len == 8


def test_packed_plans_cut_each_document_and_give_positions_inside_it():
    cu = [0, 8, 24, 28]
    zig = shard_plan(cu_seqlens=torch.tensor(cu, dtype=torch.int32), world_size=2, rank=0)
    assert zig.balance == "zigzag" and zig.runs[0] == ((0, 2), (6, 6), (20, 5), (27, 1))  # adjacent chunks joined
    assert zig.positions().tolist() == [0, 1, 6, 7, 0, 1, 2, 3, 12, 13, 14, 15, 0, 3]
    cont = shard_plan(cu_seqlens=[0, 5, 19, 28], world_size=4, rank=1, balance="auto")
    assert cont.balance == "contiguous" and cont.runs[1] == ((7, 7),)
    assert cont.positions().tolist() == [2, 3, 4, 5, 6, 7, 8]


def _causal_work(plan) -> list:
    """Each rank's causal query-key pairs."""
    out = []
    for runs in plan.runs:
        pairs = 0
        for start, length in runs:
            for a, b in plan.documents:
                lo, hi = max(start, a), min(start + length, b)
                pairs += sum(q - a + 1 for q in range(lo, hi))
        out.append(pairs)
    return out


def test_documents_balance_keeps_documents_whole_where_the_work_stays_even():
    # 2 ranks, 64 tokens each: placed all whole, the longest document (32) leaves one rank 5% more
    # work than the mean (more than DOCUMENT_IMBALANCE); zigzagged, the rest balance exactly whole
    cu = [0, 32, 44, 64, 68, 76, 100, 116, 128]
    plans = [shard_plan(cu_seqlens=cu, world_size=2, rank=r, balance="documents") for r in range(2)]
    runs = plans[0].runs
    assert plans[0].balance == "documents" and runs == plans[1].runs
    # rank 0: chunks 0 and 3 of the first document, documents 1, 3, 4, 5; rank 1: chunks 1, 2, documents 2, 6, 7
    assert runs == (((0, 8), (24, 20), (64, 36)), ((8, 16), (44, 20), (100, 28)))
    every = torch.cat([p.global_index() for p in plans]).sort().values
    assert torch.equal(every, torch.arange(128))
    work = _causal_work(plans[0])
    assert max(work) <= 1.03 * sum(work) / 2
    # no room for a whole document (20 and 12 tokens, 16 a rank): both zigzagged, as "zigzag" cuts them
    even = [0, 20, 32]
    assert shard_plan(cu_seqlens=even, world_size=2, rank=0, balance="documents").runs == \
        shard_plan(cu_seqlens=even, world_size=2, rank=0, balance="zigzag").runs


@pytest.mark.parametrize("kwargs,error,match", [
    (dict(seqlen=20, balance="zigzag"), ValueError, "divisible by 2 x 3"),
    (dict(cu_seqlens=[0, 10, 15, 21], balance="documents"), ValueError, "documents balance found no placement"),
    (dict(seqlen=20, balance="contiguous"), ValueError, "do not divide over 3"),
    (dict(seqlen=24, balance="head-tail"), ValueError, "`balance` must be one of"),
    (dict(seqlen=None), ValueError, "exactly one of"),
    (dict(cu_seqlens=[0, 6, 3]), ValueError, "not decrease"),
])
def test_plan_errors_name_the_problem(kwargs, error, match):
    with pytest.raises(error, match=match):
        shard_plan(**kwargs, world_size=3, rank=0)


def test_shard_cuts_the_whole_tensor_in_local_order():
    plan = shard_plan(12, world_size=2, rank=1, balance="zigzag")
    x = torch.arange(2 * 12).view(2, 12, 1, 1)
    assert plan.shard(x)[0, :, 0, 0].tolist() == [3, 4, 5, 6, 7, 8]
    with pytest.raises(ValueError, match="cuts 12"):
        plan.shard(x[:, :10])


# ----------------------------------------------------------------------------- the kernel calls


def _global_rule(q, k, documents, left, right, chunk):
    def segment(p):
        for i, (a, b) in enumerate(documents):
            if a <= p < b:
                return i, (p - a) // chunk if chunk else 0
    return (segment(q) == segment(k) and (right == UNBOUNDED or k <= q + right)
            and (left == UNBOUNDED or k >= q - left))


def test_pieces_cover_exactly_the_pairs_the_global_rule_keeps():
    """Random runs of queries and keys, documents, chunks and windows: the kernel calls' own keep
    rules (bottom-right aligned windows on their sub-ranges) cover every kept (query, key) pair
    once and no other."""
    rng = random.Random(0)
    for _ in range(1500):
        total = rng.randint(1, 40)
        cuts = sorted(rng.sample(range(1, total), rng.randint(0, min(4, total - 1)))) if total > 1 else []
        offsets = [0, *cuts, total]
        documents = list(zip(offsets, offsets[1:]))

        def runs():
            out = []
            for _ in range(rng.randint(1, 3)):
                a = rng.randint(0, total - 1)
                out.append((a, rng.randint(1, total - a)))
            return out
        q_runs, k_runs = runs(), runs()
        left, right = rng.choice([UNBOUNDED, 0, 1, 3, 7]), rng.choice([UNBOUNDED, 0, 0, 2, 5])
        chunk = rng.choice([0, 0, 2, 5])
        q_pos = [p for a, n in q_runs for p in range(a, a + n)]
        k_pos = [p for a, n in k_runs for p in range(a, a + n)]
        covered = torch.zeros(len(q_pos), len(k_pos), dtype=torch.int)
        for p in pieces(q_runs, k_runs, documents, left, right, chunk):
            assert (p.left == UNBOUNDED or p.left >= 0) and (p.right == UNBOUNDED or p.right >= 0)
            covered[p.q_off:p.q_off + p.q_len, p.k_off:p.k_off + p.k_len] += \
                keep_mask(p.q_len, p.k_len, p.left, p.right).int()
        wanted = torch.tensor([[int(_global_rule(q, k, documents, left, right, chunk)) for k in k_pos]
                               for q in q_pos], dtype=torch.int)
        assert torch.equal(covered, wanted), (documents, q_runs, k_runs, left, right, chunk)


def test_the_gather_strategy_fetches_only_the_keys_a_window_reaches():
    """4 ranks, zigzag chunks of 12: with a causal 5-key window rank 1 (chunks 1 and 6) needs the
    last 5 keys of chunk 0 (rank 0's local [7, 12)) and of chunk 5 (rank 2's local [19, 24)), nothing
    of rank 3; causal without a window, all of chunk 0 and nothing of chunk 7."""
    from fusedattn.distributed.strategies import Problem
    from fusedattn.spec import resolve_spec

    plan = shard_plan(96, world_size=4, rank=1, balance="zigzag")

    def needed(window):
        spec = resolve_spec(16, layout="bshd", causal=True, window=window, scale=None, softcap=None,
                            deterministic=False)
        return Problem(plan, spec, "torch", 0, 2).reach()[1]
    assert needed((5, 0)) == ((7, 12), (0, 24), (19, 24), None)
    assert needed(None) == ((0, 12), (0, 24), (0, 24), (0, 24))


def test_one_rank_is_attention_on_the_whole_sequence():
    """A plan of one rank (no process group needed): cp_attention is fusedattn.attention, output,
    lse and gradients, with a window, softcap and sinks."""
    import fusedattn
    from fusedattn.distributed import cp_attention

    gen = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(2, 21, h, 16, generator=gen).requires_grad_() for h in (4, 2, 2))
    sinks = torch.randn(4, generator=gen).requires_grad_()
    options = dict(causal=True, window=(6, 0), softcap=4.0, sinks=sinks, return_lse=True)
    out, lse = cp_attention(q, k, v, shard_plan(21, world_size=1, rank=0), **options)
    ref_out, ref_lse = fusedattn.attention(q, k, v, **options)
    torch.testing.assert_close(out, ref_out)
    torch.testing.assert_close(lse, ref_lse)
    dout = torch.randn_like(out)
    grads = torch.autograd.grad((out * dout).sum() + lse.sum(), (q, k, v, sinks))
    ref_grads = torch.autograd.grad((ref_out * dout).sum() + ref_lse.sum(), (q, k, v, sinks))
    for name, a, b in zip(("dq", "dk", "dv", "dsinks"), grads, ref_grads):
        torch.testing.assert_close(a, b, msg=name)


@pytest.mark.parametrize("world,heads,window,chunk,causal,expected", [
    (4, (32, 8), (5, 0), None, False, "allgather"),  # a window narrower than a shard: only its reach moves
    (4, (32, 8), None, 8, False, "allgather"),
    (4, (32, 8), (50, 0), None, False, "ulysses"),  # wider than a shard: K/V of most of the sequence
    (4, (32, 8), None, None, False, "ulysses"),
    (4, (32, 8), None, None, True, "ulysses"),  # the last chunk's prefix is 3 shards of K/V
    (2, (32, 8), None, None, True, "allgather"),  # over 2 ranks the prefix is one shard
    (4, (32, 2), None, None, False, "allgather"),  # 2 K/V heads gathered: fewer words than q over all-to-all
    (4, (6, 3), None, None, False, "ring"),  # the heads do not split over 4, the gather moves more
    (1, (6, 3), None, None, False, "allgather"),
])
def test_auto_picks_the_strategy_the_problem_suits(world, heads, window, chunk, causal, expected):
    from fusedattn.distributed import choose_strategy

    plan = shard_plan(96, world_size=world, rank=0)
    assert choose_strategy(plan, *heads, window, chunk, causal=causal) == expected


def test_auto_gathers_whole_documents_and_all_to_alls_zigzagged_ones():
    """Whole documents on their rank leave little to fetch; every document zigzagged over 4 ranks
    needs most of every document's keys on every rank."""
    from fusedattn.distributed import choose_strategy

    cu = [16 * i for i in range(13)] + [256]  # twelve short documents, one long
    whole = shard_plan(cu_seqlens=cu, world_size=4, rank=0, balance="documents")
    zigzag = shard_plan(cu_seqlens=cu, world_size=4, rank=0, balance="zigzag")
    assert choose_strategy(whole, 32, 8, causal=True) == "allgather"
    assert choose_strategy(zigzag, 32, 8, causal=True) == "ulysses"


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the kernels on a GPU (the CPU path: the gloo tests)")
@pytest.mark.parametrize("documents", [None, (96, 250, 167)], ids=["one sequence", "documents"])
def test_one_gpu_rank_runs_the_gather_on_the_kernels(documents):
    """A plan of one rank on the GPU: the gather strategy's packed call on the kernels (bf16, GQA,
    a window, softcap, sinks, documents) against float64 on the whole sequence, outputs, lse and
    every gradient; no process group needed."""
    from fusedattn.distributed import cp_attention

    gen = torch.Generator(device="cuda").manual_seed(5)
    seqlen = sum(documents) if documents else 513
    q, k, v, dout = (torch.randn(1, seqlen, h, 64, device="cuda", dtype=torch.bfloat16, generator=gen)
                     for h in (4, 2, 2, 4))
    sinks = torch.randn(4, device="cuda", generator=gen)
    case = CPCase("gpu", heads_q=4, heads_kv=2, window=(100, 0), softcap=20.0, sinks=True, documents=documents)
    if documents:
        cu = torch.tensor([0, *torch.tensor(documents).cumsum(0).tolist()], dtype=torch.int32)
        plan = shard_plan(cu_seqlens=cu, world_size=1, rank=0)
    else:
        plan = shard_plan(seqlen, world_size=1, rank=0)
    squeeze = (lambda t: t[0]) if documents else (lambda t: t)
    leaves = [squeeze(t).detach().requires_grad_() for t in (q, k, v)] + [sinks.clone().requires_grad_()]
    out, lse = cp_attention(*leaves[:3], plan, strategy="allgather", causal=True, window=case.window,
                            softcap=case.softcap, sinks=leaves[3], return_lse=True)
    dlse = torch.randn(lse.shape, device="cuda", generator=gen)
    grads = torch.autograd.grad((out.float() * squeeze(dout).float()).sum() + (lse * dlse).sum(), leaves)
    results = {}
    for dtype in (torch.float64, torch.bfloat16):
        ref_leaves = [t.detach().to(dtype).requires_grad_() for t in (q, k, v)] + \
            [sinks.to(torch.float64 if dtype == torch.float64 else torch.float32).requires_grad_()]
        o, l = _reference(case, *ref_leaves, documents)
        loss = (o.float() * dout.float()).sum() + (l.float() * (dlse if not documents else dlse[None])).sum()
        results[dtype] = (o, l, *torch.autograd.grad(loss, ref_leaves))
    ours = [out, lse, *grads]
    for i, name in enumerate(["out", "lse", "dq", "dk", "dv", "dsinks"]):
        ref64, lowp = results[torch.float64][i], results[torch.bfloat16][i]
        if documents and name not in ("dsinks",):
            ref64, lowp = ref64[0], lowp[0]
        assert_close_to_reference(name, ours[i].detach().double(), lowp.double(), ref64)


def test_cp_attention_errors_name_the_problem():
    from fusedattn.distributed import cp_attention

    plan = shard_plan(24, world_size=2, rank=0)
    q = torch.randn(1, 12, 4, 16)
    with pytest.raises(ValueError, match="holds 12 tokens"):
        cp_attention(q[:, :10], q, q, plan)
    with pytest.raises(TypeError, match="must be a ShardPlan"):
        cp_attention(q, q, q, 24)
    with pytest.raises(ValueError, match="packed documents"):
        cp_attention(q, q, q, shard_plan(cu_seqlens=[0, 8, 24], world_size=2, rank=0, balance="contiguous"))
    with pytest.raises(NotImplementedError, match="`mask` is not taken"):
        cp_attention(q, q, q, plan, mask=torch.ones(12, 12, dtype=torch.bool))


# ----------------------------------------------------------------------------- the strategies, on gloo


@dataclass(frozen=True)
class CPCase:
    name: str
    heads_q: int = 12
    heads_kv: int = 2
    causal: bool = True
    window: tuple | None = None
    softcap: float | None = None
    sinks: bool = False
    chunk: int | None = None
    documents: tuple | None = None  # document lengths (packed)
    balance: str = "auto"
    lse_grad: bool = True
    strategies: tuple = ("allgather", "ring", "ulysses")
    options: dict = field(default_factory=dict)


def _cases(world: int) -> list:
    two_n = 2 * world
    return [
        CPCase("causal GQA zigzag"),
        CPCase("full, contiguous", causal=False, balance="contiguous"),
        CPCase("causal, window narrower than a shard, softcap", window=(3, 0), softcap=5.0),
        CPCase("causal, window wider than a shard, sinks", window=(17, 0), sinks=True),
        CPCase("two-sided window, MQA (cp > Hkv)", causal=False, window=(4, 2), heads_kv=1),
        CPCase("causal chunks of 5", chunk=5, heads_kv=1),
        CPCase("packed documents, zigzag per document, sinks", documents=(two_n, 3 * two_n, 2 * two_n), sinks=True),
        # one document zigzagged, one whole on each rank (length 3: not divisible by 2N, never split)
        CPCase("documents whole on a rank beside a zigzagged one", documents=(4 * two_n, *(3,) * world),
               balance="documents", window=(two_n + 1, 0)),
        CPCase("packed documents crossing shards, window, chunk", documents=(5, 19, 12), balance="contiguous",
               window=(6, 0), chunk=7),
        CPCase("auto strategy, no lse gradient", heads_kv=2, strategies=("auto",), lse_grad=False),
        # a rank's heads in two groups, one's all-to-all under the other's attention (2 and 4 ranks)
        CPCase("Ulysses in two head groups, documents, window, sinks", heads_q=24, heads_kv=8, window=(9, 0),
               sinks=True, documents=(two_n, 3 * two_n), strategies=("ulysses",)),
    ]


def _reference(case: CPCase, q, k, v, sinks, lengths):
    """The whole sequence on one process (per document when packed): (out, lse)."""
    options = dict(causal=case.causal, window=case.window, softcap=case.softcap, chunk=case.chunk,
                   return_lse=True)
    if lengths is None:
        return reference_attention(q, k, v, sinks=sinks, **options)
    outs, lses, start = [], [], 0
    for n in lengths:
        rows = slice(start, start + n)
        o, lse = reference_attention(q[:, rows], k[:, rows], v[:, rows], sinks=sinks, **options)
        outs.append(o)
        lses.append(lse)
        start += n
    return torch.cat(outs, 1), torch.cat(lses, 2)


def _check_case(case: CPCase, world: int, rank: int, strategy: str, deterministic: bool = False) -> None:
    from fusedattn.distributed import cp_attention

    gen = torch.Generator().manual_seed(sum(map(ord, case.name)))  # the same inputs on every rank
    lengths = case.documents
    seqlen = sum(lengths) if lengths else 24
    batch = 1 if lengths else 2
    q = torch.randn(batch, seqlen, case.heads_q, 16, generator=gen)
    k = torch.randn(batch, seqlen, case.heads_kv, 16, generator=gen)
    v = torch.randn(batch, seqlen, case.heads_kv, 16, generator=gen)
    dout = torch.randn(batch, seqlen, case.heads_q, 16, generator=gen)
    dlse = torch.randn(batch, case.heads_q, seqlen, generator=gen) if case.lse_grad else None
    sinks = torch.randn(case.heads_q, generator=gen) if case.sinks else None
    if lengths:
        cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)
        plan = shard_plan(cu_seqlens=cu, balance=case.balance)
    else:
        plan = shard_plan(seqlen, balance=case.balance)

    def local(t):
        return plan.shard(t[0] if lengths else t).detach().requires_grad_()
    ql, kl, vl = local(q), local(k), local(v)
    sl = None if sinks is None else sinks.clone().requires_grad_()
    out, lse = cp_attention(ql, kl, vl, plan, strategy=strategy, causal=case.causal, window=case.window,
                            softcap=case.softcap, sinks=sl, chunk=case.chunk, deterministic=deterministic,
                            return_lse=True)
    loss = (out * local(dout).detach()).sum()
    if dlse is not None:
        lse_local = plan.shard(dlse[0] if lengths else dlse, dim=-1)
        loss = loss + (lse * lse_local).sum()
    leaves = [t for t in (ql, kl, vl, sl) if t is not None]
    grads = torch.autograd.grad(loss, leaves)
    if sl is not None:
        dist.all_reduce(grads[-1])  # each rank's rows' part of the sinks' gradient

    results = {}
    for dtype in (torch.float64, torch.float32):
        leaves_ref = [t.to(dtype).requires_grad_() for t in (q, k, v)] + \
            ([sinks.to(dtype).requires_grad_()] if sinks is not None else [])
        o_ref, lse_ref = _reference(case, *leaves_ref[:3], leaves_ref[3] if sinks is not None else None, lengths)
        loss_ref = (o_ref * dout.to(dtype)).sum() + ((lse_ref * dlse.to(dtype)).sum() if dlse is not None else 0)
        g_ref = torch.autograd.grad(loss_ref, leaves_ref)
        results[dtype] = (o_ref, lse_ref, *g_ref)

    def mine(t, dim=None):
        return plan.shard(t[0] if lengths else t, dim=dim)
    names = ["out", "lse", "dq", "dk", "dv", "dsinks"]
    ours = [out, lse, *grads]
    for i, name in enumerate(names[:len(ours)]):
        ref64, lowp = results[torch.float64][i], results[torch.float32][i]
        if name == "lse":
            ref64, lowp = mine(ref64, -1), mine(lowp, -1)
        elif name != "dsinks":
            ref64, lowp = mine(ref64), mine(lowp)
        finite = torch.isfinite(ref64)
        assert torch.equal(finite, torch.isfinite(ours[i].detach())), f"{name}: -inf rows differ"
        assert_close_to_reference(f"{case.name} [{strategy}] {name}", ours[i].detach()[finite].double(),
                                  lowp[finite].double(), ref64[finite])
    if deterministic:
        again = torch.autograd.grad(
            _loss_again(cp_attention, ql, kl, vl, sl, plan, strategy, case, local(dout), dlse, lengths), leaves)
        if sl is not None:
            dist.all_reduce(again[-1])
        for name, a, b in zip(["dq", "dk", "dv", "dsinks"], grads, again):
            assert torch.equal(a, b), f"{case.name} [{strategy}] {name}: not bitwise identical run to run"


def _loss_again(cp_attention, ql, kl, vl, sl, plan, strategy, case, dout_local, dlse, lengths):
    out, lse = cp_attention(ql, kl, vl, plan, strategy=strategy, causal=case.causal, window=case.window,
                            softcap=case.softcap, sinks=sl, chunk=case.chunk, deterministic=True, return_lse=True)
    loss = (out * dout_local).sum()
    if dlse is not None:
        loss = loss + (lse * plan.shard(dlse[0] if lengths else dlse, dim=-1)).sum()
    return loss


def _worker(rank: int, world: int, port: int) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    torch.set_num_threads(1)
    failures = []
    try:
        for case in _cases(world):
            for strategy in case.strategies:
                if strategy == "ulysses" and (case.heads_q % world or (case.heads_kv % world and world % case.heads_kv)):
                    continue  # the heads do not split over this group (tested below as an error)
                try:
                    _check_case(case, world, rank, strategy, deterministic=case.name.startswith("causal GQA"))
                except AssertionError as e:
                    failures.append(f"{case.name} [{strategy}]: {e}")
        _check_errors(world)
        plan = shard_plan(24)
        whole = torch.arange(2 * 24 * 3, dtype=torch.float32).view(2, 24, 3, 1)
        assert torch.equal(plan.unshard(plan.shard(whole)), whole), "unshard(shard(x)) != x"
        if rank < 2:  # a group of the first two ranks, which only they create
            from fusedattn.distributed import cp_group

            pair = shard_plan(24, group=cp_group([0, 1]))
            assert pair.world_size == 2 and pair.rank == rank
            assert torch.equal(pair.unshard(pair.shard(whole)), whole), "unshard(shard(x)) != x over a subgroup"
    finally:
        dist.destroy_process_group()
    assert not failures, f"rank {rank} of {world}:\n" + "\n".join(failures)


def _check_errors(world: int) -> None:
    from fusedattn.distributed import cp_attention

    plan = shard_plan(24)
    q = torch.randn(1, plan.local_len, 5, 16)
    kv = torch.randn(1, plan.local_len, 5, 16)
    if world > 1:
        try:
            cp_attention(q, kv, kv, plan, strategy="ulysses")
        except ValueError as e:
            assert "splits the heads" in str(e)
        else:
            raise AssertionError("ulysses with heads that do not split over the group did not raise")
    for kwargs, error in ((dict(dropout_p=0.1), NotImplementedError), (dict(alibi_slopes=torch.ones(5)),
                                                                      NotImplementedError),
                          (dict(strategy="tree"), ValueError)):
        try:
            cp_attention(q, kv, kv, plan, **kwargs)
        except error:
            pass
        else:
            raise AssertionError(f"{kwargs} did not raise {error.__name__}")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.parametrize("world", [2, 3, 4])
def test_every_strategy_matches_the_whole_sequence_on_one_process(world):
    """Every strategy and case on `world` gloo processes: outputs, lse, dq, dk, dv and the sinks'
    gradient (summed over the ranks) against float64 on the whole sequence; the deterministic case
    bitwise identical twice."""
    mp.spawn(_worker, args=(world, _free_port()), nprocs=world, join=True)


def _bench_worker(rank: int, world: int, port: int, out: str) -> None:
    from pathlib import Path

    from fusedattn.bench import cp as cp_bench

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    torch.set_num_threads(1)
    try:
        cp_bench.run(128, ["ulysses", "ring", "allgather", "auto"], Path(out), {"device": "cpu"}, heads=(4, 2),
                     head_dim=16, window=8, granule=2)
    finally:
        dist.destroy_process_group()


def test_the_cp_bench_runs_every_row_and_strategy_on_gloo(tmp_path):
    """``python -m fusedattn.bench --cp``'s rows on 2 CPU processes at a toy size (its smoke test:
    the GPU calls are few): every row's one-process time, every strategy checked against it and
    timed, with an efficiency; the JSON written by rank 0."""
    import json

    out = tmp_path / "cp.json"
    mp.spawn(_bench_worker, args=(2, _free_port(), str(out)), nprocs=2, join=True)
    rows = json.loads(out.read_text())["rows"]
    assert {r["row"] for r in rows} == {"causal", "causal, window 8", "packed documents, causal"}
    for r in rows:
        assert "note" not in r, r
        assert r["fwdbwd_ms"] > 0
        if r["gpus"] == 2:
            assert r["max_abs_diff_vs_1gpu"] < 1e-4 and 0 < r["efficiency"], r
    assert len([r for r in rows if r["gpus"] == 2]) == 3 * 4
