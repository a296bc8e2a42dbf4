#!/usr/bin/env python3
"""Tests of scripts/report.py: synthetic benchmark JSON in a temporary directory, the markdown rows,
ratios and verdicts it yields (op benchmarks, graph-layer sweep, workload runs against PyTorch), the plots,
and clear errors on malformed input. CPU only; the plot tests
skip where matplotlib is not importable."""

import contextlib
import copy
import importlib.util
import io
import json
import os
import sys
import tempfile
import unittest
from unittest import mock

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "scripts"))
import report  # noqa: E402

HAVE_MATPLOTLIB = importlib.util.find_spec("matplotlib") is not None

GEMM_SHAPE = {"m": 2048, "n": 9216, "k": 12288}
ATT_SHAPE = {"batch": 1, "q_heads": 24, "kv_heads": 24, "seq": 2048, "head_dim": 128}


def entry(name, kind, median_ms, shape=None, flops=1e12, nbytes=None, **extra):
    e = {"name": name, "kind": kind, "shape": shape or (ATT_SHAPE if kind == "attention" else GEMM_SHAPE),
         "dtype": "bf16", "median_ms": median_ms, "p10_ms": median_ms, "p90_ms": median_ms,
         "flops": None if kind == "kernel" else flops, "bytes": nbytes,
         "tflops": None, "gbps": None, "fraction_of_peak": None}
    e.update(extra)
    return e


def ops_doc(tool, results, gemm_tflops=700.0, copy_gbps=3000.0):
    return {"tool": tool, "version": "test", "environment": {"gpu": "Test GPU", "cuda_driver": "13.0"},
            "protocol": {"warmup": 10, "repeats": 50, "timer": "cuda events around each repeat"},
            "peaks": {"bf16_gemm_tflops": gemm_tflops, "copy_gbps": copy_gbps}, "results": results}


def replay_doc():
    return ops_doc("replay-ops", [
        entry("s.qkv.fwd", "gemm", 1.0),          # pytorch 0.96 -> ratio 0.96 pass
        entry("s.qkv.dgrad", "gemm", 1.0),        # pytorch 0.94 -> 0.94 fail
        entry("s.qkv.wgrad", "gemm", 2.0),        # pytorch 1.90 -> exactly 0.95 pass
        entry("s.attention.fwd", "attention", 1.0),      # no target
        entry("s.attention.fwd_bwd", "attention", 1.0),  # pytorch deterministic 2.5 -> 2.5 pass
        entry("t.attention.fwd_bwd", "attention", 1.0),  # no deterministic entry: default 0.96 -> fail
        entry("s.only_replay.fwd", "gemm", 1.0),
        entry("s.shape.fwd", "gemm", 1.0, shape={"m": 1, "n": 2, "k": 3}),
        entry("s.layernorm.fwd", "kernel", 1.0, shape={"rows": 2048, "cols": 12288}, nbytes=2.55e9),
        entry("s.gelu.fwd", "kernel", 1.0, shape={"n": 1}, nbytes=2.1e9),
    ], copy_gbps=3000.0)


def pytorch_doc():
    return ops_doc("pytorch", [
        entry("s.qkv.fwd", "gemm", 0.96),
        entry("s.qkv.dgrad", "gemm", 0.94),
        entry("s.qkv.wgrad", "gemm", 1.90),
        entry("s.attention.fwd", "attention", 0.5, backend="FLASH_ATTENTION"),
        entry("s.attention.fwd_bwd", "attention", 0.98, backend="CUDNN_ATTENTION"),
        entry("s.attention.fwd_bwd@flash", "attention", 1.25, backend="FLASH_ATTENTION"),
        entry("s.attention.fwd_bwd@cudnn", "attention", 0.98, backend="CUDNN_ATTENTION"),
        entry("s.attention.fwd_bwd@deterministic", "attention", 2.5, backend="FLASH_ATTENTION"),
        entry("t.attention.fwd_bwd", "attention", 0.96),
        entry("t.attention.fwd_bwd@cudnn", "attention", None, note="CUDNN_ATTENTION refused: no GQA"),
        entry("s.only_pytorch.fwd", "gemm", 1.0),
        entry("s.shape.fwd", "gemm", 1.0),
    ], gemm_tflops=650.0, copy_gbps=2900.0)


def graphs_doc():
    chain = {"kernels": 1000, "sum_kernel_us": 2000.0, "eager_us": 4500.0, "eager_launch_us_per_kernel": 4.5,
             "graph_us": 2200.0, "graph_launch_us": 9.0, "graph_over_sum": 1.1, "small_graphs_us": 2300.0,
             "small_graph_size": 50}
    sweep = [{"host_delay_us": d, "eager_us": e, "graph_us": g, "small_graphs_us": s, "speedup": e / g}
             for d, e, g, s in [(10, 900.0, 1000.0, 1100.0), (0, 500.0, 1000.0, 1100.0),
                                (20, 1400.0, 1000.0, 1050.0), (40, 2400.0, 1000.0, 1000.0)]]
    return {"tool": "replay-graphs-bench", "environment": {"gpu": "Test GPU"}, "chain": chain,
            "mix": dict(chain, kernels=200), "sweep": sweep}


def workload_doc(tool, mode, median_ms, peak_bytes=70e9, loss_hash="00aa", capture=(300.0, 500.0), delay=None,
                 layers=7, flops=42e12):
    """A workload run (reports/SCHEMA.md) of gpt3 175b-tp4."""
    graphed = mode != "none"
    doc = {"tool": "replay-gpt3" if tool == "replay" else "pytorch", "version": "test", "workload": "gpt3",
           "preset": "175b-tp4", "graphs": mode, "environment": {"gpu": "Test GPU"},
           "config": {"layers": layers, "hidden": 12288, "heads": 24, "seq": 2048, "micro_batch": 1,
                      "steps": 50},
           "step_ms": {"median": median_ms, "p10": median_ms * 0.99, "p90": median_ms * 1.01, "mean": median_ms,
                       "count": 50},
           "host_enqueue_us": {"median": 80.0, "p90": 90.0},
           "throughput": {"tokens_per_s": 2048 / median_ms * 1e3, "samples_per_s": 1e3 / median_ms},
           "model_tflops": flops / median_ms / 1e9, "flops_per_step": flops, "mfu": 0.5,
           "peaks": {"bf16_gemm_tflops": 800.0}, "memory": {"peak_bytes": peak_bytes},
           "graphs_info": {"count": 1 if graphed else 0, "nodes": 900 if graphed else 0,
                           "capture_ms": capture[0] if graphed else None,
                           "instantiate_ms": capture[1] if graphed else None},
           "losses": [10.0, 9.5], "loss_hash": loss_hash}
    if delay is not None:
        doc["config"]["host_delay_us"] = delay
    return doc


def workload_runs():
    """File name -> doc: replay full 0.90x PyTorch graphed (exactly at the target), eager 0.95x."""
    return {
        "replay_gpt3_175b-tp4_none.json": workload_doc("replay", "none", 100.0),
        "replay_gpt3_175b-tp4_layer.json": workload_doc("replay", "layer", 95.0, peak_bytes=70.7e9),
        "replay_gpt3_175b-tp4_full.json": workload_doc("replay", "full", 90.0, peak_bytes=70.2e9),
        "pytorch_gpt3_175b-tp4_none.json": workload_doc("pytorch", "none", 105.0, loss_hash="11bb"),
        "pytorch_gpt3_175b-tp4_full.json": workload_doc("pytorch", "full", 100.0, peak_bytes=75e9,
                                                        loss_hash="11bb"),
    }


def table_row(md, name):
    """Cells of the first markdown table row whose first cell is `name`."""
    for line in md.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if line.startswith("|") and cells[0] == name:
            return cells
    raise AssertionError(f"no table row {name!r} in:\n{md}")


class TempDirCase(unittest.TestCase):
    def setUp(self):
        self._tmp = tempfile.TemporaryDirectory()
        self.dir = self._tmp.name

    def tearDown(self):
        self._tmp.cleanup()

    def write(self, name, doc):
        path = os.path.join(self.dir, name)
        with open(path, "w") as f:
            f.write(doc if isinstance(doc, str) else json.dumps(doc))
        return path

    def run_ops(self, replay=None, pytorch=None):
        rp = self.write("replay.json", replay or replay_doc())
        pp = self.write("pytorch.json", pytorch or pytorch_doc())
        out = os.path.join(self.dir, "out")
        md, rows, krows = report.report_ops(rp, pp, out)
        with open(md) as f:
            return f.read(), {r["name"]: r for r in rows}, {r["name"]: r for r in krows}, out


