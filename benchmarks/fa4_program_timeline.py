"""Where a FlashAttention-4 backward program's time goes, beside ours: the SM clock stamped at each
milestone of every program of FA4's Hopper backward (``flash_bwd_sm90.py``) and of our Gluon dK/dV
pass (``program_timeline.py``), the same rows in one process (GPU machine only, FA4's wheels
installed; timing experiment, outputs not used).

FA4's kernel is compiled from its Python source (CuTe DSL), so the stamps are written into a copy of
that source (``stamped_fa4_source``: each insertion at an anchor that must occur exactly once, so a
changed FA4 fails loudly), imported beside the real module and put in its interface's place for the
stamped calls (its in-memory compile cache cleared around them). Each stamp is one thread's
``st.global`` of ``%clock`` (``%smid`` in slot 0) into an int32 buffer of ``SLOTS`` per program,
whose address is baked into the kernel when it compiles. FA4's slots:

    0 its SM, 1 kernel entry, 2 pipelines set up (before the warps part), 3 producer start (its
    first K and Q load), 4 producer has issued every load, 5 warpgroup 0 before its first step,
    15 warpgroup 0's first step over, 6 warpgroup 0's steps over, 8 dK and dV stores issued,
    9 warpgroup 1's steps over, 10 the stores have read dK and dV, 11 the dQ drain's last
    reduce-add read, 13 the step count; 16 and 17 the global nanosecond timer at 1 and 10 (the SM
    clock's rate).

Per program the phases are differences of these (cycles); between programs on one SM, the gap from
one program's last stamp to the next one's entry. Medians over the launch's programs, per row.

    PYTHONPATH=src python benchmarks/fa4_program_timeline.py --fa4-site /root/fa4/site --out timeline.json \\
        [--rows 4x16x4096x128xw1024,4x16x4096x128xcausal,4x16x4096x128xfull,4x32x4096x64xfull]
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import os
import site
import sys
import tempfile
import traceback

import torch

sys.path.insert(0, os.path.dirname(__file__))
from program_timeline import SLOTS, stamped_bwd_module, summarise, time_rows  # noqa: E402
from program_cost import kernel_times  # noqa: E402

FA4_IMPORTS = """
from cutlass.cutlass_dsl import dsl_user_op as _dsl_user_op
from cutlass._mlir.dialects import llvm as _llvm
"""


def fa4_global_u32_op(name: str, instruction: str) -> str:
    """CuTe DSL source, for a copy of FA4's kernel source, of ``name(address, value)``: the calling
    thread's ``instruction`` (``st.global.u32``, ``red.global.add.u32``) of a 32-bit value at a 64-bit
    global address."""
    return f'''

@_dsl_user_op
def {name}(address, value, *, loc=None, ip=None):
    _llvm.inline_asm(None, [cutlass.Int64(address).ir_value(loc=loc, ip=ip),
                            cutlass.Int32(value).ir_value(loc=loc, ip=ip)],
                     "{instruction} [$0], $1;", "l,r", has_side_effects=True, is_align_stack=False,
                     asm_dialect=_llvm.AsmDialect.AD_ATT)
'''


STAMP_FUNCTIONS = FA4_IMPORTS + fa4_global_u32_op("_store_u32", "st.global.u32") + '''
STAMP_BASE = [0]  # the stamps' buffer's address (fa4_program_timeline.py sets it before compiling)


@cute.jit
def _stamp(event: cutlass.Constexpr[int], value: Int32):
    """Timing experiment: ``value`` into slot ``event`` of this program's slots in the buffer."""
    bx, by, bz = cute.arch.block_idx()
    gx, gy, _ = cute.arch.grid_dim()
    program = cutlass.Int64(bx + gx * (by + gy * bz))
    _store_u32(cutlass.Int64(STAMP_BASE[0]) + (program * SLOTS + event) * 4, value)

