#!/usr/bin/env python3
"""Per variant, the dropout kernels' stream-protocol time a call (us) in each replay-ops run, in run order."""
import glob
import json
import os

here = os.path.dirname(os.path.abspath(__file__))
for call in ("no_lag", "lag"):
    print(f"== {call}")
    names = sorted({os.path.basename(f).rsplit("_", 1)[0] for f in glob.glob(f"{here}/output/{call}/*.json")},
                   key=lambda v: (v != "base", v))
    for variant in names:
        runs = sorted(glob.glob(f"{here}/output/{call}/{variant}_*.json"),
                      key=lambda f: int(f.rsplit("_", 1)[1].split(".")[0]))
        times = {}
        for f in runs:
            for r in json.load(open(f))["results"]:
                times.setdefault(r["name"].split(".", 1)[1], []).append(r["stream"]["median_ms"] * 1e3)
        for op, xs in times.items():
            s = sorted(xs)
            print(f"{variant:6s} {op:24s} {' '.join(f'{x:.2f}' for x in xs)} | min {s[0]:.2f} median "
                  f"{(s[len(s) // 2 - 1] + s[len(s) // 2]) / 2:.2f}")
