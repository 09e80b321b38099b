"""The Hopper kernels, compiled ahead of time on any machine (no GPU needed): every launch the
heuristic makes (and the Gluon forward and dK/dV pass in every schedule the tuning run may pick)
must compile for sm_90a, and ptxas must not serialise its wgmmas (nor spill, in the Gluon dK/dV
pass without dQ, without a sliding window and without a causal mask's tile lists: those spill
32-96 bytes, measured faster than the alternatives, benchmarks/NOTES.md v19, v25 and v26).

A serialised kernel is still correct, so no numerical test can see it; it runs the tensor cores
at a fraction of their rate. ptxas decides it per function (info C7515): one loop in the wrong
place once cost the dK/dV pass half its speed (benchmarks/NOTES.md v11).
"""

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


VARIANTS = "plain,causal,softcap,window+softcap,mask,causal+mask,causal+mask+sinks,bias,varlen+causal"
# the Gluon forward's schedules, then the dK/dV pass's (m128: 128-row steps; dq: with dQ; det: dQ in
# a fixed order; without dQ a schedule without turns runs with turns, dispatch.dkdv_without_dq, so
# only its dQ form is named)
SCHEDULES = ("0,1,2,ws2,ws2pp,ws3,ws3pp,"
             "dkdv2pp1,dkdv2pp2,dkdv3pp1,dkdv3pp2,dkdv2dq,dkdv2pp1dq,dkdv2m128dq,dkdv2pp1m128dq,dkdv2pp2m128dq,"
             "dkdv2dqdet,dkdv2m128dqdet")


@pytest.mark.parametrize("head_dim", [64, 128])
def test_hopper_kernels_compile_with_pipelined_wgmma(head_dim):
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}  # compile for real, not interpret
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT / "src"), env.get("PYTHONPATH", "")])
    result = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "compile_report.py"), "--check", "--head-dims", str(head_dim),
         "--tma-loads", "on", "--variants", VARIANTS, "--hopper-schedules", SCHEDULES],
        capture_output=True, text=True, env=env, timeout=900)
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-4000:]
    assert "regs=" in result.stdout  # the kernels were compiled and reported
    assert "forward (Gluon" in result.stdout  # the heuristic's Hopper forward is the Gluon kernel
    assert "bwd dkdv (Gluon" in result.stdout  # and so is its dK/dV pass
    assert "SERIALIZED" not in result.stdout and "FAILED" not in result.stdout, result.stdout


def test_the_ordered_drain_reads_its_next_turn_under_its_completion_wait():
    """Deterministic mode's dK/dV pass (dQ summed in a fixed order, D=128): each step the drain reads
    the next step's turn counter (relaxed, from L2) after its reduce-adds' sources are read and before
    it waits for their completion, then passes its own turn on. Read after the completion wait, the
    drain's serial cycle outlasted a 64-row step and paced the pass: 12% of it at 4k keys
    (benchmarks/NOTES.md v86); an acquire read would wait for the load before the completion wait."""
    import re

    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT / "src"), str(ROOT / "benchmarks"), env.get("PYTHONPATH", "")])
    code = ("import torch, compile_report as cr\n"
            "from fusedattn.tuning.configs import _cuda_configs\n"
            "cfg = _cuda_configs(torch.bfloat16, 128, 128, 4096, (9, 0), has_left=False, has_right=False).dkdv\n"
            "print(cr.compile_hopper_dkdv(128, 'bf16', cfg, False, dq=True, ordered=True)['asm']['ptx'])\n")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=900)
    assert result.returncode == 0, result.stderr[-4000:]
    ops = re.findall(r"ld\.acquire\.gpu|ld\.relaxed\.gpu\.global\.b32|cp\.async\.bulk\.wait_group\.read\s+0"
                     r"|cp\.async\.bulk\.wait_group 0;|atom\.global\.gpu\.release", result.stdout)
    names = ["acquire" if "acquire" in op else "read turn" if "relaxed" in op else "sources read" if ".read" in op
             else "completed" if "wait_group" in op else "release" for op in ops]
    assert "acquire" not in names, names
    step = ["sources read", "read turn", "completed", "release"]
    assert any(names[i:i + 4] == step for i in range(len(names))), names
