"""Rebuild the timing rounds of a safety-matrix run from its episode logs (the run's json was lost)."""
import json, glob, os, statistics, sys
d = sys.argv[1]
eps = []
for f in glob.glob(f"{d}/episodes-*.jsonl"):
    name = os.path.basename(f)[9:-6]
    for line in open(f):
        if line.strip():
            e = json.loads(line); e["t"] = name; eps.append(e)
eps.sort(key=lambda e: e["start"])
runs, cur = [], []
for e in eps:
    if cur and cur[-1]["t"] != e["t"]:
        runs.append(cur); cur = []
    cur.append(e)
runs.append(cur)
alone = [r for r in runs if len(r) >= 3 and r[-1]["start"] + r[-1]["dur"] - r[0]["start"] >= 0.6]
cyc_start = float(sys.argv[2]) if len(sys.argv) > 2 else None
by = {}
for r in alone:
    t0 = r[0]["start"]
    ds = [e["dur"] for e in r if e["start"] >= t0 + 0.3 and e is not r[-1]]
    if len(ds) < 3:
        continue
    by.setdefault(r[0]["t"], []).append((t0, statistics.median(ds), len(ds)))
ws = sorted({k.rsplit("-", 1)[0] for k in by})
out = {}
for w in ws:
    s, c = by.get(f"{w}-subject", []), by.get(f"{w}-control", [])
    # phases: the big gap (cycles) between before and after
    allt = sorted([x[0] for x in s + c])
    gaps = [(allt[i + 1] - allt[i], i) for i in range(len(allt) - 1)]
    g, gi = max(gaps)
    split = allt[gi] + g / 2
    res = {}
    for ph, sel in (("before", lambda t: t < split), ("after", lambda t: t >= split)):
        ss = [x for x in s if sel(x[0])]; cc = [x for x in c if sel(x[0])]
        n = min(len(ss), len(cc))
        rs = sorted(ss[i][1] / cc[i][1] for i in range(n))
        q = statistics.quantiles(rs, n=4) if n >= 4 else [None, None, None]
        res[ph] = {"n": n, "ratio": statistics.median(rs) if rs else None, "rs": [round(x, 3) for x in rs],
                   "s_ms": [round(x[1] * 1e3, 2) for x in ss], "c_ms": [round(x[1] * 1e3, 2) for x in cc],
                   "spread": f"{rs[0]:.3f} [{q[0]:.3f} {q[2]:.3f}] {rs[-1]:.3f}" if n >= 4 else str(rs)}
    res["after_over_before"] = res["after"]["ratio"] / res["before"]["ratio"]
    # the control's own drift: its after/before, and the subject's
    res["control_after_over_before"] = statistics.median(res["after"]["c_ms"]) / statistics.median(res["before"]["c_ms"])
    res["subject_after_over_before"] = statistics.median(res["after"]["s_ms"]) / statistics.median(res["before"]["s_ms"])
    out[w] = res
    print(f"{w:16s} a/b={res['after_over_before']:.4f}  before {res['before']['n']} {res['before']['spread']}  after {res['after']['n']} {res['after']['spread']}  ctrl drift {res['control_after_over_before']:.3f} subj drift {res['subject_after_over_before']:.3f}")
json.dump(out, open(f"{d}/timing_rebuilt.json", "w"), indent=1)
