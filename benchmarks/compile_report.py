"""Compile the kernels for Hopper (sm_90a) ahead of time, without a GPU, and print the
compiler's resource report: registers per thread, spills, shared memory.

    python benchmarks/compile_report.py [--head-dims 64,128] [--dtype bf16] [--check]

Uses the heuristic launch configs of ``tuning/configs.py``. Catches compile errors that
the interpreter cannot see (e.g. non-constexpr globals) and register spills, at no
device time; flags kernels whose wgmmas ptxas serialised (``--check``: exit 1 on that or on
a compile failure; tests/test_hopper_codegen.py runs it). Pointer arguments and strides are
declared 16-divisible, as Triton specialises them at launch for aligned tensors.
"""

from __future__ import annotations

import argparse
import inspect
from dataclasses import replace
import os
import re
import subprocess
import sys
import tempfile

os.environ.pop("TRITON_INTERPRET", None)

import torch  # noqa: E402
import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

from fusedattn import dispatch  # noqa: E402
from fusedattn.kernels.gluon import bwd as hopper_bwd  # noqa: E402
from fusedattn.kernels.gluon import common as hopper  # noqa: E402
from fusedattn.kernels.gluon import fwd as hopper_fwd  # noqa: E402
from fusedattn.kernels.triton import bwd, fwd, kvcache  # noqa: E402
from fusedattn.spec import UNBOUNDED, AttentionSpec  # noqa: E402
from fusedattn.tuning.configs import KernelConfig, _cuda_configs  # noqa: E402

TARGET = GPUTarget("cuda", 90, 32)
TYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
CAUSAL_SPEC = AttentionSpec("bshd", UNBOUNDED, 0, 1.0, 0.0, False)


def compile_kernel(kernel, dtype: str, constexprs: dict, num_warps: int, num_stages: int,
                   pointer_types: dict | None = None, descriptors: dict | None = None):
    fn = kernel.fn if hasattr(kernel, "fn") else kernel
    names = list(inspect.signature(fn).parameters)
    constexprs = {k: v for k, v in constexprs.items() if k in names}  # feature flags one kernel lacks
    signature, attrs = {}, {}
    for i, name in enumerate(names):
        if name in constexprs:
            signature[name] = "constexpr"
        elif descriptors and name in descriptors:
            signature[name] = descriptors[name]
        elif name[0].isupper():  # tensors are the capitalised arguments
            signature[name] = "*" + (pointer_types or {}).get(name, dtype)
            attrs[(i,)] = [["tt.divisibility", 16]]
        elif name.startswith("stride"):
            signature[name] = "i32"
            attrs[(i,)] = [["tt.divisibility", 16]]
        elif name in ("qk_scale", "softcap_log2", "scale", "dropout_scale"):
            signature[name] = "fp32"
        else:
            signature[name] = "i32"
    src = ASTSource(kernel, signature, constexprs, attrs)
    compiled = triton.compile(src, target=TARGET, options=dict(num_warps=num_warps, num_stages=num_stages))
    usage = _resource_usage(compiled.asm["cubin"])
    return dict(regs=usage.get("REG"), spills=usage.get("STACK"), shared=compiled.metadata.shared, asm=compiled.asm,
                serialized=wgmma_serialization(compiled.asm["ptx"]))


def wgmma_serialization(ptx: str) -> str | None:
    """ptxas's reason for serialising every wgmma of the kernel (info C7515 or C7512), or None.

    When ptxas cannot keep a wgmma pipeline stage intact anywhere in a function, it waits after
    *each* wgmma in the whole function: the tensor cores then idle most of the time (our dK/dV
    pass ran at 45% tensor-pipe activity for that reason; benchmarks/NOTES.md v10)."""
    tool = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "ptxas")
    with tempfile.TemporaryDirectory() as tmp:
        src = os.path.join(tmp, "kernel.ptx")
        with open(src, "w") as f:
            f.write(ptx)
        arch = re.search(r"^\.target\s+(sm_\w+)", ptx, re.M).group(1)
        text = subprocess.run([tool, "-v", f"-arch={arch}", src, "-o", os.path.join(tmp, "kernel.cubin")],
                              capture_output=True, text=True).stderr
    found = re.search(r"wgmma\.mma_async instructions are serialized due to (.*?) (?:in|for) the function", text)
    return found.group(1) if found else None


def _resource_usage(cubin: bytes) -> dict:
    """Registers and stack (spill) bytes from ``cuobjdump --dump-resource-usage`` (shipped with Triton)."""
    tool = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        text = subprocess.run([tool, "--dump-resource-usage", f.name], capture_output=True, text=True).stdout
    return {k: int(v) for k, v in re.findall(r"(REG|STACK|SHARED|LOCAL):(\d+)", text)}


