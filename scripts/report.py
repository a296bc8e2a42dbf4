#!/usr/bin/env python3
"""report.py: markdown tables and plots from the JSON that replay's benchmarks write (reports/SCHEMA.md).

    python3 scripts/report.py ops --replay replay_ops.json [--pytorch pytorch_ops.json] --out DIR
        -> DIR/ops_summary.md, DIR/ops_ratio.png, DIR/ops_failed_series.png (when a GEMM or attention
           that failed has per-call times from both tools)
    python3 scripts/report.py graphs --json graphs_bench.json --out DIR
        -> DIR/graphs_summary.md, DIR/graphs_sweep.png
    python3 scripts/report.py comm --json probe.json --out DIR
        -> DIR/comm_summary.md (replay-comm-probe's bus bandwidth, against the 2 x H100 anchor)
    python3 scripts/report.py workloads --dir RUNS [--out DIR]
        -> DIR/workloads_summary.md, DIR/<workload>_<preset>_step_time.png,
           DIR/<workload>_<preset>_host_delay.png (when runs with --host-delay-us exist)

`workloads` reads every workload run in RUNS, named <tool>_<workload>_<preset>_<mode>.json (tool replay or
pytorch; mode none, layer or full), with _delay<N>us before .json for a run with --host-delay-us N, e.g.
replay_gpt3_175b-tp4_full.json, pytorch_gpt3_175b-tp4_none.json, replay_gpt3_175b-tp4_none_delay20us.json.

Each report section is one function returning markdown lines, each plot one function writing a PNG.
Targets that fail are reported in the tables and the exit code stays 0; malformed input exits 1 with a
message naming the file and the entry, before anything is written.
"""

import argparse
import json
import math
import os
import re
import sys

# Targets: replay's throughput as a fraction of the basis.
GEMM_TARGET = 0.95          # of PyTorch (torch.matmul), every GEMM direction
ATTENTION_TARGET = 0.97     # of PyTorch's SDPA forward+backward with the same determinism (below)
KERNEL_TARGET = 0.80        # of replay's own measured copy bandwidth, memory-bound kernels

PASS, FAIL, MISSING, MISMATCH, INFO = "pass", "FAIL", "missing", "mismatch", "—"

SHAPE_ABBREV = {"batch": "b", "q_heads": "hq", "kv_heads": "hkv", "seq": "s", "head_dim": "d"}

# The attention forward+backward is judged like for like. replay's workloads run cuDNN's deterministic
# backward (bit-reproducible runs): it is judged against PyTorch's `@deterministic` variant, the default
# SDPA selection under torch.use_deterministic_algorithms(True). replay-ops --attention-nondeterministic
# (cuDNN's non-deterministic backward) is judged against PyTorch's default, which is non-deterministic,
# in a row of its own named NONDETERMINISTIC_ROW.format(name).
DETERMINISTIC_VARIANT = "deterministic"
NONDETERMINISTIC_ROW = "{} (non-deterministic)"


class ReportError(Exception):
    """Malformed or unreadable input; the message names the file and the entry."""


# ---------------------------------------------------------------------------------------------------------
# Loading and validation
# ---------------------------------------------------------------------------------------------------------

def _is_number(v):
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


def _number_or_null(v):
    return v is None or _is_number(v)


def load_json(path):
    try:
        with open(path) as f:
            doc = json.load(f)
    except OSError as e:
        raise ReportError(f"{path}: cannot read: {e.strerror}") from None
    except json.JSONDecodeError as e:
        raise ReportError(f"{path}: not valid JSON: {e}") from None
    if not isinstance(doc, dict):
        raise ReportError(f"{path}: expected a JSON object at the top level")
    return doc


def _check_tool(doc, path, tool):
    if doc.get("tool") != tool:
        raise ReportError(f"{path}: 'tool' is {doc.get('tool')!r}, expected {tool!r}")


def _check_object(doc, key, path, required=True):
    v = doc.get(key)
    if v is None and not required:
        return
    if not isinstance(v, dict):
        raise ReportError(f"{path}: '{key}' must be an object")


def validate_ops(doc, path, tool):
    """Checks an op-benchmark JSON (tool 'replay-ops' or 'pytorch') and returns it."""
    _check_tool(doc, path, tool)
    _check_object(doc, "environment", path)
    _check_object(doc, "peaks", path)
    for key in ("bf16_gemm_tflops", "copy_gbps"):
        if not _number_or_null(doc["peaks"].get(key)):
            raise ReportError(f"{path}: peaks.{key} must be a number or null")
    results = doc.get("results")
    if not isinstance(results, list):
        raise ReportError(f"{path}: 'results' must be a list")
    seen = set()
    for i, r in enumerate(results):
        where = f"{path}: results[{i}]"
        if not isinstance(r, dict):
            raise ReportError(f"{where} is not an object")
        name = r.get("name")
        if not isinstance(name, str) or not name:
            raise ReportError(f"{where} has no 'name'")
        where = f"{path}: results[{i}] ({name})"
        if name in seen:
            raise ReportError(f"{where}: duplicate name")
        seen.add(name)
        if r.get("kind") not in ("gemm", "attention", "kernel"):
            raise ReportError(f"{where}: 'kind' is {r.get('kind')!r}, expected gemm, attention or kernel")
        if not isinstance(r.get("shape"), dict):
            raise ReportError(f"{where}: 'shape' must be an object")
        for key in ("median_ms", "p10_ms", "p90_ms", "flops", "bytes"):
            if not _number_or_null(r.get(key)):
                raise ReportError(f"{where}: '{key}' must be a number or null")
        if r.get("median_ms") is not None and r["median_ms"] <= 0:
            raise ReportError(f"{where}: 'median_ms' must be positive")
        samples = r.get("samples_ms")
        if samples is not None and not (isinstance(samples, list) and samples and all(map(_is_number, samples))):
            raise ReportError(f"{where}: 'samples_ms' must be a non-empty list of numbers")
    return doc


def validate_graphs(doc, path):
    """Checks a replay-graphs-bench JSON and returns it."""
    _check_tool(doc, path, "replay-graphs-bench")
    _check_object(doc, "environment", path, required=False)
    _check_object(doc, "chain", path)
    _check_object(doc, "mix", path, required=False)
    for part in ("chain", "mix"):
        for key, v in (doc.get(part) or {}).items():
            if not _number_or_null(v):
                raise ReportError(f"{path}: {part}.{key} must be a number or null")
    sweep = doc.get("sweep")
    if not isinstance(sweep, list):
        raise ReportError(f"{path}: 'sweep' must be a list")
    for i, p in enumerate(sweep):
        if not isinstance(p, dict) or not _is_number(p.get("host_delay_us")):
            raise ReportError(f"{path}: sweep[{i}] needs a numeric 'host_delay_us'")
        for key in ("eager_us", "graph_us", "small_graphs_us", "speedup"):
            if not _number_or_null(p.get(key)):
                raise ReportError(f"{path}: sweep[{i}].{key} must be a number or null")
    return doc


# ---------------------------------------------------------------------------------------------------------
# Formatting
# ---------------------------------------------------------------------------------------------------------

def fmt(v, spec=".4g"):
    return "—" if v is None else format(v, spec)


def fmt_shape(shape):
    if not shape:
        return "—"
    return " ".join(f"{SHAPE_ABBREV.get(k, k)}={v}" for k, v in shape.items())


def table(header, rows):
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
    return lines


def _measured(entry):
    return entry is not None and entry.get("median_ms") is not None


# ---------------------------------------------------------------------------------------------------------
# Op comparison (pure: dicts in, rows out)
# ---------------------------------------------------------------------------------------------------------

def split_variant(name):
    """'x.attention.fwd_bwd@flash' -> ('x.attention.fwd_bwd', 'flash'); no '@' -> (name, None)."""
    base, sep, variant = name.partition("@")
    return (base, variant) if sep else (name, None)


def target_for(kind, name):
    """The ratio replay must reach for this op, or None where there is no target."""
    if kind == "gemm":
        return GEMM_TARGET
    if kind == "attention" and name.endswith(".fwd_bwd"):
        return ATTENTION_TARGET
    if kind == "kernel":
        return KERNEL_TARGET
    return None


def _judge(ratio, target):
    if target is None:
        return INFO
    return PASS if ratio >= target else FAIL


def _disagreement(a, b):
    """Why two tools' entries for one name are not the same operation, or None."""
    if a["kind"] != b["kind"]:
        return f"kind {a['kind']} vs {b['kind']}"
    if a["shape"] != b["shape"]:
        return f"shape {fmt_shape(a['shape'])} vs {fmt_shape(b['shape'])}"
    fa, fb = a.get("flops"), b.get("flops")
    if fa is not None and fb is not None and abs(fa - fb) > 1e-9 * max(abs(fa), abs(fb)):
        return f"flops {fa:.6g} vs {fb:.6g}"
    return None


def _ordered_names(*result_lists):
    return _union_keys([{r["name"]: r for r in results} for results in result_lists])


def _why_unmeasured(tool, entry):
    if entry is None:
        return f"not in the {tool} JSON"
    return f"{tool} did not measure it" + (f" ({entry['note']})" if entry.get("note") else "")


def _op_row(name, kind, a, b, basis=None):
    """One compared row, labelled name: replay entry a against PyTorch entry b (either may be None). basis
    names what PyTorch ran for an attention forward+backward ("deterministic" or "default"), None
    otherwise. The target is the op's, from the entries' own name (a PyTorch variant's without its
    suffix), whatever the row's label."""
    op = split_variant((a or b)["name"])[0]
    row = {"name": name, "kind": kind, "shape": (a or b)["shape"], "replay": a, "pytorch": b, "basis": basis,
           "ratio": None, "p10_ratio": None, "target": target_for(kind, op), "status": MISSING, "note": None}
    if a is not None and b is not None and _disagreement(a, b):
        row.update(status=MISMATCH, note=_disagreement(a, b))
    elif not _measured(a) or not _measured(b):
        row["note"] = "; ".join(_why_unmeasured(tool, e) for tool, e in (("replay", a), ("pytorch", b))
                                if not _measured(e))
    else:
        row["ratio"] = b["median_ms"] / a["median_ms"]
        row["status"] = _judge(row["ratio"], row["target"])
        if _is_number(a.get("p10_ms")) and _is_number(b.get("p10_ms")) and a["p10_ms"] > 0:
            row["p10_ratio"] = b["p10_ms"] / a["p10_ms"]
    return row


def compare_ops(replay, pytorch, nondet=None):
    """One row per GEMM or attention name (explicit-backend variants excluded), in replay's order then
    PyTorch's extras. ratio = replay throughput / PyTorch throughput = pytorch median / replay median, the
    one judged; p10_ratio is the same for the fastest tenth of the calls (pytorch p10 / replay p10).

    An attention forward+backward is judged against PyTorch with the same determinism: replay's entry
    (deterministic) against PyTorch's `@deterministic` variant where the PyTorch JSON has one, else against
    its default selection (JSON from before that variant). nondet, replay-ops --attention-nondeterministic's
    JSON, adds under each such row one named NONDETERMINISTIC_ROW, against PyTorch's default."""
    rep = {r["name"]: r for r in replay["results"]}
    pt = {r["name"]: r for r in pytorch["results"]}
    nd = {r["name"]: r for r in (nondet or {"results": []})["results"]}
    rows = []
    for name in _ordered_names(replay["results"], pytorch["results"]):
        a, b = rep.get(name), pt.get(name)
        kind = (a or b)["kind"]
        if kind == "kernel" or split_variant(name)[1] is not None:
            continue
        if not (kind == "attention" and name.endswith(".fwd_bwd")):
            rows.append(_op_row(name, kind, a, b))
            continue
        det = pt.get(f"{name}@{DETERMINISTIC_VARIANT}")
        rows.append(_op_row(name, kind, a, det, DETERMINISTIC_VARIANT) if det is not None
                    else _op_row(name, kind, a, b, "default"))
        if name in nd:
            rows.append(_op_row(NONDETERMINISTIC_ROW.format(name), kind, nd[name], b, "default"))
    return rows