class OpsComparison(TempDirCase):
    def test_ratio_is_pytorch_time_over_replay_time(self):
        _, rows, _, _ = self.run_ops()
        self.assertAlmostEqual(rows["s.qkv.fwd"]["ratio"], 0.96)
        self.assertAlmostEqual(rows["s.qkv.wgrad"]["ratio"], 0.95)
        self.assertAlmostEqual(rows["s.attention.fwd"]["ratio"], 0.5)

    def test_gemm_target(self):
        _, rows, _, _ = self.run_ops()
        self.assertEqual(rows["s.qkv.fwd"]["status"], report.PASS)
        self.assertEqual(rows["s.qkv.dgrad"]["status"], report.FAIL)
        self.assertEqual(rows["s.qkv.wgrad"]["status"], report.PASS)  # 0.95 exactly meets 0.95
        self.assertEqual(rows["s.qkv.fwd"]["target"], 0.95)

    def test_attention_target_only_for_forward_backward(self):
        _, rows, _, _ = self.run_ops()
        self.assertEqual(rows["s.attention.fwd_bwd"]["status"], report.PASS)
        self.assertEqual(rows["t.attention.fwd_bwd"]["status"], report.FAIL)  # 0.96 < 0.97
        self.assertEqual(rows["s.attention.fwd"]["status"], report.INFO)
        self.assertIsNone(rows["s.attention.fwd"]["target"])

    def test_attention_judged_against_pytorch_with_the_same_determinism(self):
        _, rows, _, _ = self.run_ops()
        s, t = rows["s.attention.fwd_bwd"], rows["t.attention.fwd_bwd"]
        self.assertEqual(s["basis"], "deterministic")  # replay's deterministic backward vs @deterministic
        self.assertAlmostEqual(s["ratio"], 2.5)
        self.assertEqual(s["pytorch"]["name"], "s.attention.fwd_bwd@deterministic")
        self.assertEqual(t["basis"], "default")  # no @deterministic entry: against the default, as before
        self.assertAlmostEqual(t["ratio"], 0.96)
        self.assertIsNone(rows["s.qkv.fwd"]["basis"])

    def test_refused_deterministic_variant_is_missing_not_the_default(self):
        p = pytorch_doc()
        for e in p["results"]:
            if e["name"] == "s.attention.fwd_bwd@deterministic":
                e.update(median_ms=None, p10_ms=None, p90_ms=None, note="refused under deterministic algorithms")
        _, rows, _, _ = self.run_ops(pytorch=p)
        s = rows["s.attention.fwd_bwd"]
        self.assertEqual(s["status"], report.MISSING)
        self.assertIn("refused under deterministic algorithms", s["note"])

    def test_nondeterministic_rows_are_judged_against_the_default(self):
        nondet = ops_doc("replay-ops", [entry("s.attention.fwd_bwd", "attention", 0.8),
                                        entry("t.attention.fwd_bwd", "attention", 1.0)])
        rp = self.write("replay.json", replay_doc())
        pp = self.write("pytorch.json", pytorch_doc())
        np_ = self.write("nondet.json", nondet)
        md, rows, _ = report.report_ops(rp, pp, os.path.join(self.dir, "out"), np_)
        names = [r["name"] for r in rows]
        i = names.index("s.attention.fwd_bwd")
        self.assertEqual(names[i + 1], "s.attention.fwd_bwd (non-deterministic)")  # under its deterministic row
        nd = rows[i + 1]
        self.assertEqual(nd["basis"], "default")
        self.assertAlmostEqual(nd["ratio"], 0.98 / 0.8)
        self.assertEqual(nd["status"], report.PASS)
        self.assertEqual(nd["target"], report.ATTENTION_TARGET)
        t = next(r for r in rows if r["name"] == "t.attention.fwd_bwd (non-deterministic)")
        self.assertEqual(t["status"], report.FAIL)  # 0.96 / 1.0
        with open(md) as f:
            text = f.read()
        self.assertIn("5 of 12 targets met (4 failed, 3 not judged).", text)
        self.assertIn("`t.attention.fwd_bwd (non-deterministic)`", text[text.index("Failed:"):])
        cells = table_row(text, "`s.attention.fwd_bwd (non-deterministic)`")
        self.assertEqual(cells[3:5], ["0.8", "0.98 (CUDNN_ATTENTION, default)"])

    def test_backend_variants_are_not_main_rows(self):
        _, rows, _, _ = self.run_ops()
        self.assertFalse(any("@" in name for name in rows))

    def test_missing_entries_are_rows(self):
        md, rows, _, _ = self.run_ops()
        self.assertEqual(rows["s.only_replay.fwd"]["status"], report.MISSING)
        self.assertEqual(rows["s.only_pytorch.fwd"]["status"], report.MISSING)
        self.assertIn("not in the pytorch JSON", rows["s.only_replay.fwd"]["note"])
        self.assertIn("not in the replay JSON", rows["s.only_pytorch.fwd"]["note"])
        cells = table_row(md, "`s.only_pytorch.fwd`")
        self.assertEqual(cells[3], "missing")  # replay ms
        self.assertTrue(cells[-1].startswith("missing"))

    def test_shape_disagreement_is_flagged_not_judged(self):
        _, rows, _, _ = self.run_ops()
        self.assertEqual(rows["s.shape.fwd"]["status"], report.MISMATCH)
        self.assertIsNone(rows["s.shape.fwd"]["ratio"])
        self.assertIn("shape", rows["s.shape.fwd"]["note"])

    def test_unmeasured_entry_carries_its_note(self):
        p = pytorch_doc()
        p["results"][0] = entry("s.qkv.fwd", "gemm", None, note="out of memory")
        _, rows, _, _ = self.run_ops(pytorch=p)
        self.assertEqual(rows["s.qkv.fwd"]["status"], report.MISSING)
        self.assertIn("out of memory", rows["s.qkv.fwd"]["note"])

    def test_kernels_against_replay_copy_bandwidth(self):
        md, _, krows, _ = self.run_ops()
        ln = krows["s.layernorm.fwd"]
        self.assertAlmostEqual(ln["gbps"], 2550.0)  # 2.55e9 bytes in 1 ms
        self.assertAlmostEqual(ln["ratio"], 0.85)    # of replay's 3000 GB/s, not PyTorch's 2900
        self.assertEqual(ln["status"], report.PASS)
        self.assertEqual(krows["s.gelu.fwd"]["status"], report.FAIL)  # 0.70
        cells = table_row(md, "`s.gelu.fwd`")
        self.assertEqual(cells[3], "2100.0")
        self.assertEqual(cells[5], "—")  # no stream entry: judged on the per-call time
        self.assertEqual(cells[6], "0.700")
        self.assertEqual(cells[8], "FAIL")

    def test_determinism_section(self):
        nondet = ops_doc("replay-ops", [entry("s.attention.fwd_bwd", "attention", 0.8)])
        rp = self.write("replay.json", replay_doc())
        pp = self.write("pytorch.json", pytorch_doc())
        np_ = self.write("nondet.json", nondet)
        md, _, _ = report.report_ops(rp, pp, os.path.join(self.dir, "out"), np_)
        with open(md) as f:
            text = f.read()
        section = text.split("## Attention with and without a deterministic backward")[1]
        # op, replay det, replay non-det, pytorch det, pytorch default, det/pt det, non-det/pt default,
        # det/pt default
        cells = table_row(section, "`s.attention.fwd_bwd`")
        self.assertEqual(cells[1:], ["1", "0.8", "2.5 (FLASH_ATTENTION)", "0.98 (CUDNN_ATTENTION)", "2.500",
                                     "1.225", "0.980"])
        t = table_row(section, "`t.attention.fwd_bwd`")  # neither a non-deterministic nor a deterministic entry
        self.assertEqual(t[1:], ["1", "missing", "missing", "0.96", "—", "—", "0.960"])

    def test_no_determinism_section_without_either_side(self):
        p = pytorch_doc()
        p["results"] = [e for e in p["results"] if not e["name"].endswith("@deterministic")]
        md, _, _, _ = self.run_ops(pytorch=p)
        self.assertNotIn("with and without a deterministic backward", md)

    def test_kernels_judged_on_the_stream_time_when_present(self):
        r = replay_doc()
        for e in r["results"]:
            if e["name"] == "s.gelu.fwd":  # 2100 GB/s per call; 2.1e9 bytes in 0.84 ms in a stream
                e["stream"] = {"calls": 24, "buffer_sets": 3, "median_ms": 0.84, "p10_ms": 0.84, "p90_ms": 0.84}
        md, _, krows, _ = self.run_ops(replay=r)
        gelu = krows["s.gelu.fwd"]
        self.assertAlmostEqual(gelu["gbps"], 2100.0)
        self.assertAlmostEqual(gelu["stream_gbps"], 2500.0)
        self.assertAlmostEqual(gelu["ratio"], 2500.0 / 3000.0)
        self.assertEqual(gelu["status"], report.PASS)
        cells = table_row(md, "`s.gelu.fwd`")
        self.assertEqual(cells[4], "0.84")
        self.assertEqual(cells[5], "2500.0")
        self.assertEqual(cells[8], "pass")

    def test_markdown_rows(self):
        md, _, _, _ = self.run_ops()
        cells = table_row(md, "`s.qkv.dgrad`")
        self.assertEqual(cells[1], "gemm")
        self.assertEqual(cells[2], "m=2048 n=9216 k=12288")
        self.assertEqual(cells[3], "1")
        self.assertEqual(cells[4], "0.94")
        self.assertEqual(cells[5], "1000.0")  # 1e12 flops in 1 ms
        self.assertEqual(cells[6], "0.940")
        self.assertEqual(cells[7], "0.940")  # p10 ratio: the fixture's p10 is its median
        self.assertEqual(cells[8], "— / —")  # the fixture has no samples_ms
        self.assertEqual(cells[9], "0.95")
        self.assertEqual(cells[10], "FAIL")
        self.assertEqual(table_row(md, "`s.attention.fwd_bwd`")[4], "2.5 (FLASH_ATTENTION, deterministic)")
        self.assertEqual(table_row(md, "`t.attention.fwd_bwd`")[4], "0.96 (default)")
        self.assertEqual(table_row(md, "`s.attention.fwd`")[4], "0.5 (FLASH_ATTENTION)")

    def test_calls_are_the_samples_each_tool_timed(self):
        replay, pytorch = replay_doc(), pytorch_doc()
        next(e for e in replay["results"] if e["name"] == "s.qkv.dgrad")["samples_ms"] = [1.0] * 9
        next(e for e in pytorch["results"] if e["name"] == "s.qkv.dgrad")["samples_ms"] = [0.94] * 8
        md, _, _, _ = self.run_ops(replay, pytorch)
        self.assertEqual(table_row(md, "`s.qkv.dgrad`")[8], "9 / 8")
        self.assertEqual(table_row(md, "`s.only_replay.fwd`")[8], "— / —")  # no PyTorch entry

    def test_fastest_tenth_is_shown_and_named_when_only_the_median_fails(self):
        replay, pytorch = replay_doc(), pytorch_doc()
        # s.qkv.dgrad: medians 1.0 vs 0.94 (fails), fastest tenths 0.80 vs 0.79 (ratio 0.9875)
        next(e for e in replay["results"] if e["name"] == "s.qkv.dgrad")["p10_ms"] = 0.80
        next(e for e in pytorch["results"] if e["name"] == "s.qkv.dgrad")["p10_ms"] = 0.79
        md, rows, _, _ = self.run_ops(replay, pytorch)
        self.assertEqual(rows["s.qkv.dgrad"]["status"], report.FAIL)  # judged on the medians
        self.assertAlmostEqual(rows["s.qkv.dgrad"]["p10_ratio"], 0.79 / 0.80)
        self.assertEqual(table_row(md, "`s.qkv.dgrad`")[7], "0.988")
        line = next(line for line in md.splitlines() if line.startswith("Of these"))
        self.assertIn("`s.qkv.dgrad` (0.988)", line)
        # t.attention.fwd_bwd fails at p10 too (equal p10 and median in the fixture): not named
        self.assertNotIn("t.attention.fwd_bwd", line)
        self.assertIsNone(rows["s.only_replay.fwd"]["p10_ratio"])  # nothing to compare with

    def test_verdict_counts_targets(self):
        md, _, _, _ = self.run_ops()
        # with a target: 6 GEMMs (2 missing, 1 mismatched) + 2 attention fwd_bwd + 2 kernels = 10;
        # met: qkv.fwd, qkv.wgrad, s.attention.fwd_bwd, layernorm
        self.assertIn("4 of 10 targets met (3 failed, 3 not judged).", md)
        failed = next(line for line in md.splitlines() if line.startswith("Failed:"))
        for name in ("s.qkv.dgrad", "t.attention.fwd_bwd", "s.gelu.fwd"):
            self.assertIn(f"`{name}`", failed)
        self.assertIn("`s.only_replay.fwd`", md[md.index("Not judged"):])

    def test_attention_backend_table(self):
        md, _, _, _ = self.run_ops()
        section = md[md.index("## Attention forward+backward"):]
        cells = table_row(section, "`s.attention.fwd_bwd`")
        # op, replay, default, @flash, @cudnn, @deterministic, replay/default, replay/@flash, replay/@cudnn,
        # replay/@deterministic
        self.assertEqual(cells[1], "1")
        self.assertEqual(cells[2], "0.98 (CUDNN_ATTENTION)")
        self.assertEqual(cells[3], "1.25")
        self.assertEqual(cells[5], "2.5")
        self.assertEqual(cells[7], "1.250")
        self.assertEqual(cells[9], "2.500")
        t = table_row(section, "`t.attention.fwd_bwd`")
        self.assertEqual(t[3], "missing")   # no @flash entry for t
        self.assertEqual(t[4], "refused")
        self.assertIn("no GQA", section)

    def test_peaks_and_environment(self):
        md, _, _, _ = self.run_ops()
        peaks = table_row(md, "bf16 GEMM 8192^3 (TFLOP/s)")
        self.assertEqual(peaks[1:], ["700.0", "650.0", "1.077"])
        self.assertEqual(table_row(md, "gpu")[1:], ["Test GPU", "Test GPU"])
        self.assertEqual(table_row(md, "protocol.repeats")[1:], ["50", "50"])

    def test_entries_in_no_table_are_listed(self):
        p = pytorch_doc()
        p["results"].append(entry("s.softmax.fwd", "kernel", 1.0, shape={"n": 1}, nbytes=1e9))
        md, _, _, _ = self.run_ops(pytorch=p)
        self.assertIn("- pytorch: `s.softmax.fwd`", md)

    def test_main_exits_zero_when_targets_fail(self):
        rp, pp = self.write("r.json", replay_doc()), self.write("p.json", pytorch_doc())
        out = os.path.join(self.dir, "cli")
        with contextlib.redirect_stdout(io.StringIO()):
            rc = report.main(["ops", "--replay", rp, "--pytorch", pp, "--out", out])
        self.assertEqual(rc, 0)
        self.assertTrue(os.path.getsize(os.path.join(out, "ops_summary.md")) > 0)

    def test_without_pytorch_json(self):
        rp = self.write("r.json", replay_doc())
        out = os.path.join(self.dir, "nopt")
        with contextlib.redirect_stdout(io.StringIO()):
            rc = report.main(["ops", "--replay", rp, "--out", out])
        self.assertEqual(rc, 0)
        with open(os.path.join(out, "ops_summary.md")) as f:
            md = f.read()
        self.assertIn("no PyTorch JSON (the baseline was not run)", md)
        cells = table_row(md, "`s.qkv.fwd`")
        self.assertEqual(cells[4], "missing")
        self.assertTrue(cells[-1].startswith("missing"))
        self.assertEqual(table_row(md, "`s.layernorm.fwd`")[-1], "pass")  # kernels need only replay

    def test_without_matplotlib_the_tables_still_come(self):
        with mock.patch.object(report, "_pyplot", return_value=None), \
                contextlib.redirect_stderr(io.StringIO()) as err:
            md, rows, _, out = self.run_ops()
        self.assertIn("ops_ratio.png not written: matplotlib is not importable", md)
        self.assertIn("warning", err.getvalue())
        self.assertFalse(os.path.exists(os.path.join(out, "ops_ratio.png")))
        self.assertEqual(rows["s.qkv.fwd"]["status"], report.PASS)

    def test_failed_ops_series_only_when_both_tools_have_samples(self):
        md, _, _, out = self.run_ops()  # the fixture has no samples_ms
        self.assertNotIn("ops_failed_series.png", md)
        replay, pytorch = replay_doc(), pytorch_doc()
        for doc in (replay, pytorch):
            for e in doc["results"]:
                e["samples_ms"] = [e["median_ms"]] * 3 if e["median_ms"] else None
        with mock.patch.object(report, "plot_failed_series", return_value=True) as plot:
            md, _, _, _ = self.run_ops(replay, pytorch)
        names = [r["name"] for r in plot.call_args[0][0]]
        self.assertEqual(names, ["s.qkv.dgrad", "t.attention.fwd_bwd"])  # the failed GEMM and attention
        self.assertIn("![per-call times of the failed ops](ops_failed_series.png)", md)

    @unittest.skipUnless(HAVE_MATPLOTLIB, "matplotlib is not importable")
    def test_failed_ops_series_plot_written(self):
        replay, pytorch = replay_doc(), pytorch_doc()
        for doc, first in ((replay, 1.0), (pytorch, 0.9)):
            for e in doc["results"]:
                if e["name"] == "s.qkv.dgrad":
                    e["samples_ms"] = [first, first, 1.0, 1.0]
        _, _, _, out = self.run_ops(replay, pytorch)
        with open(os.path.join(out, "ops_failed_series.png"), "rb") as f:
            self.assertEqual(f.read(8), b"\x89PNG\r\n\x1a\n")

    @unittest.skipUnless(HAVE_MATPLOTLIB, "matplotlib is not importable")
    def test_ratio_plot_written(self):
        _, _, _, out = self.run_ops()
        png = os.path.join(out, "ops_ratio.png")
        self.assertGreater(os.path.getsize(png), 1000)
        with open(png, "rb") as f:
            self.assertEqual(f.read(8), b"\x89PNG\r\n\x1a\n")