def report(head_dim: int, dtype: str, flags: dict, tma_loads: bool) -> int:
    """Prints one line per kernel; returns how many failed to compile or had their wgmmas serialised."""
    torch_dtype = TYPES[dtype]
    flags = dict(dict(HAS_MASK=False, MASK_SHIFT_Q=0, MASK_SHIFT_K=0, MASK_TMA=False, HAS_SINKS=False, HAS_BIAS=False,
                      BIAS_TMA=False, DBIAS=0, DBIAS_SUM_Q=False, DBIAS_SUM_K=False, VARLEN=False,
                      HAS_ALIBI=False, HAS_CHUNK=False, HAS_DROPOUT=False), **flags)
    configs = _cuda_configs(torch_dtype, head_dim, head_dim, 4096, (9, 0), flags["HAS_LEFT"], flags["HAS_RIGHT"],
                            flags["HAS_SOFTCAP"])
    block_d = fwd.padded_dim(head_dim)
    common = dict(HEAD_DIM=head_dim, HEAD_DIM_V=head_dim, BLOCK_D=block_d, BLOCK_DV=block_d,
                  DOT_PRECISION=fwd.dot_precision(torch_dtype), **flags)
    # the Triton kernels' softcap form as a launch on the GPU gets it (bf16: tanh.approx)
    softcap_spec = AttentionSpec("bshd", UNBOUNDED, 0, 1.0, 30.0 if flags["HAS_SOFTCAP"] else 0.0, False)
    common["HAS_SOFTCAP"] = fwd.softcap_mode(softcap_spec, torch_dtype, torch.device("cuda"))
    fp32_ptrs = dict(Lse="fp32", Lse2="fp32", Delta="fp32", DLse="fp32", Sinks="fp32", Mask="u8", TileLists="i32",
                     ColumnLists="i32", RowLists="i32", CuSeqlensQ="i32", CuSeqlensK="i32", Alibi="fp32",
                     DropoutSeed="i64",
                     DBias="fp32" if flags["DBIAS"] == bwd.DBIAS_ATOMIC else dtype)

    def descs(rows: int, *names: str) -> dict:
        return {n: f"tensordesc<{dtype}[1,1,{rows},{block_d}]>" for n in names} if tma_loads else {}

    gluon_forward, gluon_dkdv = configs.forward, configs.dkdv
    # a mask: by its tile lists; a bias by elements through TMA: the Gluon forward reads it
    # ALiBi, chunk, dropout: the Triton kernels, and only the Gluon forms the planner allows below (causal ALiBi in
    # the forward and the dK/dV pass, dropout in the dK/dV pass: dispatch.gluon_support)
    triton_only = flags["HAS_ALIBI"] or flags["HAS_CHUNK"] or flags["HAS_DROPOUT"]
    gluon_runs = not flags["HAS_SINKS"] and not flags["HAS_BIAS"] and not triton_only
    # sinks: the warp-specialised Gluon forward takes them (the 8-warp one does not: dispatch.plan_forward)
    gluon_forward_runs = not triton_only and (not flags["HAS_BIAS"] or flags["BIAS_TMA"]) and \
        (not flags["HAS_SINKS"] or bool(configs.forward.hopper_split))
    # ALiBi's causal (key-term) form: the warp-specialised Gluon forward takes it (dispatch.gluon_forward_takes_alibi)
    gluon_alibi = flags["HAS_ALIBI"] == 2 and not flags["HAS_MASK"] and not flags["HAS_BIAS"] \
        and not flags["HAS_LEFT"] and bool(gluon_forward.hopper_split)
    # a mask of partial tiles (read through TMA or pointers) keeps the Triton kernels
    gluon_forward_runs = gluon_forward_runs and not (flags["HAS_MASK"] and flags["HAS_BIAS"])
    if (flags["HAS_MASK"] or flags["HAS_BIAS"]) and gluon_dkdv.hopper_overlap is not None:
        gluon_forward = dispatch.gluon_mask_forward(gluon_forward)
    if flags["HAS_MASK"] and gluon_dkdv.hopper_overlap is not None:
        gluon_dkdv = dispatch.gluon_mask_dkdv(gluon_dkdv)
    if gluon_dkdv.hopper_overlap is not None:  # the Triton kernel then runs the fallback's tiles
        configs = replace(configs, dkdv=dispatch.triton_dkdv_fallback(gluon_dkdv))
    dq_atomic = {"dq_desc": f"tensordesc<fp32[1,{configs.dkdv.block_m},{block_d}]>"}
    dkdv_descs = descs(configs.dkdv.block_m, "q_desc", "do_desc")
    dq_descs = descs(configs.dq.block_n, "k_desc", "v_desc")
    # The launches of kernels/bwd.py: split dK/dV and dQ launches (group_size 1 is specialised
    # to a constant, as Triton does at launch for MHA), the same for GQA (group_size a runtime
    # value), the fused launch, the TMA-atomic launch.
    split = dict(ATOMIC_DQ=False, DQ_TMA=False)
    triton_forward = dispatch.triton_fallback(configs.forward) if configs.forward.hopper_overlap is not None \
        else configs.forward
    if flags["HAS_BIAS"]:  # as the planner sends it to kernels/triton/fwd.forward
        triton_forward = replace(triton_forward, block_n=min(triton_forward.block_n, 64))
    def tile(rows, cols, ty=dtype):
        return f"tensordesc<{ty}[1,1,{rows},{cols}]>"

    bias_descs = {}
    if flags["MASK_TMA"]:  # the mask's bytes through TMA (fwd.mask_descriptor)
        bias_descs.update(mask_desc=tile(triton_forward.block_m, triton_forward.block_n, "u8"),
                          mask_dkdv_desc=tile(configs.dkdv.block_m, configs.dkdv.block_n, "u8"),
                          mask_dq_desc=tile(configs.dq.block_m, configs.dq.block_n, "u8"))
    if flags["BIAS_TMA"]:  # the bias and its gradient through TMA (memory.score_tile_descriptor)
        dbias_type = "fp32" if flags["DBIAS"] == bwd.DBIAS_ATOMIC else dtype
        bias_descs.update(bias_desc=tile(triton_forward.block_m, triton_forward.block_n),
                          bias_dkdv_desc=tile(configs.dkdv.block_m, configs.dkdv.block_n),
                          bias_dq_desc=tile(configs.dq.block_m, configs.dq.block_n),
                          dbias_desc=tile(configs.dkdv.block_m, configs.dkdv.block_n, dbias_type))
    jobs = [
        ("forward", fwd._forward_kernel, triton_forward, {}, descs(triton_forward.block_n, "k_desc", "v_desc")),
        ("bwd dkdv", bwd._backward_kernel, configs.dkdv, dict(split, group_size=1, RUN_DKDV=True, RUN_DQ=False),
         dkdv_descs),
        ("bwd dkdv gqa", bwd._backward_kernel, configs.dkdv, dict(split, RUN_DKDV=True, RUN_DQ=False), dkdv_descs),
        ("bwd dq", bwd._backward_kernel, configs.dq, dict(split, group_size=1, RUN_DKDV=False, RUN_DQ=True), dq_descs),
        # dK/dV and dQ programs in one launch: only where a config asks for it (``fuse_dq_pass``, which
        # neither the heuristic nor the tuner sets). At D=128 ptxas serialises its wgmmas for want of
        # registers (C7512).
        *([("bwd fused", bwd._backward_kernel, configs.dkdv, dict(split, group_size=1, RUN_DKDV=True, RUN_DQ=True),
            {**dkdv_descs, **descs(configs.dq.block_n, "k_desc", "v_desc")})] if configs.fuse_dq_pass else []),
        ("bwd tma-dq", bwd._backward_kernel, configs.dkdv, dict(ATOMIC_DQ=True, DQ_TMA=True, group_size=1,
                                                                 RUN_DKDV=True, RUN_DQ=False),
         {**dkdv_descs, **dq_atomic}),
    ]
    problems = 0
    if gluon_forward.hopper_overlap is not None and tma_loads and gluon_forward_runs:
        # a mask's lists, if even (tile_lists.rows_even), make it persistent too: the report takes that form
        persistent = hopper_fwd.runs_persistent(gluon_forward, flags["HAS_RIGHT"],
                                                not flags["HAS_MASK"] and not flags["HAS_BIAS"],
                                                even_lists=flags["HAS_MASK"] and not flags["HAS_BIAS"])
        problems += _report_hopper_forward(head_dim, dtype, gluon_forward, flags["HAS_RIGHT"], flags["HAS_SOFTCAP"],
                                           flags["HAS_LEFT"], flags["HAS_MASK"], flags["HAS_BIAS"],
                                           persistent and not flags["VARLEN"], flags["VARLEN"],
                                           sinks=flags["HAS_SINKS"])
    if gluon_forward.hopper_overlap is not None and tma_loads and gluon_alibi:
        alibi_forward = dispatch.gluon_alibi_forward(gluon_forward, head_dim)
        persistent = hopper_fwd.runs_persistent(alibi_forward, flags["HAS_RIGHT"], True)
        problems += _report_hopper_forward(head_dim, dtype, alibi_forward, flags["HAS_RIGHT"], flags["HAS_SOFTCAP"],
                                           flags["HAS_LEFT"], persistent=persistent, alibi=True,
                                           dropout=flags["HAS_DROPOUT"])
    # dropout: the warp-specialised forward takes it without a mask, bias or packing, on the ALiBi form's config
    forward_dropout = (flags["HAS_DROPOUT"] and not flags["HAS_ALIBI"] and not flags["HAS_MASK"]
                       and not flags["HAS_BIAS"] and not flags["VARLEN"] and not flags["HAS_SINKS"]
                       and not flags["HAS_CHUNK"] and bool(gluon_forward.hopper_split))
    if gluon_forward.hopper_overlap is not None and tma_loads and forward_dropout:
        dropout_forward = dispatch.gluon_alibi_forward(gluon_forward, head_dim)
        persistent = hopper_fwd.runs_persistent(dropout_forward, flags["HAS_RIGHT"], True)
        problems += _report_hopper_forward(head_dim, dtype, dropout_forward, flags["HAS_RIGHT"], flags["HAS_SOFTCAP"],
                                           flags["HAS_LEFT"], persistent=persistent, dropout=True)
    if gluon_dkdv.hopper_overlap is not None and tma_loads and gluon_runs:
        # deterministic calls run the pass without dQ; the default at D=128 the 5-matmul form
        for with_dq in (False, True) if configs.atomic_dq else (False,):
            problems += _report_hopper_dkdv(head_dim, dtype, gluon_dkdv, flags["HAS_RIGHT"], with_dq,
                                            flags["HAS_SOFTCAP"], flags["HAS_LEFT"], flags["HAS_MASK"],
                                            varlen=flags["VARLEN"])
    if gluon_dkdv.hopper_overlap is not None and tma_loads and gluon_alibi:  # its causal form, as the forward's
        for with_dq in (False, True) if configs.atomic_dq else (False,):
            problems += _report_hopper_dkdv(head_dim, dtype, gluon_dkdv, flags["HAS_RIGHT"], with_dq,
                                            flags["HAS_SOFTCAP"], flags["HAS_LEFT"], alibi=True,
                                            dropout=flags["HAS_DROPOUT"])
    # dropout: the Gluon dK/dV pass takes it without a mask, bias or packing (dispatch.gluon_dkdv_takes_dropout)
    gluon_dropout = (flags["HAS_DROPOUT"] and not flags["HAS_MASK"] and not flags["HAS_BIAS"] and not flags["VARLEN"]
                     and not flags["HAS_SINKS"] and not flags["HAS_CHUNK"] and not flags["HAS_ALIBI"])
    if gluon_dkdv.hopper_overlap is not None and tma_loads and gluon_dropout:
        for with_dq in (False, True) if configs.atomic_dq else (False,):
            problems += _report_hopper_dkdv(head_dim, dtype, gluon_dkdv, flags["HAS_RIGHT"], with_dq,
                                            flags["HAS_SOFTCAP"], flags["HAS_LEFT"], dropout=True)
    gluon_dq = configs.gluon_dq
    if gluon_dq is not None and tma_loads and gluon_runs and not flags["HAS_MASK"] and not flags["VARLEN"]:
        # where dQ has a pass of its own (deterministic mode), the Gluon one
        problems += _report_hopper_forward(head_dim, dtype, gluon_dq, flags["HAS_RIGHT"], flags["HAS_SOFTCAP"],
                                           flags["HAS_LEFT"], grad_q=True)
    if gluon_dq is not None and tma_loads and gluon_dropout:  # dropout's dQ pass
        problems += _report_hopper_forward(head_dim, dtype, gluon_dq, flags["HAS_RIGHT"], flags["HAS_SOFTCAP"],
                                           flags["HAS_LEFT"], grad_q=True, dropout=True)
    gluon_dkdv_bias = (flags["HAS_BIAS"] and flags["BIAS_TMA"] and not flags["HAS_SOFTCAP"] and not flags["HAS_SINKS"]
                       and flags["DBIAS"] == bwd.DBIAS_STORE and configs.atomic_dq and head_dim == 128)
    if gluon_dkdv.hopper_overlap is not None and tma_loads and gluon_dkdv_bias:  # the 5-matmul form only
        problems += _report_hopper_dkdv(head_dim, dtype, gluon_dkdv, flags["HAS_RIGHT"], True, False,
                                        flags["HAS_LEFT"], flags["HAS_MASK"], True)
    for name, kernel, cfg, extra, descriptors in jobs:  # with a Gluon forward, Triton's is its fallback
        if kernel is bwd._backward_kernel:
            constexprs = dict(common, DKDV_BLOCK_M=configs.dkdv.block_m, DKDV_BLOCK_N=configs.dkdv.block_n,
                              DQ_BLOCK_M=configs.dq.block_m, DQ_BLOCK_N=configs.dq.block_n,
                              INTERIOR_STAGES=configs.dkdv.num_stages, MASKED_STAGES=1, **extra)
            constexprs.update(DKDV_TMA_LOADS=tma_loads and extra["RUN_DKDV"], DQ_TMA_LOADS=tma_loads and extra["RUN_DQ"])
        else:
            constexprs = dict(common, BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, TMA_LOADS=tma_loads, **extra)
        shown = f"{name:<13} {cfg.block_m}x{cfg.block_n} w{cfg.num_warps} s{cfg.num_stages}"
        try:
            r = compile_kernel(kernel, dtype, constexprs, cfg.num_warps, cfg.num_stages, fp32_ptrs,
                               {**descriptors, **bias_descs})
            sass_hint = "wgmma" if "wgmma" in r["asm"].get("ptx", "") else "mma"
            serial = f"  WGMMA SERIALIZED: {r['serialized']}" if r["serialized"] else ""
            problems += bool(r["serialized"])
            print(f"  {shown}  regs={r['regs']} stack={r['spills']} smem={r['shared']} ({sass_hint}){serial}")
        except Exception as e:
            print(f"  {shown}  FAILED: {type(e).__name__}: {str(e)[:400]}")
            problems += 1
    return problems


