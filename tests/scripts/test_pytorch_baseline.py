#!/usr/bin/env python3
"""Tests of scripts/pytorch_baseline.py's pure parts, run without torch: the ops shape table, FLOP formulas,
names, statistics and JSON entries; the gpt3 shard's shapes, parameter counts, FLOPs, default layers,
learning-rate schedule, data order, token-file checks, loss hash and JSON document; the llama31 shard's
shapes against replay-llama31's presets, parameter counts, FLOPs, default layers, optimizer, RoPE
frequencies and JSON document; argument errors. Importing the script must not import torch."""

import importlib.util
import json
import math
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
import report  # noqa: E402


def run_cli(*args):
    return subprocess.run([sys.executable, os.path.join(SCRIPTS, "pytorch_baseline.py"), *args],
                          capture_output=True, text=True, timeout=60)


class Import(unittest.TestCase):
    @unittest.skipIf(TORCH_PRESENT, "torch is installed here")
    def test_import_does_not_need_torch(self):
        self.assertNotIn("torch", sys.modules)
        self.assertNotIn("pytorch_gpt3", sys.modules)  # the model module is loaded only to run


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
                         f"{shard}.attention.fwd_bwd@flash", f"{shard}.attention.fwd_bwd@cudnn",
                         f"{shard}.attention.fwd_bwd@deterministic"}
        self.assertEqual(set(names), expected)

    def test_backend_variants(self):
        specs = {s["name"]: s for s in pb.op_specs()}
        self.assertIsNone(specs["gpt3_175b_tp4.attention.fwd_bwd"]["backend"])
        self.assertEqual(specs["gpt3_175b_tp4.attention.fwd_bwd@cudnn"]["backend"], "cudnn")
        self.assertEqual(specs["gpt3_175b_tp4.attention.fwd_bwd@flash"]["flops"],
                         specs["gpt3_175b_tp4.attention.fwd_bwd"]["flops"])
        det = specs["llama31_405b_tp8.attention.fwd_bwd@deterministic"]
        self.assertEqual(det["backend"], pb.ATTENTION_DETERMINISTIC)  # the default selection, deterministic
        self.assertEqual(det["direction"], "fwd_bwd")
        self.assertNotIn(pb.ATTENTION_DETERMINISTIC, pb.ATTENTION_BACKENDS)  # no backend is forced

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

    def test_repeats_within_a_budget(self):
        # floor(budget / call), at least min(5, repeats), at most repeats: replay's bench::repeats_within
        self.assertEqual(pb.repeats_within(25.0, 2.25, 5, 50), 11)
        self.assertEqual(pb.repeats_within(25.0, 5.1, 5, 50), 5)     # 4.9 calls: the floor of 5
        self.assertEqual(pb.repeats_within(25.0, 50.0, 5, 50), 5)
        self.assertEqual(pb.repeats_within(25.0, 0.02, 5, 50), 50)   # 1250 fit: --repeats
        self.assertEqual(pb.repeats_within(25.0, 10.0, 5, 3), 3)     # fewer repeats than the floor
        self.assertEqual(pb.repeats_within(0.0, 2.25, 5, 50), 50)    # no budget
        self.assertEqual(pb.repeats_within(25.0, 0.0, 5, 50), 50)    # too fast to time
        self.assertEqual(pb.repeats_within(25.0, float("nan"), 5, 50), 50)
        self.assertEqual(pb.MIN_BUDGET_REPEATS, 5)

    def test_result_entry(self):
        spec = next(s for s in pb.op_specs() if s["name"] == "gpt3_175b_tp4.qkv.fwd")
        r = pb.make_result(spec, [1.0, 1.25, 1.0], peak_tflops=800.0)
        self.assertEqual(r["median_ms"], 1.0)
        self.assertEqual(r["samples_ms"], [1.0, 1.25, 1.0])  # every timed call, in call order
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
        self.assertNotIn("samples_ms", r)
        self.assertEqual(r["note"], "CUDNN_ATTENTION refused")
        self.assertEqual(r["backend"], "CUDNN_ATTENTION")
        self.assertIsNotNone(r["flops"])


TP4 = pb.gpt3_config("175b-tp4")
TP8 = pb.gpt3_config("175b-tp8")


