"""Write ablated copies of FA4's SM90 backward next to it: flash_bwd_sm90_abl{N}.py (timing only).
bit 1: no dQ reduce-adds; bit 2: no dQ staging store (kept under a branch no run takes); bit 4: no exp2."""
import sys
from pathlib import Path
root = Path(sys.argv[1]) / "flash_attn" / "cute"
src = (root / "flash_bwd_sm90.py").read_text()
ADD = '''                            with cute.arch.elect_one():
                                copy_utils.cpasync_reduce_bulk_add_f32(
                                    sdQaccum[None, warp_group_idx].iterator,
                                    gdQaccum[(None, warp_group_idx), m_block_safe].iterator,
                                    self.tma_copy_bytes["dQ"],
                                )
'''
STS = '''            cute.autovec_copy(tdQrdQaccum_flat, tdQsdQaccum)
'''
EXP = '''                acc_S_mn[r, c] = cute.math.exp2(
                    acc_S_mn[r, c] * softmax_scale_log2 - lse_val, fastmath=True
                )
'''
for old in (ADD, STS, EXP):
    assert src.count(old) == 1, old
for n in (1, 3, 4):
    s = src
    if n & 1:
        s = s.replace(ADD, "                            pass\n")
    if n & 2:
        s = s.replace(STS, "            if softmax_scale_log2 < Float32(-1.0e30):\n    " + STS)
    if n & 4:
        s = s.replace(EXP, "                acc_S_mn[r, c] = acc_S_mn[r, c] * softmax_scale_log2 - lse_val\n")
    (root / f"flash_bwd_sm90_abl{n}.py").write_text(s)
    print("wrote", root / f"flash_bwd_sm90_abl{n}.py")
