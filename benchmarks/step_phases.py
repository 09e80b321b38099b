"""Where a backward step's time goes, FA4's beside ours: each step of the dK/dV pass (ours: the
lockstep form with dQ, ``gluon.bwd._step``'s DQ_FIRST path; FA4: ``mma_one_m_block`` of its Hopper
backward) reads the SM clock at the same milestones, and warpgroup 0's first thread adds each phase's
cycles into a global sum (one ``red.global.add`` a phase a step). Over every step of the launch, the
sums give each phase's mean cycles a step (GPU machine only, FA4's wheels installed for its side;
timing experiment, outputs not used).

Phases, in order (each from the milestone before; both kernels issue S and dP back to back, then dV,
dQ, dK):

    0 the step's Q and dO landed (ours: the ring slot; FA4: Q's pipeline)
    1 S landed (FA4: dO's wait too)          2 P (the exponentials)       3 dP landed
    4 dS computed and staged for dQ           5 dV retired, dQ issued (the warpgroups meet on dS)
    6 dK issued, dQ retired and handed to the drain                        7 dK retired
    8 (the step count)

Both kernels are copies of their sources with the clock reads written in at anchors that must each
occur exactly once (``stamped_ours``, ``stamped_fa4``), loaded beside the real modules; the sums'
address is baked into the copies when they are made.

Caveat (measured): the clock reads and adds are barriers to the compilers' scheduling, so they undo
the overlap between phases that is being compared. On one H200 (D=128, 4k) a stamped step took ~45%
more cycles than the unstamped one in ours and ~80% more in FA4's: compare a phase across kernels only
where both kernels do the same work in it, and the whole step only unstamped (``program_timeline``).

    PYTHONPATH=src python benchmarks/step_phases.py --fa4-site /root/fa4/site --out phases.json \\
        [--rows 4x16x4096x128xw1024,4x16x4096x128xcausal,4x16x4096x128xfull]
"""
from __future__ import annotations

import argparse
import json
import os
import site
import sys
import tempfile
import traceback

import torch

sys.path.insert(0, os.path.dirname(__file__))
from fa4_program_timeline import (FA4_IMPORTS, apply_edits, fa4_call, fa4_global_u32_op,  # noqa: E402
                                  load_fa4_copy)
from gluon_modules_ab import load_other, make_call, route_to  # noqa: E402

PHASES = ["Q, dO landed", "S landed", "P (exponentials)", "dP landed", "dS staged", "dV retired, dQ issued",
          "dK issued, dQ retired and handed off", "dK retired"]
COUNT_SLOT = len(PHASES)

OURS_FUNCTIONS = '''

PHASE_BASE: gl.constexpr = gl.constexpr(PHASE_ADDRESS)  # the sums' address (step_phases.py)


@gluon.jit
def _clock():
    layout: gl.constexpr = gl.BlockedLayout([1], [32], [4], [0])
    offs = gl.arange(0, 128, layout=layout)
    return gl.inline_asm_elementwise("mov.u32 $0, %clock;", "=r,r", [offs], dtype=gl.int32, is_pure=False, pack=1)


@gluon.jit
def _phase(prev, SLOT: gl.constexpr, WG: gl.constexpr, COUNT: gl.constexpr = False):
    """Timing experiment: the clock now; warpgroup 0's first thread adds the cycles since ``prev`` into
    sum SLOT (and, with COUNT, one step into the count's)."""
    now = _clock()
    if WG == 0:
        layout: gl.constexpr = gl.BlockedLayout([1], [32], [4], [0])
        offs = gl.arange(0, 128, layout=layout)
        address = gl.full([128], PHASE_BASE + 4 * SLOT, gl.int64, layout=layout)
        gl.inline_asm_elementwise("{ .reg .pred p; setp.eq.u32 p, $3, 0; @p red.global.add.u32 [$2], $1; "
                                  "mov.u32 $0, 0; }", "=r,r,l,r", [now - prev, address, offs], dtype=gl.int32,
                                  is_pure=False, pack=1)
        if COUNT:
            count_at = gl.full([128], PHASE_BASE + 4 * COUNT_SLOT, gl.int64, layout=layout)
            gl.inline_asm_elementwise("{ .reg .pred p; setp.eq.u32 p, $3, 0; @p red.global.add.u32 [$2], $1; "
                                      "mov.u32 $0, 0; }", "=r,r,l,r", [offs * 0 + 1, count_at, offs],
                                      dtype=gl.int32, is_pure=False, pack=1)
    return now

'''.replace("COUNT_SLOT", str(COUNT_SLOT))

