#!/usr/bin/env python3
"""Tests of scripts/report.py: synthetic benchmark JSON in a temporary directory, the markdown rows,
ratios and verdicts it yields, the plots, and clear errors on malformed input. CPU only; the plot tests
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
        entry("s.attention.fwd_bwd", "attention", 1.0),  # pytorch 0.98 -> pass
        entry("t.attention.fwd_bwd", "attention", 1.0),  # pytorch 0.96 -> fail
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
        self.assertEqual(cells[4], "0.700")
        self.assertEqual(cells[6], "FAIL")

    def test_markdown_rows(self):
        md, _, _, _ = self.run_ops()
        cells = table_row(md, "`s.qkv.dgrad`")
        self.assertEqual(cells[1], "gemm")
        self.assertEqual(cells[2], "m=2048 n=9216 k=12288")
        self.assertEqual(cells[3], "1")
        self.assertEqual(cells[4], "0.94")
        self.assertEqual(cells[5], "1000.0")  # 1e12 flops in 1 ms
        self.assertEqual(cells[6], "0.940")
        self.assertEqual(cells[7], "0.95")
        self.assertEqual(cells[8], "FAIL")
        self.assertIn("(CUDNN_ATTENTION)", table_row(md, "`s.attention.fwd_bwd`")[4])

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
        # op, replay, default, @flash, @cudnn, replay/default, replay/@flash, replay/@cudnn
        self.assertEqual(cells[1], "1")
        self.assertEqual(cells[2], "0.98 (CUDNN_ATTENTION)")
        self.assertEqual(cells[3], "1.25")
        self.assertEqual(cells[6], "1.250")
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

    def test_without_matplotlib_the_tables_still_come(self):
        with mock.patch.object(report, "_pyplot", return_value=None), \
                contextlib.redirect_stderr(io.StringIO()) as err:
            md, rows, _, out = self.run_ops()
        self.assertIn("ops_ratio.png not written: matplotlib is not importable", md)
        self.assertIn("warning", err.getvalue())
        self.assertFalse(os.path.exists(os.path.join(out, "ops_ratio.png")))
        self.assertEqual(rows["s.qkv.fwd"]["status"], report.PASS)

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


if __name__ == "__main__":
    unittest.main()
