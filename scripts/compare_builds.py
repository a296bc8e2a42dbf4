#!/usr/bin/env python3
"""compare_builds.py: run the same workload commands with two builds' binaries, taking turns, and say
whether each gives the same loss and weight hashes and how its median step time compares.

What a refactor must show: the same bits at the same seeds, and step times unchanged within noise.

    python3 scripts/compare_builds.py --old OLD_BIN_DIR --new NEW_BIN_DIR --out DIR [--rounds 2]
        [--case 'gpt3 tiny none 20' ...]

A case is 'WORKLOAD PRESET MODE STEPS [EXTRA FLAGS...]'; without --case the default list runs (the
tiny presets and the suite's shard presets in every graph mode). Each run writes DIR/<tag>_<case>_<round>.json;
the table goes to DIR/compare.md and DIR/compare.json. Exit 1 when a hash differs or a run fails.
"""
import argparse
import json
import os
import shlex
import statistics
import subprocess
import sys

DEFAULT_CASES = [
    "gpt3 tiny none 20", "gpt3 tiny layer 20", "gpt3 tiny full 20",
    "llama31 tiny none 20", "llama31 tiny layer 20", "llama31 tiny full 20",
    "gpt3 175b-tp4 none 10", "gpt3 175b-tp4 layer 10", "gpt3 175b-tp4 full 10",
    "llama31 405b-tp8 none 5", "llama31 405b-tp8 layer 5", "llama31 405b-tp8 full 5",
]


def parse_case(text):
    parts = shlex.split(text)
    if len(parts) < 4 or not parts[3].isdigit():
        raise ValueError(f"case {text!r}: expected 'WORKLOAD PRESET MODE STEPS [FLAGS...]'")
    return {"workload": parts[0], "preset": parts[1], "mode": parts[2], "steps": int(parts[3]),
            "extra": parts[4:], "name": "_".join(p.lstrip("-") for p in parts)}


def command(bin_dir, case, seed, json_path):
    return [os.path.join(bin_dir, "replay-" + case["workload"]), "--preset", case["preset"],
            "--graphs", case["mode"], "--steps", str(case["steps"]), "--seed", str(seed),
            "--json", json_path] + case["extra"]


def compare(case, old_runs, new_runs):
    """One table row from each build's runs of a case (a list of JSON documents, None for a failure)."""
    row = {"case": case["name"], "failed": [], "same_loss_hash": None, "same_weights_hash": None}
    for tag, runs in (("old", old_runs), ("new", new_runs)):
        if any(r is None for r in runs) or not runs:
            row["failed"].append(tag)
    if row["failed"]:
        return row
    hashes = lambda runs, key: {r[key] for r in runs}
    row["same_loss_hash"] = hashes(old_runs, "loss_hash") == hashes(new_runs, "loss_hash") \
        and len(hashes(new_runs, "loss_hash")) == 1
    row["same_weights_hash"] = hashes(old_runs, "weights_hash") == hashes(new_runs, "weights_hash") \
        and len(hashes(new_runs, "weights_hash")) == 1
    row["loss_hash"] = sorted(hashes(new_runs, "loss_hash"))
    row["old_ms"] = statistics.median(r["step_ms"]["median"] for r in old_runs)
    row["new_ms"] = statistics.median(r["step_ms"]["median"] for r in new_runs)
    row["ratio"] = row["new_ms"] / row["old_ms"] if row["old_ms"] > 0 else None
    return row


def markdown(rows):
    lines = ["| case | same loss hash | same weights hash | old ms | new ms | new / old |",
             "|---|---|---|---|---|---|"]
    for r in rows:
        if r["failed"]:
            lines.append(f"| {r['case']} | failed ({', '.join(r['failed'])}) | | | | |")
            continue
        yes = lambda b: "yes" if b else "**no**"
        lines.append(f"| {r['case']} | {yes(r['same_loss_hash'])} | {yes(r['same_weights_hash'])} | "
                     f"{r['old_ms']:.3f} | {r['new_ms']:.3f} | {r['ratio']:.3f} |")
    return "\n".join(lines) + "\n"


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--old", required=True, help="folder with the old build's replay-* binaries")
    p.add_argument("--new", required=True, help="folder with the new build's replay-* binaries")
    p.add_argument("--out", required=True, help="folder for the runs' JSON and the table")
    p.add_argument("--rounds", type=int, default=2, help="runs of each build per case, in turns")
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--case", action="append", help="'WORKLOAD PRESET MODE STEPS [FLAGS...]'")
    args = p.parse_args(argv)
    if args.rounds < 1:
        p.error("--rounds must be at least 1")
    try:
        cases = [parse_case(c) for c in (args.case or DEFAULT_CASES)]
    except ValueError as e:
        p.error(str(e))
    for d in (args.old, args.new):
        if not os.path.isdir(d):
            p.error(f"{d} is not a folder")
    os.makedirs(args.out, exist_ok=True)
    rows = []
    for case in cases:
        runs = {"old": [], "new": []}
        for rnd in range(args.rounds):
            for tag, bin_dir in (("old", args.old), ("new", args.new)):
                path = os.path.join(args.out, f"{tag}_{case['name']}_{rnd}.json")
                cmd = command(bin_dir, case, args.seed, path)
                print("compare_builds:", " ".join(cmd), flush=True)
                with open(path[:-5] + ".log", "w") as log:
                    ok = subprocess.run(cmd, stdout=log, stderr=subprocess.STDOUT).returncode == 0
                runs[tag].append(json.load(open(path)) if ok and os.path.exists(path) else None)
        rows.append(compare(case, runs["old"], runs["new"]))
        print(markdown(rows[-1:]).splitlines()[-1], flush=True)
    with open(os.path.join(args.out, "compare.json"), "w") as f:
        json.dump(rows, f, indent=2)
    with open(os.path.join(args.out, "compare.md"), "w") as f:
        f.write(markdown(rows))
    bad = [r for r in rows if r["failed"] or not (r["same_loss_hash"] and r["same_weights_hash"])]
    print(f"compare_builds: {len(rows) - len(bad)} of {len(rows)} cases identical; table in "
          f"{os.path.join(args.out, 'compare.md')}")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
