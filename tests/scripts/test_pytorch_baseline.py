#!/usr/bin/env python3
"""Tests of scripts/pytorch_baseline.py's pure parts (shape table, FLOP formulas, names, statistics, JSON
entries, argument errors), run without torch; importing the script must not import torch."""

import importlib.util
import os
import re
import subprocess
import sys
import tempfile
import unittest

SCRIPTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "scripts")
sys.path.insert(0, SCRIPTS)
TORCH_PRESENT = "torch" in sys.modules or importlib.util.find_spec("torch") is not None
import pytorch_baseline as pb  # noqa: E402


def run_cli(*args):
    return subprocess.run([sys.executable, os.path.join(SCRIPTS, "pytorch_baseline.py"), *args],
                          capture_output=True, text=True, timeout=60)


class Import(unittest.TestCase):
    @unittest.skipIf(TORCH_PRESENT, "torch is installed here")
    def test_import_does_not_need_torch(self):
        self.assertNotIn("torch", sys.modules)


class Shapes(unittest.TestCase):
    def test_gemm_directions(self):
        M, N, K = 2048, 9216, 12288
        self.assertEqual(pb.gemm_shape("fwd", M, N, K), {"m": M, "n": N, "k": K})
        self.assertEqual(pb.gemm_shape("dgrad", M, N, K), {"m": M, "n": K, "k": N})
        self.assertEqual(pb.gemm_shape("wgrad", M, N, K), {"m": N, "n": K, "k": M})
        with self.assertRaises(ValueError):
            pb.gemm_shape("bwd", M, N, K)

    def test_schema_table(self):
        # reports/SCHEMA.md, one row per (shard, layer): M, N, K
        expected = {
            "gpt3_175b_tp4.qkv": (2048, 9216, 12288), "gpt3_175b_tp4.proj": (2048, 12288, 3072),
            "gpt3_175b_tp4.fc1": (2048, 12288, 12288), "gpt3_175b_tp4.fc2": (2048, 12288, 12288),
            "llama31_405b_tp8.qkv": (8192, 2304, 16384), "llama31_405b_tp8.proj": (8192, 16384, 2048),
            "llama31_405b_tp8.fc1": (8192, 13312, 16384), "llama31_405b_tp8.fc2": (8192, 16384, 6656),
        }
        fwd = {s["name"][:-len(".fwd")]: s for s in pb.op_specs() if s["kind"] == "gemm"
               and s["direction"] == "fwd"}
        self.assertEqual(set(fwd), set(expected))
        for layer, (M, N, K) in expected.items():
            self.assertEqual(fwd[layer]["shape"], {"m": M, "n": N, "k": K}, layer)
            self.assertEqual(fwd[layer]["dims"], (M, N, K), layer)
        att = {s["shard"]: s["shape"] for s in pb.op_specs() if s["kind"] == "attention"}
        self.assertEqual(att["gpt3_175b_tp4"],
                         {"batch": 1, "q_heads": 24, "kv_heads": 24, "seq": 2048, "head_dim": 128})
        self.assertEqual(att["llama31_405b_tp8"],
                         {"batch": 1, "q_heads": 16, "kv_heads": 1, "seq": 8192, "head_dim": 128})


class Flops(unittest.TestCase):
    def test_gemm_flops_equal_across_directions(self):
        by_layer = {}
        for s in pb.op_specs():
            if s["kind"] == "gemm":
                by_layer.setdefault(s["name"].rsplit(".", 1)[0], set()).add(s["flops"])
        self.assertEqual(by_layer["gpt3_175b_tp4.qkv"], {2.0 * 2048 * 9216 * 12288})
        self.assertTrue(all(len(f) == 1 for f in by_layer.values()))

    def test_attention_flops(self):
        gpt = {"batch": 1, "q_heads": 24, "kv_heads": 24, "seq": 2048, "head_dim": 128}
        fwd = 4 * 24 * 2048**2 * 128 / 2
        self.assertEqual(pb.attention_flops(gpt, "fwd"), fwd)
        self.assertEqual(pb.attention_flops(gpt, "fwd_bwd"), 3.5 * fwd)
        llama = {"batch": 1, "q_heads": 16, "kv_heads": 1, "seq": 8192, "head_dim": 128}
        self.assertEqual(pb.attention_flops(llama, "fwd"), 4 * 16 * 8192**2 * 128 / 2)
        with self.assertRaises(ValueError):
            pb.attention_flops(gpt, "bwd")


