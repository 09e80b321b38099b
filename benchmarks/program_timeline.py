"""Where a dK/dV program's time goes, phase by phase: the SM clock stamped at each milestone of
every program of the Gluon dK/dV pass (GPU machine only; timing experiment, outputs not used).

The stamped kernel is a copy of this tree's ``kernels/gluon/bwd.py`` with stamps written into it
(``stamped_source``: each insertion at an anchor that must occur exactly as often as expected, so a
changed kernel fails loudly instead of stamping the wrong place), loaded beside the real module
(``gluon_modules_ab.load_other``) and routed to for the stamped calls. The stamps go to an int32
buffer of ``SLOTS`` per program, passed where the kernel takes dQ's turn counters (unused outside
deterministic mode, which this script does not run). Each program writes:

    0 its SM, 1 kernel entry, 2 barriers set up (before the warps' dispatch), 3 producer start,
    4 producer has issued every load, 5 warpgroup 0 has K and V, 15 warpgroup 0 starts its masked
    steps (interior ones before), 6 warpgroup 0's steps over, 7 after the last dS round, 8 dK/dV
    staged (``done``), 9 warpgroup 1's steps over, 10 producer's stores have read dK/dV, 11 the dQ
    drain's last reduce-add read, 12 back from the partitions (default warps), 13 the step count,
    14 drain start; 16 and 17 the global nanosecond timer at entry and back from the partitions (the
    SM clock's rate: the cycles of 1 -> 12 over those nanoseconds).

Per program the phases are differences of these (cycles); between programs on one SM, the gap
from one program's last stamp to the next one's entry (the launch of a new program). Medians over
the launch's programs, per row; and the stamped kernel's time beside the unstamped one's (what the
stamps cost).

    PYTHONPATH=src python benchmarks/program_timeline.py --out timeline.json \\
        [--rows 4x16x4096x128xw1024,4x16x4096x128xcausal]
"""
from __future__ import annotations

import argparse
import collections
import json
import os
import statistics
import sys
import tempfile

import torch

import fusedattn.kernels.gluon as package
import fusedattn.kernels.gluon.bwd as this_bwd
import fusedattn.kernels.gluon.fwd as this_fwd

sys.path.insert(0, os.path.dirname(__file__))
from gluon_modules_ab import load_other, make_call, route_to  # noqa: E402
from program_cost import kernel_times  # noqa: E402

SLOTS = 18

STAMP_FUNCTIONS = '''

@gluon.jit
def _stamp(stamps, EVENT: gl.constexpr, NW: gl.constexpr, VALUE=None):
    """Timing experiment: the SM clock (EVENT 0: the SM id; 16 and up: the global nanosecond timer;
    VALUE: that value) into slot EVENT of this program's SLOTS in the int32 buffer ``stamps``."""
    layout: gl.constexpr = gl.BlockedLayout([1], [32], [NW], [0])
    offs = gl.arange(0, 32 * NW, layout=layout)
    if VALUE is not None:
        value = offs * 0 + VALUE
    elif EVENT == 0:
        value = gl.inline_asm_elementwise("mov.u32 $0, %smid;", "=r,r", [offs], dtype=gl.int32, is_pure=False,
                                          pack=1)
    elif EVENT >= 16:
        value = gl.inline_asm_elementwise("mov.u32 $0, %globaltimer_lo;", "=r,r", [offs], dtype=gl.int32,
                                          is_pure=False, pack=1)
    else:
        value = gl.inline_asm_elementwise("mov.u32 $0, %clock;", "=r,r", [offs], dtype=gl.int32, is_pure=False,
                                          pack=1)
    program = gl.program_id(0) + (gl.program_id(1) + gl.program_id(2) * gl.num_programs(1)) * gl.num_programs(0)
    gl.store(stamps + program.to(gl.int64) * SLOTS + EVENT + offs * 0, value, mask=offs == 0)

'''.replace("SLOTS", str(SLOTS))