def compile_hopper_forward(head_dim: int, dtype: str, cfg, causal: bool, softcap: bool = False, left: bool = False,
                           lists: bool = False, bias: bool = False, persistent: bool = False, varlen: bool = False,
                           grad_q: bool = False, alibi: bool = False, dropout: bool = False, sinks: bool = False):
    """The Gluon forward of kernels/hopper_fwd.py as its launcher builds it (4-D descriptors);
    ``lists``: walking a mask's tile lists, ``bias``: reading a bias of the inputs' dtype,
    ``persistent``: the tile loop of a launch of fewer programs than tiles, ``varlen``: packed
    sequences (warp-specialised kernel); ``grad_q``: the same kernel as the backward's dQ pass. The
    8-warp kernel takes its tile off a ``chunk_grid`` launch (``GRID``), its launcher's form at whole
    chunks."""
    from triton.experimental.gluon._runtime import GluonASTSource

    def desc(rows: int, cols: int = head_dim) -> str:
        block = [1, 1, rows, cols]
        return f"tensordesc<{dtype}[{','.join(map(str, block))}],{hopper.smem_layout(tuple(block), TYPES[dtype])!r}>"

    if cfg.hopper_split:
        kernel, rows, num_warps = hopper_fwd._attn_fwd_ws_kernel, hopper.WG_ROWS, 4
        maxnreg, consumer_regs, producer_regs = hopper.ws_registers(cfg.hopper_split)
        constexprs = dict(BLOCK_N=cfg.block_n, HEAD_D=head_dim, CAUSAL=causal, LEFT=left, SOFTCAP=softcap, NUM_STAGES=cfg.num_stages,
                          SPLIT=cfg.hopper_split, PINGPONG=cfg.hopper_pingpong, LISTS=lists, BIAS=bias,
                          PERSISTENT=persistent, VARLEN=varlen, PRODUCER_REGS=producer_regs,
                          CONSUMER_REGS=consumer_regs, GRAD_Q=grad_q, ALIBI=alibi, DROPOUT=dropout, SINKS=sinks,
                          num_warps=num_warps)
        list_args = dict(head_rows="i32", tile_lists="*i32", list_stride_b="i32", list_stride_h="i32", list_stride_r="i32",
                         list_head_div="i32", bias_desc=desc(rows, cfg.block_n) if bias else desc(rows),
                         bias_batches="i32", bias_head_div="i32", lse_head_stride="i32",
                         Out="*fp32" if grad_q else f"*{dtype}", stride_out_row="i32", stride_out_head="i32",
                         do_desc=desc(rows), Alibi="*fp32", DropoutSeed="*i64", dropout_threshold="i32",
                         dropout_scale="fp32", Sinks="*fp32")
        options = dict(num_warps=num_warps, num_stages=1, maxnreg=maxnreg)
    else:
        kernel, rows, num_warps = hopper_fwd._attn_fwd_kernel, hopper_fwd.BLOCK_M, hopper_fwd.NUM_WARPS
        constexprs = dict(BLOCK_M=rows, BLOCK_N=cfg.block_n, HEAD_D=head_dim, CAUSAL=causal, LEFT=left, SOFTCAP=softcap,
                          OVERLAP=cfg.hopper_overlap, NUM_STAGES=cfg.num_stages, GRID=True, num_warps=num_warps)
        options = dict(num_warps=num_warps, num_stages=1)
        list_args = {}
    signature = dict(q_desc=desc(rows), k_desc=desc(cfg.block_n), v_desc=desc(cfg.block_n), o_desc=desc(rows),
                     Lse="*fp32", seq_q="i32", seq_k="i32", num_heads="i32", group="i32", window_left="i32", qk_scale="fp32",
                     softcap_log2="fp32", query_blocks="i32", chunk_heads="i32", **list_args,
                     **{name: "constexpr" for name in constexprs})
    src = GluonASTSource(kernel, signature, constexprs, {(4,): [["tt.divisibility", 16]]})
    compiled = triton.compile(src, target=TARGET, options=options)
    usage = _resource_usage(compiled.asm["cubin"])
    return dict(regs=usage.get("REG"), spills=usage.get("STACK"), shared=compiled.metadata.shared, asm=compiled.asm,
                serialized=wgmma_serialization(compiled.asm["ptx"]))


