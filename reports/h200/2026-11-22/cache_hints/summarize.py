# summarize.py FILE: medians over every round of the dropout (d_*) and cross-entropy (c_*) probes in FILE.
import re, sys, collections
d = collections.defaultdict(list); c = collections.defaultdict(list)
for line in open(sys.argv[1]):
    v, _, rest = line.split(" ", 2)
    m = re.search(r"bwd\+dbias p=0.1 ([\d.]+) p=0 ([\d.]+) \| bwd p=0.1 ([\d.]+) p=0 ([\d.]+) \| fwd p=0.1 ([\d.]+)", rest)
    if m: d[v].append([float(x) for x in m.groups()])
    m = re.search(r"forward ([\d.]+) backward ([\d.]+)", rest)
    if m: c[v].append([float(x) for x in m.groups()])
ld = "plain cs cg lu nc".split(); st = "plain cs cg wb".split()
med = lambda a, i: sorted(x[i] for x in a)[len(a) // 2]
print("dropout, us a call (median of all rounds): backward+dbias p=0.1 | p=0 || backward p=0.1 | p=0 || forward p=0.1")
for v in sorted(d, key=lambda k: med(d[k], 0)):
    print(f"{v:12s} ld {ld[int(v[2])]:5s} st {st[int(v[3])]:5s} {med(d[v],0):6.2f} {med(d[v],1):6.2f} || {med(d[v],2):6.2f} {med(d[v],3):6.2f} || {med(d[v],4):6.2f}  ({len(d[v])} rounds, {min(x[0] for x in d[v]):.2f}-{max(x[0] for x in d[v]):.2f})")
print("cross-entropy, us a call: forward backward")
for v in sorted(c, key=lambda k: med(c[k], 1)):
    print(f"{v:12s} ld {ld[int(v[2])]:5s} st {st[int(v[3])]:5s} {med(c[v],0):6.2f} {med(c[v],1):6.2f}")