def kernel_rows(replay):
    """Memory-bound kernels against replay's measured copy peak. A result with a 'stream' entry (back-to-back
    calls in one graph over rotating buffer sets, the way the copy peak is measured: no launch or event
    latency inside the span) is judged on it; the per-call event time is shown beside it."""
    copy = replay["peaks"].get("copy_gbps")
    rows = []
    for r in replay["results"]:
        if r["kind"] != "kernel":
            continue
        gbps = r["bytes"] / r["median_ms"] / 1e6 if _measured(r) and r.get("bytes") else None
        stream = r.get("stream") or {}
        stream_ms = stream.get("median_ms")
        stream_gbps = r["bytes"] / stream_ms / 1e6 if stream_ms and r.get("bytes") else None
        judged = stream_gbps if stream_gbps is not None else gbps
        row = {"name": r["name"], "shape": r["shape"], "median_ms": r.get("median_ms"), "gbps": gbps,
               "stream_ms": stream_ms, "stream_gbps": stream_gbps,
               "ratio": None, "target": KERNEL_TARGET, "status": MISSING, "note": None}
        if judged is None:
            row["note"] = "not measured" if not _measured(r) else "no 'bytes'"
        elif not copy:
            row["note"] = "replay measured no copy bandwidth"
        else:
            row["ratio"] = judged / copy
            row["status"] = _judge(row["ratio"], KERNEL_TARGET)
        rows.append(row)
    return rows


def backend_rows(replay, pytorch):
    """Explicit-backend variants from the PyTorch JSON, grouped under their base name: (variants, rows),
    each row {name, replay, default, variants: {variant: entry}}."""
    rep = {r["name"]: r for r in replay["results"]}
    pt = {r["name"]: r for r in pytorch["results"]}
    variants, groups = [], {}
    for r in pytorch["results"]:
        base, variant = split_variant(r["name"])
        if variant is None:
            continue
        if variant not in variants:
            variants.append(variant)
        groups.setdefault(base, {})[variant] = r
    rows = [{"name": base, "replay": rep.get(base), "default": pt.get(base), "variants": v}
            for base, v in groups.items()]
    return variants, rows


def leftover_names(replay, pytorch, *row_lists):
    """Entries no table shows (e.g. a kernel only PyTorch timed): listed so that nothing drops silently."""
    shown = {row["name"] for rows in row_lists for row in rows}
    shown |= {r["name"] for r in pytorch["results"] if split_variant(r["name"])[1] is not None}
    return [(tool, r["name"]) for tool, doc in (("replay", replay), ("pytorch", pytorch))
            for r in doc["results"] if r["name"] not in shown]


# ---------------------------------------------------------------------------------------------------------
# Sections of the op report
# ---------------------------------------------------------------------------------------------------------

def _union_keys(dicts):
    """Keys of several dicts, in first-seen order."""
    keys = []
    for d in dicts:
        keys += [k for k in (d or {}) if k not in keys]
    return keys


def section_environment(labelled_docs):
    """Environment, version and protocol of each tool, side by side."""
    labels = [label for label, _ in labelled_docs]
    envs = [doc.get("environment") or {} for _, doc in labelled_docs]
    protocols = [doc.get("protocol") or {} for _, doc in labelled_docs]
    rows = [["version", *[fmt(doc.get("version"), "") for _, doc in labelled_docs]]]
    rows += [[k, *[fmt(e.get(k), "") for e in envs]] for k in _union_keys(envs)]
    rows += [[f"protocol.{k}", *[fmt(p.get(k), "") for p in protocols]] for k in _union_keys(protocols)]
    lines = ["## Environment", ""] + table(["", *labels], rows)
    for label, doc in labelled_docs:
        if isinstance(doc.get("settings"), dict):
            settings = ", ".join(f"`{k}={v}`" for k, v in doc["settings"].items())
            lines += ["", f"{label} settings: {settings}"]
    return lines + [""]


def section_peaks(replay, pytorch):
    def ratio(a, b):
        return a / b if a and b else None
    rows = []
    for key, label in (("bf16_gemm_tflops", "bf16 GEMM 8192^3 (TFLOP/s)"),
                       ("copy_gbps", "2 GiB device copy, read + write (GB/s)")):
        a, b = replay["peaks"].get(key), pytorch["peaks"].get(key)
        rows.append([label, fmt(a, ".1f"), fmt(b, ".1f"), fmt(ratio(a, b), ".3f")])
    header = ["", "replay", "pytorch", "replay/pytorch"]
    return ["## Peaks measured by each tool", ""] + table(header, rows) + [""]


def section_verdict(rows, krows):
    """One line: how many targets were met, and which failed or could not be judged."""
    judged = [r for r in rows + krows if r["target"] is not None]
    met = [r for r in judged if r["status"] == PASS]
    failed = [r["name"] for r in judged if r["status"] == FAIL]
    unjudged = [r["name"] for r in rows + krows if r["status"] in (MISSING, MISMATCH)]
    lines = ["## Verdict", "", f"{len(met)} of {len(judged)} targets met ({len(failed)} failed, "
             f"{len(judged) - len(met) - len(failed)} not judged)."]
    if failed:
        lines.append("Failed: " + ", ".join(f"`{n}`" for n in failed) + ".")
    fast_ok = [r for r in rows if r["status"] == FAIL and r["p10_ratio"] is not None
               and r["p10_ratio"] >= r["target"]]
    if fast_ok:
        lines.append("Of these, the fastest tenth of the calls meets the target for " +
                     ", ".join(f"`{r['name']}` ({r['p10_ratio']:.3f})" for r in fast_ok) +
                     ": the medians differ more than the best calls do (see the p10 column).")
    if unjudged:
        lines.append("Not judged (missing or mismatched): " + ", ".join(f"`{n}`" for n in unjudged) + ".")
    lines.append(f"Targets: GEMMs >= {GEMM_TARGET:.2f} of PyTorch; attention forward+backward >= "
                 f"{ATTENTION_TARGET:.2f} of PyTorch's with the same determinism (replay's deterministic "
                 "backward, which the workloads run, against PyTorch under torch.use_deterministic_algorithms; "
                 "replay's non-deterministic one against PyTorch's default, which is non-deterministic); "
                 f"memory-bound kernels >= {KERNEL_TARGET:.2f} "
                 "of replay's copy bandwidth. Ratios are replay throughput over PyTorch's (PyTorch median / "
                 "replay median); the verdict is on medians.")
    return lines + [""]


def _tflops(e):
    """TFLOP/s from the entry's flops and median (not its own 'tflops' field, so both tools are judged
    by one formula)."""
    return e["flops"] / e["median_ms"] / 1e9 if _measured(e) and e.get("flops") else None


def _result(row):
    return row["status"] + (f": {row['note']}" if row["note"] else "")


def _calls(e):
    """How many calls an entry timed (the length of its samples_ms), or a dash where it does not say."""
    samples = e.get("samples_ms") if e else None
    return str(len(samples)) if isinstance(samples, list) else "—"


def section_ops_table(rows):
    out = []
    for r in rows:
        a, b = r["replay"], r["pytorch"]
        rep_ms = fmt(a["median_ms"]) if a else MISSING
        pt_ms = fmt(b["median_ms"]) if b else MISSING
        if b is not None and (b.get("backend") or r.get("basis")):
            pt_ms += " (" + ", ".join(x for x in (b.get("backend"), r.get("basis")) if x) + ")"
        rep_tf = fmt(_tflops(a), ".1f")
        out.append([f"`{r['name']}`", r["kind"], fmt_shape(r["shape"]), rep_ms, pt_ms, rep_tf,
                    fmt(r["ratio"], ".3f"), fmt(r["p10_ratio"], ".3f"), f"{_calls(a)} / {_calls(b)}",
                    fmt(r["target"], ".2f"), _result(r)])
    header = ["op", "kind", "shape", "replay ms", "pytorch ms", "replay TFLOP/s", "replay/pytorch", "at p10",
              "calls", "target", "result"]
    return ["## GEMMs and attention: replay against PyTorch", "",
            "Medians (judged) and, under \"at p10\", the same ratio for the fastest tenth of each tool's calls. "
            "Near the power limit a series of calls can run partly at one clock level and partly at another; "
            "the median then moves with the point where the clocks drop, the fastest calls much less. Each tool "
            "times as many calls as fit its protocol's budget_ms (see Environment), so that a series ends "
            "before the drop; \"calls\" gives how many each timed (replay / PyTorch).", ""] \
        + table(header, out) + [""]


def section_kernels(krows, copy_gbps):
    if not krows:
        return ["## Memory-bound kernels", "", "No memory-bound kernels in the replay JSON.", ""]
    out = [[f"`{r['name']}`", fmt_shape(r["shape"]), fmt(r["median_ms"]), fmt(r["gbps"], ".1f"),
            fmt(r["stream_ms"]), fmt(r["stream_gbps"], ".1f"), fmt(r["ratio"], ".3f"), fmt(r["target"], ".2f"),
            _result(r)] for r in krows]
    header = ["kernel", "shape", "one call ms", "GB/s", "in a stream ms", "GB/s", "of copy", "target", "result"]
    return (["## Memory-bound kernels", "",
             f"Against replay's measured copy bandwidth, {fmt(copy_gbps, '.1f')} GB/s (a 2 GiB copy). \"One call\" "
             "is timed with events around each call; \"in a stream\" is the per-call time inside one graph of "
             "back-to-back calls over rotating buffer sets (inputs not in L2), the way the copy peak and a training "
             "step run them, and is what \"of copy\" judges when present.", ""]
            + table(header, out) + [""])


def _ratio_cell(rep, other):
    """replay's throughput over the other entry's (other median / replay median), or a dash."""
    return fmt(other["median_ms"] / rep["median_ms"], ".3f") if _measured(rep) and _measured(other) else "—"


def section_attention_backends(variants, rows):
    title = ["## Attention forward+backward under each PyTorch backend", ""]
    if not rows:
        return title + ["No explicit-backend entries in the PyTorch JSON.", ""]

    def cell(e):
        if e is None:
            return MISSING
        if e.get("median_ms") is None:
            return "refused" if "refused" in (e.get("note") or "") else "not measured"
        return fmt(e["median_ms"])

    out, notes = [], []
    for r in rows:
        default = r["default"]
        dcell = cell(default) + (f" ({default['backend']})" if default and default.get("backend") else "")
        vs = [r["variants"].get(v) for v in variants]
        out.append([f"`{r['name']}`", cell(r["replay"]), dcell, *[cell(e) for e in vs],
                    _ratio_cell(r["replay"], default), *[_ratio_cell(r["replay"], e) for e in vs]])
        notes += [f"- `{r['name']}@{v}`: {e['note']}" for v, e in zip(variants, vs) if e and e.get("note")]
    header = ["op", "replay ms", "pytorch default ms", *[f"@{v} ms" for v in variants], "replay/default",
              *[f"replay/@{v}" for v in variants]]
    return title + table(header, out) + ([""] + notes if notes else []) + [""]


def section_leftovers(leftovers):
    if not leftovers:
        return []
    return (["## Entries not compared", ""] + [f"- {tool}: `{name}`" for tool, name in leftovers] + [""])


