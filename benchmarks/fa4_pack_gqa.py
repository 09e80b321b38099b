"""FlashAttention-4's forward with its query heads packed per KV head (``pack_gqa``) and without,
beside ours: D=128, S=4k, B=4, H=16, GQA 16/2 and MHA, causal and full. Forward kernel time
(profiler, one process, 3 rounds of 20 calls, median); each output checked against ours (printed
max |difference|). Timing only; FA4's wheels installed as benchmarks/NOTES.md v62-v63 say.

    PYTHONPATH=src python benchmarks/fa4_pack_gqa.py [site-packages dir of FA4]
"""
import site
import sys

site.addsitedir(sys.argv[1] if len(sys.argv) > 1 else "/root/fa4/site")
import torch  # noqa: E402

sys.path.insert(0, "benchmarks")
import fusedattn  # noqa: E402
from fusedattn.bench.systems import fa4_attn_func, fa4_call, stored_as  # noqa: E402
from program_cost import bhsd_inputs, kernel_times, role  # noqa: E402

fn = fa4_attn_func()
for heads_kv in (2, 16):
    q, k, v = bhsd_inputs(4, 16, heads_kv, 4096, 128)
    qs, ks, vs = (stored_as(t, "bshd") for t in (q, k, v))
    for causal in (True, False):
        res = {}
        with torch.no_grad():
            ref = fusedattn.attention(q, k, v, layout="bhsd", causal=causal)
            forms = {"ours": lambda: fusedattn.attention(q, k, v, layout="bhsd", causal=causal)}
            for pack in ((True, False) if heads_kv != 16 else (False,)):
                forms[f"fa4-pack{int(pack)}"] = (lambda pack=pack: fa4_call(fn, qs, ks, vs, causal=causal,
                                                                            pack_gqa=pack))
            for name, f in forms.items():
                err = (f().float() - ref.float()).abs().max().item()
                ts = []
                for _ in range(3):
                    t = kernel_times(f, 20)
                    ts.append(sum(x for n, x in t.items() if role(n) == "forward"))
                res[name] = (sorted(ts)[1], err)
        print(f"Hkv={heads_kv} causal={causal}: "
              + "  ".join(f"{n} {t:.1f} us (err {e:.3g})" for n, (t, e) in res.items()), flush=True)
