# summarize.py FILE...: per probe binary, the range of each timing over all its runs in the given outputs of
# ../cache_hints/dropout_main.cu, and the distinct result lines (dx hash, dbias sum, dbias[0..2]).
import collections, re, sys
times = collections.defaultdict(lambda: collections.defaultdict(list))
results = collections.defaultdict(set)
cur = None
names = ["bwd+dbias p=0.1", "bwd+dbias p=0", "bwd p=0.1", "bwd p=0", "fwd p=0.1"]
for path in sys.argv[1:]:
    for line in open(path):
        m = re.match(r"== (\S+)", line)
        if m:
            cur = m.group(1)
            continue
        m = re.match(r"dx hash (\S+) kept \S+ dbias sum (\S+) dbias\[0..2\] (.*)", line)
        if m:
            results[cur].add(" ".join(m.groups()))
            continue
        m = re.match(r"round \d: bwd\+dbias p=0.1 (\S+) p=0 (\S+) \| bwd p=0.1 (\S+) p=0 (\S+) \| fwd p=0.1 (\S+)", line)
        if m:
            for k, v in zip(names, m.groups()):
                times[cur][k].append(float(v))
        m = re.match(r"round \d: copy kernel \S+ cudaMemcpyAsync (\S+)", line)
        if m:
            times[cur]["cudaMemcpyAsync"].append(float(m.group(1)))
cols = names + ["cudaMemcpyAsync"]
print("| probe | " + " | ".join(cols) + " |")
print("|---" * (len(cols) + 1) + "|")
for v in times:
    print(f"| {v} | " + " | ".join(f"{min(times[v][k]):.2f}-{max(times[v][k]):.2f}" for k in cols) + " |")
print()
for v in results:
    print(v, "; ".join(sorted(results[v])))