class MalformedInput(TempDirCase):
    def expect_error(self, text, *fragments, replay=True):
        bad = self.write("bad.json", text)
        good = self.write("good.json", pytorch_doc() if replay else replay_doc())
        args = (bad, good) if replay else (good, bad)
        out = os.path.join(self.dir, "out")
        with self.assertRaises(report.ReportError) as cm:
            report.report_ops(*args, out)
        for fragment in fragments:
            self.assertIn(fragment, str(cm.exception))
        self.assertFalse(os.path.exists(out), "nothing may be written from malformed input")

    def test_not_json(self):
        self.expect_error("{not json", "bad.json", "not valid JSON")

    def test_missing_file(self):
        with self.assertRaises(report.ReportError) as cm:
            report.report_ops(os.path.join(self.dir, "absent.json"), self.write("p.json", pytorch_doc()),
                              self.dir)
        self.assertIn("cannot read", str(cm.exception))

    def test_wrong_tool(self):
        self.expect_error(pytorch_doc(), "'tool' is 'pytorch', expected 'replay-ops'")

    def test_results_not_a_list(self):
        d = replay_doc()
        d["results"] = {}
        self.expect_error(d, "'results' must be a list")

    def test_entry_without_name(self):
        d = replay_doc()
        del d["results"][2]["name"]
        self.expect_error(d, "results[2] has no 'name'")

    def test_duplicate_name(self):
        d = pytorch_doc()
        d["results"].append(copy.deepcopy(d["results"][0]))
        self.expect_error(d, "duplicate name", "s.qkv.fwd", replay=False)

    def test_bad_samples(self):
        for bad in ("fast", [], [1.0, "slow"]):
            d = replay_doc()
            d["results"][0]["samples_ms"] = bad
            with self.subTest(bad=bad):
                self.expect_error(d, "results[0] (s.qkv.fwd)", "samples_ms")

    def test_non_numeric_time(self):
        d = replay_doc()
        d["results"][0]["median_ms"] = "fast"
        self.expect_error(d, "results[0] (s.qkv.fwd)", "median_ms")

    def test_unknown_kind(self):
        d = replay_doc()
        d["results"][0]["kind"] = "conv"
        self.expect_error(d, "'kind' is 'conv'")

    def test_main_reports_error_without_traceback(self):
        bad = self.write("bad.json", "[]")
        err = io.StringIO()
        with contextlib.redirect_stderr(err):
            rc = report.main(["ops", "--replay", bad, "--pytorch", bad, "--out", self.dir])
        self.assertEqual(rc, 1)
        self.assertIn("report.py: error:", err.getvalue())
        self.assertNotIn("Traceback", err.getvalue())

    def test_graphs_sweep_not_a_list(self):
        d = graphs_doc()
        d["sweep"] = None
        with self.assertRaises(report.ReportError) as cm:
            report.report_graphs(self.write("g.json", d), self.dir)
        self.assertIn("'sweep' must be a list", str(cm.exception))

    def test_graphs_sweep_point_without_delay(self):
        d = graphs_doc()
        del d["sweep"][1]["host_delay_us"]
        with self.assertRaises(report.ReportError) as cm:
            report.report_graphs(self.write("g.json", d), self.dir)
        self.assertIn("sweep[1]", str(cm.exception))