OURS_EDITS = [  # (anchor, replacement): each anchor exactly once in gluon/bwd.py
    ("KEYS_PER_WG = WG_ROWS  # keys per consumer warpgroup: one wgmma M\n",
     "KEYS_PER_WG = WG_ROWS  # keys per consumer warpgroup: one wgmma M\n" + OURS_FUNCTIONS),
    ("    k_s = k_smem.index(WG).reshape([k_smem.shape[3], HEAD_D])\n    slot = t % NUM_STAGES\n"
     "    mbarrier.wait(ready.index(slot), (t // NUM_STAGES) & 1)\n",
     "    _c = _clock()\n    k_s = k_smem.index(WG).reshape([k_smem.shape[3], HEAD_D])\n    slot = t % NUM_STAGES\n"
     "    mbarrier.wait(ready.index(slot), (t // NUM_STAGES) & 1)\n    _c = _phase(_c, 0, WG)\n"),
    ("        s = warpgroup_mma_wait(num_outstanding=1, deps=[s_tok])\n",
     "        s = warpgroup_mma_wait(num_outstanding=1, deps=[s_tok])\n        _c = _phase(_c, 1, WG)\n"),
    ("    p = gl.exp2(s * qk_scale - gl.expand_dims(lse2, 0))  # P^T (keys x queries), fp32\n",
     "    p = gl.exp2(s * qk_scale - gl.expand_dims(lse2, 0))  # P^T (keys x queries), fp32\n"
     "    _c = _phase(_c, 2, WG)\n"),
    ("        dp = warpgroup_mma_wait(num_outstanding=0, deps=[dp_tok])\n",
     "        dp = warpgroup_mma_wait(num_outstanding=0, deps=[dp_tok])\n        _c = _phase(_c, 3, WG)\n"),
    ("        _stage_ds(ds_t, ds16, k_smem, dq_state, WG, BIAS)\n        dq = _dq_issue(",
     "        _stage_ds(ds_t, ds16, k_smem, dq_state, WG, BIAS)\n        _c = _phase(_c, 4, WG)\n"
     "        dq = _dq_issue("),
    ("        dv, _ = warpgroup_mma_wait(num_outstanding=DQ_WGMMAS, deps=[dv, p_a])\n",
     "        dv, _ = warpgroup_mma_wait(num_outstanding=DQ_WGMMAS, deps=[dv, p_a])\n        _c = _phase(_c, 5, WG)\n"),
    ("        _dq_hand_off(t, dq, dq_state, scale, WG)\n        dk, _ = warpgroup_mma_wait(num_outstanding=0, "
     "deps=[dk, ds_a])\n",
     "        _dq_hand_off(t, dq, dq_state, scale, WG)\n        _c = _phase(_c, 6, WG)\n"
     "        dk, _ = warpgroup_mma_wait(num_outstanding=0, deps=[dk, ds_a])\n        _c = _phase(_c, 7, WG, True)\n"),
]

FA4_FUNCTIONS = FA4_IMPORTS + fa4_global_u32_op("_red_add_u32", "red.global.add.u32") + '''
PHASE_BASE = [0]  # the sums' address (step_phases.py sets it before compiling)


@cute.jit
def _phase(prev: Int32, slot: cutlass.Constexpr[int], count: cutlass.Constexpr[bool] = False) -> Int32:
    """Timing experiment: the clock now; the first consumer thread (warpgroup 0's) adds the cycles
    since ``prev`` into sum ``slot`` (and, with ``count``, one step into the count's)."""
    now = cute.arch.clock()
    tid, _, _ = cute.arch.thread_idx()
    if tid == 128:
        _red_add_u32(cutlass.Int64(PHASE_BASE[0]) + 4 * slot, now - prev)
        if const_expr(count):
            _red_add_u32(cutlass.Int64(PHASE_BASE[0]) + 4 * COUNT_SLOT, Int32(1))
    return now

'''.replace("COUNT_SLOT", str(COUNT_SLOT))

FA4_EDITS = [  # (anchor, replacement): each anchor exactly once in flash_bwd_sm90.py
    ("from flash_attn.cute.block_sparse_utils import (\n",
     FA4_FUNCTIONS + "from flash_attn.cute.block_sparse_utils import (\n"),
    ("        smem_idx_PdS = smem_idx_Q if const_expr(self.PdS_stage > 1) else 0\n",
     "        smem_idx_PdS = smem_idx_Q if const_expr(self.PdS_stage > 1) else 0\n        _c = cute.arch.clock()\n"),
    ("        pipeline_Q.consumer_wait(consumer_state_Q, pipeline_Q.consumer_try_wait(consumer_state_Q))\n",
     "        pipeline_Q.consumer_wait(consumer_state_Q, pipeline_Q.consumer_try_wait(consumer_state_Q))\n"
     "        _c = _phase(_c, 0)\n"),
    ("        acc_dP = mma_dov_fn(A_idx=smem_idx_Q, wg_wait=1)\n",
     "        acc_dP = mma_dov_fn(A_idx=smem_idx_Q, wg_wait=1)\n        _c = _phase(_c, 1)\n"),
    ("        tLSErdPsum = copy_utils.load_s2r(tLSEsdPsum[None, smem_idx_dO])\n",
     "        tLSErdPsum = copy_utils.load_s2r(tLSEsdPsum[None, smem_idx_dO])\n        _c = _phase(_c, 2)\n"),
    ("        # (4) [Pointwise 2] dS = P*(dP-dPsum)\n        warpgroup.wait_group(0)\n",
     "        # (4) [Pointwise 2] dS = P*(dP-dPsum)\n        warpgroup.wait_group(0)\n        _c = _phase(_c, 3)\n"),
    ("        copy_dS_r2s(tdKrdS, dst_idx=smem_idx_PdS)\n",
     "        copy_dS_r2s(tdKrdS, dst_idx=smem_idx_PdS)\n        _c = _phase(_c, 4)\n"),
    ("            acc_dQ = mma_dsk_fn(A_idx=smem_idx_PdS, wg_wait=1)\n",
     "            acc_dQ = mma_dsk_fn(A_idx=smem_idx_PdS, wg_wait=1)\n            _c = _phase(_c, 5)\n"),
    ("                barrier_id=int(NamedBarrierBwd.dQFullWG0) + warp_group_idx,\n"
     "                number_of_threads=self.num_threads_per_warp_group + cute.arch.WARP_SIZE,\n            )\n",
     "                barrier_id=int(NamedBarrierBwd.dQFullWG0) + warp_group_idx,\n"
     "                number_of_threads=self.num_threads_per_warp_group + cute.arch.WARP_SIZE,\n            )\n"
     "            _c = _phase(_c, 6)\n"),
    ("            warpgroup.wait_group(0)\n            pipeline_Q.consumer_release(consumer_state_Q)\n        else:\n",
     "            warpgroup.wait_group(0)\n            _c = _phase(_c, 7, True)\n"
     "            pipeline_Q.consumer_release(consumer_state_Q)\n        else:\n"),
]