class Gpt3Shapes(unittest.TestCase):
    def test_tp4_shard(self):
        for key, value in {"hidden": 12288, "heads": 24, "head_dim": 128, "ffn": 12288, "seq": 2048,
                           "micro_batch": 1, "vocab": 50688, "vocab_shard": 12672, "data_vocab": 50257,
                           "tp": 4, "model_layers": 96}.items():
            self.assertEqual(TP4[key], value, key)

    def test_tp8_shard(self):
        self.assertEqual((TP8["heads"], TP8["ffn"], TP8["vocab_shard"], TP8["tp"]), (12, 6144, 6400, 8))

    def test_tiny_is_small(self):
        tiny = pb.gpt3_config("tiny")
        self.assertLess(pb.gpt3_params(tiny, pb.default_layers(tiny)), 10_000_000)
        self.assertEqual(tiny["vocab_shard"], tiny["vocab"])  # TP 1: the whole vocabulary

    def test_vocab_padding(self):
        self.assertEqual(pb.padded_vocab(50257), 50304)
        self.assertEqual(pb.padded_vocab(512), 512)
        self.assertEqual(pb.padded_vocab(513), 640)

    def test_unknown_preset(self):
        with self.assertRaises(ValueError):
            pb.gpt3_config("175b-tp3")

    def test_layer_params_match_the_op_shapes(self):
        # reference/workloads.md: about 453M parameters per layer per GPU at TP4; the weights are exactly
        # the GEMMs that `ops` times for the same shard, plus biases and two LayerNorms.
        weights = sum(n * k for _, n, k in pb.SHARDS["gpt3_175b_tp4"]["linears"])
        biases = 9216 + 3 * 12288
        self.assertEqual(pb.gpt3_layer_params(TP4), weights + biases + 4 * 12288)
        self.assertEqual(pb.gpt3_layer_params(TP4), 453_080_064)

    def test_embedding_params(self):
        self.assertEqual(pb.gpt3_embedding_params(TP4), 12672 * 12288 + 2048 * 12288 + 2 * 12288)
        self.assertEqual(pb.gpt3_params(TP4, 7), 7 * 453_080_064 + pb.gpt3_embedding_params(TP4))

    def test_whole_model_at_tp1_is_gpt3_175b(self):
        full = dict(TP4, heads=96, ffn=49152, vocab_shard=50304, tp=1)
        n = pb.gpt3_params(full, 96)
        self.assertAlmostEqual(n / 175e9, 1.0, delta=0.005)
        per_token = pb.flops_per_step(full, 96) / 2048
        self.assertAlmostEqual(per_token / 1.077e12, 1.0, delta=0.005)  # reference/workloads.md


class Gpt3Flops(unittest.TestCase):
    def test_formula(self):
        tokens = 2048
        expected = 6.0 * pb.gpt3_params(TP4, 7) * tokens + 12.0 * 7 * 2048 * (24 * 128) * tokens
        self.assertEqual(pb.flops_per_step(TP4, 7), expected)

    def test_attention_term_uses_this_shards_heads(self):
        # Halving the heads per GPU (TP4 -> TP8) halves the attention term.
        attn = lambda cfg: pb.flops_per_step(cfg, 1) - 6.0 * pb.gpt3_params(cfg, 1) * 2048  # noqa: E731
        self.assertAlmostEqual(attn(TP4) / attn(TP8), 2.0)

    def test_formula_string_in_the_json_says_what_d_is(self):
        self.assertIn("6*N*tokens + 12*L*s*d*tokens", pb.FLOPS_FORMULA)
        self.assertIn("heads x head_dim", pb.FLOPS_FORMULA)