class GraphsReport(TempDirCase):
    def run_graphs(self, doc=None):
        out = os.path.join(self.dir, "out")
        md, crossings = report.report_graphs(self.write("g.json", doc or graphs_doc()), out)
        with open(md) as f:
            return f.read(), crossings, out

    def test_crossover_interpolates_between_sweep_points(self):
        sweep = graphs_doc()["sweep"]
        c = report.crossover(sweep, "graph_us")
        # sorted: d=10 eager 900 < graph 1000 (gain -100); d=20 eager 1400 (gain +400) -> 10 + 10*100/500 = 12
        self.assertEqual(c["first_delay_us"], 20)
        self.assertAlmostEqual(c["interpolated_us"], 12.0)
        s = report.crossover(sweep, "small_graphs_us")
        self.assertEqual(s["first_delay_us"], 20)  # gain at 20 is 1400 - 1050 > 0

    def test_crossover_at_first_point_and_never(self):
        pts = [{"host_delay_us": 0, "eager_us": 5.0, "graph_us": 4.0},
               {"host_delay_us": 5, "eager_us": 9.0, "graph_us": 4.0}]
        self.assertEqual(report.crossover(pts, "graph_us"), {"first_delay_us": 0, "interpolated_us": None})
        never = [{"host_delay_us": d, "eager_us": 1.0, "graph_us": 2.0} for d in (0, 10)]
        self.assertIsNone(report.crossover(never, "graph_us"))
        self.assertIsNone(report.crossover([], "graph_us"))

    def test_summary_tables(self):
        md, _, _ = self.run_graphs()
        self.assertEqual(table_row(md, "kernels")[1:], ["1000", "200"])
        self.assertEqual(table_row(md, "one graph / sum of kernels")[1:], ["1.100", "1.100"])
        self.assertEqual(table_row(md, "eager / one graph")[1], "2.05")
        row = table_row(md, "20")
        self.assertEqual(row[1:], ["1400.00", "1000.00", "1050.00", "1.40", "1.33"])
        # sweep rows come out sorted by delay
        delays = [line.split("|")[1].strip() for line in md[md.index("## Host-delay sweep"):].splitlines()
                  if line.startswith("| ") and line.split("|")[1].strip().isdigit()]
        self.assertEqual(delays, ["0", "10", "20", "40"])
        self.assertIn("faster than eager from 20 µs host delay (curves cross near 12.0 µs)", md)
        self.assertIn("1.100x the sum of its kernels", md)

    def test_missing_mix_is_shown(self):
        d = graphs_doc()
        del d["mix"]
        md, _, _ = self.run_graphs(d)
        self.assertEqual(table_row(md, "kernels")[1:], ["1000", "missing"])

    def test_graphs_never_paying_is_said(self):
        d = graphs_doc()
        for p in d["sweep"]:
            p["graph_us"] = p["eager_us"] + 1
        md, crossings, _ = self.run_graphs(d)
        self.assertIsNone(crossings["graph_us"])
        self.assertIn("One graph: never faster than eager", md)

    @unittest.skipUnless(HAVE_MATPLOTLIB, "matplotlib is not importable")
    def test_sweep_plot_written(self):
        _, _, out = self.run_graphs()
        png = os.path.join(out, "graphs_sweep.png")
        self.assertGreater(os.path.getsize(png), 1000)
        with open(png, "rb") as f:
            self.assertEqual(f.read(8), b"\x89PNG\r\n\x1a\n")