'''.replace("SLOTS", str(SLOTS))

EPILOGUE_CALL_END = "                    mdK_semaphore,\n                    mdV_semaphore,\n                )\n"

# (anchor, replacement): each anchor must occur exactly once.
EDITS = [
    # the stamp function, ahead of the block-sparse imports
    ("from flash_attn.cute.block_sparse_utils import (\n",
     STAMP_FUNCTIONS + "from flash_attn.cute.block_sparse_utils import (\n"),
    # entry
    ("        warp_idx = cute.arch.make_warp_uniform(cute.arch.warp_idx())\n\n        # prefetch TMA descriptors\n",
     "        warp_idx = cute.arch.make_warp_uniform(cute.arch.warp_idx())\n\n        # prefetch TMA descriptors\n"
     "        _tid0, _, _ = cute.arch.thread_idx()\n        if _tid0 == 0:\n"
     "            _stamp(0, cute.arch.smid())\n            _stamp(1, cute.arch.clock())\n"
     "            _stamp(16, cute.arch.globaltimer_lo())\n"),
    # pipelines set up, before the warps part
    ("        TileSchedulerCls = partial(TileScheduler.create, tile_sched_params)\n\n",
     "        TileSchedulerCls = partial(TileScheduler.create, tile_sched_params)\n\n"
     "        if _tid0 == 0:\n            _stamp(2, cute.arch.clock())\n"),
    # the producer: start (its first K and Q), every load issued
    ("                        first_m_block = m_block_min\n",
     "                        first_m_block = m_block_min\n"
     "                        if cute.arch.lane_idx() == 0:\n                            _stamp(3, cute.arch.clock())\n"
     "                            _stamp(13, m_block_max - m_block_min)\n"),
    ("                            producer_state_Q.advance()\n                            producer_state_dO.advance()\n",
     "                            producer_state_Q.advance()\n                            producer_state_dO.advance()\n"
     "                        if cute.arch.lane_idx() == 0:\n                            _stamp(4, cute.arch.clock())\n"),
    # the consumers: before the first step, after it, steps over
    ("                    dKV_accumulate = False\n",
     "                    dKV_accumulate = False\n"
     "                    if tidx == 0:\n                        _stamp(5, cute.arch.clock())\n"),
    ("                        dKV_accumulate = True\n",
     "                        dKV_accumulate = True\n"
     "                        if tidx == 0:\n                            if m_block == m_block_min:\n"
     "                                _stamp(15, cute.arch.clock())\n"
     "                    if tidx == 0:\n                        _stamp(6, cute.arch.clock())\n"
     "                    if tidx == 128:\n                        _stamp(9, cute.arch.clock())\n"),
    # dK and dV stores issued (after the epilogue's call), and read
    (EPILOGUE_CALL_END + "            else:\n",
     EPILOGUE_CALL_END + "                if tidx == 0:\n                    _stamp(8, cute.arch.clock())\n"
     "            else:\n"),
    ("        warp_idx = cute.arch.make_warp_uniform(cute.arch.warp_idx())\n        if warp_idx == 4:\n"
     "            cute.arch.cp_async_bulk_wait_group(0, read=True)\n",
     "        warp_idx = cute.arch.make_warp_uniform(cute.arch.warp_idx())\n        if warp_idx == 4:\n"
     "            cute.arch.cp_async_bulk_wait_group(0, read=True)\n"
     "            if tidx == 0:\n                _stamp(10, cute.arch.clock())\n"
     "                _stamp(17, cute.arch.globaltimer_lo())\n"),
    # the dQ drain's last reduce-add read
    ("        if const_expr(not self.deterministic):\n            cute.arch.cp_async_bulk_wait_group(0, read=True)\n",
     "        if const_expr(not self.deterministic):\n            cute.arch.cp_async_bulk_wait_group(0, read=True)\n"
     "        if cute.arch.lane_idx() == 0:\n            _stamp(11, cute.arch.clock())\n"),
]

PHASES = [  # (name, from slot, to slot)
    ("entry -> pipelines set up", 1, 2),
    ("set up -> producer starts (the warps part)", 2, 3),
    ("producer start -> wg0 before its first step", 3, 5),
    ("producer start -> wg0's first step over", 3, 15),
    ("wg0 steps after the first", 15, 6),
    ("wg0 steps over -> dK, dV stores issued", 6, 8),
    ("stores issued -> stores read", 8, 10),
    ("wg0 steps over -> drain's last add read", 6, 11),
    ("wg1 steps over - wg0's", 6, 9),
    ("producer start -> all loads issued", 3, 4),
]


def apply_edits(source: str, edits: list, what: str) -> str:
    """``source`` with each (anchor, replacement) of ``edits`` applied; each anchor must occur exactly
    once (a changed source fails loudly, naming ``what`` and the anchor)."""
    for anchor, replacement in edits:
        found = source.count(anchor)
        if found != 1:
            raise RuntimeError(f"{what}: anchor found {found} times, expected 1:\n{anchor}")
        source = source.replace(anchor, replacement)
    return source


def stamped_fa4_source(source: str) -> str:
    """FA4's ``flash_bwd_sm90.py`` with the stamps written in (``EDITS``)."""
    return apply_edits(source, EDITS, "fa4_program_timeline")


def load_fa4_copy(edit, suffix: str):
    """FA4's ``flash_bwd_sm90.py`` as ``edit(source)`` writes it, imported beside the real module as
    ``flash_attn.cute.flash_bwd_sm90_<suffix>`` (from a file: CuTe DSL reads a kernel's source)."""
    import flash_attn.cute.flash_bwd_sm90 as real
    with open(real.__file__) as f:
        source = edit(f.read())
    path = os.path.join(tempfile.mkdtemp(prefix=f"fa4-{suffix}-"), f"flash_bwd_sm90_{suffix}.py")
    with open(path, "w") as f:
        f.write(source)
    spec = importlib.util.spec_from_file_location(f"flash_attn.cute.flash_bwd_sm90_{suffix}", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def stamped_fa4_module():
    """FA4's backward class compiled from the stamped source, and the stamps' buffer."""
    module = load_fa4_copy(stamped_fa4_source, "stamped")
    buffer = torch.zeros(SLOTS << 18, dtype=torch.int32, device="cuda")
    module.STAMP_BASE[0] = buffer.data_ptr()
    return module, buffer


def fa4_call(row: str):
    """FA4's forward and backward on (B, S, H, D) storage for a row ``BxHxSxDxMASK`` (causal, full, wN)."""
    from flash_attn.cute import flash_attn_func
    b, h, s, d, mask = row.split("x")
    gen = torch.Generator(device="cuda").manual_seed(0)
    q, k, v, do = (torch.randn(int(b), int(s), int(h), int(d), device="cuda", dtype=torch.bfloat16, generator=gen)
                   for _ in range(4))
    leaves = [t.requires_grad_() for t in (q, k, v)]
    window = (int(mask[1:]) - 1, 0) if mask[0] == "w" else (None, None)

    def call():
        o = flash_attn_func(*leaves, causal=mask != "full", window_size=window)
        o = o[0] if isinstance(o, tuple) else o
        return torch.autograd.grad(o, leaves, do)
    return call


def time_fa4_rows(rows: list[str], raw_dir: str | None = None) -> dict:
    import flash_attn.cute.interface as interface
    real_class = interface.FlashAttentionBackwardSm90
    stamped, buffer = stamped_fa4_module()
    results = {}
    for row in rows:
        call = fa4_call(row)
        plain = kernel_times(call, 10)
        interface._flash_attn_bwd.compile_cache.clear()
        interface.FlashAttentionBackwardSm90 = stamped.FlashAttentionBackwardSm90
        try:
            timed = kernel_times(call, 10)
            buffer.zero_()
            call()
            torch.cuda.synchronize()
        finally:
            interface.FlashAttentionBackwardSm90 = real_class
            interface._flash_attn_bwd.compile_cache.clear()
        programs = int((buffer.view(-1, SLOTS)[:, 1] != 0).nonzero().max()) + 1
        if raw_dir:
            torch.save(buffer[:programs * SLOTS].view(programs, SLOTS).cpu(), os.path.join(raw_dir, f"fa4-{row}.pt"))
        summary = summarise(buffer, programs, PHASES, end_slots=(10, 11), step_span=(15, 6), steps_less=1,
                            clock_span=(1, 10))
        summary["kernels_us"] = dict(plain=plain, stamped=timed)
        results[row] = summary
        print("fa4", row, json.dumps(summary, indent=1), flush=True)
    return results


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True)
    p.add_argument("--fa4-site", default=None)
    p.add_argument("--raw", default=None, help="a folder for the stamps themselves (one tensor a row and system)")
    p.add_argument("--rows", default="4x16x4096x128xw1024,4x16x4096x128xcausal,4x16x4096x128xfull,4x32x4096x64xfull")
    args = p.parse_args()
    if args.fa4_site:
        site.addsitedir(args.fa4_site)
    rows = args.rows.split(",")
    results = {"device": torch.cuda.get_device_name()}
    try:
        results["fa4"] = time_fa4_rows(rows, args.raw)
    except Exception:  # the stamped FA4 is the risky half: keep ours either way
        results["fa4_error"] = traceback.format_exc()
        print(results["fa4_error"], flush=True)
    stamped, buffer = stamped_bwd_module()
    results["fusedattn"] = time_rows(rows, stamped, buffer, args.raw)
    with open(args.out, "w") as f:
        json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