# ---------------------------------------------------------------------------------------------------------
# Plots
# ---------------------------------------------------------------------------------------------------------

def _pyplot():
    """matplotlib.pyplot on the Agg backend, or None where matplotlib is not installed."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    return plt


STATUS_COLOURS = {PASS: "tab:green", FAIL: "tab:red", INFO: "tab:gray", MISMATCH: "tab:orange"}


def plot_ops_ratio(rows, path):
    """Horizontal bars of replay/PyTorch per op, coloured by verdict, with each op's target marked."""
    plt = _pyplot()
    if plt is None:
        return False
    fig, ax = plt.subplots(figsize=(9, 1.5 + 0.28 * max(len(rows), 1)))
    ys = list(range(len(rows)))[::-1]
    for y, r in zip(ys, rows):
        if r["ratio"] is None:
            ax.text(0.02, y, r["status"], va="center", fontsize=8, color="tab:red")
            continue
        ax.barh(y, r["ratio"], color=STATUS_COLOURS.get(r["status"], "tab:gray"), height=0.7)
        if r["target"] is not None:
            ax.plot([r["target"]] * 2, [y - 0.4, y + 0.4], color="black", linewidth=1.5)
    ax.axvline(1.0, color="black", linestyle="--", linewidth=0.8)
    ax.set_yticks(ys)
    ax.set_yticklabels([r["name"] for r in rows], fontsize=8)
    ax.set_xlabel("replay throughput / PyTorch throughput (black ticks: targets)")
    ax.set_title("replay against PyTorch, per op")
    if not rows:
        ax.text(0.5, 0.5, "no comparable ops", ha="center", transform=ax.transAxes)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return True


def plot_graph_sweep(sweep, crossings, path):
    """Eager, one-graph and small-graphs time against host delay, with each crossover marked."""
    plt = _pyplot()
    if plt is None:
        return False
    fig, ax = plt.subplots(figsize=(8, 5))
    xs = [p["host_delay_us"] for p in sweep]
    styles = {"eager_us": ("eager", "tab:red", None), "graph_us": ("one graph", "tab:blue", ":"),
              "small_graphs_us": ("small graphs", "tab:green", "--")}
    for key, (label, colour, _) in styles.items():
        pts = [(x, p.get(key)) for x, p in zip(xs, sweep) if p.get(key) is not None]
        if pts:
            ax.plot(*zip(*pts), marker="o", label=label, color=colour)
    for key, c in crossings.items():
        if c is not None:
            label, colour, dash = styles[key]
            ax.axvline(c["first_delay_us"], color=colour, linestyle=dash,
                       label=f"{label} pays from {c['first_delay_us']:g} µs")
    ax.set_xlabel("host delay per kernel launch (µs)")
    ax.set_ylabel("time (µs)")
    ax.set_title("Eager against CUDA graphs as the host slows down")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return True


def plot_failed_series(rows, path, limit=6):
    """Each tool's per-call times (samples_ms, the run that gave its median) for the first `limit` rows,
    one panel an op: where a series changes clock level part-way, the panel shows at which call."""
    plt = _pyplot()
    if plt is None:
        return False
    rows = rows[:limit]
    fig, axes = plt.subplots(len(rows), 1, figsize=(9, 2.2 * len(rows)), squeeze=False)
    for ax, r in zip(axes[:, 0], rows):
        for tool, colour in (("replay", "tab:blue"), ("pytorch", "tab:orange")):
            samples = r[tool]["samples_ms"]
            ax.plot(range(len(samples)), samples, color=colour, linewidth=1,
                    label=f"{tool} (median {r[tool]['median_ms']:.4g} ms)")
        ax.set_title(f"{r['name']}: replay/pytorch {r['ratio']:.3f} at the median", fontsize=9)
        ax.set_ylabel("ms per call", fontsize=8)
        ax.legend(fontsize=8)
    axes[-1, 0].set_xlabel("timed call")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


def _plot_line(written, name, what):
    if written:
        return [f"![{what}]({name})", ""]
    print(f"report.py: warning: matplotlib is not importable; {name} not written", file=sys.stderr)
    return [f"({name} not written: matplotlib is not importable.)", ""]


# ---------------------------------------------------------------------------------------------------------
# Graph-layer report
# ---------------------------------------------------------------------------------------------------------

CHAIN_FIELDS = [
    ("kernels", "kernels", ".0f"),
    ("sum_kernel_us", "sum of the kernels' own times (µs)", ".2f"),
    ("eager_us", "eager, back to back (µs)", ".2f"),
    ("eager_launch_us_per_kernel", "eager launch cost per kernel (µs)", ".2f"),
    ("graph_us", "one graph (µs)", ".2f"),
    ("graph_launch_us", "graph launch cost (µs)", ".2f"),
    ("graph_over_sum", "one graph / sum of kernels", ".3f"),
    ("small_graphs_us", "small graphs (µs)", ".2f"),
    ("small_graph_size", "kernels per small graph", ".0f"),
]


def crossover(sweep, key):
    """Where the graph variant `key` starts to pay (time below eager), scanning host delays upwards:
    {first_delay_us, interpolated_us} or None if it never does. interpolated_us is the linear estimate of
    where the two curves cross between the last delay that did not pay and the first that did (None when
    graphs pay already at the smallest delay)."""
    pts = sorted((p for p in sweep if p.get("eager_us") is not None and p.get(key) is not None),
                 key=lambda p: p["host_delay_us"])
    for i, p in enumerate(pts):
        gain = p["eager_us"] - p[key]
        if gain > 0:
            if i == 0:
                return {"first_delay_us": p["host_delay_us"], "interpolated_us": None}
            q = pts[i - 1]
            prev = q["eager_us"] - q[key]
            x = q["host_delay_us"] + (p["host_delay_us"] - q["host_delay_us"]) * (-prev) / (gain - prev)
            return {"first_delay_us": p["host_delay_us"], "interpolated_us": x}
    return None


def section_graph_chain(doc):
    parts = [(p, doc.get(p)) for p in ("chain", "mix")]
    keys = [k for k, _, _ in CHAIN_FIELDS]
    extra = [k for k in _union_keys([d for _, d in parts]) if k not in keys]
    rows = []
    for key, label, spec in CHAIN_FIELDS + [(k, k, ".4g") for k in extra]:
        rows.append([label, *[fmt(d.get(key), spec) if d is not None else MISSING for _, d in parts]])

    def speedup(d):
        return d["eager_us"] / d["graph_us"] if d and d.get("eager_us") and d.get("graph_us") else None
    rows.append(["eager / one graph",
                 *[fmt(speedup(d), ".2f") if d is not None else MISSING for _, d in parts]])
    lines = ["## Launch costs: a chain of small kernels, and a mix", ""]
    lines += table(["", "chain", "mix"], rows) + [""]
    chain = doc["chain"]
    if chain.get("graph_over_sum") is not None:
        per_kernel = fmt(chain.get("eager_launch_us_per_kernel"), ".2f")
        lines.append(f"One graph replays the chain in {chain['graph_over_sum']:.3f}x the sum of its kernels' "
                     f"times; eager launches cost {per_kernel} µs per kernel, one graph launch "
                     f"{fmt(chain.get('graph_launch_us'), '.2f')} µs.")
        lines.append("")
    return lines


def section_graph_sweep(sweep, crossings):
    def ratio(p, key):
        return p["eager_us"] / p[key] if p.get("eager_us") and p.get(key) else None
    rows = [[fmt(p["host_delay_us"], "g"), fmt(p.get("eager_us"), ".2f"), fmt(p.get("graph_us"), ".2f"),
             fmt(p.get("small_graphs_us"), ".2f"), fmt(ratio(p, "graph_us"), ".2f"),
             fmt(ratio(p, "small_graphs_us"), ".2f")]
            for p in sorted(sweep, key=lambda p: p["host_delay_us"])]
    header = ["host delay µs", "eager µs", "one graph µs", "small graphs µs", "eager/one graph",
              "eager/small graphs"]
    lines = ["## Host-delay sweep", ""] + table(header, rows) + [""]
    for key, label in (("graph_us", "One graph"), ("small_graphs_us", "Small graphs")):
        c = crossings[key]
        if c is None:
            lines.append(f"- {label}: never faster than eager over the sweep.")
        elif c["interpolated_us"] is None:
            lines.append(f"- {label}: faster than eager already at the smallest delay, "
                         f"{c['first_delay_us']:g} µs.")
        else:
            lines.append(f"- {label}: faster than eager from {c['first_delay_us']:g} µs host delay "
                         f"(curves cross near {c['interpolated_us']:.1f} µs).")
    return lines + [""]


# ---------------------------------------------------------------------------------------------------------
# Reports
# ---------------------------------------------------------------------------------------------------------

# Stands in for the PyTorch JSON when the baseline was not run (no torch): every comparison shows missing.
NO_PYTORCH = {"tool": "pytorch", "version": None, "environment": {},
              "peaks": {"bf16_gemm_tflops": None, "copy_gbps": None}, "results": []}


def section_determinism(replay, nondet, pytorch):
    """Attention forward+backward in both tools with and without determinism, side by side: what a
    deterministic backward costs each, and replay's deterministic one against PyTorch's default."""
    det = {r["name"]: r for r in replay["results"]}
    nd = {r["name"]: r for r in (nondet or {"results": []})["results"]}
    pt = {r["name"]: r for r in pytorch["results"]}
    names = [r["name"] for r in replay["results"]
             if r.get("kind") == "attention" and r["name"].endswith(".fwd_bwd")]

    def ms(e):
        return fmt(e.get("median_ms")) if e else MISSING

    out = []
    for name in names:
        d, n = det.get(name), nd.get(name)
        pd, p = pt.get(f"{name}@{DETERMINISTIC_VARIANT}"), pt.get(name)
        pd_ms = ms(pd) + (f" ({pd['backend']})" if pd and pd.get("backend") else "")
        p_ms = ms(p) + (f" ({p['backend']})" if p and p.get("backend") else "")
        out.append([f"`{name}`", ms(d), ms(n), pd_ms, p_ms, _ratio_cell(d, pd), _ratio_cell(n, p),
                    _ratio_cell(d, p)])
    if not out or (not nd and not any(f"{n}@{DETERMINISTIC_VARIANT}" in pt for n in names)):
        return []
    header = ["op", "replay deterministic ms", "replay non-deterministic ms", "pytorch deterministic ms",
              "pytorch default ms", "deterministic / pytorch deterministic",
              "non-deterministic / pytorch default", "deterministic / pytorch default"]
    return (["## Attention with and without a deterministic backward", "",
             "replay's workloads use cuDNN's deterministic backward (bit-reproducible runs); "
             "`replay-ops --attention-nondeterministic` times cuDNN's non-deterministic one (no workload uses "
             "it). PyTorch's default is non-deterministic; under torch.use_deterministic_algorithms(True) it "
             "refuses cuDNN's attention and runs another backend's deterministic backward. The first two "
             "ratios are the judged pairs; the last sets replay's deterministic backward against PyTorch's "
             "non-deterministic one.", ""] + table(header, out) + [""])