class WorkloadsReport(TempDirCase):
    def run_workloads(self, runs=None, extra=None):
        d = os.path.join(self.dir, "runs")
        os.makedirs(d, exist_ok=True)
        files = dict(workload_runs() if runs is None else runs)
        files.update(extra or {})
        for name, doc in files.items():
            with open(os.path.join(d, name), "w") as f:
                f.write(doc if isinstance(doc, str) else json.dumps(doc))
        out = os.path.join(self.dir, "out")
        md, verdicts = report.report_workloads(d, out)
        with open(md) as f:
            text = f.read()
        return text, {t["name"]: t for t in verdicts[("gpt3", "175b-tp4")]}, out

    def test_file_names(self):
        key = report.workload_file_key
        self.assertEqual(key("replay_gpt3_175b-tp4_full.json"), ("replay", "gpt3", "175b-tp4", "full", 0))
        self.assertEqual(key("pytorch_llama31_405b-tp8_none.json"),
                         ("pytorch", "llama31", "405b-tp8", "none", 0))
        self.assertEqual(key("replay_gpt3_tiny_none_delay20us.json"), ("replay", "gpt3", "tiny", "none", 20))
        for other in ("replay_ops.json", "pytorch_ops.json", "graphs_bench.json",
                      "replay_gpt3_tiny_full.mllog"):
            self.assertIsNone(key(other), other)
        for bad in ("replay_gpt3_175b-tp4_eager.json", "replay_gpt3_full.json",
                    "pytorch_gpt3_tiny_full_20us.json"):
            with self.subTest(bad), self.assertRaises(report.ReportError) as cm:
                key(bad)
            self.assertIn("<tool>_<workload>_<preset>_<mode>.json", str(cm.exception))

    def test_targets_and_ratios(self):
        _, t, _ = self.run_workloads()
        full = t["full-graph step time / PyTorch graphed"]
        self.assertAlmostEqual(full["value"], 0.90)
        self.assertEqual(full["status"], report.PASS)  # exactly at the target passes
        eager = t["eager step time / PyTorch eager"]
        self.assertAlmostEqual(eager["value"], 100 / 105)
        self.assertEqual(eager["status"], report.PASS)
        self.assertAlmostEqual(t["peak memory, layer graphs / eager"]["value"], 1.01)
        self.assertEqual(t["peak memory, layer graphs / eager"]["status"], report.PASS)  # 1% exactly
        self.assertEqual(t["peak memory, full graphs / eager"]["status"], report.PASS)
        self.assertEqual(t["capture + instantiate, full graphs (ms)"]["value"], 800.0)
        self.assertEqual(t["capture + instantiate, full graphs (ms)"]["status"], report.PASS)
        self.assertEqual(t["loss hash identical across replay's modes"]["status"], report.PASS)

    def test_failures(self):
        runs = workload_runs()
        runs["replay_gpt3_175b-tp4_full.json"] = workload_doc("replay", "full", 91.0, peak_bytes=71e9,
                                                              loss_hash="00ab", capture=(1500.0, 500.0))
        runs["replay_gpt3_175b-tp4_none.json"] = workload_doc("replay", "none", 106.0)
        md, t, _ = self.run_workloads(runs)
        for name in ("full-graph step time / PyTorch graphed", "eager step time / PyTorch eager",
                     "peak memory, full graphs / eager", "capture + instantiate, full graphs (ms)",
                     "loss hash identical across replay's modes"):
            self.assertEqual(t[name]["status"], report.FAIL, name)
        self.assertIn("full 00ab", t["loss hash identical across replay's modes"]["note"])
        self.assertIn("2 of 7 targets met (5 failed, 0 not judged).", md)
        cells = table_row(md, "full-graph step time / PyTorch graphed")
        self.assertEqual(cells[1:], ["0.910", "<= 0.90", "FAIL"])

    def test_markdown_rows(self):
        md, _, _ = self.run_workloads()
        cells = table_row(md, "replay full")
        # run, median, p10/p90, ÷ PyTorch, host µs, tokens/s, TFLOP/s, MFU, GiB, graphs, setup, hash
        self.assertEqual(cells[1], "90.000")
        self.assertEqual(cells[2], "89.100 / 90.900")
        self.assertEqual(cells[3], "0.900")
        self.assertEqual(cells[5], "22756")
        self.assertEqual(cells[6], "466.7")
        self.assertEqual(cells[8], "65.38")
        self.assertEqual(cells[9], "1 / 900")
        self.assertEqual(cells[10], "300.0 + 500.0")
        self.assertEqual(cells[11], "`00aa`")
        self.assertEqual(table_row(md, "replay none")[3], "0.952")  # against PyTorch eager
        self.assertEqual(table_row(md, "pytorch full")[3], "—")

    def test_missing_runs_are_shown(self):
        runs = workload_runs()
        del runs["replay_gpt3_175b-tp4_layer.json"]
        del runs["pytorch_gpt3_175b-tp4_full.json"]
        md, t, _ = self.run_workloads(runs)
        self.assertEqual(table_row(md, "replay layer")[1], "missing")
        self.assertEqual(table_row(md, "pytorch full")[1], "missing")
        self.assertEqual(table_row(md, "replay full")[3], "—")  # no basis
        full = t["full-graph step time / PyTorch graphed"]
        self.assertEqual(full["status"], report.MISSING)
        self.assertIn("no pytorch run", full["note"])
        self.assertEqual(t["peak memory, layer graphs / eager"]["status"], report.MISSING)
        self.assertEqual(t["capture + instantiate, layer graphs (ms)"]["status"], report.MISSING)
        hashes = t["loss hash identical across replay's modes"]
        self.assertEqual(hashes["status"], report.PASS)  # none and full agree
        self.assertIn("no layer run", hashes["note"])
        # met: eager ratio, full-graph memory, full-graph capture, loss hashes; 3 not judged
        self.assertIn("4 of 7 targets met (0 failed, 3 not judged).", md)

    def test_pytorch_has_no_layer_row(self):
        md, _, _ = self.run_workloads()
        with self.assertRaises(AssertionError):
            table_row(md, "pytorch layer")

    def test_different_shapes_are_not_compared(self):
        runs = workload_runs()
        runs["pytorch_gpt3_175b-tp4_full.json"] = workload_doc("pytorch", "full", 100.0, layers=6)
        md, t, _ = self.run_workloads(runs)
        full = t["full-graph step time / PyTorch graphed"]
        self.assertEqual(full["status"], report.MISMATCH)
        self.assertIn("layers 7 vs 6", full["note"])

    def test_moe_runs_compare_only_at_the_same_blocks(self):
        # replay-moe fits 7 of 671b-ep32's blocks; PyTorch (scripts/pytorch_moe.py) may fit fewer.
        def moe(doc, moe_layers):
            doc = dict(doc, workload="moe", preset="671b-ep32",
                       tool="replay-moe" if doc["tool"] == "replay-gpt3" else "pytorch")
            doc["config"] = {"hidden": 7168, "heads": 64, "seq": 4096, "micro_batch": 1, "dense_layers": 0,
                             "moe_layers": moe_layers, "experts": 256, "local_experts": 8, "topk": 8,
                             "capacity_rows_per_expert": 4096, "steps": 10}
            return doc
        d = os.path.join(self.dir, "moe")
        os.makedirs(d)
        runs = {name.replace("gpt3_175b-tp4", "moe_671b-ep32"): moe(doc, 7) for name, doc in workload_runs().items()}
        runs["pytorch_moe_671b-ep32_full.json"] = moe(workload_doc("pytorch", "full", 100.0), 6)
        for name, doc in runs.items():
            with open(os.path.join(d, name), "w") as f:
                json.dump(doc, f)
        _, verdicts = report.report_workloads(d, os.path.join(self.dir, "out"))
        t = {v["name"]: v for v in verdicts[("moe", "671b-ep32")]}
        full = t["full-graph step time / PyTorch graphed"]
        self.assertEqual(full["status"], report.MISMATCH)
        self.assertIn("moe_layers 7 vs 6", full["note"])
        self.assertEqual(t["eager step time / PyTorch eager"]["status"], report.PASS)  # both 7 blocks
        # At the same blocks the full graph is judged against the issue's own 0.85 (0.90 / 1.00 fails).
        runs["pytorch_moe_671b-ep32_full.json"] = moe(workload_doc("pytorch", "full", 100.0), 7)
        for name, doc in runs.items():
            with open(os.path.join(d, name), "w") as f:
                json.dump(doc, f)
        md, verdicts = report.report_workloads(d, os.path.join(self.dir, "out2"))
        full = {v["name"]: v for v in verdicts[("moe", "671b-ep32")]}["full-graph step time / PyTorch graphed"]
        self.assertEqual((full["limit"], full["status"]), (0.85, report.FAIL))
        with open(md) as f:
            self.assertIn("(moe: 0.85x)", f.read())

    def test_flop_formula_disagreement_is_said(self):
        runs = workload_runs()
        for name in ("pytorch_gpt3_175b-tp4_none.json", "pytorch_gpt3_175b-tp4_full.json"):
            runs[name]["flops_per_step"] = 40e12
        md, t, _ = self.run_workloads(runs)
        self.assertIn("flops_per_step differs", md)
        self.assertEqual(t["full-graph step time / PyTorch graphed"]["status"], report.PASS)

    def test_capture_without_instantiate_time_is_not_judged(self):
        runs = workload_runs()
        runs["replay_gpt3_175b-tp4_full.json"]["graphs_info"]["instantiate_ms"] = None
        _, t, _ = self.run_workloads(runs)
        self.assertEqual(t["capture + instantiate, full graphs (ms)"]["status"], report.MISSING)

    def test_host_delay_runs(self):
        extra = {}
        for d, eager in ((10, 120.0), (40, 180.0)):
            extra[f"replay_gpt3_175b-tp4_none_delay{d}us.json"] = workload_doc("replay", "none", eager, delay=d)
            extra[f"replay_gpt3_175b-tp4_full_delay{d}us.json"] = workload_doc("replay", "full", 90.0, delay=d)
        md, t, out = self.run_workloads(extra=extra)
        # the main table and the targets use the runs without delay
        self.assertEqual(table_row(md, "replay none")[1], "100.000")
        self.assertAlmostEqual(t["eager step time / PyTorch eager"]["value"], 100 / 105)
        section = md[md.index("### Graphs against simulated host delay"):]
        row40 = dict(zip(table_row(section, "host delay µs")[1:], table_row(section, "40")[1:]))
        self.assertEqual(row40["replay none ms"], "180.000")
        self.assertEqual(row40["replay layer ms"], "missing")
        self.assertEqual(row40["replay none / full"], "2.00")
        self.assertEqual(row40["replay none / layer"], "—")
        self.assertNotIn("pytorch none ms", row40)  # PyTorch ran no delays
        points = report.host_delay_points({("replay", "none", 0): workload_doc("replay", "none", 100.0),
                                           ("replay", "full", 0): workload_doc("replay", "full", 90.0),
                                           ("replay", "none", 10): workload_doc("replay", "none", 120.0),
                                           ("replay", "full", 10): workload_doc("replay", "full", 90.0)})
        self.assertEqual([d for d, _ in points[("replay", "full")]], [0, 10])
        self.assertAlmostEqual(points[("replay", "full")][1][1], 120 / 90)
        if HAVE_MATPLOTLIB:
            self.assertTrue(os.path.exists(os.path.join(out, "gpt3_175b-tp4_host_delay.png")))

    def test_no_host_delay_plot_without_delay_runs(self):
        md, _, out = self.run_workloads()
        self.assertNotIn("host_delay.png", md)
        self.assertNotIn("Graphs against simulated host delay", md)
        self.assertFalse(os.path.exists(os.path.join(out, "gpt3_175b-tp4_host_delay.png")))

    def test_other_files_are_ignored(self):
        md, _, _ = self.run_workloads(extra={"replay_ops.json": replay_doc(), "pytorch_ops.json": pytorch_doc(),
                                             "graphs_bench.json": graphs_doc(), "notes.txt": "x"})
        self.assertIn("Inputs: 5 runs", md)

    def test_presets_get_their_own_sections(self):
        tiny = workload_doc("replay", "none", 1.0)
        tiny["preset"] = "tiny"
        md, _, _ = self.run_workloads(extra={"replay_gpt3_tiny_none.json": tiny})
        self.assertIn("## gpt3 175b-tp4", md)
        self.assertIn("## gpt3 tiny", md)

    @unittest.skipUnless(HAVE_MATPLOTLIB, "matplotlib is not importable")
    def test_step_time_plot_written(self):
        extra = {"replay_gpt3_175b-tp4_none_delay20us.json": workload_doc("replay", "none", 140.0, delay=20),
                 "replay_gpt3_175b-tp4_full_delay20us.json": workload_doc("replay", "full", 90.0, delay=20)}
        md, _, out = self.run_workloads(extra=extra)
        for name in ("gpt3_175b-tp4_step_time.png", "gpt3_175b-tp4_host_delay.png"):
            png = os.path.join(out, name)
            self.assertGreater(os.path.getsize(png), 1000, name)
            with open(png, "rb") as f:
                self.assertEqual(f.read(8), b"\x89PNG\r\n\x1a\n")
            self.assertIn(f"]({name})", md)

    def test_without_matplotlib_the_tables_still_come(self):
        with mock.patch.object(report, "_pyplot", return_value=None), \
                contextlib.redirect_stderr(io.StringIO()):
            md, t, out = self.run_workloads()
        self.assertIn("gpt3_175b-tp4_step_time.png not written", md)
        self.assertEqual(t["eager step time / PyTorch eager"]["status"], report.PASS)

    def test_cli_out_defaults_to_dir(self):
        d = os.path.join(self.dir, "cli")
        os.makedirs(d)
        for name, doc in workload_runs().items():
            with open(os.path.join(d, name), "w") as f:
                json.dump(doc, f)
        with contextlib.redirect_stdout(io.StringIO()):
            rc = report.main(["workloads", "--dir", d])
        self.assertEqual(rc, 0)
        self.assertTrue(os.path.exists(os.path.join(d, "workloads_summary.md")))