# (anchor, replacement, expected count): the anchor's text must occur exactly that often.
EDITS = [
    # the stamp function, after the module's constants
    ("KEYS_PER_WG = WG_ROWS  # keys per consumer warpgroup: one wgmma M\n",
     "KEYS_PER_WG = WG_ROWS  # keys per consumer warpgroup: one wgmma M\n" + STAMP_FUNCTIONS, 1),
    # the buffer: where dQ's turn counters go when off
    ("lse2 if dropout is None else dropout[0], dq_lock if dq_lock is not None else lse2)",
     "lse2 if dropout is None else dropout[0], dq_lock if dq_lock is not None else TIMELINE[0])", 1),
    # the producer: its signature, start, loads issued, stores read
    ("              VARLEN: gl.constexpr, WALK: gl.constexpr):\n",
     "              VARLEN: gl.constexpr, WALK: gl.constexpr, stamps=0):\n", 1),
    ("    q_start, k_start, stats_row0 = packed[0], packed[1], packed[2]\n    KEYS: gl.constexpr = k_desc.block_type.shape[2]\n    for c in gl.static_range(SPLIT):\n",
     "    q_start, k_start, stats_row0 = packed[0], packed[1], packed[2]\n    _stamp(stamps, 3, 1)\n    KEYS: gl.constexpr = k_desc.block_type.shape[2]\n    for c in gl.static_range(SPLIT):\n", 1),
    ("                   LEFT, LISTS, BIAS, WALK)\n    # Each consumer's dK, dV out by TMA",
     "                   LEFT, LISTS, BIAS, WALK)\n    _stamp(stamps, 4, 1)\n    # Each consumer's dK, dV out by TMA", 1),
    ("                    tma.async_copy_shared_to_global(dv_desc, [batch, head_kv, nc, 0], v_smem.index(c))\n        tma.store_wait(pendings=0)\n",
     "                    tma.async_copy_shared_to_global(dv_desc, [batch, head_kv, nc, 0], v_smem.index(c))\n        tma.store_wait(pendings=0)\n    _stamp(stamps, 10, 1)\n", 1),
    # the drain: start and end
    ("    if DQ:\n        ds_s, dq_empty = dq_state[0], dq_state[4]\n",
     "    _stamp(order_at[0], 14, 1)\n    if DQ:\n        ds_s, dq_empty = dq_state[0], dq_state[4]\n", 1),
    ("                gl.atomic_add(lock, 1 + _bulk_writes_done(), sem=\"release\", scope=\"gpu\")\n\n\n# ---",
     "                gl.atomic_add(lock, 1 + _bulk_writes_done(), sem=\"release\", scope=\"gpu\")\n    _stamp(order_at[0], 11, 1)\n\n\n# ---", 1),
    # the consumers: signature, K/V landed, masked steps' start, steps over, last dS round, done
    ("              WALK: gl.constexpr = WALK_ASCENDING):\n    \"\"\"Keys [n0 + WG * 64, + 64) of the program",
     "              WALK: gl.constexpr = WALK_ASCENDING, stamps=0):\n    \"\"\"Keys [n0 + WG * 64, + 64) of the program", 1),
    ("        for c in gl.static_range(SPLIT):\n            mbarrier.wait(kv_bars.index(c), 0)\n        # Two phases",
     "        for c in gl.static_range(SPLIT):\n            mbarrier.wait(kv_bars.index(c), 0)\n        if WG == 0:\n            _stamp(stamps, 5, 4)\n            _stamp(stamps, 13, 4, n_steps)\n        # Two phases", 1),
    ("                t_begin, t_end = first_end, n_steps\n",
     "                t_begin, t_end = first_end, n_steps\n                if WG == 0:\n                    _stamp(stamps, 15, 4)\n", 1),
    ("        if not _dq_by_keys(DQ_ROWS, DQ_COLS, BLOCK_M, HEAD_D):\n            # The other warpgroups' dQ wgmmas read this K tile",
     "        if WG == 0:\n            _stamp(stamps, 6, 4)\n        else:\n            _stamp(stamps, 9, 4)\n        if not _dq_by_keys(DQ_ROWS, DQ_COLS, BLOCK_M, HEAD_D):\n            # The other warpgroups' dQ wgmmas read this K tile", 1),
    ("            mbarrier.wait(ds_bar.index(n_steps % 2), (n_steps // 2) & 1)\n    else:\n",
     "            mbarrier.wait(ds_bar.index(n_steps % 2), (n_steps // 2) & 1)\n        if WG == 0:\n            _stamp(stamps, 7, 4)\n    else:\n", 1),
    ("        gl.thread_barrier()  # a named barrier over this partition's warps\n        mbarrier.arrive(done.index(WG), count=1)\n",
     "        gl.thread_barrier()  # a named barrier over this partition's warps\n        mbarrier.arrive(done.index(WG), count=1)\n        if WG == 0:\n            _stamp(stamps, 8, 4)\n", 1),
    # the kernel: entry, before the dispatch, after it; the partitions take the buffer
    ("    KEYS: gl.constexpr = k_desc.block_type.shape[2]\n    gl.static_assert(not GROUP_SUM or",
     "    _stamp(DqLock, 0, 4)\n    _stamp(DqLock, 1, 4)\n    _stamp(DqLock, 16, 4)\n    KEYS: gl.constexpr = k_desc.block_type.shape[2]\n    gl.static_assert(not GROUP_SUM or", 1),
    ("    elif SPLIT == 2:\n        gl.warp_specialize([",
     "    elif SPLIT == 2:\n        _stamp(DqLock, 2, 4)\n        gl.warp_specialize([", 1),
    ("                         DROPOUT, WALK)),\n",
     "                         DROPOUT, WALK, DqLock)),\n", 5),
    ("                         VARLEN, WALK)),\n",
     "                         VARLEN, WALK, DqLock)),\n", 2),
    ("                      CAUSAL, LEFT, DQ, LISTS, DBIAS, VARLEN, ORDERED, WALK)),\n        ], [4, 1, 1], [CONSUMER_REGS, PRODUCER_REGS, PRODUCER_REGS])\n    else:",
     "                      CAUSAL, LEFT, DQ, LISTS, DBIAS, VARLEN, ORDERED, WALK)),\n        ], [4, 1, 1], [CONSUMER_REGS, PRODUCER_REGS, PRODUCER_REGS])\n        _stamp(DqLock, 12, 4)\n        _stamp(DqLock, 17, 4)\n    else:", 1),
]