def report_ops(replay_path, pytorch_path, out_dir, nondeterministic_path=None):
    """Writes out_dir/ops_summary.md and out_dir/ops_ratio.png; returns (md path, rows, kernel rows).
    pytorch_path None: the baseline was not run; its columns read missing and no ratio is judged.
    nondeterministic_path: replay-ops --attention-nondeterministic JSON, judged against PyTorch's default
    (compare_ops) and shown in the determinism section."""
    replay = validate_ops(load_json(replay_path), replay_path, "replay-ops")
    if pytorch_path is None:
        pytorch = NO_PYTORCH
    else:
        pytorch = validate_ops(load_json(pytorch_path), pytorch_path, "pytorch")
    nondet = None
    if nondeterministic_path is not None:
        nondet = validate_ops(load_json(nondeterministic_path), nondeterministic_path, "replay-ops")
    rows, krows = compare_ops(replay, pytorch, nondet), kernel_rows(replay)
    variants, brows = backend_rows(replay, pytorch)
    os.makedirs(out_dir, exist_ok=True)
    written = plot_ops_ratio(rows, os.path.join(out_dir, "ops_ratio.png"))
    pytorch_input = (f"`{os.path.basename(pytorch_path)}` (PyTorch)" if pytorch_path is not None
                     else "no PyTorch JSON (the baseline was not run)")
    lines = ["# replay ops against PyTorch", "",
             f"Inputs: `{os.path.basename(replay_path)}` (replay), {pytorch_input}.", ""]
    lines += section_verdict(rows, krows)
    lines += section_ops_table(rows)
    lines += _plot_line(written, "ops_ratio.png", "replay / PyTorch per op")
    with_series = [r for r in rows if r["status"] == FAIL
                   and all(r[tool] is not None and r[tool].get("samples_ms") for tool in ("replay", "pytorch"))]
    if with_series:
        lines += ["Per-call times of the GEMMs and attention that failed, each tool's run with the best median:", ""]
        lines += _plot_line(plot_failed_series(with_series, os.path.join(out_dir, "ops_failed_series.png")),
                            "ops_failed_series.png", "per-call times of the failed ops")
    lines += section_attention_backends(variants, brows)
    lines += section_determinism(replay, nondet, pytorch)
    lines += section_kernels(krows, replay["peaks"].get("copy_gbps"))
    lines += section_leftovers(leftover_names(replay, pytorch, rows, krows))
    lines += section_peaks(replay, pytorch)
    lines += section_environment([("replay", replay), ("pytorch", pytorch)])
    md = os.path.join(out_dir, "ops_summary.md")
    with open(md, "w") as f:
        f.write("\n".join(lines))
    return md, rows, krows


def report_graphs(json_path, out_dir):
    """Writes out_dir/graphs_summary.md and out_dir/graphs_sweep.png; returns (md path, crossings)."""
    doc = validate_graphs(load_json(json_path), json_path)
    crossings = {key: crossover(doc["sweep"], key) for key in ("graph_us", "small_graphs_us")}
    os.makedirs(out_dir, exist_ok=True)
    written = plot_graph_sweep(sorted(doc["sweep"], key=lambda p: p["host_delay_us"]), crossings,
                               os.path.join(out_dir, "graphs_sweep.png"))
    lines = ["# replay graph layer: launch costs and host-delay sweep", "",
             f"Input: `{os.path.basename(json_path)}`.", ""]
    lines += section_graph_chain(doc)
    lines += section_graph_sweep(doc["sweep"], crossings)
    lines += _plot_line(written, "graphs_sweep.png", "time against host delay")
    lines += section_environment([("replay-graphs-bench", doc)])
    md = os.path.join(out_dir, "graphs_summary.md")
    with open(md, "w") as f:
        f.write("\n".join(lines))
    return md, crossings


# ---------------------------------------------------------------------------------------------------------
# Workload runs: replay-<workload> against pytorch_baseline.py <workload>
# ---------------------------------------------------------------------------------------------------------

# Targets (replay against PyTorch, and replay against itself).
FULL_GRAPH_TARGET = 0.90       # replay full-graph step time / PyTorch's torch.cuda.graph step time, at most
# ... where a workload's issue sets its own: the DeepSeek-V3 shard (issue 30) at most 0.85x.
FULL_GRAPH_TARGETS = {"moe": 0.85}
EAGER_TARGET = 1.00            # replay eager step time / PyTorch eager step time, at most
GRAPH_MEMORY_TOLERANCE = 0.01  # replay peak memory with graphs within this fraction of eager
CAPTURE_LIMIT_MS = 2000.0      # replay capture + instantiate time of a graph mode, under

MODES = ("none", "layer", "full")
TOOLS = ("replay", "pytorch")
# File names: <tool>_<workload>_<preset>_<mode>.json, and _delay<N>us before .json for runs with
# --host-delay-us N (N > 0). The op benchmarks' replay_ops.json and pytorch_ops.json are not workload runs.
WORKLOAD_FILE = re.compile(r"^(replay|pytorch)_([a-z][a-z0-9]*)_([A-Za-z0-9.-]+)_(none|layer|full)"
                           r"(?:_delay([0-9]+)us)?\.json$")
NOT_WORKLOAD_FILES = ("replay_ops.json", "pytorch_ops.json")


def workload_file_key(name):
    """(tool, workload, preset, mode, host delay in µs) from a workload file name; None for files that are
    not workload runs (other names, the op benchmarks' JSON). A replay_*/pytorch_* JSON whose name does not
    follow the pattern is an error, so a misnamed run never drops silently."""
    if not name.endswith(".json") or not name.startswith(("replay_", "pytorch_")) or name in NOT_WORKLOAD_FILES:
        return None
    m = WORKLOAD_FILE.match(name)
    if not m:
        raise ReportError(f"{name}: a workload run's file must be named <tool>_<workload>_<preset>_<mode>.json "
                          "(tool replay or pytorch, mode none, layer or full), with _delay<N>us before .json "
                          "for a --host-delay-us run")
    tool, workload, preset, mode, delay = m.groups()
    return tool, workload, preset, mode, int(delay) if delay else 0


def _require(cond, path, message):
    if not cond:
        raise ReportError(f"{path}: {message}")


def validate_workload(doc, path):
    """Checks a workload-run JSON (reports/SCHEMA.md) and returns it."""
    workload = doc.get("workload")
    _require(isinstance(workload, str) and workload, path, "'workload' must be a non-empty string")
    _require(doc.get("tool") in ("pytorch", f"replay-{workload}"), path,
             f"'tool' is {doc.get('tool')!r}, expected 'replay-{workload}' or 'pytorch'")
    _require(isinstance(doc.get("preset"), str) and doc["preset"], path, "'preset' must be a non-empty string")
    _require(doc.get("graphs") in MODES, path,
             f"'graphs' is {doc.get('graphs')!r}, expected none, layer or full")
    for key in ("config", "step_ms", "throughput", "memory"):
        _check_object(doc, key, path)
    for key in ("environment", "host_enqueue_us", "graphs_info", "peaks"):
        _check_object(doc, key, path, required=False)
    _require(_number_or_null(doc["config"].get("host_delay_us")), path,
             "config.host_delay_us must be a number or null")
    step = doc["step_ms"]
    for key in ("median", "p10", "p90"):
        _require(_is_number(step.get(key)) and step[key] > 0, path, f"step_ms.{key} must be a positive number")
    for part, keys in (("throughput", ("tokens_per_s", "samples_per_s")), ("memory", ("peak_bytes",)),
                       ("host_enqueue_us", ("median", "p90")),
                       ("graphs_info", ("count", "nodes", "capture_ms", "instantiate_ms"))):
        for key in keys:
            _require(_number_or_null((doc.get(part) or {}).get(key)), path,
                     f"{part}.{key} must be a number or null")
    for key in ("model_tflops", "mfu", "flops_per_step"):
        _require(_number_or_null(doc.get(key)), path, f"'{key}' must be a number or null")
    losses = doc.get("losses")
    _require(isinstance(losses, list) and all(_number_or_null(v) for v in losses), path,
             "'losses' must be a list of numbers")
    _require(doc.get("loss_hash") is None or isinstance(doc["loss_hash"], str), path,
             "'loss_hash' must be a string or null")
    return doc


def load_workload_runs(directory):
    """Every workload run in `directory`: {(workload, preset): {(tool, mode, delay): (file name, doc)}}, in
    file-name order. The name and the content must agree."""
    try:
        names = sorted(os.listdir(directory))
    except OSError as e:
        raise ReportError(f"{directory}: cannot list: {e.strerror}") from None
    groups = {}
    for name in names:
        key = workload_file_key(name)
        if key is None:
            continue
        tool, workload, preset, mode, delay = key
        path = os.path.join(directory, name)
        doc = validate_workload(load_json(path), path)
        found = ("replay" if doc["tool"].startswith("replay-") else "pytorch", doc["workload"], doc["preset"],
                 doc["graphs"], doc["config"].get("host_delay_us") or 0)
        for what, named, inside in zip(("tool", "workload", "preset", "graphs", "config.host_delay_us"),
                                       key, found):
            _require(named == inside, path, f"the file name says {what} {named!r} but the run has {inside!r}")
        groups.setdefault((workload, preset), {})[(tool, mode, delay)] = (name, doc)
    if not groups:
        raise ReportError(f"{directory}: no workload run (replay_<workload>_<preset>_<mode>.json or "
                          "pytorch_<workload>_<preset>_<mode>.json)")
    return groups


# Config keys that must agree between the tools for their step times to be compared.
SHAPE_KEYS = ("layers", "hidden", "heads", "head_dim", "ffn", "seq", "micro_batch", "microbatches", "vocab",
              "vocab_shard", "tp",
              # replay-moe and scripts/pytorch_moe.py: the blocks (671b-ep32 keeps as many as fit), the
              # experts and their capacity layout
              "dense_layers", "moe_layers", "experts", "local_experts", "topk", "expert_ffn", "shared_ffn",
              "capacity_rows_per_expert")


def shape_disagreement(a, b):
    """Why two runs do not do the same work (a config key both carry and that differs), or None."""
    ca, cb = a["config"], b["config"]
    diffs = [f"{k} {ca[k]} vs {cb[k]}" for k in SHAPE_KEYS if k in ca and k in cb and ca[k] != cb[k]]
    return ", ".join(diffs) if diffs else None


def _median(doc):
    return doc["step_ms"]["median"] if doc else None


def _graph_setup_ms(doc):
    g = doc.get("graphs_info") or {}
    if g.get("capture_ms") is None or g.get("instantiate_ms") is None:
        return None
    return g["capture_ms"] + g["instantiate_ms"]


def _target(name, value, limit, status, note=None, spec=".3f"):
    return {"name": name, "value": value, "limit": limit, "status": status, "note": note, "spec": spec}


def _ratio_target(name, rep, pt, limit):
    """replay step time / PyTorch step time, at most `limit`."""
    if rep is None or pt is None:
        missing = [f"{tool} run" for tool, d in (("replay", rep), ("pytorch", pt)) if d is None]
        return _target(name, None, limit, MISSING, "no " + " and no ".join(missing))
    why = shape_disagreement(rep, pt)
    if why:
        return _target(name, None, limit, MISMATCH, f"not the same work: {why}")
    ratio = _median(rep) / _median(pt)
    return _target(name, ratio, limit, PASS if ratio <= limit else FAIL)