class MalformedWorkloads(TempDirCase):
    def expect_error(self, files, *fragments):
        d = tempfile.mkdtemp(dir=self.dir)
        for name, doc in files.items():
            with open(os.path.join(d, name), "w") as f:
                f.write(doc if isinstance(doc, str) else json.dumps(doc))
        out = os.path.join(d, "out")
        with self.assertRaises(report.ReportError) as cm:
            report.report_workloads(d, out)
        for fragment in fragments:
            self.assertIn(fragment, str(cm.exception))
        self.assertFalse(os.path.exists(out), "nothing may be written from malformed input")

    def with_bad(self, name, change):
        files = workload_runs()
        change(files[name])
        return files

    def test_empty_directory(self):
        self.expect_error({"replay_ops.json": replay_doc()}, "no workload run")

    def test_missing_directory(self):
        with self.assertRaises(report.ReportError) as cm:
            report.report_workloads(os.path.join(self.dir, "absent"), self.dir)
        self.assertIn("cannot list", str(cm.exception))

    def test_not_json(self):
        self.expect_error({"replay_gpt3_175b-tp4_none.json": "{"}, "replay_gpt3_175b-tp4_none.json",
                          "not valid JSON")

    def test_misnamed_file(self):
        self.expect_error({"replay_gpt3_175b-tp4_eager.json": workload_doc("replay", "none", 1.0)},
                          "replay_gpt3_175b-tp4_eager.json", "must be named")

    def test_name_and_content_disagree(self):
        files = {"replay_gpt3_175b-tp4_full.json": workload_doc("replay", "none", 1.0)}
        self.expect_error(files, "the file name says graphs 'full' but the run has 'none'")
        files = {"pytorch_gpt3_175b-tp4_none.json": workload_doc("replay", "none", 1.0)}
        self.expect_error(files, "the file name says tool 'pytorch' but the run has 'replay'")
        files = {"replay_gpt3_175b-tp4_none_delay5us.json": workload_doc("replay", "none", 1.0)}
        self.expect_error(files, "config.host_delay_us")

    def test_wrong_tool(self):
        files = self.with_bad("replay_gpt3_175b-tp4_none.json", lambda d: d.update(tool="replay-llama31"))
        self.expect_error(files, "'tool' is 'replay-llama31', expected 'replay-gpt3' or 'pytorch'")

    def test_bad_fields(self):
        cases = [
            (lambda d: d.update(graphs="eager"), "'graphs' is 'eager'"),
            (lambda d: d.pop("step_ms"), "'step_ms' must be an object"),
            (lambda d: d["step_ms"].update(median=0), "step_ms.median must be a positive number"),
            (lambda d: d["step_ms"].update(p90="slow"), "step_ms.p90"),
            (lambda d: d["memory"].update(peak_bytes="70 GB"), "memory.peak_bytes must be a number or null"),
            (lambda d: d.update(losses=[1.0, "x"]), "'losses' must be a list of numbers"),
            (lambda d: d.update(loss_hash=12), "'loss_hash' must be a string or null"),
            (lambda d: d.update(mfu=[0.5]), "'mfu' must be a number or null"),
            (lambda d: d["graphs_info"].update(capture_ms="fast"), "graphs_info.capture_ms"),
        ]
        for change, fragment in cases:
            with self.subTest(fragment):
                self.expect_error(self.with_bad("replay_gpt3_175b-tp4_full.json", change),
                                  "replay_gpt3_175b-tp4_full.json", fragment)

    def test_main_reports_error_without_traceback(self):
        d = os.path.join(self.dir, "runs")
        os.makedirs(d)
        with open(os.path.join(d, "replay_gpt3_tiny_none.json"), "w") as f:
            f.write("[]")
        err = io.StringIO()
        with contextlib.redirect_stderr(err):
            rc = report.main(["workloads", "--dir", d])
        self.assertEqual(rc, 1)
        self.assertIn("report.py: error:", err.getvalue())
        self.assertIn("expected a JSON object", err.getvalue())
        self.assertNotIn("Traceback", err.getvalue())


class TimeToTrainReport(TempDirCase):
    def ttt_doc(self, mode, median_ms, steps, seconds, evals=13, eval_s=0.09, loss_hash="00aa"):
        doc = workload_doc("replay", mode, median_ms, loss_hash=loss_hash)
        doc["preset"] = "small"
        doc["loss_floor"] = 1.0837
        doc["target_quality"] = 1.1337
        doc["steps_to_target"] = steps
        doc["time_to_train_s"] = seconds
        doc["evaluation"] = {"metric": "loss", "results": [
            {"step": 250 * (i + 1), "samples": 64, "value": 1.5 - 0.01 * i, "seconds": eval_s}
            for i in range(evals)]}
        return doc

    def test_steps_time_and_evaluation_share_per_mode(self):
        self.write("replay_gpt3_small_none.json", self.ttt_doc("none", 20.0, 3250, 66.0))
        self.write("replay_gpt3_small_layer.json", self.ttt_doc("layer", 18.5, 3250, 61.0))
        self.write("replay_gpt3_small_full.json", self.ttt_doc("full", 17.6, 3250, 58.5, eval_s=0.117))
        md_path = report.report_time_to_train(self.dir, self.dir)
        with open(md_path) as f:
            md = f.read()
        self.assertIn("floor 1.0837 + 0.050", md)
        none = table_row(md, "none")
        self.assertEqual(none[1], "3250")
        self.assertEqual(none[2], "66.0")
        self.assertEqual(none[5], "13")
        self.assertEqual(none[6], "1.17")  # 13 x 0.09 s
        self.assertEqual(none[7], "1.8%")
        self.assertEqual(table_row(md, "full")[7], "2.6%")  # 13 x 0.117 / 58.5
        self.assertIn("- full: time to train 0.886x eager's", md)
        self.assertIn("loss hashes identical in every mode", md)

    def test_unreached_targets_and_differing_hashes_are_said(self):
        self.write("replay_gpt3_small_none.json", self.ttt_doc("none", 20.0, None, None))
        self.write("replay_gpt3_small_full.json", self.ttt_doc("full", 17.6, 3250, 58.5, loss_hash="ffff"))
        with open(report.report_time_to_train(self.dir, self.dir)) as f:
            md = f.read()
        self.assertEqual(table_row(md, "none")[1], "not reached")
        self.assertEqual(table_row(md, "none")[7], "-")
        self.assertIn("loss hashes DIFFER", md)

    def test_a_run_without_a_target_is_refused(self):
        doc = self.ttt_doc("none", 20.0, 3250, 66.0)
        doc["target_quality"] = None
        self.write("replay_gpt3_small_none.json", doc)
        with self.assertRaises(report.ReportError):
            report.report_time_to_train(self.dir, self.dir)