class Gpt3DefaultLayers(unittest.TestCase):
    def test_what_fits_an_80gb_h100(self):
        self.assertEqual(pb.default_layers(TP4), 7)
        self.assertEqual(pb.default_layers(TP8), 15)
        # and the state of those layers does fit the budget, one more layer does not
        for cfg, layers in ((TP4, 7), (TP8, 15)):
            self.assertLessEqual(18 * pb.gpt3_params(cfg, layers), pb.STATE_BUDGET_BYTES)
            self.assertGreater(18 * pb.gpt3_params(cfg, layers + 1), pb.STATE_BUDGET_BYTES)

    def test_capped_by_the_model_and_at_least_one(self):
        tiny = pb.gpt3_config("tiny")
        self.assertEqual(pb.default_layers(tiny), tiny["model_layers"])
        self.assertEqual(pb.default_layers(TP4, budget_bytes=1), 1)

    def test_bytes_per_parameter(self):
        self.assertEqual(pb.STATE_BYTES_PER_PARAM, 4 + 2 + 4 + 4 + 4)
        self.assertGreater(pb.default_layers(TP4, bytes_per_param=16), 7)


class Gpt3Schedule(unittest.TestCase):
    def test_warmup_then_cosine(self):
        o = pb.GPT3_OPTIMIZER
        self.assertAlmostEqual(pb.lr_at(0), o["lr"] / o["warmup_steps"])
        self.assertAlmostEqual(pb.lr_at(o["warmup_steps"] - 1), o["lr"])
        self.assertAlmostEqual(pb.lr_at(o["warmup_steps"]), o["lr"])
        middle = (o["warmup_steps"] + o["decay_steps"]) / 2
        self.assertAlmostEqual(pb.lr_at(middle), (o["lr"] + o["min_lr"]) / 2)
        self.assertAlmostEqual(pb.lr_at(o["decay_steps"]), o["min_lr"])
        self.assertAlmostEqual(pb.lr_at(10 * o["decay_steps"]), o["min_lr"])
        lrs = [pb.lr_at(s) for s in range(0, 2 * o["decay_steps"], 997)]
        peak = lrs.index(max(lrs))
        self.assertTrue(all(a <= b for a, b in zip(lrs[:peak], lrs[1:peak + 1])))
        self.assertTrue(all(a >= b for a, b in zip(lrs[peak:], lrs[peak + 1:])))

    def test_mlperf_hyperparameters(self):
        o = pb.GPT3_OPTIMIZER
        self.assertEqual((o["betas"], o["eps"], o["weight_decay"], o["clip_norm"]),
                         ((0.9, 0.95), 1e-8, 0.1, 1.0))
        self.assertEqual(o["warmup_steps"], math.ceil(265 * 1536 / 1536))


class Gpt3Data(unittest.TestCase):
    def test_sequential_batches_skip_leftovers_and_wrap(self):
        self.assertEqual(pb.sequential_batches(5, 2, 5), [[0, 1], [2, 3], [0, 1], [2, 3], [0, 1]])
        self.assertEqual(pb.sequential_batches(3, 1, 4), [[0], [1], [2], [0]])
        with self.assertRaises(ValueError):
            pb.sequential_batches(1, 2, 1)

    def test_shard_entropy(self):
        self.assertAlmostEqual(pb.shard_entropy(512, 512), math.log(512))
        # 50257 ids onto 12576: 12529 shard ids receive 4 source ids, 47 receive 3
        p4, p3 = 4 / 50257, 3 / 50257
        expected = -(12529 * p4 * math.log(p4) + 47 * p3 * math.log(p3))
        self.assertAlmostEqual(pb.shard_entropy(50257, 12576), expected)
        self.assertLess(pb.shard_entropy(50257, 12576), math.log(12576))

    def good_attrs(self, **changes):
        attrs = {"format": b"replay-tokens", "format_version": 1, "vocab_size": 50257, "seq_len": 2048,
                 "num_sequences": 16}
        attrs.update(changes)
        return attrs

    def test_token_file_accepted(self):
        self.assertIsNone(pb.token_file_problem(self.good_attrs(), (16, 2049), True, TP4))
        self.assertIsNone(pb.token_file_problem(self.good_attrs(format="replay-tokens"), (16, 2049), True, TP4))

    def test_token_file_problems(self):
        cases = [
            (self.good_attrs(format="other"), (16, 2049), True, "format is"),
            (self.good_attrs(format_version=2), (16, 2049), True, "format_version"),
            (self.good_attrs(), None, True, "no dataset /tokens"),
            (self.good_attrs(), (16, 2049, 1), True, "rank 3"),
            (self.good_attrs(), (16, 2049), False, "not 32-bit integers"),
            (self.good_attrs(seq_len=0), (16, 1), True, "seq_len is 0"),
            (self.good_attrs(vocab_size=1.5), (16, 2049), True, "vocab_size is 1.5"),
            (self.good_attrs(), (15, 2049), True, "/tokens shape [15, 2049]"),
            (self.good_attrs(seq_len=1024), (16, 1025), True, "not the model's 2048"),
            (self.good_attrs(vocab_size=60000), (16, 2049), True, "larger than the model's vocabulary 50688"),
        ]
        for attrs, shape, is_int32, fragment in cases:
            with self.subTest(fragment):
                self.assertIn(fragment, pb.token_file_problem(attrs, shape, is_int32, TP4) or "")