def workload_targets(runs, workload=None):
    """The issue's targets for one workload and preset, from its delay-0 runs {(tool, mode): doc}; the
    full-graph limit is the workload's own where FULL_GRAPH_TARGETS has one."""
    rep = {m: runs.get(("replay", m)) for m in MODES}
    pt = {m: runs.get(("pytorch", m)) for m in MODES}
    full_limit = FULL_GRAPH_TARGETS.get(workload, FULL_GRAPH_TARGET)
    out = [_ratio_target("full-graph step time / PyTorch graphed", rep["full"], pt["full"], full_limit),
           _ratio_target("eager step time / PyTorch eager", rep["none"], pt["none"], EAGER_TARGET)]
    for mode in ("layer", "full"):
        name = f"peak memory, {mode} graphs / eager"
        a, e = rep[mode], rep["none"]
        lacking = [m for m, d in (("none", e), (mode, a)) if d is None or not d["memory"].get("peak_bytes")]
        if lacking:
            out.append(_target(name, None, 1 + GRAPH_MEMORY_TOLERANCE, MISSING,
                               "no replay " + " or ".join(lacking) + " run with peak_bytes"))
            continue
        ratio = a["memory"]["peak_bytes"] / e["memory"]["peak_bytes"]
        ok = abs(ratio - 1) <= GRAPH_MEMORY_TOLERANCE + 1e-12
        out.append(_target(name, ratio, 1 + GRAPH_MEMORY_TOLERANCE, PASS if ok else FAIL))
    for mode in ("layer", "full"):
        name = f"capture + instantiate, {mode} graphs (ms)"
        d = rep[mode]
        ms = _graph_setup_ms(d) if d else None
        if ms is None:
            why = f"no replay {mode} run" if d is None else "capture_ms or instantiate_ms is null"
            out.append(_target(name, None, CAPTURE_LIMIT_MS, MISSING, why, ".1f"))
        else:
            status = PASS if ms < CAPTURE_LIMIT_MS else FAIL
            out.append(_target(name, ms, CAPTURE_LIMIT_MS, status, None, ".1f"))
    present = {m: d for m, d in rep.items() if d is not None}
    hashes = {m: d.get("loss_hash") for m, d in present.items()}
    name = "loss hash identical across replay's modes"
    if len(present) < 2 or any(h is None for h in hashes.values()):
        out.append(_target(name, None, None, MISSING, "fewer than two replay runs with a loss_hash"))
    else:
        same = len(set(hashes.values())) == 1
        notes = [] if same else [", ".join(f"{m} {h}" for m, h in hashes.items())]
        absent = [m for m in MODES if m not in present]
        if absent:
            notes.append(f"compared {', '.join(present)}; no {', '.join(absent)} run")
        out.append(_target(name, None, None, PASS if same else FAIL, "; ".join(notes) or None))
    return out


def workload_notes(runs):
    """Facts a reader needs before trusting a comparison: shape or FLOP-formula disagreements, differing
    step counts."""
    notes = []
    rep = [d for (tool, _), d in runs.items() if tool == "replay"]
    pt = [d for (tool, _), d in runs.items() if tool == "pytorch"]
    if rep and pt:
        a, b = rep[0], pt[0]
        why = shape_disagreement(a, b)
        if why:
            notes.append(f"replay and PyTorch ran different shapes ({why}): their times are not compared.")
        fa, fb = a.get("flops_per_step"), b.get("flops_per_step")
        if not why and fa and fb and abs(fa - fb) > 1e-9 * max(fa, fb):
            notes.append(f"flops_per_step differs (replay {fa:.6g}, PyTorch {fb:.6g}): the FLOP formulas "
                         "disagree, so TFLOP/s and MFU are not comparable across the tools; step times are.")
    steps = {(tool, m): d["step_ms"].get("count") for (tool, m), d in runs.items()}
    if len({v for v in steps.values() if v is not None}) > 1:
        counts = ", ".join(f"{t} {m} {v}" for (t, m), v in steps.items())
        notes.append(f"Timed step counts differ: {counts}.")
    return notes


def _gib(v):
    return fmt(v / 2**30, ".2f") if v is not None else "—"


def _run_row(tool, mode, doc, basis):
    label = f"{tool} {mode}"
    if doc is None:
        return [label] + [MISSING] + ["—"] * 10
    s, g, mem = doc["step_ms"], doc.get("graphs_info") or {}, doc["memory"]
    setup = "—"
    if g.get("capture_ms") is not None:
        setup = fmt(g["capture_ms"], ".1f") + (f" + {fmt(g['instantiate_ms'], '.1f')}"
                                               if g.get("instantiate_ms") is not None else " + —")
    graphs = f"{fmt(g.get('count'), '.0f')} / {fmt(g.get('nodes'), '.0f')}" if g else "—"
    ratio = "—"
    if basis is not None and tool == "replay":
        ratio = fmt(s["median"] / basis["step_ms"]["median"], ".3f")
    host = doc.get("host_enqueue_us") or {}
    return [label, fmt(s["median"], ".3f"), f"{fmt(s['p10'], '.3f')} / {fmt(s['p90'], '.3f')}", ratio,
            fmt(host.get("median"), ".0f"), fmt(doc["throughput"].get("tokens_per_s"), ".0f"),
            fmt(doc.get("model_tflops"), ".1f"), fmt(doc.get("mfu"), ".3f"), _gib(mem.get("peak_bytes")),
            graphs, setup, f"`{doc['loss_hash']}`" if doc.get("loss_hash") else "—"]


def section_workload(workload, preset, runs, delay_runs, plot_lines):
    """One workload and preset: the runs side by side, the targets, notes, plots, host-delay table."""
    header = ["run", "step ms (median)", "p10 / p90", "÷ PyTorch", "host enqueue µs", "tokens/s", "TFLOP/s",
              "MFU", "peak GiB", "graphs / nodes", "capture + instantiate ms", "loss hash"]
    rows = []
    for tool in TOOLS:
        for mode in MODES:
            doc = runs.get((tool, mode))
            if doc is None and tool == "pytorch" and mode == "layer":
                continue  # PyTorch's baseline has no per-layer mode
            basis = runs.get(("pytorch", "none" if mode == "none" else "full"))
            rows.append(_run_row(tool, mode, doc, basis))
    lines = [f"## {workload} {preset}", ""] + table(header, rows) + [""]
    lines.append("÷ PyTorch: replay's median step time over PyTorch's, eager against eager and each graph "
                 "mode against PyTorch's whole-step graph (below 1: replay is faster). Host enqueue: the "
                 "host's time to enqueue one step; it approaches the step time when the driver cannot take "
                 "more work ahead (README, \"Looking inside a step\").")
    lines.append("")
    targets = workload_targets(runs, workload)
    trows = [[t["name"], fmt(t["value"], t["spec"]), _limit_text(t), _result(t)] for t in targets]
    lines += ["### Targets", ""] + table(["target", "value", "limit", "result"], trows) + [""]
    notes = workload_notes(runs)
    if notes:
        lines += [f"- {n}" for n in notes] + [""]
    lines += plot_lines
    if delay_runs:
        lines += section_host_delay(delay_runs)
    return lines, targets


def _limit_text(t):
    if t["limit"] is None:
        return "equal"
    if t["name"].startswith("peak memory"):
        return f"within {GRAPH_MEMORY_TOLERANCE:.0%}"
    if t["name"].startswith("capture"):
        return f"< {t['limit']:.0f}"
    return f"<= {t['limit']:.2f}"


def _delay_tools(runs):
    """Tools with at least one run at a host delay above zero, and the modes each ran."""
    tools = [t for t in TOOLS if any(k[0] == t and k[2] > 0 for k in runs)]
    return {t: [m for m in MODES if any(k[0] == t and k[1] == m for k in runs)] for t in tools}


def host_delay_points(runs):
    """Speedup of each graph mode over eager, per tool that has host-delay runs, at each delay where both
    were run: {(tool, mode): [(delay_us, eager ms / mode ms)]}, delays ascending."""
    tools = _delay_tools(runs)
    points = {}
    for (tool, mode, delay), doc in sorted(runs.items(), key=lambda kv: kv[0][2]):
        eager = runs.get((tool, "none", delay))
        if tool in tools and mode != "none" and eager is not None:
            points.setdefault((tool, mode), []).append((delay, _median(eager) / _median(doc)))
    return points


def section_host_delay(runs):
    """Step times and graph speedups against simulated host delay (runs {(tool, mode, delay): doc})."""
    delays = sorted({d for _, _, d in runs})
    tools = _delay_tools(runs)
    header, rows = ["host delay µs"], []
    for tool, modes in tools.items():
        header += [f"{tool} {m} ms" for m in modes]
        header += [f"{tool} none / {m}" for m in modes if m != "none"]
    for d in delays:
        row = [fmt(d, "g")]
        for tool, modes in tools.items():
            docs = {m: runs.get((tool, m, d)) for m in modes}
            row += [fmt(_median(docs[m]), ".3f") if docs[m] else MISSING for m in modes]
            row += [fmt(_median(docs["none"]) / _median(docs[m]), ".2f")
                    if docs.get("none") and docs[m] else "—" for m in modes if m != "none"]
        rows.append(row)
    return (["### Graphs against simulated host delay", "",
             "`--host-delay-us N` adds N µs of host work to each eager kernel launch; none / mode above 1 "
             "means the graph mode beats eager at that delay.", ""] + table(header, rows) + [""])


