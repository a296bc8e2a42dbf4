#!/usr/bin/env python3
"""Per variant and op, the stream-protocol time a call (us) of each replay-ops run, in run order."""
import glob
import json
import os
import sys

here = os.path.dirname(os.path.abspath(__file__))
for probe in sys.argv[1:] or ["lane_major", "last_window"]:
    print(f"== {probe}")
    for variant in ("base", "lane"):
        runs = sorted(glob.glob(f"{here}/output/{probe}/{variant}_*.json"),
                      key=lambda f: int(f.rsplit("_", 1)[1].split(".")[0]))
        times = {}
        for f in runs:
            for r in json.load(open(f))["results"]:
                times.setdefault(r["name"].split(".", 1)[1], []).append(r["stream"]["median_ms"] * 1e3)
        for op, xs in times.items():
            s = sorted(xs)
            print(f"{variant:5s} {op:24s} {' '.join(f'{x:.2f}' for x in xs)} | min {s[0]:.2f} median "
                  f"{(s[len(s) // 2 - 1] + s[len(s) // 2]) / 2:.2f}")