def stamped_ours(source: str, address: int) -> str:
    """This tree's ``gluon/bwd.py`` with the phase sums at ``address`` written in."""
    return apply_edits(source, OURS_EDITS, "step_phases, gluon/bwd.py").replace("PHASE_ADDRESS", str(address))


def stamped_fa4(source: str) -> str:
    """FA4's ``flash_bwd_sm90.py`` with the phase sums written in (their address: ``PHASE_BASE[0]``)."""
    return apply_edits(source, FA4_EDITS, "step_phases, flash_bwd_sm90.py")


def summarise(sums: list[int]) -> dict:
    """Mean cycles a step of each phase, and of the whole step, from the sums and the step count."""
    steps = max(sums[COUNT_SLOT], 1)
    phases = {name: sums[i] / steps for i, name in enumerate(PHASES)}
    return dict(steps=sums[COUNT_SLOT], phases=phases, step=sum(phases.values()))


def run_fa4(rows: list[str]) -> dict:
    import flash_attn.cute.interface as interface
    module = load_fa4_copy(stamped_fa4, "phases")
    sums = torch.zeros(COUNT_SLOT + 1, dtype=torch.int32, device="cuda")
    module.PHASE_BASE[0] = sums.data_ptr()
    real_class, results = interface.FlashAttentionBackwardSm90, {}
    interface._flash_attn_bwd.compile_cache.clear()
    interface.FlashAttentionBackwardSm90 = module.FlashAttentionBackwardSm90
    try:
        for row in rows:
            call = fa4_call(row)
            call()  # compiles
            torch.cuda.synchronize()
            sums.zero_()
            call()
            torch.cuda.synchronize()
            results[row] = summarise([int(v) & 0xFFFFFFFF for v in sums.tolist()])
            print("fa4", row, json.dumps(results[row], indent=1), flush=True)
    finally:
        interface.FlashAttentionBackwardSm90 = real_class
        interface._flash_attn_bwd.compile_cache.clear()
    return results


def run_ours(rows: list[str]) -> dict:
    import fusedattn.kernels.gluon.bwd as this_bwd
    import fusedattn.kernels.gluon.fwd as this_fwd
    sums = torch.zeros(COUNT_SLOT + 1, dtype=torch.int32, device="cuda")
    directory = tempfile.mkdtemp(prefix="phases-")
    with open(this_bwd.__file__) as f:
        source = stamped_ours(f.read(), sums.data_ptr())
    with open(os.path.join(directory, "bwd.py"), "w") as f:
        f.write(source)
    stamped, results = load_other(directory), {}
    for row in rows:
        call = make_call(row, forward_only=False)
        route_to(stamped)
        try:
            call()  # compiles
            torch.cuda.synchronize()
            sums.zero_()
            call()
            torch.cuda.synchronize()
        finally:
            route_to({"fwd": this_fwd, "bwd": this_bwd})
        results[row] = summarise([int(v) & 0xFFFFFFFF for v in sums.tolist()])
        print("fusedattn", row, json.dumps(results[row], indent=1), flush=True)
    return results


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True)
    p.add_argument("--fa4-site", default=None)
    p.add_argument("--rows", default="4x16x4096x128xw1024,4x16x4096x128xcausal,4x16x4096x128xfull")
    args = p.parse_args()
    if args.fa4_site:
        site.addsitedir(args.fa4_site)
    rows = args.rows.split(",")
    results = {"device": torch.cuda.get_device_name(), "phases": PHASES, "fusedattn": run_ours(rows)}
    try:
        results["fa4"] = run_fa4(rows)
    except Exception:  # FA4's side is the riskier one: keep ours either way
        results["fa4_error"] = traceback.format_exc()
        print(results["fa4_error"], flush=True)
    with open(args.out, "w") as f:
        json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