def _report_hopper_forward(head_dim: int, dtype: str, cfg, causal: bool, softcap: bool = False, left: bool = False,
                           lists: bool = False, bias: bool = False, persistent: bool = False,
                           varlen: bool = False, grad_q: bool = False, alibi: bool = False,
                           dropout: bool = False, sinks: bool = False) -> int:
    if cfg.hopper_split:
        kind = f"warp-specialised, {cfg.hopper_split} warpgroups{', ping-pong' if cfg.hopper_pingpong else ''}"
        rows = hopper.WG_ROWS * cfg.hopper_split
    else:
        kind, rows = f"overlap {cfg.hopper_overlap}", hopper_fwd.BLOCK_M
    shown = (f"{'dQ pass' if grad_q else 'forward'} (Gluon, {kind}{', tile lists' if lists else ''}{', bias' if bias else ''}"
             f"{', persistent' if persistent else ''}{', packed' if varlen else ''}{', ALiBi' if alibi else ''}"
             f"{', dropout' if dropout else ''}{', sinks' if sinks else ''}) "
             f"{rows}x{cfg.block_n} "
             f"s{cfg.num_stages}")
    try:
        r = compile_hopper_forward(head_dim, dtype, cfg, causal, softcap, left, lists, bias, persistent, varlen, grad_q,
                                   alibi, dropout, sinks)
    except Exception as e:
        print(f"  {shown}  FAILED: {type(e).__name__}: {str(e)[:400]}")
        return 1
    serial = f"  WGMMA SERIALIZED: {r['serialized']}" if r["serialized"] else ""
    print(f"  {shown}  regs={r['regs']} stack={r['spills']} smem={r['shared']}{serial}")
    return int(bool(r["serialized"]))