class RunsReport(TempDirCase):
    def write(self, name, graphs, loss_hash, layers=4, tp=1):
        doc = {"tool": "replay-unet", "workload": "unet", "preset": "sd2-b32", "graphs": graphs,
               "config": {"layers": layers, "graphs_extra": graphs}, "step_ms": {"median": 300.0},
               "throughput": {"images_per_s": 106.7, "samples_per_s": 106.7}, "mfu": 0.33,
               "memory": {"peak_bytes": 50 * 2**30}, "loss_hash": loss_hash,
               "parallel": {"tensor_parallel": tp, "data_parallel": 1}}
        with open(os.path.join(self.dir, name + ".json"), "w") as f:
            json.dump(doc, f)

    def test_rows_and_hashes_compared_per_configuration(self):
        self.write("a_none", "none", "h1")
        self.write("a_full", "full", "h1")
        self.write("b_full", "full", "h2", layers=6)  # another configuration: not compared with a
        text = open(report.report_runs(self.dir, self.dir, "UNet")).read()
        self.assertIn("# UNet", text)
        self.assertIn("| a_full | sd2-b32 | full | tp1 x dp1 | 300.000 | 107 images/s | 33.0% | 50.00 | h1 |", text)
        self.assertIn("loss hashes identical in a_full (full), a_none (none)", text)
        self.assertNotIn("DIFFER", text)
        self.write("a_layer", "layer", "h3")
        text = open(report.report_runs(self.dir, self.dir, "UNet")).read()
        self.assertIn("DIFFER", text)

    def test_a_directory_without_runs_is_refused(self):
        with self.assertRaises(report.ReportError):
            report.report_runs(self.dir, self.dir, "x")

    def unet_run(self, batch, graphs, step_ms, host_us, seed=1):
        doc = {"tool": "replay-unet", "workload": "unet", "preset": "sd2-b32", "graphs": graphs,
               "config": {"batch": batch, "latent_height": 64, "seed": seed, "steps": 10},
               "step_ms": {"median": step_ms}, "host_enqueue_us": {"median": host_us, "p90": host_us},
               "throughput": {"images_per_s": batch / step_ms * 1e3}, "memory": {"peak_bytes": 16 * 2**30},
               "loss_hash": f"h{batch}"}
        with open(os.path.join(self.dir, f"replay_unet_b{batch}_{graphs}.json"), "w") as f:
            json.dump(doc, f)

    def test_unet_batch_sweep_puts_host_enqueue_beside_the_step(self):
        self.unet_run(1, "none", 30.737, 30714.0)
        self.unet_run(1, "full", 29.027, 4619.0, seed=2)  # the seed is not part of the model
        self.unet_run(8, "none", 92.877, 92839.0)
        self.unet_run(8, "full", 90.450, 57914.0)
        self.unet_run(32, "none", 309.343, 309530.0)
        self.unet_run(32, "full", 308.895, 307389.0)
        self.unet_run(2, "none", 40.0, 39000.0)  # no full run at 2 images: left out
        text = open(report.report_runs(self.dir, self.dir, "UNet")).read()
        self.assertIn("## UNet batch sweep (sd2-b32 model", text)
        self.assertEqual(table_row(text, "1"),
                         ["1", "30.737", "30.714", "29.027", "4.619", "1.059x", "34.5", "16.00 / 16.00"])
        self.assertEqual(table_row(text, "32")[5], "1.001x")
        with self.assertRaises(AssertionError):
            table_row(text, "2")
        self.assertIn("gains more than 1% at 1, 8 images; it is never slower than eager beyond 1%.", text)

    def test_no_unet_sweep_with_one_batch(self):
        self.unet_run(32, "none", 309.343, 309530.0)
        self.unet_run(32, "full", 308.895, 307389.0)
        text = open(report.report_runs(self.dir, self.dir, "UNet")).read()
        self.assertNotIn("batch sweep", text)

    def write_rnnt(self, name, graphs, decoder, decode_ms, tokens="7c72", loss_hash="h1"):
        doc = {"tool": "replay-rnnt", "workload": "rnnt", "preset": "mlperf-b192", "graphs": graphs,
               "config": {"batch": 192, "decoder": decoder, "eval_graph": "two",
                          "last_eval": {"decoder": decoder, "utterances": 128, "decode_ms": decode_ms,
                                        "decode_utterances_per_s": 128 / decode_ms * 1e3, "encode_ms": 20.0,
                                        "hypothesis_labels": 3000, "tokens_hash": tokens}},
               "step_ms": {"median": 120.0}, "throughput": {"utterances_per_s": 1600.0},
               "memory": {"peak_bytes": 23 * 2**30}, "loss_hash": loss_hash}
        with open(os.path.join(self.dir, name + ".json"), "w") as f:
            json.dump(doc, f)

    def test_rnnt_decoders_side_by_side_against_the_targets(self):
        self.write_rnnt("rnnt_host", "none", "host", 90.0)
        self.write_rnnt("rnnt_unrolled", "none", "unrolled", 40.0)
        self.write_rnnt("rnnt_while_full", "full", "while", 30.0)
        self.write_rnnt("rnnt_while_none", "none", "while", 35.0)
        text = open(report.report_runs(self.dir, self.dir, "RNN-T")).read()
        self.assertIn("## RNN-T greedy decoding", text)
        self.assertIn("| rnnt_while_full | mlperf-b192 | while | full | 30.00 | 4267 | 20.00 | 128 | 3000 |", text)
        # The fastest WHILE run against each other decoder: 90 / 30 = 3.0 >= 2.5, 40 / 30 > 1.
        self.assertIn("| mlperf-b192: WHILE node / host loop throughput (rnnt_while_full vs rnnt_host) | 3.00 "
                      "| >= 2.5 | pass |", text)
        self.assertIn("unrolled graph throughput (rnnt_while_full vs rnnt_unrolled) | 1.33 | > 1 | pass |", text)
        # The decoder and the evaluation's results are not training configuration: hashes still compared.
        self.assertIn("loss hashes identical in", text)

    def test_rnnt_decoding_misses_and_mismatches_are_said(self):
        self.write_rnnt("rnnt_host", "none", "host", 60.0)
        self.write_rnnt("rnnt_while_full", "full", "while", 30.0)
        text = open(report.report_runs(self.dir, self.dir, "RNN-T")).read()
        self.assertIn("| 2.00 | >= 2.5 | FAIL |", text)
        self.assertIn("missing (no unrolled run)", text)
        self.write_rnnt("rnnt_unrolled", "none", "unrolled", 40.0, tokens="ffff")
        text = open(report.report_runs(self.dir, self.dir, "RNN-T")).read()
        self.assertIn("mismatch (tokens differ)", text)

    def test_the_while_run_that_decoded_the_same_tokens_is_compared(self):
        # bench.sh's eager run trains at exact shapes (other weights, other tokens): faster, but not
        # the one to set against the ladder's host loop.
        self.write_rnnt("rnnt_host", "none", "host", 60.0, tokens="aaaa")
        self.write_rnnt("rnnt_while_none", "none", "while", 20.0, tokens="bbbb")
        self.write_rnnt("rnnt_while_full", "full", "while", 25.0, tokens="aaaa")
        text = open(report.report_runs(self.dir, self.dir, "RNN-T")).read()
        self.assertIn("| mlperf-b192: WHILE node / host loop throughput (rnnt_while_full vs rnnt_host) | 2.40 "
                      "| >= 2.5 | FAIL |", text)


class CommReport(TempDirCase):
    def probe_doc(self, ranks=2, wrong=0):
        rows = []
        for collective in ("all_reduce", "all_gather"):
            for size, us in ((8 << 20, 50.0), (1 << 30, 3210.0)):
                for mode, scale in (("eager", 1.0), ("graph", 0.98)):
                    t = us * scale
                    algbw = size / (t * 1e-6) / 1e9
                    factor = 2 * (ranks - 1) / ranks if collective == "all_reduce" else (ranks - 1) / ranks
                    rows.append({"collective": collective, "dtype": "bf16", "mode": mode, "size": size,
                                 "bytes": size, "count": size // 2, "time_us": t, "algbw_gbps": algbw,
                                 "busbw_gbps": algbw * factor, "wrong_elements": 0})
        rows[0]["wrong_elements"] = wrong
        return {"tool": "replay-comm-probe", "environment": {"gpu": "NVIDIA H100 80GB HBM3", "nccl": "2.28.3"},
                "world": {"size": ranks, "local_size": ranks, "one_host": True},
                "protocol": {"warmup": 5, "iters": 20, "in_place": False}, "results": rows}

    def test_tables_and_anchor(self):
        path = self.write("probe.json", self.probe_doc())
        text = open(report.report_comm(path, self.dir)).read()
        self.assertIn("2 ranks on NVIDIA H100 80GB HBM3, NCCL 2.28.3; out of place", text)
        self.assertIn("Results: pass, every element exact", text)
        self.assertIn("## all_reduce, bf16", text)
        self.assertIn("| 1 GiB | 3210.00 | 334.5 | 3145.80 | 341.3 |", text)
        self.assertIn("## all_gather, bf16", text)
        self.assertIn("| 1 GiB | 3210.00 | 167.2 |", text)  # (n-1)/n of the same time's algbw
        # 8 MiB in 50 us: 167.8 GB/s against 169; 1 GiB against 334. Sizes the run lacks are left out.
        self.assertIn("| 8 MiB | 167.8 | 169 | 0.99 |", text)
        self.assertIn("| 1 GiB | 334.5 | 334 | 1.00 |", text)
        self.assertNotIn("| 64 MiB |", text)

    def test_wrong_results_and_four_ranks(self):
        path = self.write("probe.json", self.probe_doc(ranks=4, wrong=3))
        text = open(report.report_comm(path, self.dir)).read()
        self.assertIn("Results: FAIL, 3 element(s) wrong", text)
        self.assertNotIn("against the anchor", text)  # a two-GPU measurement

    def test_malformed_input_is_named(self):
        doc = self.probe_doc()
        del doc["results"][2]["busbw_gbps"]
        with self.assertRaisesRegex(report.ReportError, r"results\[2\] has no busbw_gbps"):
            report.report_comm(self.write("probe.json", doc), self.dir)
        with self.assertRaisesRegex(report.ReportError, "expected replay-comm-probe"):
            report.report_comm(self.write("probe.json", {"tool": "replay-gpt3"}), self.dir)
        doc = self.probe_doc()
        doc["world"]["size"] = 1
        with self.assertRaisesRegex(report.ReportError, "world.size"):
            report.report_comm(self.write("probe.json", doc), self.dir)