class Gpt3Json(unittest.TestCase):
    def document(self, graphs="full"):
        measured = {"version": "2.11.0", "environment": {"gpu": "Test GPU"}, "settings": {},
                    "attention_backend": "FLASH_ATTENTION",
                    "memory": {"peak_bytes": 70e9, "reserved_bytes": 72e9, "arena_bytes": None,
                               "graph_extra_bytes": None},
                    "graphs_info": {"count": 1, "nodes": 900, "capture_ms": 400.0, "instantiate_ms": 100.0},
                    "losses": [10.5, 10.25], "weights_hash": "00ff", "loss_floor": 9.44}
        run = {"preset": "175b-tp4", "graphs": graphs, "seed": 1234, "steps": 4, "warmup": 3, "data": "random"}
        return pb.workload_document(TP4, 7, run, [200.0, 210.0, 190.0, 205.0], [50.0, 60.0, 70.0, 80.0], 800.0,
                                measured)

    def test_rates(self):
        d = self.document()
        self.assertEqual(d["step_ms"]["median"], 202.5)
        self.assertEqual(d["step_ms"]["count"], 4)
        self.assertAlmostEqual(d["throughput"]["tokens_per_s"], 2048 / 0.2025)
        self.assertAlmostEqual(d["throughput"]["samples_per_s"], 1 / 0.2025)
        self.assertAlmostEqual(d["model_tflops"], pb.flops_per_step(TP4, 7) / 0.2025 / 1e12)
        self.assertAlmostEqual(d["mfu"], d["model_tflops"] / 800.0)
        self.assertEqual(d["host_enqueue_us"]["median"], 65.0)
        self.assertEqual(d["loss_hash"], pb.loss_hash([10.5, 10.25]))

    def test_schema_keys(self):
        d = self.document()
        for key in ("tool", "version", "workload", "preset", "graphs", "environment", "config",
                    "tensor_parallel_collectives", "step_ms", "host_enqueue_us", "throughput", "model_tflops",
                    "flops_per_step", "flops_formula", "mfu", "peaks", "memory", "graphs_info", "losses",
                    "loss_hash", "weights_hash", "loss_floor"):
            self.assertIn(key, d)
        for key in ("layers", "hidden", "heads", "head_dim", "ffn", "seq", "micro_batch", "microbatches",
                    "vocab", "vocab_shard", "tp", "dropout", "seed", "steps", "warmup", "precision"):
            self.assertIn(key, d["config"])
        self.assertEqual((d["tool"], d["workload"], d["config"]["layers"]), ("pytorch", "gpt3", 7))
        json.dumps(d, allow_nan=False)

    def test_every_key_is_documented(self):
        with open(os.path.join(SCRIPTS, "..", "reports", "SCHEMA.md")) as f:
            schema = f.read()
        d = self.document()
        for key in list(d) + list(d["config"]) + list(d["memory"]) + list(d["optimizer"]):
            self.assertIn(f'"{key}"', schema, key)

    def test_report_accepts_it(self):
        for graphs in ("none", "full"):
            d = report.validate_workload(self.document(graphs), f"pytorch_gpt3_175b-tp4_{graphs}.json")
            self.assertEqual(d["graphs"], graphs)
            self.assertEqual(report.workload_file_key(f"pytorch_gpt3_175b-tp4_{graphs}.json"),
                             ("pytorch", "gpt3", "175b-tp4", graphs, 0))