def compile_hopper_dkdv(head_dim: int, dtype: str, cfg, causal: bool, dq: bool = False,
                       softcap: bool = False, left: bool = False, lists: bool = False, group_sum: bool = False,
                       bias: bool = False, dbias: bool = False, varlen: bool = False, alibi: bool = False,
                       dropout: bool = False, ordered: bool = False, register_order: bool | None = None,
                       persistent: bool = False, interleaved: bool = False):
    """The warp-specialised Gluon dK/dV pass of kernels/hopper_bwd.py as its launcher builds it
    (``group_sum``: one program per query head, dK/dV added into fp32 sums over the GQA group;
    ``bias``, ``dbias``: reading a bias of the inputs' dtype, storing its gradient; ``varlen``:
    packed sequences, dK/dV stored by pointers; ``register_order``: dQ staged as register-order runs,
    by default as the planner stages it for lengths that are multiples of 64, i.e. without packing;
    ``persistent``: a program per SM walking tiles, ``hopper_bwd.dkdv_programs``; ``interleaved``: the
    fixed order's causal launch in ``interleaved_order``, ``hopper_bwd.fixed_order_launch``)."""
    from triton.experimental.gluon._runtime import GluonASTSource

    def desc(rows: int, ty: str = dtype) -> str:
        block = [1, 1, rows, head_dim]
        torch_type = torch.float32 if ty == "fp32" else TYPES[ty]
        return f"tensordesc<{ty}[{','.join(map(str, block))}],{hopper.smem_layout(tuple(block), torch_type)!r}>"

    stats = [1, cfg.block_m]
    stats_desc = f"tensordesc<fp32[{','.join(map(str, stats))}],{hopper.smem_layout(tuple(stats), torch.float32)!r}>"
    maxnreg, consumer_regs, producer_regs = hopper.ws_registers(cfg.hopper_split)
    constexprs = dict(BLOCK_M=cfg.block_m, HEAD_D=head_dim, CAUSAL=causal, LEFT=left, SOFTCAP=softcap, NUM_STAGES=cfg.num_stages,
                      SPLIT=cfg.hopper_split, PINGPONG=cfg.hopper_pingpong, CHUNKED=(1 if persistent else 2) if causal else 0,
                      DQ=dq, LISTS=lists,
                      GROUP_SUM=group_sum, BIAS=bias, DBIAS=dbias, VARLEN=varlen, PRODUCER_REGS=producer_regs,
                      CONSUMER_REGS=consumer_regs, ALIBI=alibi, DROPOUT=dropout, ORDERED=ordered, num_warps=4,
                      PERSISTENT=persistent)
    if hasattr(hopper_bwd, "dkdv_walk"):  # the walk of a fixed dQ order (a module without it has one form)
        constexprs["WALK"] = hopper_bwd.dkdv_walk(causal, cfg, ordered, **({"interleaved": True} if interleaved else {}))
    if interleaved:
        constexprs["CHUNKED"] = 3
    if varlen:
        constexprs["CHUNKED"] = 0
    else:  # the launcher passes no dK/dV pointers
        constexprs.update(DK=None, DV=None)
    dq_block = [1, 1, *hopper_bwd.dq_tile_shape(cfg.block_m)]
    dq_layout = hopper.smem_layout(tuple(dq_block), torch.float32)
    if register_order is None:
        register_order = dq and not varlen
    if register_order:
        dq_block = [1, 1, *hopper_bwd.RUN_BOX]
        dq_layout = hopper.unswizzled_layout(len(dq_block), torch.float32)
    dq_desc = f"tensordesc<fp32[{','.join(map(str, dq_block))}],{dq_layout!r}>" if dq else stats_desc
    score_block = [1, 1, cfg.block_m, 64 * cfg.hopper_split]
    score_layout = hopper.smem_layout(tuple(score_block), TYPES[dtype])
    score_tile = f"tensordesc<{dtype}[{','.join(map(str, score_block))}],{score_layout!r}>"
    keys = desc(hopper_bwd.KEYS_PER_WG)
    outputs = desc(hopper_bwd.KEYS_PER_WG, "fp32") if group_sum else keys
    signature = dict(q_desc=desc(cfg.block_m), do_desc=desc(cfg.block_m), k_desc=keys, v_desc=keys, dk_desc=outputs,
                     dv_desc=outputs, lse_desc=stats_desc, dl_desc=stats_desc, dq_desc=dq_desc, seq_q="i32", seq_k="i32", heads_q="i32",
                     heads_kv="i32", group="i32", window_left="i32", qk_scale="fp32", softcap_log2="fp32", scale="fp32",
                     tile_lists="*i32", list_stride_b="i32", list_stride_h="i32", list_stride_n="i32",
                     bias_desc=score_tile if bias else dq_desc, dbias_desc=score_tile if dbias else dq_desc,
                     bias_batches="i32", bias_head_div="i32", key_blocks="i32", chunk_heads="i32", tiles="i32",
                     stride_kv_row="i32", stride_kv_head="i32", Alibi="*fp32", DropoutSeed="*i64",
                     dropout_threshold="i32", dropout_scale="fp32", DqLock="*i32",
                     **{name: "constexpr" for name in constexprs})
    if varlen:
        signature.update(DK=f"*{dtype}", DV=f"*{dtype}")
    src = GluonASTSource(hopper_bwd._dkdv_ws_kernel, signature, constexprs)
    compiled = triton.compile(src, target=TARGET, options=dict(num_warps=4, num_stages=1, maxnreg=maxnreg))
    usage = _resource_usage(compiled.asm["cubin"])
    return dict(regs=usage.get("REG"), spills=usage.get("STACK"), shared=compiled.metadata.shared, asm=compiled.asm,
                serialized=wgmma_serialization(compiled.asm["ptx"]))


