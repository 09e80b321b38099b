import torch, sys, collections
import numpy as np
path = sys.argv[1]; n = int(sys.argv[2]) if len(sys.argv) > 2 else 4096
t = torch.load(path).view(-1, 16)[:n].numpy().astype(np.int64)
valid = t[:, 1] != 0
t = t[valid]; print(path.split('/')[-1], "programs", len(t))
sm = t[:, 0]
def d(a, b):
    x = (t[:, b] - t[:, a]) % (1 << 32)
    return x
names = {1: "start", 2: "pre-ws", 3: "prod K/V issued", 4: "prod all issued", 5: "WG0 K/V landed", 6: "WG0 loop end",
         7: "WG0 done", 8: "WG1 loop end", 10: "prod stores done", 11: "drain end", 12: "kernel end"}
for a, b in [(1, 2), (2, 3), (3, 5), (1, 5), (5, 6), (6, 7), (7, 10), (6, 11), (8, 6), (10, 12), (11, 12), (1, 12)]:
    x = d(a, b)
    x = np.where(x > (1 << 31), x - (1 << 32), x)
    print(f"  {names[a]:18s} -> {names[b]:18s} median {np.median(x):8.0f}  mean {x.mean():8.0f}  p10 {np.percentile(x,10):8.0f} p90 {np.percentile(x,90):8.0f}")
# gaps between programs on one SM: sort by (sm, start)
order = np.lexsort((t[:, 1], sm))
ts = t[order]; sms = sm[order]
gaps = []
for i in range(1, len(ts)):
    if sms[i] == sms[i - 1]:
        g = (ts[i, 1] - ts[i - 1, 12]) % (1 << 32)
        if g < (1 << 31): gaps.append(g)
gaps = np.array(gaps)
print(f"  gap prev kernel end -> next start on one SM: median {np.median(gaps):.0f} mean {gaps.mean():.0f} p10 {np.percentile(gaps,10):.0f} p90 {np.percentile(gaps,90):.0f}")
span = collections.defaultdict(list)
for i in range(len(ts)):
    span[sms[i]].append(ts[i])
per_sm = [ (len(v), (v[-1][12]-v[0][1]) % (1<<32)) for v in span.values()]
cnt = np.array([p[0] for p in per_sm]); busy = np.array([p[1] for p in per_sm])
print(f"  programs per SM {cnt.min()}-{cnt.max()}, SM span cycles median {np.median(busy):.0f} max {busy.max():.0f}")
tot = d(1, 12); print(f"  sum program cycles / SM span: {tot.sum() / busy.sum():.3f}")
