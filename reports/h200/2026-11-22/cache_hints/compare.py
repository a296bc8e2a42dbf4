# compare.py DIR: per kernel, the stream median (us) of each replay-ops variant over its rounds (ops_<V>_<round>.json).
import glob, json, os, re, sys, collections
t = collections.defaultdict(lambda: collections.defaultdict(list)); peak = {}
for f in sorted(glob.glob(os.path.join(sys.argv[1], "ops_*_*.json"))):
    v = re.match(r"ops_(\w+?)_\d+\.json", os.path.basename(f)).group(1)
    d = json.load(open(f))
    for r in d["results"]:
        if r.get("stream"): t[r["name"]][v].append(r["stream"]["median_ms"] * 1e3)
        peak.setdefault(r["name"], (r["bytes"], d.get("peaks", {})))
vs = sorted({v for k in t for v in t[k]})
print("kernel".ljust(40) + "".join(f"{v:>18s}" for v in vs) + "   (us a call in a stream: median [min-max] over rounds)")
for k in sorted(t):
    row = k.ljust(40)
    for v in vs:
        a = sorted(t[k][v]); row += f"{a[len(a)//2]:8.2f} [{a[0]:.1f}-{a[-1]:.1f}]" if a else " " * 18
    print(row)