def _report_hopper_dkdv(head_dim: int, dtype: str, cfg, causal: bool, dq: bool = False, softcap: bool = False,
                        left: bool = False, lists: bool = False, bias: bool = False, varlen: bool = False,
                        alibi: bool = False, dropout: bool = False, ordered: bool = False) -> int:
    if not dq:  # as the planner runs it without dQ
        cfg = dispatch.dkdv_without_dq(cfg)
    kind = (f"{cfg.hopper_split} warpgroups, ping-pong {cfg.hopper_pingpong}{', + dQ' if dq else ''}"
            f"{' in a fixed order' if ordered else ''}"
            f"{', tile lists' if lists else ''}{', bias + gradient' if bias else ''}{', packed' if varlen else ''}"
            f"{', ALiBi' if alibi else ''}{', dropout' if dropout else ''}")
    shown = f"bwd dkdv (Gluon, warp-specialised, {kind}) {cfg.block_m}x{64 * cfg.hopper_split} s{cfg.num_stages}"
    failed = 0
    # causal GQA outside deterministic mode sums dK/dV over the group where the pass can (group sums)
    group_sums = ((False, True) if causal and not ordered and dispatch.sums_over_group(CAUSAL_SPEC, 2, 1, cfg, lists)
                  else (False,))
    forms = [(group_sum, False, False) for group_sum in group_sums]
    # the persistent pass where the planner may run it (hopper_bwd.dkdv_programs: short causal rows)
    if causal and hopper_bwd.persistent_dkdv_fits(head_dim, cfg, dq, lists or bias or ordered or varlen or alibi
                                                  or dropout):
        forms.append((False, True, False))
    if causal and ordered:  # the fixed order's interleaved launch (hopper_bwd.fixed_order_launch)
        forms.append((False, False, True))
    for group_sum, persistent, interleaved in forms:
        try:
            r = compile_hopper_dkdv(head_dim, dtype, cfg, causal, dq, softcap, left, lists, group_sum,
                                    bias, bias, varlen, alibi, dropout, ordered, persistent=persistent,
                                    interleaved=interleaved)
        except Exception as e:
            print(f"  {shown}  FAILED: {type(e).__name__}: {str(e)[:400]}")
            return 1
        serial = f"  WGMMA SERIALIZED: {r['serialized']}" if r["serialized"] else ""
        spilled = "  SPILLS" if r["spills"] else ""
        print(f"  {shown}{' group sums' if group_sum else ''}{' persistent' if persistent else ''}"
              f"{' interleaved' if interleaved else ''}  "
              f"regs={r['regs']} stack={r['spills']} smem={r['shared']}{serial}{spilled}")
        # The 5-matmul form spills 80-96 bytes and still beat everything else (NOTES.md v19); the
        # sliding-window pass 40-48 bytes at D=128 and still beat the Triton one it replaced (v25),
        # the causal tile-list walk 32 bytes (its masked loop runs on the diagonal tiles only, v26), the
        # packed-sequence pass 8-32 bytes (the sequence's offsets and dK/dV pointers live across the walk
        # for its pointer stores; at D=128 with dQ it still ran 30% under the Triton passes, v39), the
        # dropout pass 40-150 bytes (its Philox calls and keep words; still 0.81x of plain, v60).
        failed += int(bool(r["serialized"]) or bool(r["spills"]) and not dq and not left and not (lists and causal)
                      and not varlen and not dropout)
    return failed