class MultiGpuReport(TempDirCase):
    """bench.sh's multi_gpu runs against issue 27's targets."""

    def run_doc(self, tool, mode, median_ms, tp=1, dp=1, loss_hash="aa", buckets=0, peak=20e9):
        doc = workload_doc(tool, mode, median_ms, peak_bytes=peak, loss_hash=loss_hash)
        doc["parallel"] = {"world_size": tp * dp, "tensor_parallel": tp, "data_parallel": dp,
                           "grad_buckets": buckets}
        return doc

    def write_runs(self, tp_full=104.0, pytorch_full=125.0, dp_layer=50.0, sp_hash="bb"):
        for mode, ms in (("none", 105.0), ("layer", 104.5), ("full", tp_full)):
            self.write(f"replay_gpt3_175b_tp2_{mode}.json", self.run_doc("replay", mode, ms, tp=2, loss_hash="bb"))
            self.write(f"replay_gpt3_175b_tp2sp_{mode}.json",
                       self.run_doc("replay", mode, ms, tp=2, loss_hash=sp_hash if mode == "full" else "bb"))
            self.write(f"replay_gpt3_175b_tp2shard_1gpu_{mode}.json", self.run_doc("replay", mode, 100.0))
        for mode, ms in (("none", 47.0), ("layer", dp_layer), ("full", 47.0)):
            self.write(f"replay_gpt3_175b-tp4_dp2_{mode}.json",
                       self.run_doc("replay", mode, ms, dp=2, loss_hash="cc", buckets=10, peak=19e9))
        self.write("replay_gpt3_175b-tp4_dp2_onebucket_full.json",
                   self.run_doc("replay", "full", 51.0, dp=2, loss_hash="cc", buckets=1, peak=19e9))
        self.write("replay_gpt3_175b-tp4_1gpu_full.json", self.run_doc("replay", "full", 42.0, peak=27e9))
        self.write("pytorch_gpt3_175b_tp2_full.json", self.run_doc("pytorch", "full", pytorch_full, tp=2))
        self.write("pytorch_gpt3_175b_tp2_none.json", self.run_doc("pytorch", "none", pytorch_full + 1, tp=2))
        self.write("probe_sweep.json", {"tool": "replay-comm-probe"})  # not a run: ignored

    def summary(self):
        with open(report.report_multi_gpu(self.dir, self.dir)) as f:
            return f.read()

    def test_targets_pass_and_fail_on_their_limits(self):
        self.write_runs()
        md = self.summary()
        self.assertEqual(table_row(md, "tp2 full step / the shard on one GPU")[1:4], ["1.040", "<= 1.12", "pass"])
        self.assertEqual(table_row(md, "tp2 full step / PyTorch tp2 graphed")[1:4], ["0.832", "<= 0.85", "pass"])
        self.assertEqual(table_row(md, "tp2sp full step / the shard on one GPU")[3], "pass")
        row = table_row(md, "dp2 layer step / eager")
        self.assertEqual(row[1:4], ["1.064", "<= 1.01", "FAIL"])
        self.assertEqual(table_row(md, "dp2 full step / eager")[3], "pass")
        self.assertEqual(table_row(md, "tp2: loss hash identical across modes")[3], "pass")
        self.assertEqual(table_row(md, "collectives' bus bandwidth / the probe's at the same size")[2:4],
                         [">= 0.80", "missing"])
        self.assertIn("dp2 full: 47.00 ms, 10 gradient bucket(s), 1.119x the shard on one GPU (42.00 ms)", md)
        self.assertIn("dp2_onebucket full: 51.00 ms, 1 gradient bucket(s)", md)
        self.assertIn("Loss hashes identical across dp2 (cc), dp2_onebucket (cc)", md)

    def test_a_slow_tp_step_a_slow_replay_and_differing_hashes_fail(self):
        self.write_runs(tp_full=115.0, pytorch_full=130.0, sp_hash="dd")
        md = self.summary()
        self.assertEqual(table_row(md, "tp2 full step / the shard on one GPU")[1:4], ["1.150", "<= 1.12", "FAIL"])
        self.assertEqual(table_row(md, "tp2 full step / PyTorch tp2 graphed")[1:4], ["0.885", "<= 0.85", "FAIL"])
        row = table_row(md, "tp2sp: loss hash identical across modes")
        self.assertEqual(row[3], "FAIL")
        self.assertIn("full dd", row[4])

    def test_missing_pytorch_is_missing_not_passed(self):
        self.write_runs()
        os.remove(os.path.join(self.dir, "pytorch_gpt3_175b_tp2_full.json"))
        md = self.summary()
        self.assertEqual(table_row(md, "tp2 full step / PyTorch tp2 graphed")[3], "missing")

    def test_the_steps_collectives_against_the_probe(self):
        self.write_runs()
        doc = self.run_doc("replay", "full", 104.0, tp=2, loss_hash="bb")
        doc["parallel"]["collectives"] = [
            {"comm": "tensor-parallel", "collective": "all_reduce", "dtype": "bf16", "bytes": 48 << 20,
             "calls_per_step": 14, "median_us": 200.0, "busbw_gbps": 251.7},
            {"comm": "tensor-parallel", "collective": "all_gather", "dtype": "f32", "bytes": 96 << 20,
             "calls_per_step": 1, "median_us": 900.0, "busbw_gbps": 55.9},
            {"comm": "tensor-parallel", "collective": "reduce_scatter", "dtype": "bf16", "bytes": 24 << 20,
             "calls_per_step": 1, "median_us": 100.0, "busbw_gbps": 125.8},
            {"comm": "tensor-parallel", "collective": "all_gather", "dtype": "f32", "bytes": 48 << 10,
             "calls_per_step": 1, "median_us": 12.0, "busbw_gbps": 2.0},  # latency-bound: not judged
            {"comm": "data-parallel", "collective": "all_reduce", "dtype": "bf16", "bytes": 48 << 20,
             "calls_per_step": 1, "median_us": 500.0, "busbw_gbps": 100.0, "overlapped": True}]
        self.write("replay_gpt3_175b_tp2_full.json", doc)
        os.makedirs(os.path.join(self.dir, "comm"))
        probe = {"tool": "replay-comm-probe", "results": [
            {"collective": "all_reduce", "dtype": "bf16", "mode": "eager", "bytes": 48 << 20, "busbw_gbps": 262.0},
            {"collective": "all_reduce", "dtype": "bf16", "mode": "graph", "bytes": 48 << 20, "busbw_gbps": 999.0},
            {"collective": "all_gather", "dtype": "fp32", "mode": "eager", "bytes": 96 << 20, "busbw_gbps": 250.0}]}
        self.write("comm/probe_step_sizes.json", probe)
        md = self.summary()
        row = table_row(md, "tp2: tensor-parallel all_reduce bf16 48 MiB, bus bandwidth / the probe's")
        self.assertEqual(row[1:4], ["0.961", ">= 0.80", "pass"])  # against the eager probe, not the graph
        row = table_row(md, "tp2: tensor-parallel all_gather f32 96 MiB, bus bandwidth / the probe's")
        self.assertEqual(row[1:4], ["0.224", ">= 0.80", "FAIL"])
        row = table_row(md, "tp2: tensor-parallel reduce_scatter bf16 24 MiB, bus bandwidth / the probe's")
        self.assertEqual(row[3], "missing")
        self.assertIn("did not run this collective", row[4])
        self.assertNotIn("48 KiB", md)
        row = table_row(md, "tp2: data-parallel all_reduce bf16 48 MiB, bus bandwidth / the probe's")
        self.assertEqual(row[1], "0.382")
        self.assertEqual(row[3], report.INFO)  # overlapped with the backward: not judged
        self.assertIn("overlapped with the backward", row[4])

    def test_overlapped_buckets_must_beat_one_bucket(self):
        self.write_runs()
        md = self.summary()
        self.assertEqual(table_row(md, "dp2 full step, buckets overlapped / one bucket after the backward")[1:4],
                         ["0.922", "<= 1.00", "pass"])
        self.write("replay_gpt3_175b-tp4_dp2_full.json",
                   self.run_doc("replay", "full", 52.0, dp=2, loss_hash="cc", buckets=10, peak=19e9))
        md = self.summary()
        self.assertEqual(table_row(md, "dp2 full step, buckets overlapped / one bucket after the backward")[3], "FAIL")

    def test_llama_layouts_are_kept_apart_from_gpt3s(self):
        self.write_runs()
        for mode, ms in (("none", 300.0), ("layer", 299.0), ("full", 330.0)):
            self.write(f"replay_llama31_405b_tp4sp_{mode}.json",
                       self.run_doc("replay", mode, ms, tp=4, loss_hash="ee"))
        self.write("replay_llama31_405b_tp4shard_1gpu_full.json", self.run_doc("replay", "full", 280.0))
        md = self.summary()
        self.assertEqual(table_row(md, "llama31-tp4sp full step / the shard on one GPU")[1:4],
                         ["1.179", "<= 1.12", "FAIL"])
        self.assertEqual(table_row(md, "llama31-tp4sp full step / eager")[3], "FAIL")
        self.assertEqual(table_row(md, "llama31-tp4sp: loss hash identical across modes")[3], "pass")
        self.assertNotIn("llama31-tp4sp full step / PyTorch", md)  # PyTorch's TP models GPT-3 only
        self.assertEqual(table_row(md, "tp2 full step / the shard on one GPU")[1], "1.040")  # GPT-3's unchanged

    def test_a_directory_without_runs_is_an_error(self):
        self.write("probe_sweep.json", {"tool": "replay-comm-probe"})
        with self.assertRaisesRegex(report.ReportError, "no multi-GPU run JSON"):
            report.report_multi_gpu(self.dir, self.dir)

if __name__ == "__main__":
    unittest.main()