def plot_step_times(runs, title, path):
    """Median step time per mode, replay and PyTorch side by side, p10-p90 as error bars."""
    plt = _pyplot()
    if plt is None:
        return False
    fig, ax = plt.subplots(figsize=(7, 4.5))
    width, top = 0.38, 0.0
    for i, (tool, colour) in enumerate((("replay", "tab:blue"), ("pytorch", "tab:orange"))):
        labelled = False
        for x, mode in enumerate(MODES):
            doc = runs.get((tool, mode))
            xpos = x + (i - 0.5) * width
            if doc is None:
                text = "n/a" if (tool, mode) == ("pytorch", "layer") else "missing"
                ax.text(xpos, 0, text, ha="center", va="bottom", rotation=90, fontsize=8, color="gray")
                continue
            s = doc["step_ms"]
            ax.bar(xpos, s["median"], width, color=colour, label=None if labelled else tool,
                   yerr=[[s["median"] - s["p10"]], [s["p90"] - s["median"]]], capsize=3)
            labelled = True
            top = max(top, s["p90"])
    ax.set_ylim(0, top * 1.2 if top else 1)  # room for the legend above the bars
    if ax.get_legend_handles_labels()[1]:
        ax.legend(loc="upper center", ncol=2)
    ax.set_xticks(range(len(MODES)))
    ax.set_xticklabels(["eager (none)", "per-layer graphs", "full-step graph"])
    ax.set_ylabel("step time, ms (median; bars p10-p90)")
    ax.set_title(title)
    ax.grid(axis="y", alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return True


def plot_host_delay(points, title, path):
    """Speedup of graphs over eager against simulated host delay, one line per tool and graph mode."""
    plt = _pyplot()
    if plt is None:
        return False
    fig, ax = plt.subplots(figsize=(7, 4.5))
    styles = {"layer": "--", "full": "-"}
    colours = {"replay": "tab:blue", "pytorch": "tab:orange"}
    for (tool, mode), pts in sorted(points.items()):
        ax.plot(*zip(*pts), marker="o", linestyle=styles.get(mode, "-"), color=colours.get(tool),
                label=f"{tool} {mode} graphs")
    ax.axhline(1.0, color="black", linestyle=":", linewidth=0.8)
    ax.set_xlabel("simulated host delay per eager kernel launch (µs)")
    ax.set_ylabel("eager step time / graph step time")
    ax.set_title(title)
    ax.grid(alpha=0.3)
    if points:
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return True


def report_workloads(directory, out_dir):
    """Writes out_dir/workloads_summary.md and, per workload and preset, <workload>_<preset>_step_time.png
    and (with host-delay runs) <workload>_<preset>_host_delay.png. Returns (md path, {(workload, preset):
    targets})."""
    groups = load_workload_runs(directory)
    os.makedirs(out_dir, exist_ok=True)
    body, verdicts, files = [], {}, []
    for (workload, preset), found in groups.items():
        files += [name for name, _ in found.values()]
        runs = {(tool, mode): doc for (tool, mode, delay), (_, doc) in found.items() if delay == 0}
        delayed = {k: doc for k, (_, doc) in found.items()}
        has_delay = any(k[2] > 0 for k in found)
        stem = f"{workload}_{preset}"
        plots = _plot_line(plot_step_times(runs, f"{workload} {preset}: step time",
                                           os.path.join(out_dir, f"{stem}_step_time.png")),
                           f"{stem}_step_time.png", "step time per mode")
        if has_delay:
            plots += _plot_line(plot_host_delay(host_delay_points(delayed),
                                                f"{workload} {preset}: graphs against host delay",
                                                os.path.join(out_dir, f"{stem}_host_delay.png")),
                                f"{stem}_host_delay.png", "speedup against host delay")
        lines, targets = section_workload(workload, preset, runs, delayed if has_delay else None, plots)
        body += lines
        verdicts[(workload, preset)] = targets
    judged = [t for ts in verdicts.values() for t in ts]
    met = sum(t["status"] == PASS for t in judged)
    failed = [f"{w} {p}: {t['name']}" for (w, p), ts in verdicts.items() for t in ts if t["status"] == FAIL]
    unjudged = len(judged) - met - len(failed)
    head = ["# Workload runs: replay against PyTorch", "",
            f"Inputs: {len(files)} runs in `{directory}`: " + ", ".join(f"`{n}`" for n in files) + ".", "",
            "## Verdict", "",
            f"{met} of {len(judged)} targets met ({len(failed)} failed, {unjudged} not judged)."]
    if failed:
        head.append("Failed: " + "; ".join(failed) + ".")
    own = "".join(f" ({w}: {v:.2f}x)" for w, v in FULL_GRAPH_TARGETS.items() if any(k[0] == w for k in groups))
    head += [f"Targets: replay's full-step graph at most {FULL_GRAPH_TARGET:.2f}x PyTorch's graphed step "
             f"time{own}; replay eager at most {EAGER_TARGET:.2f}x PyTorch eager; replay's peak memory with graphs "
             f"within {GRAPH_MEMORY_TOLERANCE:.0%} of eager; capture + instantiate under "
             f"{CAPTURE_LIMIT_MS / 1000:g} s per graph mode; identical loss hashes across replay's modes.", ""]
    docs = {}
    for found in groups.values():
        for (tool, _, _), (_, doc) in found.items():
            docs.setdefault(tool, doc)
    lines = head + body + section_environment([(tool, docs[tool]) for tool in TOOLS if tool in docs])
    md = os.path.join(out_dir, "workloads_summary.md")
    with open(md, "w") as f:
        f.write("\n".join(lines))
    return md, verdicts


def _time_to_train_row(mode, doc):
    """One mode's line of the time-to-train table."""
    evals = (doc.get("evaluation") or {}).get("results") or []
    eval_s = sum(e.get("seconds") or 0 for e in evals)
    ttt = doc.get("time_to_train_s")
    return [mode, fmt(doc.get("steps_to_target"), "d") if doc.get("steps_to_target") is not None else "not reached",
            fmt(ttt, ".1f") if ttt is not None else "-", fmt(doc["step_ms"]["median"], ".3f"),
            fmt((doc.get("host_enqueue_us") or {}).get("median"), ".0f"), str(len(evals)),
            fmt(eval_s, ".2f"), f"{eval_s / ttt:.1%}" if ttt else "-"]


def report_time_to_train(directory, out_dir):
    """Writes out_dir/time_to_train_summary.md from the replay_<workload>_<preset>_<mode>.json runs of
    `directory` that ran to a target quality (--target-quality or --target-above-floor): per mode the
    steps and MLPerf's time to train, the median step, the evaluations' share of the time, and each
    graph mode's time to train against eager's. Returns the path."""
    groups = load_workload_runs(directory)
    os.makedirs(out_dir, exist_ok=True)
    lines = ["# Time to train", ""]
    for (workload, preset), found in groups.items():
        runs = {mode: doc for (tool, mode, delay), (_, doc) in found.items() if tool == "replay" and delay == 0}
        for mode, doc in runs.items():
            _require(doc.get("target_quality") is not None, f"{directory}/replay_{workload}_{preset}_{mode}.json",
                     "not a time-to-train run (no target_quality)")
        any_doc = next(iter(runs.values()))
        floor = any_doc.get("loss_floor")
        target = any_doc["target_quality"]
        lines += [f"## {workload} {preset}", "",
                  f"Target: held-out loss {target:.4f}" + (f" (the data's floor {floor:.4f} + {target - floor:.3f})"
                                                             if floor is not None else "") +
                  "; MLPerf's measure, run_start to run_stop, evaluations included.", "",
                  *table(["mode", "steps to target", "time to train (s)", "median step (ms)",
                          "host enqueue (µs)", "evaluations", "evaluation (s)", "evaluation share"],
                         [_time_to_train_row(m, runs[m]) for m in MODES if m in runs]), ""]
        base = runs.get("none")
        hashes = {m: d.get("loss_hash") for m, d in runs.items()}
        if base and base.get("time_to_train_s"):
            for m in ("layer", "full"):
                if m in runs and runs[m].get("time_to_train_s"):
                    lines.append(f"- {m}: time to train {runs[m]['time_to_train_s'] / base['time_to_train_s']:.3f}x "
                                 f"eager's")
        lines.append("- loss hashes " + ("identical in every mode" if len(set(hashes.values())) == 1
                                         else "DIFFER: " + ", ".join(f"{m} {h}" for m, h in hashes.items())))
        lines.append("")
    md = os.path.join(out_dir, "time_to_train_summary.md")
    with open(md, "w") as f:
        f.write("\n".join(lines))
    return md


def _runs_row(name, doc):
    step = (doc.get("step_ms") or {}).get("median")
    thr = doc.get("throughput") or {}
    unit, value = next(((k, v) for k, v in thr.items() if k != "samples_per_s"), (None, None))
    par = doc.get("parallel") or {}
    layout = f"tp{par.get('tensor_parallel', 1)} x dp{par.get('data_parallel', 1)}" if par else "-"
    peak = (doc.get("memory") or {}).get("peak_bytes")
    mfu = doc.get("mfu")
    return [name, doc.get("preset", "-"), doc.get("graphs", "-"), layout,
            f"{step:.3f}" if step is not None else "-",
            f"{value:,.0f} {unit.replace('_per_s', '/s')}" if value is not None else "-",
            f"{100 * mfu:.1f}%" if isinstance(mfu, (int, float)) else "-",
            f"{peak / 2**30:.2f}" if peak else "-", doc.get("loss_hash", "-")]


# RNN-T's greedy decoders (issue 29): the WHILE node at least 2.5x the eager host loop and faster than
# NVIDIA's unrolled graph, on the same evaluation batches.
RNNT_EVAL_KEYS = ("decoder", "last_eval", "while_unroll", "decode_handle")
RNNT_WHILE_OVER_HOST_TARGET = 2.5


def rnnt_decoding_lines(docs):
    """RNN-T runs with a timed evaluation (config.last_eval.decode_ms): per run its decoder, graph mode,
    decoding time and utterances/s (the last evaluation's, timed on the device apart from the encoder),
    the tokens hash; then the WHILE node against the host loop and the unrolled graph per preset, among
    runs whose tokens hashes agree (the same weights decoded the same tokens). [] without such runs."""
    runs = []
    for name, doc in docs:
        ev = (doc.get("config") or {}).get("last_eval") or {}
        if doc.get("workload") == "rnnt" and _is_number(ev.get("decode_ms")) and ev["decode_ms"] > 0:
            runs.append((name, doc, ev))
    if not runs:
        return []
    rows = [[name, doc.get("preset", "-"), ev.get("decoder", "-"), doc.get("graphs", "-"),
             fmt(ev["decode_ms"], ".2f"), fmt(ev.get("decode_utterances_per_s"), ".0f"),
             fmt(ev.get("encode_ms"), ".2f"), fmt(ev.get("utterances"), ".0f"),
             fmt(ev.get("hypothesis_labels"), ".0f"), f"`{ev.get('tokens_hash', '-')}`"]
            for name, doc, ev in runs]
    lines = ["## RNN-T greedy decoding", "",
             *table(["run", "preset", "decoder", "graphs", "decode ms", "decode utt/s", "encoder ms",
                     "utterances", "labels emitted", "tokens hash"], rows), "",
             "Decode ms: the last evaluation's greedy decoding (decode_init to the hypotheses stored, summed "
             "over its batches), timed on the device (%globaltimer marks in the stream, inside the graphs "
             "too); the encoder is timed apart. The host loop's synchronisations count; so does any capture "
             "made during that evaluation (the unrolled graph's first, the WHILE node's one-shot graph per "
             "batch with --graphs none).", ""]
    targets = []
    for preset in sorted({doc.get("preset") for _, doc, _ in runs}):
        best = {}
        for name, doc, ev in runs:
            if doc.get("preset") != preset:
                continue
            dec = ev.get("decoder")
            if dec not in best or ev["decode_ms"] < best[dec][2]["decode_ms"]:
                best[dec] = (name, doc, ev)
        whiles = sorted(((n, d, e) for n, d, e in runs if d.get("preset") == preset and e.get("decoder") == "while"),
                        key=lambda r: r[2]["decode_ms"])
        for other, limit, what in (("host", RNNT_WHILE_OVER_HOST_TARGET, "host loop"),
                                   ("unrolled", 1.0, "unrolled graph")):
            o = best.get(other)
            # The fastest WHILE run that decoded the same tokens (the same weights), else the fastest.
            same_tokens = [r for r in whiles if o is not None and r[2].get("tokens_hash") == o[2].get("tokens_hash")]
            w = (same_tokens or whiles or [None])[0]
            label = f"{preset}: WHILE node / {what} throughput"
            if w is None or o is None:
                missing = "no WHILE run" if w is None else f"no {other} run"
                targets.append([label, "—", f">= {limit:g}" if limit > 1 else "> 1", f"{MISSING} ({missing})"])
                continue
            speedup = o[2]["decode_ms"] / w[2]["decode_ms"]
            same = w[2].get("tokens_hash") == o[2].get("tokens_hash")
            ok = speedup >= limit if limit > 1 else speedup > limit
            verdict = (PASS if ok else FAIL) if same else f"{MISMATCH} (tokens differ)"
            targets.append([f"{label} ({w[0]} vs {o[0]})", fmt(speedup, ".2f"),
                            f">= {limit:g}" if limit > 1 else "> 1", verdict])
    lines += ["### RNN-T decoding targets", "",
              *table(["target", "value", "limit", "result"], targets), ""]
    return lines


def _host_us(doc):
    """The median host enqueue time of a run, in µs (a number, or reports/SCHEMA.md's {median, p90})."""
    h = doc.get("host_enqueue_us")
    return h.get("median") if isinstance(h, dict) else h


def unet_sweep_lines(docs):
    """The UNet's batch sweep (issue 28): replay-unet's eager and whole-step-graph runs of one model at
    several batches (config.batch), the GPU step time beside the host's enqueue time, and where the
    whole-step graph starts to pay. Nothing when fewer than two batches ran both modes."""
    groups = {}
    for name, doc in docs:
        cfg = doc.get("config") or {}
        if doc.get("tool") != "replay-unet" or doc.get("graphs") not in ("none", "full") or "batch" not in cfg:
            continue
        model = tuple((k, json.dumps(v)) for k, v in sorted(cfg.items())
                      if k not in ("batch", "steps", "warmup", "seed", "overflow_at"))
        groups.setdefault(model, {}).setdefault((cfg["batch"], doc["graphs"]), (name, doc))
    lines = []
    for runs in groups.values():
        batches = sorted(b for b in {b for b, _ in runs} if (b, "none") in runs and (b, "full") in runs)
        if len(batches) < 2:
            continue
        rows, gains = [], []
        for b in batches:
            none, full = runs[(b, "none")][1], runs[(b, "full")][1]
            sn, sf = none["step_ms"]["median"], full["step_ms"]["median"]
            hn, hf = _host_us(none), _host_us(full)
            gains.append((b, sn / sf))
            peaks = [(d.get("memory") or {}).get("peak_bytes") for d in (none, full)]
            rows.append([str(b), f"{sn:.3f}", fmt(hn / 1e3 if hn is not None else None, ".3f"), f"{sf:.3f}",
                         fmt(hf / 1e3 if hf is not None else None, ".3f"), f"{sn / sf:.3f}x",
                         f"{b / sf * 1e3:.1f}",
                         " / ".join(f"{p / 2**30:.2f}" if p else "-" for p in peaks)])
        preset = runs[(batches[0], "none")][1].get("preset", "")
        lines += ["", f"## UNet batch sweep ({preset} model, `--batch N`): eager against the whole-step graph", "",
                  *table(["images", "eager step (ms)", "eager host enqueue (ms)", "full step (ms)",
                          "full host enqueue (ms)", "full speed-up", "full images/s", "peak GiB none / full"],
                         rows), ""]
        paying = [str(b) for b, g in gains if g > 1.01]
        slower = [str(b) for b, g in gains if g < 0.99]
        lines.append("- The whole-step graph gains more than 1% at "
                     + (", ".join(paying) + " images" if paying else "no batch of the sweep")
                     + "; " + ("it is slower than eager beyond 1% at " + ", ".join(slower) + " images."
                               if slower else "it is never slower than eager beyond 1%."))
        lines.append("- Host enqueue is the host's wall time to enqueue a step (median). Where it is about the "
                     "step time the host waited for room in the launch queue: the GPU, not the host, set the "
                     "pace. Where it is well below, it is the host's own cost of a step.")
        lines.append("")
    return lines


def report_runs(directory, out_dir, title):
    """Writes out_dir/runs_summary.md: one row per JSON run in `directory` (any tool writing
    reports/SCHEMA.md's fields: replay's workloads, the PyTorch baselines), sorted by name, and per
    workload and preset whether replay's loss hashes agree across its graph modes. Returns the path."""
    docs = []
    for name in sorted(os.listdir(directory)):
        if not name.endswith(".json"):
            continue
        try:
            doc = load_json(os.path.join(directory, name))
        except (OSError, ValueError):
            continue
        if isinstance(doc, dict) and "step_ms" in doc:
            docs.append((name[:-5], doc))
    _require(docs, directory, "no run JSON (with step_ms) in it")
    lines = [f"# {title}", "",
             *table(["run", "preset", "graphs", "layout", "median step (ms)", "throughput", "MFU",
                     "peak memory (GiB)", "loss hash"], [_runs_row(n, d) for n, d in docs]), ""]
    groups = {}
    for name, doc in docs:
        if str(doc.get("tool", "")).startswith("replay"):
            par = doc.get("parallel") or {}
            # Runs of one configuration: what the graph mode or scope changes is left out, and so is
            # what only evaluation reads (RNN-T's decoder and its last evaluation's results).
            config = {k: v for k, v in (doc.get("config") or {}).items()
                      if "graph" not in k and k not in RNNT_EVAL_KEYS}
            key = (doc.get("workload"), doc.get("preset"), par.get("tensor_parallel", 1), par.get("data_parallel", 1),
                   json.dumps(config, sort_keys=True))
            groups.setdefault(key, {})[f"{name} ({doc.get('graphs')})"] = doc.get("loss_hash")
    for (workload, preset, tp, dp, _), hashes in groups.items():
        if len(hashes) > 1:
            same = len(set(hashes.values())) == 1
            lines.append(f"- {workload} {preset} tp{tp} x dp{dp}: loss hashes "
                         + ("identical in " + ", ".join(hashes) if same
                            else "DIFFER: " + ", ".join(f"{n} {h}" for n, h in hashes.items())))
    lines += rnnt_decoding_lines(docs)
    lines += unet_sweep_lines(docs)
    os.makedirs(out_dir, exist_ok=True)
    md = os.path.join(out_dir, "runs_summary.md")
    with open(md, "w") as f:
        f.write("\n".join(lines) + "\n")
    return md


# ---------------------------------------------------------------------------------------------------------
# Collective bandwidth (replay-comm-probe)
# ---------------------------------------------------------------------------------------------------------

# PyTorch's NCCL all-reduce, bf16, on 2 H100 80GB linked by NV18 (issue 27's anchor): message bytes ->
# bus bandwidth in GB/s.
COMM_ANCHOR = {8 << 20: 169.0, 64 << 20: 267.0, 256 << 20: 300.0, 1 << 30: 334.0}
COMM_ANCHOR_SOURCE = "PyTorch 2.11 NCCL all-reduce, bf16, 2 x H100 80GB over NV18, 20 timed calls"
COMM_RESULT_KEYS = ("collective", "dtype", "mode", "size", "bytes", "time_us", "algbw_gbps", "busbw_gbps")


def _fmt_bytes(n):
    for unit, scale in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= scale and n % scale == 0:
            return f"{n // scale} {unit}"
    return f"{n} B"


def validate_comm(doc, path):
    """Checks a replay-comm-probe JSON and returns its results."""
    _require(doc.get("tool") == "replay-comm-probe", path, f"tool is {doc.get('tool')!r}, expected replay-comm-probe")
    world = doc.get("world")
    _require(isinstance(world, dict) and isinstance(world.get("size"), int) and world["size"] >= 2, path,
             "world.size is missing or below 2")
    results = doc.get("results")
    _require(isinstance(results, list) and results, path, "no results")
    for i, r in enumerate(results):
        _require(isinstance(r, dict), path, f"results[{i}] is not an object")
        for key in COMM_RESULT_KEYS:
            _require(key in r, path, f"results[{i}] has no {key}")
        for key in ("size", "bytes", "time_us", "algbw_gbps", "busbw_gbps"):
            _require(_is_number(r[key]) and r[key] >= 0, path, f"results[{i}].{key} is {r[key]!r}")
        _require(r.get("wrong_elements") is None or (isinstance(r["wrong_elements"], int) and r["wrong_elements"] >= 0),
                 path, f"results[{i}].wrong_elements is {r.get('wrong_elements')!r}")
    return results


def comm_lines(doc, path):
    """The probe's tables: per collective and type, each size's time and bus bandwidth in each mode; then
    the all-reduce against the anchor (two ranks only: the anchor is a two-GPU measurement)."""
    results = validate_comm(doc, path)
    env, world, proto = doc.get("environment") or {}, doc["world"], doc.get("protocol") or {}
    modes = [m for m in ("eager", "graph") if any(r["mode"] == m for r in results)]
    wrong = sum(r.get("wrong_elements") or 0 for r in results)
    checked = all(r.get("wrong_elements") is not None for r in results)
    lines = ["# NCCL bus bandwidth (replay-comm-probe)", "",
             f"{world['size']} ranks on {env.get('gpu', 'an unrecorded GPU')}, NCCL {env.get('nccl', '?')}; "
             f"{'in place' if proto.get('in_place') else 'out of place'}, {proto.get('iters', '?')} calls a timed "
             f"series after {proto.get('warmup', '?')} warm-up calls; the slowest rank's time a call. busbw = "
             "algbw x 2(n-1)/n (all-reduce), x (n-1)/n (reduce-scatter, all-gather). Results: "
             + ((f"{PASS}, every element exact" if wrong == 0 else f"{FAIL}, {wrong} element(s) wrong")
                if checked else "not checked (--no-check)") + ".", ""]
    groups = {}
    for r in results:
        groups.setdefault((r["collective"], r["dtype"]), {}).setdefault(r["size"], {})[r["mode"]] = r
    for (collective, dtype), sizes in groups.items():
        lines += [f"## {collective}, {dtype}", ""]
        header = ["size"] + [h for m in modes for h in (f"{m} (us)", f"{m} busbw (GB/s)")]
        rows = []
        for size in sorted(sizes):
            row = [_fmt_bytes(size)]
            for m in modes:
                r = sizes[size].get(m)
                row += [f"{r['time_us']:.2f}", f"{r['busbw_gbps']:.1f}"] if r else [MISSING, MISSING]
            rows.append(row)
        lines += table(header, rows) + [""]
    ar = groups.get(("all_reduce", "bf16"), {})
    anchor_rows = []
    for size, want in COMM_ANCHOR.items():
        r = (ar.get(size) or {}).get("eager")
        if r is not None and world["size"] == 2:
            anchor_rows.append([_fmt_bytes(size), f"{r['busbw_gbps']:.1f}", f"{want:.0f}", f"{r['busbw_gbps'] / want:.2f}"])
    if anchor_rows:
        lines += ["## All-reduce against the anchor", "", f"Anchor: {COMM_ANCHOR_SOURCE}.", "",
                  *table(["size", "busbw, eager (GB/s)", "anchor (GB/s)", "ratio"], anchor_rows), ""]
    return lines


def report_comm(json_path, out_dir):
    """Writes out_dir/comm_summary.md from a replay-comm-probe JSON; returns its path."""
    lines = comm_lines(load_json(json_path), json_path)
    os.makedirs(out_dir, exist_ok=True)
    md = os.path.join(out_dir, "comm_summary.md")
    with open(md, "w") as f:
        f.write("\n".join(lines) + "\n")
    return md


# ---------------------------------------------------------------------------------------------------------
# Many GPUs (bench.sh's multi_gpu section): the issue's targets
# ---------------------------------------------------------------------------------------------------------

MULTI_GPU_SHARD_TARGET = 1.12   # a tensor-parallel step / the same shard on one GPU, collectives not run
MULTI_GPU_PYTORCH_TARGET = 0.85  # replay's full-graph TP step / PyTorch's graphed TP step
MULTI_GPU_NAME = re.compile(r"^(replay|pytorch)_(gpt3_175b(?:-tp4)?|llama31_405b)_(tp\d+sp|tp\d+shard_1gpu|tp\d+|"
                            r"dp\d+_onebucket|dp\d+|1gpu)_(none|layer|full)$")


def _layout_kind(lay):
    """A layout name without its model prefix ('llama31-tp4sp' -> 'tp4sp')."""
    return lay.split("-", 1)[1] if lay.startswith("llama31-") else lay


def load_multi_gpu_runs(directory):
    """{(tool, layout, mode): doc} from bench.sh's multi_gpu file names; GPT-3's layouts bare
    ('tp4sp'), Llama's prefixed ('llama31-tp4sp')."""
    runs = {}
    for name in sorted(os.listdir(directory)):
        m = MULTI_GPU_NAME.match(name[:-5]) if name.endswith(".json") else None
        if m:
            lay = m.group(3) if m.group(2).startswith("gpt3") else f"llama31-{m.group(3)}"
            runs[(m.group(1), lay, m.group(4))] = load_json(os.path.join(directory, name))
    _require(runs, directory, "no multi-GPU run JSON (replay_gpt3_175b_tp2_full.json, ...) in it")
    return runs


COLLECTIVE_BANDWIDTH_TARGET = 0.80  # the step's collective's bus bandwidth / the probe's at its size
COLLECTIVE_MIN_BYTES = 1 << 20      # smaller collectives are latency-bound: not judged on bandwidth


def _probe_busbw(probe, collective, dtype, nbytes):
    """The probe's eager bus bandwidth for this collective, dtype and size, or None."""
    dtype = {"f32": "fp32", "f16": "fp16"}.get(dtype, dtype)
    for r in (probe or {}).get("results", []):
        if (r.get("collective"), r.get("dtype"), r.get("mode"), r.get("bytes")) == (collective, dtype, "eager", nbytes):
            return r.get("busbw_gbps")
    return None


def collective_bandwidth_targets(runs, probe):
    """Each full-mode replay run's bandwidth-bound collectives (their warm-up timing, JSON
    parallel.collectives) against replay-comm-probe's eager bus bandwidth at the same collective,
    dtype and size."""
    out = []
    for (tool, lay, mode), d in sorted(runs.items()):
        if tool != "replay" or mode != "full":
            continue
        for c in (d.get("parallel") or {}).get("collectives") or []:
            if c.get("bytes", 0) < COLLECTIVE_MIN_BYTES:
                continue
            name = (f"{lay}: {c['comm']} {c['collective']} {c['dtype']} {_fmt_bytes(c['bytes'])}, "
                    "bus bandwidth / the probe's")
            ref = _probe_busbw(probe, c["collective"], c["dtype"], c["bytes"])
            if probe is None or not ref:
                why = "no probe JSON (multi_gpu/comm/probe_step_sizes.json)" if probe is None else \
                    "the probe did not run this collective, dtype and size"
                out.append(_target(name, None, COLLECTIVE_BANDWIDTH_TARGET, MISSING, why))
                continue
            r = c["busbw_gbps"] / ref
            note = f"{c['busbw_gbps']:.1f} against {ref:.1f} GB/s, {c['median_us']:.1f} us median in the warm-up"
            if c.get("overlapped"):
                # Beside the backward on a side stream its time is shared with the GEMMs: not the
                # collective's own bandwidth, so not judged; what overlap buys shows in the step time.
                out.append(_target(name, r, COLLECTIVE_BANDWIDTH_TARGET, INFO,
                                   note + "; overlapped with the backward on a side stream (sharing the SMs and "
                                   "memory with it): not judged, see the overlapped buckets' step against one bucket"))
                continue
            out.append(_target(name, r, COLLECTIVE_BANDWIDTH_TARGET,
                               PASS if r >= COLLECTIVE_BANDWIDTH_TARGET else FAIL, note))
    if not out:
        out.append(_target("collectives' bus bandwidth / the probe's at the same size", None,
                           COLLECTIVE_BANDWIDTH_TARGET, MISSING,
                           "no full-mode run reports its collectives' times (parallel.collectives)"))
    return out


def multi_gpu_targets(runs, probe=None):
    """The issue's targets: each tensor-parallel layout against the one-GPU shard, the full graph
    against PyTorch's graphed TP step, graph modes against eager, loss hashes across modes, and the
    step's collectives' bus bandwidth against the probe's (`probe`: replay-comm-probe's JSON at the
    step's sizes)."""
    rep = {(lay, mode): d for (tool, lay, mode), d in runs.items() if tool == "replay"}
    pt = {(lay, mode): d for (tool, lay, mode), d in runs.items() if tool == "pytorch"}
    layouts = sorted({lay for lay, _ in rep})
    tp_layouts = [lay for lay in layouts if _layout_kind(lay).startswith("tp") and "shard" not in lay]
    out = []

    def ratio(name, a, b, limit, what_b):
        if a is None or b is None:
            return _target(name, None, limit, MISSING, f"no {'replay' if a is None else what_b} run")
        r = _median(a) / _median(b)
        return _target(name, r, limit, PASS if r <= limit else FAIL)

    for lay in tp_layouts:
        shard = lay.replace("sp", "") + "shard_1gpu"
        out.append(ratio(f"{lay} full step / the shard on one GPU", rep.get((lay, "full")),
                         rep.get((shard, "full")), MULTI_GPU_SHARD_TARGET, "one-GPU shard"))
    for lay in (lay for lay in tp_layouts if not lay.startswith("llama31-")):  # PyTorch's TP models GPT-3
        base = lay.replace("sp", "")
        out.append(ratio(f"{lay} full step / PyTorch {base} graphed", rep.get((lay, "full")),
                         pt.get((base, "full")), MULTI_GPU_PYTORCH_TARGET, "PyTorch graphed"))
    for lay in layouts:  # overlapping the buckets with the backward must pay
        one = rep.get((lay + "_onebucket", "full"))
        if lay.startswith("dp") and "onebucket" not in lay and one is not None and rep.get((lay, "full")):
            out.append(ratio(f"{lay} full step, buckets overlapped / one bucket after the backward",
                             rep.get((lay, "full")), one, 1.0, "one-bucket"))
    for lay in layouts:
        for mode in ("layer", "full"):
            a, e = rep.get((lay, mode)), rep.get((lay, "none"))
            if a is None or e is None:
                continue
            r = _median(a) / _median(e)
            # Within 1%: the run-to-run spread of a 10-30 step median.
            out.append(_target(f"{lay} {mode} step / eager", r, 1.01, PASS if r <= 1.01 else FAIL))
    for lay in layouts:
        hashes = {m: d.get("loss_hash") for (l2, m), d in rep.items() if l2 == lay}
        if len(hashes) > 1:
            same = len(set(hashes.values())) == 1
            out.append(_target(f"{lay}: loss hash identical across modes", None, None, PASS if same else FAIL,
                               None if same else ", ".join(f"{m} {h}" for m, h in hashes.items())))
    return out + collective_bandwidth_targets(runs, probe)


def report_multi_gpu(directory, out_dir):
    """Writes out_dir/multi_gpu_summary.md: the issue's targets with verdicts, then what data
    parallelism's buckets and sharded optimizer change. Returns the path."""
    runs = load_multi_gpu_runs(directory)
    probe_path = os.path.join(directory, "comm", "probe_step_sizes.json")
    probe = load_json(probe_path) if os.path.exists(probe_path) else None
    targets = multi_gpu_targets(runs, probe)
    rows = []
    for t in targets:
        value = "-" if t["value"] is None else format(t["value"], t["spec"])
        limit = ("equal" if t["limit"] is None else
                 f">= {t['limit']:.2f}" if "bandwidth" in t["name"] else f"<= {t['limit']:.2f}")
        rows.append([t["name"], value, limit, t["status"], t["note"] or ""])
    lines = ["# Many GPUs: the targets", "", *table(["target", "value", "limit", "verdict", "note"], rows), ""]
    if any("bus bandwidth" in t["name"] for t in targets):
        lines += ["A step's collective is timed on one rank, from an event before it to one after, in the "
                  "warm-up: its time includes waiting for the other ranks to arrive, which the probe's "
                  "back-to-back calls do not; a collective on a side stream (overlapped) shares the GPU with "
                  "the step's other work and is not judged.", ""]
    rep = {(lay, mode): d for (tool, lay, mode), d in runs.items() if tool == "replay"}
    facts = []
    one, dp = rep.get(("1gpu", "full")), {lay: d for (lay, mode), d in rep.items() if lay.startswith("dp") and mode == "full"}
    for lay, d in sorted(dp.items()):
        par = d.get("parallel") or {}
        line = f"- {lay} full: {_median(d):.2f} ms, {par.get('grad_buckets', '?')} gradient bucket(s)"
        if one is not None:
            line += f", {_median(d) / _median(one):.3f}x the shard on one GPU ({_median(one):.2f} ms)"
            pa, pb = (d.get("memory") or {}).get("peak_bytes"), (one.get("memory") or {}).get("peak_bytes")
            if pa and pb:
                line += f"; peak memory {pa / 2**30:.2f} GiB against {pb / 2**30:.2f} GiB"
        facts.append(line + ".")
    hashes = {lay: d.get("loss_hash") for lay, d in dp.items()}
    if len(hashes) > 1:
        facts.append("- Loss hashes " + ("identical" if len(set(hashes.values())) == 1 else "differ") + " across "
                     + ", ".join(f"{lay} ({h})" for lay, h in sorted(hashes.items())) + ".")
    if facts:
        lines += ["Data parallelism (the distributed optimizer):", "", *facts, ""]
    os.makedirs(out_dir, exist_ok=True)
    md = os.path.join(out_dir, "multi_gpu_summary.md")
    with open(md, "w") as f:
        f.write("\n".join(lines) + "\n")
    return md


def build_parser():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    ops = sub.add_parser("ops", help="replay-ops against pytorch_baseline.py ops")
    ops.add_argument("--replay", required=True, help="JSON from replay-ops --json")
    ops.add_argument("--pytorch", default=None,
                     help="JSON from scripts/pytorch_baseline.py ops --json (without it, PyTorch reads missing)")
    ops.add_argument("--out", required=True, help="output directory")
    ops.add_argument("--attention-nondeterministic", default=None,
                     help="JSON from replay-ops --attention-nondeterministic (an extra section)")
    ops.set_defaults(func=lambda a: report_ops(a.replay, a.pytorch, a.out, a.attention_nondeterministic)[0])
    graphs = sub.add_parser("graphs", help="replay-graphs-bench launch costs and host-delay sweep")
    graphs.add_argument("--json", required=True, help="JSON from replay-graphs-bench --json")
    graphs.add_argument("--out", required=True, help="output directory")
    graphs.set_defaults(func=lambda a: report_graphs(a.json, a.out)[0])
    workloads = sub.add_parser("workloads", help="workload runs, replay against PyTorch, from every "
                                                 "<tool>_<workload>_<preset>_<mode>.json in a directory")
    workloads.add_argument("--dir", required=True, help="directory holding the runs' JSON")
    workloads.add_argument("--out", default=None, help="output directory (default: --dir)")
    workloads.set_defaults(func=lambda a: report_workloads(a.dir, a.out or a.dir)[0])
    ttt = sub.add_parser("time-to-train", help="time-to-train runs (--target-quality) per graph mode, from "
                                               "every replay_<workload>_<preset>_<mode>.json in a directory")
    ttt.add_argument("--dir", required=True, help="directory holding the runs' JSON")
    ttt.add_argument("--out", default=None, help="output directory (default: --dir)")
    ttt.set_defaults(func=lambda a: report_time_to_train(a.dir, a.out or a.dir))
    runs = sub.add_parser("runs", help="one table of every run JSON in a directory (the UNet, MoE, RNN-T and "
                                       "multi-GPU sections), with the loss hashes compared across modes")
    runs.add_argument("--dir", required=True, help="directory holding the runs' JSON")
    runs.add_argument("--out", default=None, help="output directory (default: --dir)")
    runs.add_argument("--title", default="Runs", help="the section's heading")
    runs.set_defaults(func=lambda a: report_runs(a.dir, a.out or a.dir, a.title))
    comm = sub.add_parser("comm", help="replay-comm-probe's bus bandwidth per collective, type and size, and "
                                       "the all-reduce against the 2 x H100 anchor")
    comm.add_argument("--json", required=True, help="JSON from replay-comm-probe --json")
    comm.add_argument("--out", required=True, help="output directory")
    comm.set_defaults(func=lambda a: report_comm(a.json, a.out))
    mg = sub.add_parser("multi-gpu", help="bench.sh's multi-GPU runs against the issue's targets (the one-GPU "
                                          "shard, PyTorch's TP, eager), with verdicts")
    mg.add_argument("--dir", required=True, help="directory holding the runs' JSON (bench.sh's multi_gpu)")
    mg.add_argument("--out", default=None, help="output directory (default: --dir)")
    mg.set_defaults(func=lambda a: report_multi_gpu(a.dir, a.out or a.dir))
    return parser


def main(argv=None):
    args = build_parser().parse_args(argv)
    try:
        md = args.func(args)
    except ReportError as e:
        print(f"report.py: error: {e}", file=sys.stderr)
        return 1
    print(f"wrote {md}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