class Names(unittest.TestCase):
    def test_all_names(self):
        names = [s["name"] for s in pb.op_specs()]
        self.assertEqual(len(names), len(set(names)))
        expected = set()
        for shard in ("gpt3_175b_tp4", "llama31_405b_tp8"):
            expected |= {f"{shard}.{layer}.{d}" for layer in ("qkv", "proj", "fc1", "fc2")
                         for d in ("fwd", "dgrad", "wgrad")}
            expected |= {f"{shard}.attention.fwd", f"{shard}.attention.fwd_bwd",
                         f"{shard}.attention.fwd_bwd@flash", f"{shard}.attention.fwd_bwd@cudnn"}
        self.assertEqual(set(names), expected)

    def test_backend_variants(self):
        specs = {s["name"]: s for s in pb.op_specs()}
        self.assertIsNone(specs["gpt3_175b_tp4.attention.fwd_bwd"]["backend"])
        self.assertEqual(specs["gpt3_175b_tp4.attention.fwd_bwd@cudnn"]["backend"], "cudnn")
        self.assertEqual(specs["gpt3_175b_tp4.attention.fwd_bwd@flash"]["flops"],
                         specs["gpt3_175b_tp4.attention.fwd_bwd"]["flops"])

    def test_only_filter(self):
        names = [s["name"] for s in pb.op_specs(re.compile(r"llama.*\.fc2\."))]
        self.assertEqual(names, ["llama31_405b_tp8.fc2.fwd", "llama31_405b_tp8.fc2.dgrad",
                                 "llama31_405b_tp8.fc2.wgrad"])
        self.assertEqual(pb.op_specs(re.compile("nothing")), [])


class Statistics(unittest.TestCase):
    def test_percentiles_interpolate(self):
        s = pb.summarize([5.0, 1.0, 3.0, 2.0, 4.0])
        self.assertEqual(s["median_ms"], 3.0)
        self.assertAlmostEqual(s["p10_ms"], 1.4)
        self.assertAlmostEqual(s["p90_ms"], 4.6)
        self.assertEqual(pb.percentile([7.0], 90), 7.0)
        with self.assertRaises(ValueError):
            pb.percentile([], 50)

    def test_result_entry(self):
        spec = next(s for s in pb.op_specs() if s["name"] == "gpt3_175b_tp4.qkv.fwd")
        r = pb.make_result(spec, [1.0, 1.0, 1.0], peak_tflops=800.0)
        self.assertEqual(r["median_ms"], 1.0)
        self.assertAlmostEqual(r["tflops"], 2 * 2048 * 9216 * 12288 / 1e-3 / 1e12)
        self.assertAlmostEqual(r["fraction_of_peak"], r["tflops"] / 800.0)
        self.assertIsNone(r["bytes"])
        self.assertIsNone(r["gbps"])
        self.assertEqual(r["dtype"], "bf16")
        self.assertNotIn("backend", r)

    def test_unmeasured_entry_is_null_with_note(self):
        spec = next(s for s in pb.op_specs() if s["name"].endswith("fwd_bwd@cudnn"))
        r = pb.make_result(spec, None, 800.0, note="CUDNN_ATTENTION refused", backend_used="CUDNN_ATTENTION")
        for key in ("median_ms", "p10_ms", "p90_ms", "tflops", "fraction_of_peak"):
            self.assertIsNone(r[key], key)
        self.assertEqual(r["note"], "CUDNN_ATTENTION refused")
        self.assertEqual(r["backend"], "CUDNN_ATTENTION")
        self.assertIsNotNone(r["flops"])


class CommandLine(unittest.TestCase):
    def test_bad_regex_is_a_usage_error(self):
        p = run_cli("ops", "--json", os.devnull, "--only", "(")
        self.assertEqual(p.returncode, 2)
        self.assertIn("not a regular expression", p.stderr)

    def test_only_matching_nothing(self):
        p = run_cli("ops", "--json", os.devnull, "--only", "no_such_op")
        self.assertEqual(p.returncode, 2)
        self.assertIn("matches no op", p.stderr)
        self.assertNotIn("Traceback", p.stderr)

    def test_repeats_must_be_positive(self):
        p = run_cli("ops", "--json", os.devnull, "--repeats", "0")
        self.assertEqual(p.returncode, 2)

    @unittest.skipIf(TORCH_PRESENT, "torch is installed here (the no-torch path cannot be exercised)")
    def test_no_torch_is_a_clear_error(self):
        with tempfile.TemporaryDirectory() as d:
            out = os.path.join(d, "out.json")
            p = run_cli("ops", "--json", out)
            self.assertEqual(p.returncode, 2)
            self.assertIn("pytorch_baseline.py: error: PyTorch is not importable", p.stderr)
            self.assertNotIn("Traceback", p.stderr)
            self.assertFalse(os.path.exists(out))


if __name__ == "__main__":
    unittest.main()