L8 = pb.llama31_config("405b-tp8")
L4 = pb.llama31_config("405b-tp4")


class Llama31Shapes(unittest.TestCase):
    def test_tp8_shard_is_replays(self):
        # workloads/llama31/README.md: 16 of 128 q heads, 1 of 8 KV heads, head dim 128, FFN 6656 of
        # 53248, sequence 8192, micro-batch 1, vocabulary 32000 (4000 per GPU).
        for key, value in {"hidden": 16384, "heads": 16, "kv_heads": 1, "head_dim": 128, "ffn": 6656,
                           "seq": 8192, "micro_batch": 1, "microbatches": 1, "vocab": 32000,
                           "vocab_shard": 4000, "data_vocab": 32000, "tp": 8, "model_layers": 126}.items():
            self.assertEqual(L8[key], value, key)
        self.assertEqual(pb.llama31_qkv_width(L8), 2304)

    def test_tp4_shard(self):
        self.assertEqual((L4["heads"], L4["kv_heads"], L4["ffn"], L4["vocab_shard"], L4["tp"]),
                         (32, 2, 13312, 8000, 4))
        self.assertEqual(pb.llama31_qkv_width(L4), 36 * 128)

    def test_tiny(self):
        tiny = pb.llama31_config("tiny")
        self.assertEqual((tiny["hidden"], tiny["heads"], tiny["kv_heads"], tiny["head_dim"], tiny["ffn"],
                          tiny["seq"], tiny["micro_batch"], tiny["vocab"], tiny["vocab_shard"], tiny["tp"]),
                         (128, 2, 1, 64, 256, 128, 2, 512, 512, 1))
        self.assertLess(pb.llama31_params(tiny, pb.default_layers(tiny)), 10_000_000)

    def test_vocab_padded_to_8_times_tp(self):
        self.assertEqual(pb.padded_vocab(32000, pb.LLAMA31_VOCAB_PAD_MULTIPLE * 8), 32000)
        self.assertEqual(pb.padded_vocab(32001, pb.LLAMA31_VOCAB_PAD_MULTIPLE * 8), 32064)

    def test_bad_preset_and_microbatches(self):
        with self.assertRaises(ValueError):
            pb.llama31_config("405b-tp2")
        with self.assertRaises(ValueError):
            pb.llama31_config("tiny", microbatches=0)

    def test_layer_params_match_the_op_shapes(self):
        # The weights are exactly the GEMMs `ops` times for llama31_405b_tp8, plus two RMSNorm weights:
        # about 398M per layer per GPU (reference/workloads.md).
        weights = sum(n * k for _, n, k in pb.SHARDS["llama31_405b_tp8"]["linears"])
        self.assertEqual(pb.llama31_layer_params(L8), weights + 2 * 16384)
        self.assertEqual(pb.llama31_layer_params(L8), 398_491_648)
        att = pb.SHARDS["llama31_405b_tp8"]["attention"]
        self.assertEqual((att["q_heads"], att["kv_heads"], att["seq"], att["head_dim"]),
                         (L8["heads"], L8["kv_heads"], L8["seq"], L8["head_dim"]))

    def test_embedding_params_untied(self):
        self.assertEqual(pb.llama31_embedding_params(L8), 2 * 4000 * 16384 + 16384)
        self.assertEqual(pb.model_params(L8, 8), 8 * 398_491_648 + pb.llama31_embedding_params(L8))

    def test_whole_model_at_tp1_is_llama_405b(self):
        # With Llama 3.1's own 128256-token vocabulary the whole model is 405.85B parameters.
        full = dict(L8, heads=128, kv_heads=8, ffn=53248, vocab_shard=128256, tp=1)
        self.assertAlmostEqual(pb.model_params(full, 126) / 405.85e9, 1.0, delta=0.001)


class Llama31Flops(unittest.TestCase):
    def test_formula_uses_the_shards_query_width(self):
        tokens = 8192
        expected = 6.0 * pb.model_params(L8, 8) * tokens + 12.0 * 8 * 8192 * (16 * 128) * tokens
        self.assertEqual(pb.flops_per_step(L8, 8), expected)

    def test_microbatches_scale_the_tokens(self):
        l8x4 = pb.llama31_config("405b-tp8", microbatches=4)
        self.assertEqual(pb.tokens_per_step(l8x4), 4 * 8192)
        self.assertEqual(pb.flops_per_step(l8x4, 8), 4 * pb.flops_per_step(L8, 8))


