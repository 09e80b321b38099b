"""What attention dropout's mask costs by itself on the GPU: the keep bits of every probability a
causal fwd+bwd pass visits, made and counted, with nothing else in the kernel -- the floor under
what one pass of the dropout kernels can cost over the plain ones.

Three kernels walk the causal problem's 128x128 tiles (B, H, S as the bench's variant rows):
  philox   the Philox4x32-7 words alone (xor-folded, so nothing is dead code)
  keep     the kernels' own keep tile (``kernels/triton/dropout.dropout_keep``: words, bytes, compare)
  keep^T   the same tile transposed, as the dK/dV pass takes it
and the plain and dropout fwd+bwd of ``fusedattn.attention`` are timed beside them (dropout's also with
dQ by a pass of its own, where the default sums it in the dK/dV pass), so the figures read as
fractions of the plain step. Writes a JSON with --out.

    PYTHONPATH=src python benchmarks/dropout_floor.py --out results/dropout-floor.json
"""

from __future__ import annotations

import argparse
import json

import torch
import triton
import triton.language as tl

from fusedattn.kernels.triton.dropout import DROPOUT_ROUNDS, dropout_keep

BLOCK = 128


@triton.jit
def _mask_walk(out, seed, threshold, heads, KIND: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    q_block = tl.program_id(0)
    batch_head = tl.program_id(1)
    offs_m = q_block * BLOCK_M + tl.arange(0, BLOCK_M)
    if KIND == 0:
        fold = tl.zeros([BLOCK_M, BLOCK_N // 16], dtype=tl.uint32)
    else:
        fold = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.int32)
    for k_block in range(0, q_block + 1):  # causal: the blocks up to the diagonal
        start_k = k_block * BLOCK_N
        if KIND == 0:
            groups = start_k // 16 + tl.arange(0, BLOCK_N // 16)
            c0 = (groups[None, :] + offs_m[:, None] * 0).to(tl.uint32)
            c1 = (offs_m[:, None] + groups[None, :] * 0).to(tl.uint32)
            c2 = (batch_head + c0 * 0).to(tl.uint32)
            w0, w1, w2, w3 = tl.philox(seed, c0, c1, c2, c0 * 0, DROPOUT_ROUNDS)
            fold ^= w0 ^ w1 ^ w2 ^ w3
        elif KIND == 1:
            fold += dropout_keep(seed, batch_head, offs_m, start_k, threshold, BLOCK_N, False).to(tl.int32)
        else:
            fold += dropout_keep(seed, batch_head, offs_m, start_k, threshold, BLOCK_N, True).to(tl.int32)
    tl.store(out + batch_head * tl.num_programs(0) + q_block, tl.sum((fold & 0xFFFF).to(tl.int32)))


def _attention_step(q, k, v, dout, **options):
    import fusedattn

    def step():
        for t in (q, k, v):
            t.grad = None
        fusedattn.attention(q, k, v, causal=True, **options).backward(dout)

    return step


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--heads", type=int, default=16)
    parser.add_argument("--seqlen", type=int, default=4096)
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--p", type=float, default=0.1)
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    from fusedattn import dropout

    B, H, S = args.batch, args.heads, args.seqlen
    out = torch.empty(B * H * (S // BLOCK), dtype=torch.int32, device="cuda")
    seed = 0x1234_5678_9ABC
    threshold = dropout.threshold(args.p)
    figures = {}
    for name, kind in (("philox", 0), ("keep", 1), ("keep^T", 2)):
        def run(kind=kind):
            _mask_walk[(S // BLOCK, B * H)](out, seed, threshold, H, KIND=kind, BLOCK_M=BLOCK, BLOCK_N=BLOCK,
                                            num_warps=8)
        run()
        if kind == 1:  # the kernel counts what keep_mask says, so the timed work is the real mask
            # (the first two batch-heads: the whole mask in int64 would not fit) the blocks up to the diagonal
            keep = dropout.keep_mask(seed, 1, 2, S, S, args.p, device="cuda")[0]
            blocks = torch.arange(S, device="cuda") // BLOCK
            keep = keep & (blocks[None, :] <= blocks[:, None])
            want = keep.reshape(2, S // BLOCK, -1).sum(-1).to(torch.int32).flatten()
            assert torch.equal(out[:want.numel()], want), "the keep kernel disagrees with keep_mask"
        figures[name] = triton.testing.do_bench(run, warmup=25, rep=200)
    shape = (B, S, H, args.head_dim)
    q, k, v, dout = (torch.randn(shape, device="cuda", dtype=torch.bfloat16) for _ in range(4))
    for t in (q, k, v):
        t.requires_grad_()
    figures["plain f+b"] = triton.testing.do_bench(_attention_step(q, k, v, dout), warmup=10, rep=200)
    figures[f"dropout {args.p} f+b"] = triton.testing.do_bench(_attention_step(q, k, v, dout, dropout_p=args.p),
                                                              warmup=10, rep=200)
    # the backward's other form: dQ by a pass of its own instead of the dK/dV pass's reduce-adds
    from dataclasses import replace

    from fusedattn.tuning.configs import pinned_configs, select_configs

    base = select_configs(q.device, q.dtype, args.head_dim, args.head_dim)
    if base.atomic_dq:
        with pinned_configs(replace(base, atomic_dq=False)):
            figures[f"dropout {args.p} f+b, dQ pass"] = triton.testing.do_bench(
                _attention_step(q, k, v, dout, dropout_p=args.p), warmup=10, rep=200)
    plain = figures["plain f+b"]
    print(f"{torch.cuda.get_device_name()}  B={B} H={H} S={S} D={args.head_dim} causal, 128x128 tiles")
    for name, ms in figures.items():
        print(f"  {name:18s} {ms:7.3f} ms  {ms / plain:6.3f} x plain f+b")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(dict(device=torch.cuda.get_device_name(), batch=B, heads=H, seqlen=S, head_dim=args.head_dim,
                           p=args.p, ms=figures), f, indent=1)


if __name__ == "__main__":
    main()
