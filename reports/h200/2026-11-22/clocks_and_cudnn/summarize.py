#!/usr/bin/env python3
"""summarize.py: the tables of README.md from output/ (p10 / median / p90 in ms per op and run), and
series.png, the per-call times of the Llama fc2 GEMMs from output/series.

    python3 reports/h200/2026-11-22/clocks_and_cudnn/summarize.py
"""
import glob
import json
import os

HERE = os.path.dirname(os.path.abspath(__file__))


def runs(probe, pattern="*.json"):
    return sorted(glob.glob(os.path.join(HERE, "output", probe, pattern)))


def line(path, keep=lambda name: True):
    doc = json.load(open(path))
    cells = [f"{r['name'].split('.', 1)[1]}={r['p10_ms']:.3f}/{r['median_ms']:.3f}/{r['p90_ms']:.3f}"
             for r in doc["results"] if r.get("median_ms") is not None and keep(r["name"])]
    env = doc.get("environment", {})
    lib = f" cudnn {env['cudnn']}" if "cudnn" in env else ""
    return f"{os.path.basename(path)[:-5]:<22}{lib:<13} " + " ".join(cells)


def fast_fraction(samples):
    """Share of the calls nearer the fastest call than the slowest, and the index of the first slow one."""
    lo, hi = min(samples), max(samples)
    mid = (lo + hi) / 2
    first_slow = next((i for i, v in enumerate(samples) if v > mid), None)
    return sum(v <= mid for v in samples) / len(samples), first_slow


def main():
    for probe in ("cudnn", "sustained_gemm", "sustained_attention", "lead"):
        print(f"== {probe} (p10/median/p90 ms)")
        for path in runs(probe):
            print(line(path))
    print("== series: per call, the share of calls at the fast clock level and the first slow call")
    for path in runs("series"):
        for r in json.load(open(path))["results"]:
            frac, first = fast_fraction(r["samples_ms"])
            print(f"{os.path.basename(path)[:-5]:<16} {r['name'].split('.', 1)[1]:<10} min {min(r['samples_ms']):.3f} "
                  f"median {r['median_ms']:.3f} max {max(r['samples_ms']):.3f} fast share {frac:.2f} "
                  f"first slow call {first}")
    plot_series()


def plot_series():
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("summarize.py: matplotlib not importable: series.png not drawn")
        return
    fig, axes = plt.subplots(1, 2, figsize=(12, 4), sharey=True)
    for ax, repeats in zip(axes, (50, 200)):
        for path in runs("series", f"*_r{repeats}_*.json"):
            tool = os.path.basename(path).split("_")[0]
            r = next(r for r in json.load(open(path))["results"] if r["name"].endswith("fc2.fwd"))
            ax.plot(range(len(r["samples_ms"])), r["samples_ms"], color="tab:blue" if tool == "replay" else "tab:orange",
                    alpha=0.7, lw=1, label=tool)
        handles, labels = ax.get_legend_handles_labels()
        ax.legend(dict(zip(labels, handles)).values(), dict(zip(labels, handles)).keys())
        ax.set_title(f"llama31_405b_tp8.fc2.fwd, {repeats} timed calls, 3 runs per tool")
        ax.set_xlabel("call")
    axes[0].set_ylabel("ms per call")
    fig.tight_layout()
    fig.savefig(os.path.join(HERE, "series.png"), dpi=110)
    print("summarize.py: wrote series.png")


if __name__ == "__main__":
    main()