TIMELINE_BUFFER = '''

TIMELINE = []  # the stamps' buffer (program_timeline.py sets it)
'''


def stamped_source(source: str) -> str:
    """This tree's bwd.py with the stamps written in (``EDITS``)."""
    for anchor, replacement, count in EDITS:
        found = source.count(anchor)
        if found != count:
            raise RuntimeError(f"program_timeline: anchor found {found} times, expected {count}:\n{anchor}")
        source = source.replace(anchor, replacement)
    return source + TIMELINE_BUFFER


PHASES = [  # (name, from slot, to slot)
    ("entry -> barriers set up", 1, 2),
    ("barriers -> producer starts (dispatch)", 2, 3),
    ("producer start -> wg0 has K, V", 3, 5),
    ("wg0 interior steps", 5, 15),
    ("wg0 masked steps", 15, 6),
    ("wg0 last dS round", 6, 7),
    ("wg0 dK, dV staged (done)", 7, 8),
    ("done -> producer's stores read", 8, 10),
    ("wg0 steps over -> drain's last add read", 6, 11),
    ("wg1 steps over - wg0's", 6, 9),
    ("producer start -> all loads issued", 3, 4),
    ("drain start - producer start", 3, 14),
    ("entry -> back from the partitions", 1, 12),
]


def summarise(stamps: torch.Tensor, programs: int, phases: list = PHASES, end_slots: tuple = (10, 11, 12),
              steps_slot: int = 13, step_span: tuple = (5, 6), steps_less: int = 0, clock_span: tuple = (1, 12)) -> dict:
    """Median cycles per phase over the programs, and the gap between consecutive programs on an SM.
    Slots 0 (the SM) and 1 (entry) are every stamped kernel's; a program ends at the latest of
    ``end_slots``; its steps are ``steps_slot``'s count, and its cycles a step ``step_span``'s over
    that count less ``steps_less``; the SM clock (MHz) is ``clock_span``'s cycles over the
    nanoseconds of slots 16 -> 17 (the same two points)."""
    rows = stamps[:programs * SLOTS].view(programs, SLOTS).cpu().tolist()
    medians = {}
    for name, a, b in phases:
        values = [(r[b] - r[a]) & 0xFFFFFFFF for r in rows]
        values = [v - (1 << 32) if v >= 1 << 31 else v for v in values]
        medians[name] = statistics.median(values)
    by_sm = collections.defaultdict(list)
    for r in rows:
        end = max(((r[s] - r[1]) & 0xFFFFFFFF) for s in end_slots)
        by_sm[r[0]].append((r[1], r[1] + end))
    gaps = []
    for runs in by_sm.values():
        runs.sort()
        gaps += [start - prev_end for (_, prev_end), (start, _) in zip(runs, runs[1:]) if 0 <= start - prev_end < 1e6]
    steps = [r[steps_slot] for r in rows]
    a, b = step_span
    step_cycles = [(r[b] - r[a]) & 0xFFFFFFFF for r in rows]
    step_counts = [r[steps_slot] - steps_less for r in rows]
    per_step = [cycles / max(count, 1) for cycles, count in zip(step_cycles, step_counts)]
    whole = [max(((r[s] - r[1]) & 0xFFFFFFFF) for s in end_slots) for r in rows]
    a, b = clock_span
    mhz = [1000 * ((r[b] - r[a]) & 0xFFFFFFFF) / ((r[17] - r[16]) & 0xFFFFFFFF) for r in rows if r[17] != r[16]]
    return dict(phases=medians, gap_between_programs=statistics.median(gaps) if gaps else None,
                steps_median=statistics.median(steps), cycles_per_step_median=statistics.median(per_step),
                step_cycles_mean=sum(step_cycles) / max(sum(step_counts), 1),
                entry_to_end_median=statistics.median(whole), entry_to_end_mean=statistics.fmean(whole),
                clock_mhz_median=statistics.median(mhz) if mhz else None,
                programs=programs, sms=len(by_sm))