class Llama31DefaultLayers(unittest.TestCase):
    def test_what_fits_an_80gb_h100(self):
        self.assertEqual(pb.default_layers(L8), 8)
        self.assertEqual(pb.default_layers(L4), 4)
        for cfg, layers in ((L8, 8), (L4, 4)):
            self.assertLessEqual(18 * pb.model_params(cfg, layers), pb.STATE_BUDGET_BYTES)
            self.assertGreater(18 * pb.model_params(cfg, layers + 1), pb.STATE_BUDGET_BYTES)
        tiny = pb.llama31_config("tiny")
        self.assertEqual(pb.default_layers(tiny), 2)


class Llama31Optimizer(unittest.TestCase):
    def test_replays_mlperf_settings(self):
        # workloads/llama31/llama31.cpp mlperf_optimizer: 8e-5 x GBS / 1152 down to 8e-7, warm-up
        # ceil(8000 x 1152 / GBS), decay ceil(1,200,000 x 1152 / GBS); AdamW 0.9/0.95, eps 1e-5, wd 0.1.
        o = pb.llama31_optimizer(4)
        self.assertAlmostEqual(o["lr"], 8e-5 * 4 / 1152)
        self.assertEqual((o["min_lr"], o["warmup_steps"], o["decay_steps"]), (8e-7, 2304000, 345600000))
        self.assertEqual((o["betas"], o["eps"], o["weight_decay"], o["clip_norm"]), ((0.9, 0.95), 1e-5, 0.1, 1.0))
        self.assertEqual(pb.llama31_optimizer(5)["warmup_steps"], 1843200)
        self.assertEqual(pb.llama31_optimizer(7)["warmup_steps"], -(-8000 * 1152 // 7))  # rounded up
        self.assertEqual(pb.llama31_config("405b-tp8", microbatches=4)["optimizer"]["warmup_steps"], 2304000)

    def test_schedule(self):
        o = pb.llama31_optimizer(1152)
        self.assertAlmostEqual(pb.lr_at(0, o), 8e-5 / 8000)
        self.assertAlmostEqual(pb.lr_at(7999, o), 8e-5)
        self.assertAlmostEqual(pb.lr_at(1_200_000, o), 8e-7)


class Llama31Rope(unittest.TestCase):
    def test_frequencies(self):
        f = pb.rope_frequencies(128)
        self.assertEqual(len(f), 64)
        self.assertEqual(f[0], 1.0)  # wavelength 2 pi: kept
        theta = 500000.0
        for i in range(64):
            raw = 1.0 / theta ** (2.0 * i / 128)  # as rope.cu: 1 / pow(theta, 2i / D)
            wavelen = 2 * math.pi / raw
            if wavelen < 8192 / 4:      # high frequencies kept
                self.assertEqual(f[i], raw, i)
            elif wavelen > 8192:        # low frequencies divided by 8
                self.assertAlmostEqual(f[i] / (raw / 8), 1.0, places=12, msg=i)
            else:                       # between: a blend, strictly inside [raw / 8, raw]
                self.assertTrue(raw / 8 < f[i] < raw, i)
        self.assertTrue(all(a > b for a, b in zip(f, f[1:])))  # still decreasing

    def test_norm_eps_and_base(self):
        self.assertEqual(pb.LLAMA31_NORM_EPS, 1e-5)
        self.assertEqual(pb.LLAMA31_ROPE["theta"], 500000.0)


class Llama31Json(unittest.TestCase):
    def document(self, graphs="full", microbatches=1):
        cfg = pb.llama31_config("405b-tp8", microbatches)
        measured = {"version": "2.11.0", "environment": {"gpu": "Test GPU"}, "settings": {},
                    "attention_backend": "FLASH_ATTENTION",
                    "memory": {"peak_bytes": 70e9, "reserved_bytes": 72e9, "arena_bytes": None,
                               "graph_extra_bytes": None},
                    "graphs_info": {"count": 1, "nodes": 900, "capture_ms": 400.0, "instantiate_ms": 100.0},
                    "losses": [8.5, 8.25], "weights_hash": "00ff", "loss_floor": math.log(4000)}
        run = {"preset": "405b-tp8", "graphs": graphs, "seed": 1234, "steps": 4, "warmup": 3, "data": "random"}
        return pb.workload_document(cfg, 8, run, [2000.0, 2100.0, 1900.0, 2050.0], [50.0, 60.0, 70.0, 80.0],
                                    800.0, measured)

    def test_fields(self):
        d = self.document(microbatches=4)
        self.assertEqual((d["tool"], d["workload"], d["preset"]), ("pytorch", "llama31", "405b-tp8"))
        c = d["config"]
        self.assertEqual((c["layers"], c["heads"], c["kv_heads"], c["ffn"], c["vocab_shard"], c["microbatches"]),
                         (8, 16, 1, 6656, 4000, 4))
        self.assertEqual(c["parameters"], pb.model_params(L8, 8))
        self.assertAlmostEqual(d["throughput"]["tokens_per_s"], 4 * 8192 / 2.025)
        self.assertAlmostEqual(d["throughput"]["samples_per_s"], 4 / 2.025)
        self.assertEqual(d["optimizer"]["eps"], 1e-5)
        self.assertEqual(d["optimizer"]["warmup_steps"], 2304000)
        self.assertEqual(d["flops_formula"], pb.FLOPS_FORMULA)
        json.dumps(d, allow_nan=False)

    def test_same_keys_as_gpt3_plus_kv_heads(self):
        # replay-llama31 reports config.kv_heads; every other key is gpt3's (and documented there).
        d, g = self.document(), Gpt3Json().document()
        self.assertEqual(set(d), set(g))
        self.assertEqual(set(d["config"]), set(g["config"]) | {"kv_heads"})
        self.assertEqual(list(d["config"])[:4], ["layers", "hidden", "heads", "kv_heads"])

    def test_report_accepts_it(self):
        for graphs in ("none", "full"):
            d = report.validate_workload(self.document(graphs), f"pytorch_llama31_405b-tp8_{graphs}.json")
            self.assertEqual(d["graphs"], graphs)
            self.assertEqual(report.workload_file_key(f"pytorch_llama31_405b-tp8_{graphs}.json"),
                             ("pytorch", "llama31", "405b-tp8", graphs, 0))


class LossHash(unittest.TestCase):
    def test_known_value_and_float32_bits(self):
        self.assertEqual(pb.loss_hash([]), "cbf29ce484222325")  # FNV-1a 64 offset basis
        self.assertEqual(pb.loss_hash([1.0, 2.5]), "09e6a9ee2dfe8d78")
        self.assertEqual(pb.loss_hash([1.0]), pb.loss_hash([1.0 + 1e-12]))  # same float32
        self.assertNotEqual(pb.loss_hash([0.0]), pb.loss_hash([-0.0]))
        self.assertNotEqual(pb.loss_hash([1.0, 2.0]), pb.loss_hash([2.0, 1.0]))


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

    def test_budget_range_and_warmup(self):
        p = run_cli("ops", "--json", os.devnull, "--budget-ms", "-1")
        self.assertEqual(p.returncode, 2)
        self.assertIn("--budget-ms: must be in [0, 10000], got -1", p.stderr)
        p = run_cli("ops", "--json", os.devnull, "--warmup", "1")
        self.assertEqual(p.returncode, 2)
        self.assertIn("--budget-ms needs --warmup 2 or more", p.stderr)
        self.assertNotIn("Traceback", p.stderr)
        # --budget-ms 0 lifts the need: the run goes on to the next check
        p = run_cli("ops", "--json", os.devnull, "--warmup", "1", "--budget-ms", "0", "--only", "no_such_op")
        self.assertEqual(p.returncode, 2)
        self.assertIn("matches no op", p.stderr)

    @unittest.skipIf(TORCH_PRESENT, "torch is installed here (the no-torch path cannot be exercised)")
    def test_no_torch_is_a_clear_error(self):
        with tempfile.TemporaryDirectory() as d:
            out = os.path.join(d, "out.json")
            p = run_cli("ops", "--json", out)
            self.assertEqual(p.returncode, 2)
            self.assertIn("pytorch_baseline.py: error: PyTorch is not importable", p.stderr)
            self.assertNotIn("Traceback", p.stderr)
            self.assertFalse(os.path.exists(out))

    def test_gpt3_layers_beyond_the_model(self):
        p = run_cli("gpt3", "--preset", "tiny", "--layers", "3", "--json", os.devnull)
        self.assertEqual(p.returncode, 2)
        self.assertIn("the tiny model has 2 layers", p.stderr)
        self.assertNotIn("Traceback", p.stderr)

    def test_gpt3_full_graph_needs_warmup(self):
        p = run_cli("gpt3", "--graphs", "full", "--warmup", "0", "--json", os.devnull)
        self.assertEqual(p.returncode, 2)
        self.assertIn("--graphs full needs --warmup 1 or more", p.stderr)

    def test_gpt3_missing_data_file(self):
        p = run_cli("gpt3", "--data", "/no/such/tokens.h5", "--json", os.devnull)
        self.assertEqual(p.returncode, 2)
        self.assertIn("--data /no/such/tokens.h5: no such file", p.stderr)

    def test_gpt3_json_directory_must_exist(self):
        p = run_cli("gpt3", "--json", "/no/such/dir/out.json")
        self.assertEqual(p.returncode, 2)
        self.assertIn("does not exist", p.stderr)

    def test_gpt3_bad_choices(self):
        for args in (("--preset", "175b-tp3"), ("--graphs", "layer"), ("--steps", "0")):
            with self.subTest(args):
                p = run_cli("gpt3", *args, "--json", os.devnull)
                self.assertEqual(p.returncode, 2)
                self.assertIn("usage:", p.stderr)

    @unittest.skipIf(TORCH_PRESENT, "torch is installed here (the no-torch path cannot be exercised)")
    def test_gpt3_no_torch_is_a_clear_error(self):
        with tempfile.TemporaryDirectory() as d:
            out = os.path.join(d, "out.json")
            p = run_cli("gpt3", "--preset", "tiny", "--json", out)
            self.assertEqual(p.returncode, 2)
            self.assertIn("pytorch_baseline.py: error: PyTorch is not importable", p.stderr)
            self.assertFalse(os.path.exists(out))


    def test_llama31_layers_beyond_the_model(self):
        p = run_cli("llama31", "--preset", "tiny", "--layers", "3", "--json", os.devnull)
        self.assertEqual(p.returncode, 2)
        self.assertIn("the tiny model has 2 layers", p.stderr)
        self.assertNotIn("Traceback", p.stderr)

    def test_llama31_full_graph_needs_warmup(self):
        p = run_cli("llama31", "--graphs", "full", "--warmup", "0", "--microbatches", "2", "--json", os.devnull)
        self.assertEqual(p.returncode, 2)
        self.assertIn("--graphs full needs --warmup 1 or more", p.stderr)

    def test_llama31_bad_choices(self):
        for args in (("--preset", "175b-tp4"), ("--graphs", "layer"), ("--microbatches", "0")):
            with self.subTest(args):
                p = run_cli("llama31", *args, "--json", os.devnull)
                self.assertEqual(p.returncode, 2)
                self.assertIn("usage:", p.stderr)

    def test_gpt3_has_no_microbatches_flag(self):
        p = run_cli("gpt3", "--microbatches", "2", "--json", os.devnull)
        self.assertEqual(p.returncode, 2)
        self.assertIn("unrecognized arguments", p.stderr)

    @unittest.skipIf(TORCH_PRESENT, "torch is installed here (the no-torch path cannot be exercised)")
    def test_llama31_no_torch_is_a_clear_error(self):
        with tempfile.TemporaryDirectory() as d:
            out = os.path.join(d, "out.json")
            p = run_cli("llama31", "--preset", "tiny", "--microbatches", "2", "--json", out)
            self.assertEqual(p.returncode, 2)
            self.assertIn("pytorch_baseline.py: error: PyTorch is not importable", p.stderr)
            self.assertFalse(os.path.exists(out))


if __name__ == "__main__":
    unittest.main()