def report_kvcache(head_dim: int, dtype: str) -> int:
    """The KV-cache kernels (kernels/kvcache.py) as ``kvcache_forward`` launches them for decoding
    with GQA 4 (16 packed rows), contiguous and paged, causal; the append and the split combination."""
    block_d = fwd.padded_dim(head_dim)
    pointers = dict(Out="fp32", Lse="fp32", Sinks="fp32", CacheSeqlens="i32", BlockTable="i32", PartOut="fp32",
                    PartLse="fp32", Alibi="fp32")
    common = dict(HEAD_DIM=head_dim, HEAD_DIM_V=head_dim, BLOCK_D=block_d, BLOCK_DV=block_d)
    jobs = [(f"kvcache {'paged' if paged else 'contiguous'} causal{' split' if split else ''}",
             kvcache._cache_attention_kernel,
             dict(common, BLOCK_M=kvcache.row_tile(4), BLOCK_N=kvcache.KEY_TILE, HAS_LEFT=False, HAS_RIGHT=True,
                  HAS_SOFTCAP=False, HAS_SINKS=False, PAGED=paged, DOT_PRECISION=fwd.dot_precision(TYPES[dtype]),
                  PDL=split, HAS_ALIBI=False, HAS_CHUNK=False),
             kvcache.NUM_WARPS, kvcache.pipeline_stages(block_d, block_d, TYPES[dtype].itemsize, paged, split))
            for paged, split in ((False, True), (True, True), (True, False))]
    jobs += [("kvcache append paged", kvcache._append_kernel, dict(common, BLOCK_S=16, PAGED=True), 4, 1),
             ("kvcache combine", kvcache._combine_splits_kernel, dict(HEAD_DIM_V=head_dim, BLOCK_DV=block_d,
                                                                       BLOCK_SPLITS=32, PDL=True), 4, 1)]
    # ALiBi slopes (HAS_ALIBI): the paged split kernel with a slope per packed row
    jobs += [("kvcache paged causal split alibi", kvcache._cache_attention_kernel,
              dict(jobs[1][2], HAS_ALIBI=True), jobs[1][3], jobs[1][4]),
             ("kvcache paged causal split chunk", kvcache._cache_attention_kernel,
              dict(jobs[1][2], HAS_CHUNK=True), jobs[1][3], jobs[1][4])]
    problems = 0
    for name, kernel, constexprs, warps, num_stages in jobs:
        shown = f"{name:<30} w{warps} s{num_stages}"
        try:
            r = compile_kernel(kernel, dtype, constexprs, warps, num_stages, pointers)
            print(f"  {shown}  regs={r['regs']} stack={r['spills']} smem={r['shared']}")
        except Exception as e:
            print(f"  {shown}  FAILED: {type(e).__name__}: {str(e)[:400]}")
            problems += 1
    return problems


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--head-dims", default="64,128")
    p.add_argument("--dtype", default="bf16", choices=sorted(TYPES))
    p.add_argument("--tma-loads", choices=("on", "off", "both"), default="both")
    p.add_argument("--variants", default=None,
                   help="subset of plain,causal,window+softcap,softcap,causal+softcap,window,mask,causal+mask,"
                        "causal+sinks,causal+mask+sinks,bias,causal+bias,causal+bias-atomic,causal+mask+bias,"
                        "causal+mask+bias-pointers,varlen+causal,causal+alibi,window+softcap+alibi,kvcache")
    p.add_argument("--check", action="store_true", help="exit 1 if a kernel fails to compile or is serialised")
    p.add_argument("--hopper-schedules", default=None,
                   help="also compile the Gluon kernels in these schedules: forward 0,1,2,ws2,ws3pp (64- and 128-key tiles), "
                        "dK/dV dkdv2,dkdv2pp1,dkdv3pp2 (+m128: 128-row steps; +dq: with dQ, e.g. dkdv2pp1m128dq; "
                        "+det: dQ in a fixed order, e.g. dkdv2m128dqdet)")
    args = p.parse_args()
    variants = {
        "plain": dict(HAS_LEFT=False, HAS_RIGHT=False, HAS_SOFTCAP=False),
        "causal": dict(HAS_LEFT=False, HAS_RIGHT=True, HAS_SOFTCAP=False),
        "window+softcap": dict(HAS_LEFT=True, HAS_RIGHT=True, HAS_SOFTCAP=True),
        "softcap": dict(HAS_LEFT=False, HAS_RIGHT=False, HAS_SOFTCAP=True),
        "causal+softcap": dict(HAS_LEFT=False, HAS_RIGHT=True, HAS_SOFTCAP=True),
        "window": dict(HAS_LEFT=True, HAS_RIGHT=True, HAS_SOFTCAP=False),
        # a mask whose tiles are whole (block-sparse): the Gluon kernels walk its tile lists
        "mask": dict(HAS_LEFT=False, HAS_RIGHT=False, HAS_SOFTCAP=False, HAS_MASK=True),
        "causal+mask": dict(HAS_LEFT=False, HAS_RIGHT=True, HAS_SOFTCAP=False, HAS_MASK=True),
        # a user mask and sinks: the Gluon forward walks the lists with the sink term (whole tiles)
        "causal+sinks": dict(HAS_LEFT=False, HAS_RIGHT=True, HAS_SOFTCAP=False, HAS_SINKS=True),
        "causal+mask+sinks": dict(HAS_LEFT=False, HAS_RIGHT=True, HAS_SOFTCAP=False, HAS_MASK=True, HAS_SINKS=True),
        # a trainable bias: full shape (its gradient stored; through TMA, as on the GPU where the bias is aligned), and shared by the batch (added by atomics)
        "bias": dict(HAS_LEFT=False, HAS_RIGHT=False, HAS_SOFTCAP=False, HAS_BIAS=True, BIAS_TMA=True,
                     DBIAS=bwd.DBIAS_STORE),
        "causal+bias": dict(HAS_LEFT=False, HAS_RIGHT=True, HAS_SOFTCAP=False, HAS_BIAS=True, BIAS_TMA=True,
                            DBIAS=bwd.DBIAS_STORE),
        "causal+bias-atomic": dict(HAS_LEFT=False, HAS_RIGHT=True, HAS_SOFTCAP=False, HAS_BIAS=True, BIAS_TMA=True,
                                   DBIAS=bwd.DBIAS_ATOMIC),
        "bias-pointers": dict(HAS_LEFT=False, HAS_RIGHT=False, HAS_SOFTCAP=False, HAS_BIAS=True,
                              DBIAS=bwd.DBIAS_STORE),
        # the top-k + trainable bias row: a (B, H, S, S) mask of partial tiles and a full-shape bias,
        # both through TMA as on the GPU
        "causal+mask+bias": dict(HAS_LEFT=False, HAS_RIGHT=True, HAS_SOFTCAP=False, HAS_MASK=True, MASK_TMA=True,
                                 HAS_BIAS=True, BIAS_TMA=True, DBIAS=bwd.DBIAS_STORE),
        "causal+mask+bias-pointers": dict(HAS_LEFT=False, HAS_RIGHT=True, HAS_SOFTCAP=False, HAS_MASK=True,
                                          HAS_BIAS=True, BIAS_TMA=True, DBIAS=bwd.DBIAS_STORE),
        # packed sequences (varlen_attention): the Triton kernels with pointer loads
        "varlen+causal": dict(HAS_LEFT=False, HAS_RIGHT=True, HAS_SOFTCAP=False, VARLEN=True),
        # ALiBi slopes: the Triton kernels (the Gluon ones decline ALiBi)
        # (causal: the key-term form, masking.alibi_mode; a window open to the right: the distance form)
        "causal+alibi": dict(HAS_LEFT=False, HAS_RIGHT=True, HAS_SOFTCAP=False, HAS_ALIBI=2),
        "window+softcap+alibi": dict(HAS_LEFT=True, HAS_RIGHT=True, HAS_SOFTCAP=True, HAS_ALIBI=1),
        # chunked attention and dropout: the Triton kernels too
        "causal+chunk": dict(HAS_LEFT=False, HAS_RIGHT=True, HAS_SOFTCAP=False, HAS_CHUNK=True),
        "causal+dropout": dict(HAS_LEFT=False, HAS_RIGHT=True, HAS_SOFTCAP=False, HAS_DROPOUT=True),
        "full+dropout": dict(HAS_LEFT=False, HAS_RIGHT=False, HAS_SOFTCAP=False, HAS_DROPOUT=True),
        "window+softcap+dropout": dict(HAS_LEFT=True, HAS_RIGHT=True, HAS_SOFTCAP=True, HAS_DROPOUT=True),
        "causal+alibi+dropout": dict(HAS_LEFT=False, HAS_RIGHT=True, HAS_SOFTCAP=False, HAS_ALIBI=2, HAS_DROPOUT=True),
    }
    problems = 0
    for d in map(int, args.head_dims.split(",")):
        for vname, flags in variants.items():
            if args.variants and vname not in args.variants.split(","):
                continue
            for tma in {"on": (True,), "off": (False,), "both": (False, True)}[args.tma_loads]:
                print(f"D={d} {args.dtype} {vname} tma_loads={tma}")
                problems += report(d, args.dtype, flags, tma)
    if not args.variants or "kvcache" in args.variants.split(","):
        for d in map(int, args.head_dims.split(",")):
            print(f"D={d} {args.dtype} kvcache (decoding, GQA 4)")
            problems += report_kvcache(d, args.dtype)
    for schedule in args.hopper_schedules.split(",") if args.hopper_schedules else ():
        # forward: 0, 1, 2 the 8-warp kernel's schedules; ws2, ws3 (+pp) the warp-specialised kernel.
        # dK/dV: dkdv2, dkdv3 (+pp1, +pp2) the warp-specialised pass.
        if schedule.startswith("dkdv"):
            ordered = schedule.endswith("det")  # dQ summed in a fixed order (deterministic mode)
            form = schedule.removesuffix("det")
            dq = form.endswith("dq")  # the 5-matmul form (dQ by TMA reduce-adds)
            name, _, rows = form.removesuffix("dq").partition("m")  # m128: 128-row steps
            split, pingpong = int(name[4]), int(name[7:] or 0)
            for d in map(int, args.head_dims.split(",")):
                cfg = KernelConfig(int(rows or 64), 64 * split, 4, 2, True, 0, split, pingpong)
                if d == 128 and split == 3 or dq and not hopper_bwd.computes_dq(d, cfg):
                    continue  # three warpgroups cannot hold D=128's dK, dV accumulators
                for causal in (False, True):
                    print(f"D={d} {args.dtype} {'causal' if causal else 'plain'} Gluon dK/dV schedule {schedule}")
                    problems += _report_hopper_dkdv(d, args.dtype, cfg, causal, dq, ordered=ordered)
            continue
        split = int(schedule[2]) if schedule.startswith("ws") else 0
        overlap = 0 if split else int(schedule)
        for d in map(int, args.head_dims.split(",")):
            for causal in (False, True):
                for block_n in (128,) if split else (64, 128):
                    print(f"D={d} {args.dtype} {'causal' if causal else 'plain'} Gluon forward schedule {schedule}")
                    cfg = KernelConfig(128, block_n, 8, 2, True, overlap, split, int(schedule.endswith("pp")))
                    problems += _report_hopper_forward(d, args.dtype, cfg, causal)
                    if split:  # and the tile loop of a persistent launch
                        problems += _report_hopper_forward(d, args.dtype, cfg, causal, persistent=True)
    if args.check and problems:
        print(f"{problems} kernel(s) failed to compile or had their wgmmas serialised")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