def stamped_bwd_module():
    """This tree's dK/dV pass with the stamps, loaded beside it, and the stamps' buffer."""
    directory = tempfile.mkdtemp(prefix="stamped-")
    with open(this_bwd.__file__) as f:
        source = stamped_source(f.read())
    with open(os.path.join(directory, "bwd.py"), "w") as f:
        f.write(source)
    stamped = load_other(directory)
    buffer = torch.zeros(SLOTS << 18, dtype=torch.int32, device="cuda")
    stamped["bwd"].TIMELINE.append(buffer)
    return stamped, buffer


def time_rows(rows: list[str], stamped: dict, buffer: torch.Tensor, raw_dir: str | None = None) -> dict:
    """Per row: the phases (``summarise``) and the dK/dV kernel's time unstamped and stamped (the
    stamps themselves saved in ``raw_dir``, one (programs, SLOTS) tensor a row)."""
    results = {}
    for row in rows:
        call = make_call(row, forward_only=False)
        route_to({"fwd": this_fwd, "bwd": this_bwd})
        plain = kernel_times(call, 10)
        route_to(stamped)
        timed = kernel_times(call, 10)
        buffer.zero_()
        call()
        torch.cuda.synchronize()
        route_to({"fwd": this_fwd, "bwd": this_bwd})
        programs = int((buffer.view(-1, SLOTS)[:, 1] != 0).nonzero().max()) + 1
        if raw_dir:
            torch.save(buffer[:programs * SLOTS].view(programs, SLOTS).cpu(), os.path.join(raw_dir, f"fusedattn-{row}.pt"))
        summary = summarise(buffer, programs)
        dkdv = {k: v for k, v in plain.items() if "dkdv" in k}
        dkdv_stamped = {k: v for k, v in timed.items() if "dkdv" in k}
        summary["dkdv_us"] = dict(plain=dkdv, stamped=dkdv_stamped)
        results[row] = summary
        print(row, json.dumps(summary, indent=1), flush=True)
    return results


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True)
    p.add_argument("--rows", default="4x16x4096x128xw1024,4x16x4096x128xcausal")
    args = p.parse_args()
    stamped, buffer = stamped_bwd_module()
    results = {"device": torch.cuda.get_device_name(), "rows": time_rows(args.rows.split(","), stamped, buffer)}
    with open(args.out, "w") as f:
        json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
