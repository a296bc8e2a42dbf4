#!/usr/bin/env python3
"""Tests of scripts/pytorch_baseline.py's pure parts, run without torch: the shard configurations it reads
from replay's `--print-config` JSON (well-formed and malformed documents, fake and missing binaries), the
op shapes derived from them, FLOP formulas, names, statistics and JSON entries; the gpt3 and llama31
shards' parameter counts, FLOPs, default layers, data order, token-file checks, loss hash and JSON
documents; the optimizer and learning-rate schedule taken from the same documents' `training` (replay's
formula at the steps where it changes, the schedule flags reaching the binary or overriding a --config
file); RoPE frequencies; argument errors. Importing the script must not import torch (the trainer's
device schedule is checked only where torch and a GPU are).

The MLPerf shard shapes are checked against what the replay binaries print: they are looked for in
$REPLAY_BIN_DIR (CTest sets it to the build's bin folder), else where the script looks
(pytorch_baseline.default_replay_bin). Without them those tests skip and say why; the rest run on small
documents, the binaries' tiny presets when they are there."""

import copy
import importlib.util
import json
import math
import os
import re
import struct
import subprocess
import sys
import tempfile
import unittest
from unittest import mock

SCRIPTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "scripts")
sys.path.insert(0, SCRIPTS)
TORCH_PRESENT = "torch" in sys.modules or importlib.util.find_spec("torch") is not None
import pytorch_baseline as pb  # noqa: E402
import report  # noqa: E402

BIN = os.environ.get("REPLAY_BIN_DIR") or pb.default_replay_bin()


def have_binary(workload):
    path = os.path.join(BIN, f"replay-{workload}")
    return os.path.isfile(path) and os.access(path, os.X_OK)


BINARIES = have_binary("gpt3") and have_binary("llama31")
NO_BINARIES = (f"replay-gpt3 and replay-llama31 are not in {BIN}: build replay, or set REPLAY_BIN_DIR to the "
               f"folder of its binaries")
_configs = {}


def real(workload, preset, microbatches=None):
    """The shard configuration the replay binary prints (skips the calling test without the binaries)."""
    if not BINARIES:
        raise unittest.SkipTest(NO_BINARIES)
    key = (workload, preset, microbatches)
    if key not in _configs:
        _configs[key] = pb.replay_config(BIN, workload, preset, microbatches)
    return _configs[key]


# Only where the binaries are missing: the tiny presets' documents as `--print-config` prints them (the
# keys pytorch_baseline reads). With the binaries, tiny_doc is the binary's own output.
FALLBACK_TINY = {
    "gpt3": {"tool": "replay-gpt3", "workload": "gpt3", "preset": "tiny", "config": {
        "layers": 2, "hidden": 128, "heads": 2, "head_dim": 64, "ffn": 512, "seq": 128, "micro_batch": 2,
        "microbatches": 1, "vocab": 512, "vocab_shard": 512, "tp": 1, "dropout": 0.0,
        "model": {"layers": 96, "heads": 2, "kv_heads": 2, "ffn": 512, "data_vocab": 512, "norm": "layernorm",
                  "norm_eps": 1e-05, "mlp": "gelu", "position": "learned", "rope_theta": 10000.0,
                  "rope_llama31_scaling": False, "bias": True, "tied_embedding": True}},
        "training": {"optimizer": {"name": "adamw", "beta1": 0.9, "beta2": 0.95, "eps": 1e-08,
                                   "weight_decay": 0.1, "clip_norm": 1.0},
                     "schedule": {"kind": "warmup_cosine", "lr": 0.001, "min_lr": 0.0001, "warmup_steps": 20,
                                  "decay_steps": 400},
                     "loss_scaling": None}},
    "llama31": {"tool": "replay-llama31", "workload": "llama31", "preset": "tiny", "config": {
        "layers": 2, "hidden": 128, "heads": 2, "kv_heads": 1, "head_dim": 64, "ffn": 256, "seq": 128,
        "micro_batch": 2, "microbatches": 1, "vocab": 512, "vocab_shard": 512, "tp": 1, "dropout": 0.0,
        "model": {"layers": 126, "heads": 2, "kv_heads": 1, "ffn": 256, "data_vocab": 512, "norm": "rmsnorm",
                  "norm_eps": 1e-05, "mlp": "swiglu", "position": "rope", "rope_theta": 500000.0,
                  "rope_llama31_scaling": True, "bias": False, "tied_embedding": False}},
        "training": {"optimizer": {"name": "adamw", "beta1": 0.9, "beta2": 0.95, "eps": 1e-05,
                                   "weight_decay": 0.1, "clip_norm": 1.0},
                     "schedule": {"kind": "warmup_cosine", "lr": 0.001, "min_lr": 0.0001, "warmup_steps": 20,
                                  "decay_steps": 400},
                     "loss_scaling": None}},
}
_tiny_docs = {}


def tiny_doc(workload):
    """A fresh copy of the tiny preset's `--print-config` document: the binary's, else FALLBACK_TINY's."""
    if workload not in _tiny_docs:
        _tiny_docs[workload] = (pb.run_print_config(BIN, workload, "tiny")[0] if have_binary(workload)
                                else FALLBACK_TINY[workload])
    return copy.deepcopy(_tiny_docs[workload])


def tiny(workload):
    return pb.shard_config(tiny_doc(workload), workload, "tiny_doc")


def printed_optimizer(doc):
    """What the baseline's optimizer must be for a `--print-config` document: its `training` values, as
    printed."""
    o, sc = doc["training"]["optimizer"], doc["training"]["schedule"]
    return {"schedule": sc["kind"], "lr": sc["lr"], "min_lr": sc["min_lr"], "warmup_steps": sc["warmup_steps"],
            "decay_steps": sc["decay_steps"], "betas": (o["beta1"], o["beta2"]), "eps": o["eps"],
            "weight_decay": o["weight_decay"], "clip_norm": o["clip_norm"]}


def to_f32(x):
    return struct.unpack("<f", struct.pack("<f", x))[0]


def formula(s, lr, min_lr, W, T):
    """replay's warmup_cosine learning rate of 0-based step s, written from its definition here (not
    pytorch_baseline's): lr and min_lr are replay's float32 settings, the arithmetic fp64, the result
    rounded to float32 once."""
    lr, min_lr = to_f32(lr), to_f32(min_lr)
    if s < W:
        v = lr * (s + 1) / W
    elif s < T:
        v = min_lr + (lr - min_lr) * (1 + math.cos(math.pi * ((s - W) / (T - W)))) / 2  # p, then pi p
    else:
        v = min_lr
    return to_f32(v)


def schedule_steps(W, T):
    """The steps where the schedule changes: 0, 1, W-1, W, (W+T)/2, T-1, T, T+5."""
    return (0, 1, W - 1, W, (W + T) // 2, T - 1, T, T + 5)


def write_json_file(directory, name, doc):
    path = os.path.join(directory, name)
    with open(path, "w") as f:
        json.dump(doc, f)
    return path


def run_cli(*args):
    return subprocess.run([sys.executable, os.path.join(SCRIPTS, "pytorch_baseline.py"), *args],
                          capture_output=True, text=True, timeout=60)


class RnntSubcommand(unittest.TestCase):
    """`rnnt` hands its flags to scripts/pytorch_rnnt.py, which checks them before it imports torch."""

    def test_flags_reach_pytorch_rnnt(self):
        r = run_cli("rnnt", "--help")
        self.assertEqual(r.returncode, 0, r.stderr)
        self.assertIn("--capture", r.stdout)
        self.assertIn("--check-loss", r.stdout)
        for bad, says in ((["--ladder", "384x"], "--ladder"), (["--ladder", "385x64"], "even frames"),
                          (["--mode", "graphed", "--loss", "torchaudio"], "cannot be captured")):
            r = run_cli("rnnt", *bad)
            self.assertEqual(r.returncode, 2, bad)
            self.assertIn(says, r.stderr, bad)


class UnetSubcommand(unittest.TestCase):
    """`unet` hands its flags to scripts/pytorch_unet.py, which checks them before it imports torch."""

    def test_flags_reach_pytorch_unet(self):
        r = run_cli("unet", "--help")
        self.assertEqual(r.returncode, 0, r.stderr)
        self.assertIn("--model", r.stdout)
        self.assertIn("--graphs", r.stdout)
        for bad, says in ((["--graphs", "layer"], "invalid choice"), (["--latent", "60"], "multiple of 8"),
                          (["--groups", "7"], "divide the 320"), (["--batch", "0"], "at least 1")):
            r = run_cli("unet", *bad)
            self.assertEqual(r.returncode, 2, bad)
            self.assertIn(says, r.stderr, bad)


class Import(unittest.TestCase):
    @unittest.skipIf(TORCH_PRESENT, "torch is installed here")
    def test_import_does_not_need_torch(self):
        self.assertNotIn("torch", sys.modules)
        self.assertNotIn("pytorch_gpt3", sys.modules)  # the model module is loaded only to run


class ShardConfig(unittest.TestCase):
    """shard_config: what the baseline reads from a `--print-config` document, and what it refuses."""

    def test_tiny_documents(self):
        for workload in ("gpt3", "llama31"):
            with self.subTest(workload):
                doc = tiny_doc(workload)
                cfg = pb.shard_config(doc, workload)
                c, m = doc["config"], doc["config"]["model"]
                for key in pb.SHARD_KEYS + ("layers",):
                    self.assertEqual(cfg[key], c[key], key)
                self.assertEqual((cfg["workload"], cfg["preset"]), (workload, "tiny"))
                self.assertEqual((cfg["data_vocab"], cfg["model_layers"], cfg["mlp"]),
                                 (m["data_vocab"], m["layers"], m["mlp"]))
                self.assertEqual(cfg["kv_heads"], c["kv_heads"] if workload == "llama31" else c["heads"])
                self.assertEqual(pb.default_layers(cfg), c["layers"])  # the preset's own count
                self.assertEqual(cfg["optimizer"], printed_optimizer(doc))

    def refused(self, workload, change, fragment):
        doc = tiny_doc(workload)
        change(doc)
        with self.assertRaises(pb.BaselineError) as e:
            pb.shard_config(doc, workload, "SOURCE")
        self.assertIn("SOURCE: ", str(e.exception))
        self.assertIn(fragment, str(e.exception))

    def test_malformed_documents(self):
        def setter(path, value):
            def change(doc):
                *parents, key = path.split(".")
                obj = doc
                for p in parents:
                    obj = obj[p]
                if value is KeyError:
                    del obj[key]
                else:
                    obj[key] = value(obj[key]) if callable(value) else value
            return change

        cases = [
            ("gpt3", setter("workload", "llama31"), "\"workload\" is 'llama31', expected 'gpt3'"),
            ("gpt3", setter("preset", KeyError), "\"preset\" is None"),
            ("gpt3", setter("config", KeyError), "no \"config\" object"),
            ("gpt3", setter("config.model", [1]), "no \"config.model\" object"),
            ("gpt3", setter("config.hidden", KeyError), "config.hidden is missing, expected an integer >= 1"),
            ("gpt3", setter("config.heads", "2"), "config.heads is '2', expected an integer >= 1"),
            ("gpt3", setter("config.ffn", 512.0), "config.ffn is 512.0"),
            ("gpt3", setter("config.tp", True), "config.tp is True"),
            ("gpt3", setter("config.seq", 0), "config.seq is 0"),
            ("gpt3", setter("config.layers", -1), "config.layers is -1, expected an integer >= 0"),
            ("gpt3", setter("config.model.data_vocab", KeyError), "config.model.data_vocab is missing"),
            ("gpt3", setter("config.heads", lambda v: v + 1), "is not config.model.heads"),
            ("gpt3", setter("config.ffn", lambda v: v * 2), "is not config.model.ffn"),
            ("gpt3", setter("config.vocab_shard", lambda v: v - 1), "is not config.vocab"),
            ("gpt3", setter("config.model.data_vocab", lambda v: v * 2),
             "smaller than config.model.data_vocab"),
            ("gpt3", setter("config.layers", 1000), "config.layers 1000 is more than the model's"),
            ("gpt3", setter("config.model.mlp", "swiglu"),
             'config.model.mlp is "swiglu": pytorch_gpt3.GPT3Shard implements "gelu"'),
            ("gpt3", setter("config.model.tied_embedding", KeyError), "config.model.tied_embedding is missing"),
            ("gpt3", setter("config.model.bias", 1), "config.model.bias is 1"),
            ("llama31", setter("config.kv_heads", KeyError), "config.kv_heads is missing"),
            ("llama31", setter("config.model.norm_eps", 1e-6),
             "config.model.norm_eps is 1e-06: pytorch_llama31.Llama31Shard implements 1e-05"),
            ("llama31", setter("config.model.rope_theta", 10000.0), "config.model.rope_theta is 10000.0"),
            ("llama31", setter("config.model.rope_llama31_scaling", False), "rope_llama31_scaling is false"),
            ("llama31", setter("config.model.position", "learned"), "config.model.position is \"learned\""),
            ("gpt3", setter("training", KeyError), "no \"training\" object"),
            ("gpt3", setter("training.schedule", None), "no \"training.schedule\" object"),
            ("gpt3", setter("training.optimizer", KeyError), "no \"training.optimizer\" object"),
            ("gpt3", setter("training.optimizer.name", "adam"),
             "training.optimizer.name is \"adam\", expected \"adamw\""),
            ("gpt3", setter("training.optimizer.beta2", 1.0), "training.optimizer.beta2 is 1.0"),
            ("gpt3", setter("training.optimizer.eps", KeyError), "training.optimizer.eps is missing"),
            ("gpt3", setter("training.optimizer.clip_norm", 0.0), "always clips"),
            ("llama31", setter("training.schedule.lr", -1e-4), "training.schedule.lr is -0.0001"),
            ("llama31", setter("training.schedule.min_lr", "1e-5"), "training.schedule.min_lr is \"1e-5\""),
            ("gpt3", setter("training.schedule.warmup_steps", 0),
             "training.schedule.warmup_steps is 0, expected an integer >= 1"),
            ("gpt3", setter("training.schedule.decay_steps", lambda v: 20),
             "training.schedule.decay_steps is 20, expected an integer above warmup_steps"),
            ("gpt3", setter("training.loss_scaling", {"init_scale": 65536.0}), "without loss scaling"),
        ]
        for workload, change, fragment in cases:
            with self.subTest(fragment):
                self.refused(workload, change, fragment)

    def test_key_value_heads(self):
        def gqa_gpt3(doc):  # one key/value head per GPU: the GPT-3 module has none of that
            c = doc["config"]
            c["kv_heads"] = 1
            c["model"]["kv_heads"] = c["tp"]
            c["heads"] = 2
            c["model"]["heads"] = 2 * c["tp"]
        self.refused("gpt3", gqa_gpt3, "1 key/value heads for 2 query heads: pytorch_gpt3.GPT3Shard has")

        def uneven(doc):
            c = doc["config"]
            c["heads"], c["kv_heads"] = 4, 3
            c["model"]["heads"], c["model"]["kv_heads"] = 4 * c["tp"], 3 * c["tp"]
        self.refused("llama31", uneven, "config.heads 4 is not a multiple of the key/value heads 3")

    def test_not_an_object(self):
        with self.assertRaises(pb.BaselineError) as e:
            pb.shard_config([], "gpt3", "SOURCE")
        self.assertIn("SOURCE: not a JSON object but list", str(e.exception))

    def test_text_and_files(self):
        with self.assertRaises(pb.BaselineError) as e:
            pb.parse_config_text("{\"config\": ", "SOURCE")
        self.assertIn("SOURCE: not JSON", str(e.exception))
        with self.assertRaises(pb.BaselineError) as e:
            pb.read_config_file("/no/such/config.json")
        self.assertIn("--config /no/such/config.json: cannot read it", str(e.exception))

    def test_config_file(self):
        with tempfile.TemporaryDirectory() as d:
            for workload in ("gpt3", "llama31"):
                path = write_json_file(d, f"{workload}.json", tiny_doc(workload))
                self.assertEqual(pb.load_shard_config(workload, config_path=path), tiny(workload))
                self.assertEqual(pb.load_shard_config(workload, "tiny", 1, "/no/such/bin", path),
                                 tiny(workload))
                with self.assertRaisesRegex(pb.BaselineError, "--preset 175b-tp4: --config .* is the "
                                                              "configuration of preset tiny"):
                    pb.load_shard_config(workload, "175b-tp4", config_path=path)
                with self.assertRaisesRegex(pb.BaselineError,
                                            "--microbatches 3: --config .* has microbatches 1"):
                    pb.load_shard_config(workload, microbatches=3, config_path=path)

    def test_default_replay_bin(self):
        with mock.patch.dict(os.environ, {"REPLAY_BUILD_DIR": ""}):
            self.assertEqual(pb.default_replay_bin(), os.path.join(pb.REPO, "build", "release", "bin"))
        with mock.patch.dict(os.environ, {"REPLAY_BUILD_DIR": "build/dev"}):
            self.assertEqual(pb.default_replay_bin(), os.path.join(pb.REPO, "build/dev", "bin"))
        with mock.patch.dict(os.environ, {"REPLAY_BUILD_DIR": "/opt/replay"}):
            self.assertEqual(pb.default_replay_bin(), "/opt/replay/bin")
        self.assertTrue(os.path.isfile(os.path.join(pb.REPO, "scripts", "pytorch_baseline.py")))


class FakeBinaries(unittest.TestCase):
    """run_print_config against stand-in executables: what reaches the binary, and its failures."""

    def fake(self, directory, workload, body):
        path = os.path.join(directory, f"replay-{workload}")
        with open(path, "w") as f:
            f.write("#!/bin/sh\n" + body + "\n")
        os.chmod(path, 0o755)
        return path

    def test_missing_binary(self):
        with tempfile.TemporaryDirectory() as d:
            with self.assertRaises(pb.BaselineError) as e:
                pb.run_print_config(d, "gpt3", "tiny")
            self.assertIn(f"no replay-gpt3 binary at {os.path.join(d, 'replay-gpt3')}", str(e.exception))
            self.assertIn("--replay-bin DIR", str(e.exception))
            with self.assertRaises(pb.BaselineError) as e:
                pb.load_shard_config("llama31", replay_bin=d)
            self.assertIn("with --config FILE", str(e.exception))
            open(os.path.join(d, "replay-gpt3"), "w").close()  # there, but not executable
            with self.assertRaisesRegex(pb.BaselineError, "no replay-gpt3 binary"):
                pb.run_print_config(d, "gpt3", "tiny")

    def test_arguments(self):
        with tempfile.TemporaryDirectory() as d:
            doc = write_json_file(d, "doc.json", tiny_doc("llama31"))
            args = os.path.join(d, "args")
            self.fake(d, "llama31", f'printf "%s\\n" "$@" > {args}; cat {doc}')
            self.assertEqual(pb.load_shard_config("llama31", "tiny", replay_bin=d), tiny("llama31"))
            with open(args) as f:
                self.assertEqual(f.read().split(), ["--preset", "tiny", "--print-config"])
            self.assertEqual(pb.load_shard_config("llama31", "tiny", 1, replay_bin=d), tiny("llama31"))
            with open(args) as f:
                self.assertEqual(f.read().split(),
                                 ["--preset", "tiny", "--microbatches", "1", "--print-config"])
            with self.assertRaisesRegex(pb.BaselineError, "printed microbatches 1"):
                pb.load_shard_config("llama31", "tiny", 3, replay_bin=d)
            with self.assertRaisesRegex(pb.BaselineError, "printed the configuration of preset 'tiny'"):
                pb.load_shard_config("llama31", replay_bin=d)  # the default preset, 405b-tp8

    def test_schedule_flags(self):
        # The four flags reach the binary, after --preset and --microbatches, in replay's spelling; what it
        # prints must then carry them (this stand-in prints a document with other values: refused).
        with tempfile.TemporaryDirectory() as d:
            printed = tiny_doc("gpt3")
            sc = printed["training"]["schedule"]
            sc.update(lr=0.0003, min_lr=3e-05, warmup_steps=7, decay_steps=70)
            doc = write_json_file(d, "doc.json", printed)
            args = os.path.join(d, "args")
            self.fake(d, "gpt3", f'printf "%s\n" "$@" > {args}; cat {doc}')
            asked = {"lr": 3e-4, "min_lr": 3e-5, "warmup_steps": 7, "decay_steps": 70}
            cfg = pb.load_shard_config("gpt3", "tiny", replay_bin=d, schedule=asked)
            with open(args) as f:
                self.assertEqual(f.read().split(), ["--preset", "tiny", "--lr", "0.0003", "--min-lr", "3e-05",
                                                    "--warmup-steps", "7", "--decay-steps", "70",
                                                    "--print-config"])
            self.assertEqual({k: cfg["optimizer"][k] for k in asked}, asked)
            pb.load_shard_config("gpt3", "tiny", replay_bin=d, schedule={"decay_steps": 70, "lr": None})
            with open(args) as f:
                self.assertEqual(f.read().split(), ["--preset", "tiny", "--decay-steps", "70", "--print-config"])
            for key, value, flag in (("warmup_steps", 8, "--warmup-steps 8"), ("lr", 1e-3, "--lr 0.001"),
                                     ("min_lr", 2.5e-5, "--min-lr 2.5e-05")):
                with self.subTest(key):
                    with self.assertRaisesRegex(pb.BaselineError, f"printed training.schedule.{key} .*, not the "
                                                                  f"{flag.split()[0]} {value!r} asked for"):
                        pb.load_shard_config("gpt3", "tiny", replay_bin=d, schedule={key: value})
                    with open(args) as f:
                        self.assertIn(flag, " ".join(f.read().split()))
            # replay stores the rates as float32 and prints their shortest decimals: 0.1 asked is 0.1 printed
            sc.update(lr=0.1)
            write_json_file(d, "doc.json", printed)
            self.assertEqual(pb.load_shard_config("gpt3", "tiny", replay_bin=d, schedule={"lr": 0.1})
                             ["optimizer"]["lr"], 0.1)
            with self.assertRaises(ValueError):
                pb.schedule_args({"beta1": 0.8})

    def test_refusal_passes_the_message_on(self):
        with tempfile.TemporaryDirectory() as d:
            self.fake(d, "gpt3", "echo 'replay-gpt3: --preset: x not in {tiny,a,b} (run with --help for the "
                                 "flags)' >&2; exit 2")
            with self.assertRaises(pb.BaselineError) as e:
                pb.run_print_config(d, "gpt3", "x")
            msg = str(e.exception)
            self.assertIn("`replay-gpt3 --preset x --print-config`", msg)
            self.assertIn("exit status 2: replay-gpt3: --preset: x not in {tiny,a,b}", msg)
            self.assertNotIn("--help", msg)
            self.fake(d, "gpt3", "exit 3")
            with self.assertRaisesRegex(pb.BaselineError, "exit status 3: nothing on stderr"):
                pb.run_print_config(d, "gpt3", "x")

    def test_output_that_is_not_a_configuration(self):
        with tempfile.TemporaryDirectory() as d:
            self.fake(d, "gpt3", "echo 'preset tiny'")
            with self.assertRaisesRegex(pb.BaselineError, r"the output of `replay-gpt3 --preset tiny "
                                                          r"--print-config` \(.*\): not JSON"):
                pb.run_print_config(d, "gpt3", "tiny")
            self.fake(d, "gpt3", "echo '{\"workload\": \"gpt3\", \"preset\": \"tiny\"}'")
            with self.assertRaisesRegex(pb.BaselineError, "`replay-gpt3 --preset tiny --print-config`: "
                                                          "no \"config\" object"):
                pb.load_shard_config("gpt3", "tiny", replay_bin=d)


class Shapes(unittest.TestCase):
    def test_gemm_directions(self):
        M, N, K = 2048, 9216, 12288
        self.assertEqual(pb.gemm_shape("fwd", M, N, K), {"m": M, "n": N, "k": K})
        self.assertEqual(pb.gemm_shape("dgrad", M, N, K), {"m": M, "n": K, "k": N})
        self.assertEqual(pb.gemm_shape("wgrad", M, N, K), {"m": N, "n": K, "k": M})
        with self.assertRaises(ValueError):
            pb.gemm_shape("bwd", M, N, K)

    def test_linears_from_a_configuration(self):
        cfg = {"hidden": 10, "heads": 4, "kv_heads": 2, "head_dim": 3, "ffn": 7, "mlp": "swiglu"}
        self.assertEqual(pb.shard_linears(cfg), [("qkv", (4 + 2 * 2) * 3, 10), ("proj", 10, 12),
                                                 ("fc1", 2 * 7, 10), ("fc2", 10, 7)])
        self.assertEqual(pb.shard_linears(dict(cfg, mlp="gelu"))[2], ("fc1", 7, 10))

    def test_ops_shard_of_the_tiny_presets(self):
        for workload in ("gpt3", "llama31"):
            cfg = tiny(workload)
            shard = pb.ops_shard(cfg)
            self.assertEqual(shard["tokens"], cfg["micro_batch"] * cfg["seq"])
            self.assertEqual(shard["attention"], {"batch": cfg["micro_batch"], "q_heads": cfg["heads"],
                                                  "kv_heads": cfg["kv_heads"], "seq": cfg["seq"],
                                                  "head_dim": cfg["head_dim"]})
            # The layer's weights are exactly these GEMMs' (plus biases and norms)
            weights = sum(n * k for _, n, k in shard["linears"])
            norms = 4 * cfg["hidden"] if workload == "gpt3" else 2 * cfg["hidden"]
            biases = sum(n for _, n, _ in shard["linears"]) if workload == "gpt3" else 0
            self.assertEqual(pb.WORKLOADS[workload]["layer_params"](cfg), weights + biases + norms, workload)

    def test_schema_table(self):
        # reports/SCHEMA.md, one row per (shard, layer): M, N, K; from the binaries' 175b-tp4 and 405b-tp8
        expected = {
            "gpt3_175b_tp4.qkv": (2048, 9216, 12288), "gpt3_175b_tp4.proj": (2048, 12288, 3072),
            "gpt3_175b_tp4.fc1": (2048, 12288, 12288), "gpt3_175b_tp4.fc2": (2048, 12288, 12288),
            "llama31_405b_tp8.qkv": (8192, 2304, 16384), "llama31_405b_tp8.proj": (8192, 16384, 2048),
            "llama31_405b_tp8.fc1": (8192, 13312, 16384), "llama31_405b_tp8.fc2": (8192, 16384, 6656),
        }
        specs = pb.op_specs([real(w, p) for w, p in pb.OPS_PRESETS])
        fwd = {s["name"][:-len(".fwd")]: s for s in specs if s["kind"] == "gemm" and s["direction"] == "fwd"}
        self.assertEqual(set(fwd), set(expected))
        for layer, (M, N, K) in expected.items():
            self.assertEqual(fwd[layer]["shape"], {"m": M, "n": N, "k": K}, layer)
            self.assertEqual(fwd[layer]["dims"], (M, N, K), layer)
        att = {s["shard"]: s["shape"] for s in specs if s["kind"] == "attention"}
        self.assertEqual(att["gpt3_175b_tp4"],
                         {"batch": 1, "q_heads": 24, "kv_heads": 24, "seq": 2048, "head_dim": 128})
        self.assertEqual(att["llama31_405b_tp8"],
                         {"batch": 1, "q_heads": 16, "kv_heads": 1, "seq": 8192, "head_dim": 128})


def ops_specs_mlperf():
    return pb.op_specs([real(w, p) for w, p in pb.OPS_PRESETS])


def ops_specs_tiny():
    return pb.op_specs([tiny("gpt3"), tiny("llama31")])


class Flops(unittest.TestCase):
    def test_gemm_flops_equal_across_directions(self):
        by_layer = {}
        for s in ops_specs_tiny():
            if s["kind"] == "gemm":
                by_layer.setdefault(s["name"].rsplit(".", 1)[0], set()).add(s["flops"])
        self.assertEqual(len(by_layer), 8)
        self.assertTrue(all(len(f) == 1 for f in by_layer.values()))

    def test_mlperf_gemm_flops(self):
        flops = {s["name"]: s["flops"] for s in ops_specs_mlperf()}
        for d in pb.GEMM_DIRECTIONS:
            self.assertEqual(flops[f"gpt3_175b_tp4.qkv.{d}"], 2.0 * 2048 * 9216 * 12288, d)
            self.assertEqual(flops[f"llama31_405b_tp8.fc2.{d}"], 2.0 * 8192 * 16384 * 6656, d)

    def test_attention_flops(self):
        gpt = {"batch": 1, "q_heads": 24, "kv_heads": 24, "seq": 2048, "head_dim": 128}
        fwd = 4 * 24 * 2048**2 * 128 / 2
        self.assertEqual(pb.attention_flops(gpt, "fwd"), fwd)
        self.assertEqual(pb.attention_flops(gpt, "fwd_bwd"), 3.5 * fwd)
        llama = {"batch": 1, "q_heads": 16, "kv_heads": 1, "seq": 8192, "head_dim": 128}
        self.assertEqual(pb.attention_flops(llama, "fwd"), 4 * 16 * 8192**2 * 128 / 2)
        with self.assertRaises(ValueError):
            pb.attention_flops(gpt, "bwd")


def expected_names(shards):
    names = set()
    for shard in shards:
        names |= {f"{shard}.{layer}.{d}" for layer in ("qkv", "proj", "fc1", "fc2")
                  for d in ("fwd", "dgrad", "wgrad")}
        names |= {f"{shard}.attention.fwd", f"{shard}.attention.fwd_bwd", f"{shard}.attention.fwd_bwd@flash",
                  f"{shard}.attention.fwd_bwd@cudnn", f"{shard}.attention.fwd_bwd@deterministic"}
    return names


class Names(unittest.TestCase):
    def test_names_of_any_shard(self):
        names = [s["name"] for s in ops_specs_tiny()]
        self.assertEqual(len(names), len(set(names)))
        self.assertEqual(set(names), expected_names(("gpt3_tiny", "llama31_tiny")))
        self.assertEqual(pb.shard_name({"workload": "gpt3", "preset": "175b-tp4"}), "gpt3_175b_tp4")

    def test_all_names(self):
        self.assertEqual(pb.OPS_PRESETS, (("gpt3", "175b-tp4"), ("llama31", "405b-tp8")))
        names = [s["name"] for s in ops_specs_mlperf()]
        self.assertEqual(len(names), len(set(names)))
        self.assertEqual(set(names), expected_names(("gpt3_175b_tp4", "llama31_405b_tp8")))

    def test_backend_variants(self):
        specs = {s["name"]: s for s in ops_specs_tiny()}
        self.assertIsNone(specs["gpt3_tiny.attention.fwd_bwd"]["backend"])
        self.assertEqual(specs["gpt3_tiny.attention.fwd_bwd@cudnn"]["backend"], "cudnn")
        self.assertEqual(specs["gpt3_tiny.attention.fwd_bwd@flash"]["flops"],
                         specs["gpt3_tiny.attention.fwd_bwd"]["flops"])
        det = specs["llama31_tiny.attention.fwd_bwd@deterministic"]
        self.assertEqual(det["backend"], pb.ATTENTION_DETERMINISTIC)  # the default selection, deterministic
        self.assertEqual(det["direction"], "fwd_bwd")
        self.assertNotIn(pb.ATTENTION_DETERMINISTIC, pb.ATTENTION_BACKENDS)  # no backend is forced

    def test_only_filter(self):
        names = [s["name"] for s in pb.op_specs([tiny("gpt3"), tiny("llama31")], re.compile(r"llama.*\.fc2\."))]
        self.assertEqual(names, ["llama31_tiny.fc2.fwd", "llama31_tiny.fc2.dgrad", "llama31_tiny.fc2.wgrad"])
        self.assertEqual(pb.op_specs([tiny("gpt3")], re.compile("nothing")), [])


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
        spec = next(s for s in ops_specs_tiny() if s["name"] == "gpt3_tiny.qkv.fwd")
        r = pb.make_result(spec, [1.0, 1.25, 1.0], peak_tflops=800.0)
        self.assertEqual(r["median_ms"], 1.0)
        self.assertEqual(r["samples_ms"], [1.0, 1.25, 1.0])  # every timed call, in call order
        shape = spec["shape"]
        self.assertAlmostEqual(r["tflops"], 2 * shape["m"] * shape["n"] * shape["k"] / 1e-3 / 1e12)
        self.assertAlmostEqual(r["fraction_of_peak"], r["tflops"] / 800.0)
        self.assertIsNone(r["bytes"])
        self.assertIsNone(r["gbps"])
        self.assertEqual(r["dtype"], "bf16")
        self.assertNotIn("backend", r)

    def test_unmeasured_entry_is_null_with_note(self):
        spec = next(s for s in ops_specs_tiny() if s["name"].endswith("fwd_bwd@cudnn"))
        r = pb.make_result(spec, None, 800.0, note="CUDNN_ATTENTION refused", backend_used="CUDNN_ATTENTION")
        for key in ("median_ms", "p10_ms", "p90_ms", "tflops", "fraction_of_peak"):
            self.assertIsNone(r[key], key)
        self.assertNotIn("samples_ms", r)
        self.assertEqual(r["note"], "CUDNN_ATTENTION refused")
        self.assertEqual(r["backend"], "CUDNN_ATTENTION")
        self.assertIsNotNone(r["flops"])


class ReplayBinaries(unittest.TestCase):
    """What the replay binaries print, against the known MLPerf shard shapes, and their refusals."""

    def test_gpt3_tp4_shard(self):
        tp4 = real("gpt3", "175b-tp4")
        for key, value in {"hidden": 12288, "heads": 24, "kv_heads": 24, "head_dim": 128, "ffn": 12288,
                           "seq": 2048, "micro_batch": 1, "microbatches": 1, "vocab": 50688,
                           "vocab_shard": 12672, "data_vocab": 50257, "tp": 4, "layers": 0,
                           "model_layers": 96, "mlp": "gelu"}.items():
            self.assertEqual(tp4[key], value, key)
        self.assertEqual(pb.shard_linears(tp4), [("qkv", 9216, 12288), ("proj", 12288, 3072),
                                                 ("fc1", 12288, 12288), ("fc2", 12288, 12288)])

    def test_gpt3_tp8_shard(self):
        tp8 = real("gpt3", "175b-tp8")
        self.assertEqual((tp8["heads"], tp8["ffn"], tp8["vocab"], tp8["vocab_shard"], tp8["tp"]),
                         (12, 6144, 51200, 6400, 8))

    def test_llama31_tp8_shard(self):
        # workloads/llama31/README.md: 16 of 128 q heads, 1 of 8 KV heads, head dim 128, FFN 6656 of
        # 53248, sequence 8192, micro-batch 1, vocabulary 32000 (4000 per GPU).
        l8 = real("llama31", "405b-tp8")
        for key, value in {"hidden": 16384, "heads": 16, "kv_heads": 1, "head_dim": 128, "ffn": 6656,
                           "seq": 8192, "micro_batch": 1, "microbatches": 1, "vocab": 32000,
                           "vocab_shard": 4000, "data_vocab": 32000, "tp": 8, "layers": 0,
                           "model_layers": 126, "mlp": "swiglu"}.items():
            self.assertEqual(l8[key], value, key)
        self.assertEqual(pb.llama31_qkv_width(l8), 2304)
        self.assertEqual(pb.shard_linears(l8), [("qkv", 2304, 16384), ("proj", 16384, 2048),
                                                ("fc1", 13312, 16384), ("fc2", 16384, 6656)])

    def test_llama31_tp4_shard(self):
        l4 = real("llama31", "405b-tp4")
        self.assertEqual((l4["heads"], l4["kv_heads"], l4["ffn"], l4["vocab_shard"], l4["tp"]),
                         (32, 2, 13312, 8000, 4))
        self.assertEqual(pb.llama31_qkv_width(l4), 36 * 128)

    def test_microbatches_reach_the_binary(self):
        l8x4 = real("llama31", "405b-tp8", 4)
        self.assertEqual(l8x4["microbatches"], 4)
        self.assertEqual(l8x4["optimizer"]["warmup_steps"], 2304000)
        self.assertEqual(pb.tokens_per_step(l8x4), 4 * 8192)

    def test_unknown_preset_names_the_presets(self):
        real("gpt3", "tiny")  # skips without the binaries
        for workload, preset, known in (("gpt3", "175b-tp3", "175b-tp4"), ("llama31", "405b-tp2", "405b-tp8")):
            with self.subTest(workload):
                with self.assertRaises(pb.BaselineError) as e:
                    pb.load_shard_config(workload, preset, replay_bin=BIN)
                self.assertIn(preset, str(e.exception))
                self.assertIn(known, str(e.exception))
                self.assertIn("tiny", str(e.exception))

    def test_binary_refuses_bad_microbatches(self):
        real("llama31", "tiny")
        with self.assertRaisesRegex(pb.BaselineError, "exit status 2: .*--microbatches"):
            pb.load_shard_config("llama31", "tiny", 0, replay_bin=BIN)

    def test_config_file_is_the_same_as_the_binary(self):
        real("gpt3", "tiny")
        with tempfile.TemporaryDirectory() as d:
            for workload, preset, mb in (("gpt3", "175b-tp4", None), ("llama31", "405b-tp8", 4)):
                doc = pb.run_print_config(BIN, workload, preset, mb)[0]
                path = write_json_file(d, "cfg.json", doc)
                self.assertEqual(pb.load_shard_config(workload, config_path=path), real(workload, preset, mb))

    def test_optimizer_and_schedule_are_replays(self):
        # The baseline has no optimizer settings or schedule of its own: they are what replay prints.
        real("gpt3", "tiny")  # skips without the binaries
        for workload, preset, mb in (("gpt3", "tiny", None), ("gpt3", "175b-tp4", None),
                                     ("gpt3", "175b-tp8", None), ("llama31", "tiny", None),
                                     ("llama31", "405b-tp8", None), ("llama31", "405b-tp8", 4),
                                     ("llama31", "405b-tp4", None)):
            with self.subTest(f"{workload} {preset} x{mb}"):
                doc = pb.run_print_config(BIN, workload, preset, mb)[0]
                self.assertEqual(real(workload, preset, mb)["optimizer"], printed_optimizer(doc))

    def test_mlperf_schedules_in_steps_of_the_shards_global_batch(self):
        # MLPerf's GPT-3 warm-up of 265 x 1536 samples and decay of 166,809,600 samples at 1 sequence a step;
        # Llama 3.1's 8000 and 1,200,000 steps at 1152 sequences, at 1 and 4 sequences a step.
        for (workload, preset, mb), (W, T) in {("gpt3", "175b-tp4", None): (407040, 166809600),
                                               ("llama31", "405b-tp8", None): (9216000, 1382400000),
                                               ("llama31", "405b-tp8", 4): (2304000, 345600000)}.items():
            with self.subTest(f"{workload} {preset} x{mb}"):
                o = real(workload, preset, mb)["optimizer"]
                self.assertEqual((o["schedule"], o["warmup_steps"], o["decay_steps"]), ("warmup_cosine", W, T))

    def test_schedule_flags_reach_the_binary(self):
        real("gpt3", "tiny")
        asked = {"lr": 1.23456789e-4, "min_lr": 3e-6, "warmup_steps": 7, "decay_steps": 70}
        for workload, preset, mb in (("gpt3", "tiny", None), ("gpt3", "175b-tp4", None),
                                     ("llama31", "405b-tp8", 4)):
            with self.subTest(f"{workload} {preset}"):
                default = printed_optimizer(pb.run_print_config(BIN, workload, preset, mb)[0])
                doc = pb.run_print_config(BIN, workload, preset, mb, schedule=asked)[0]
                printed = printed_optimizer(doc)
                self.assertEqual(printed["lr"], 0.00012345679)  # replay's float32, shortest decimal
                self.assertEqual((printed["min_lr"], printed["warmup_steps"], printed["decay_steps"]),
                                 (3e-6, 7, 70))
                for key in asked:
                    self.assertNotEqual(printed[key], default[key], key)
                for key in ("betas", "eps", "weight_decay", "clip_norm", "schedule"):
                    self.assertEqual(printed[key], default[key], key)  # the flags change the schedule only
                cfg = pb.load_shard_config(workload, preset, mb, replay_bin=BIN, schedule=asked)
                self.assertEqual(cfg["optimizer"], printed)
                for step in schedule_steps(7, 70):
                    self.assertEqual(pb.lr_at(step, cfg["optimizer"]),
                                     formula(step, 0.00012345679, 3e-6, 7, 70), step)
                # One flag alone leaves the others at the preset's
                one = pb.load_shard_config(workload, preset, mb, replay_bin=BIN, schedule={"warmup_steps": 7})
                self.assertEqual(one["optimizer"], dict(default, warmup_steps=7))

    def test_config_file_takes_the_flags_as_the_binary_does(self):
        real("gpt3", "tiny")
        with tempfile.TemporaryDirectory() as d:
            for workload, preset, mb in (("gpt3", "175b-tp4", None), ("llama31", "405b-tp8", 4)):
                path = write_json_file(d, "cfg.json", pb.run_print_config(BIN, workload, preset, mb)[0])
                for asked in ({"lr": 1.23456789e-4, "min_lr": 2e-6, "warmup_steps": 7, "decay_steps": 70},
                              {"lr": 0.1}, {"decay_steps": 10**9 + 7}, {"min_lr": 1 / 3}):
                    with self.subTest(f"{workload} {asked}"):
                        self.assertEqual(pb.load_shard_config(workload, config_path=path, schedule=asked),
                                         pb.load_shard_config(workload, preset, mb, BIN, schedule=asked))

    def test_binary_refuses_a_bad_schedule(self):
        real("gpt3", "tiny")
        for schedule, fragment in (({"warmup_steps": 0}, "warmup_steps must be >= 1"),
                                   ({"warmup_steps": 100, "decay_steps": 50}, "total_steps must exceed warmup")):
            with self.subTest(fragment):
                with self.assertRaises(pb.BaselineError) as e:
                    pb.load_shard_config("gpt3", "tiny", replay_bin=BIN, schedule=schedule)
                self.assertIn("exit status 2: ", str(e.exception))
                self.assertIn(fragment, str(e.exception))
                self.assertIn(" ".join(pb.schedule_args(schedule)), str(e.exception))  # the command, as run


class Schedule(unittest.TestCase):
    """lr_at of the optimizer the baseline takes from a printed configuration: replay's formula (written
    independently in `formula`, and by hand for small numbers), to the float32 bit."""

    def check_steps(self, cfg, doc):
        o, sc = cfg["optimizer"], doc["training"]["schedule"]
        W, T = sc["warmup_steps"], sc["decay_steps"]
        for step in schedule_steps(W, T):
            got = pb.lr_at(step, o)
            self.assertEqual(got, formula(step, sc["lr"], sc["min_lr"], W, T), step)
            self.assertEqual(got, to_f32(got), step)  # a float32 value
        self.assertEqual(pb.lr_at(W - 1, o), to_f32(sc["lr"]))  # the peak
        self.assertEqual(pb.lr_at(W, o), to_f32(sc["lr"]))      # cos(0): still the peak
        self.assertEqual(pb.lr_at(T, o), to_f32(sc["min_lr"]))
        self.assertEqual(pb.lr_at(T + 5, o), to_f32(sc["min_lr"]))

    def test_from_the_binaries(self):
        real("gpt3", "tiny")  # skips without the binaries
        for workload, preset in (("gpt3", "tiny"), ("gpt3", "175b-tp4"), ("llama31", "405b-tp8")):
            with self.subTest(f"{workload} {preset}"):
                self.check_steps(real(workload, preset), pb.run_print_config(BIN, workload, preset)[0])

    def test_tiny_documents(self):  # the binaries' where they are, else FALLBACK_TINY's
        for workload in ("gpt3", "llama31"):
            with self.subTest(workload):
                self.check_steps(tiny(workload), tiny_doc(workload))

    def small_document(self, kind="warmup_cosine"):
        doc = tiny_doc("gpt3")
        doc["training"]["schedule"] = {"kind": kind, "lr": 0.5, "min_lr": 0.125, "warmup_steps": 3,
                                       "decay_steps": 10}
        return doc

    def test_small_numbers_by_hand(self):
        # W = 3, T = 10, lr 0.5, min_lr 0.125 (exact in float32): warm-up 0.5/3, 1.0/3, 0.5; then
        # 0.125 + 0.375 (1 + cos(pi p)) / 2 with p = (s - 3) / 7; 0.125 from step 10.
        with tempfile.TemporaryDirectory() as d:
            path = write_json_file(d, "small.json", self.small_document())
            o = pb.load_shard_config("gpt3", config_path=path)["optimizer"]
        self.assertEqual((o["schedule"], o["lr"], o["min_lr"], o["warmup_steps"], o["decay_steps"]),
                         ("warmup_cosine", 0.5, 0.125, 3, 10))
        by_hand = {
            0: 0.16666667,          # 0.5 x 1 / 3
            1: 0.33333334,          # 0.5 x 2 / 3
            2: 0.5,                 # W - 1: 0.5 x 3 / 3
            3: 0.5,                 # W: p = 0, cos 0 = 1
            6: 0.35422269,          # (W + T) / 2 = 6.5, floored: p = 3/7, cos(3 pi / 7) = 0.22252093
            9: 0.14356834,          # T - 1: p = 6/7, cos(6 pi / 7) = -0.90096887
            10: 0.125,              # T: min_lr
            15: 0.125,              # T + 5
        }
        self.assertEqual(sorted(by_hand), list(schedule_steps(3, 10)))
        for step, value in by_hand.items():
            got = pb.lr_at(step, o)
            self.assertEqual(got, to_f32(value), step)  # the decimals above are the float32 values
            self.assertEqual(got, formula(step, 0.5, 0.125, 3, 10), step)

    def test_rates_are_replays_float32(self):
        # lr 2e-05 printed is replay's 2e-5f: the warm-up's last step gives that float32 exactly, not
        # the double 2e-5.
        o = {"schedule": "warmup_cosine", "lr": 2e-05, "min_lr": 2e-06, "warmup_steps": 407040,
             "decay_steps": 166809600}
        self.assertEqual(pb.lr_at(407039, o), to_f32(2e-5))
        self.assertNotEqual(pb.lr_at(407039, o), 2e-5)
        self.assertEqual(pb.lr_at(0, o), to_f32(to_f32(2e-5) / 407040))
        self.assertEqual(pb.schedule_constants(o), (to_f32(2e-5), to_f32(2e-6), 407040, 166809600))
        self.assertEqual(pb.fp32_decimal(2e-5), 2e-05)
        self.assertEqual(pb.fp32_decimal(1.23456789e-4), 0.00012345679)
        self.assertEqual(pb.fp32_decimal(1 / 3), 0.33333334)

    def test_unknown_kind_is_an_error(self):
        for kind in ("warmup_constant", "rnnt_warmup_hold_decay", "cosine", None):
            with self.subTest(kind):
                with self.assertRaises(pb.BaselineError) as e:
                    pb.shard_config(self.small_document(kind), "gpt3", "SOURCE")
                self.assertIn(f"SOURCE: training.schedule.kind is {json.dumps(kind)}, expected "
                              f"\"warmup_cosine\": pytorch_baseline.py implements only that schedule",
                              str(e.exception))
        with self.assertRaisesRegex(ValueError, "schedule kind 'warmup_constant'"):
            pb.lr_at(0, {"schedule": "warmup_constant", "lr": 1.0, "min_lr": 0.0, "warmup_steps": 1,
                         "decay_steps": 2})

    def test_config_file_overrides(self):
        # --lr, --min-lr, --warmup-steps, --decay-steps with --config FILE: the file's values replaced as
        # replay replaces its preset's, then checked as replay checks them.
        with tempfile.TemporaryDirectory() as d:
            path = write_json_file(d, "small.json", self.small_document())
            o = pb.load_shard_config("gpt3", config_path=path, schedule={"warmup_steps": 4, "lr": 0.1,
                                                                         "decay_steps": None})["optimizer"]
            self.assertEqual((o["lr"], o["min_lr"], o["warmup_steps"], o["decay_steps"]), (0.1, 0.125, 4, 10))
            self.assertEqual(pb.lr_at(0, o), to_f32(to_f32(0.1) / 4))
            with self.assertRaises(pb.BaselineError) as e:
                pb.load_shard_config("gpt3", config_path=path, schedule={"warmup_steps": 10})
            self.assertIn(f"--config {path} with --warmup-steps 10: training.schedule.decay_steps is 10, "
                          f"expected an integer above warmup_steps 10", str(e.exception))
            with open(path) as f:
                self.assertEqual(json.load(f)["training"]["schedule"]["warmup_steps"], 3)  # file untouched


class Gpt3Shapes(unittest.TestCase):
    def test_tiny_is_small(self):
        t = tiny("gpt3")
        self.assertLess(pb.gpt3_params(t, pb.default_layers(t)), 10_000_000)
        self.assertEqual(t["vocab_shard"], t["vocab"])  # TP 1: the whole vocabulary

    def test_layer_params_match_the_op_shapes(self):
        # About 453M parameters per layer per GPU at TP4; the weights are exactly the GEMMs that `ops`
        # times for the same shard, plus biases and two LayerNorms.
        tp4 = real("gpt3", "175b-tp4")
        weights = sum(n * k for _, n, k in pb.ops_shard(tp4)["linears"])
        biases = 9216 + 3 * 12288
        self.assertEqual(pb.gpt3_layer_params(tp4), weights + biases + 4 * 12288)
        self.assertEqual(pb.gpt3_layer_params(tp4), 453_080_064)

    def test_embedding_params(self):
        tp4 = real("gpt3", "175b-tp4")
        self.assertEqual(pb.gpt3_embedding_params(tp4), 12672 * 12288 + 2048 * 12288 + 2 * 12288)
        self.assertEqual(pb.gpt3_params(tp4, 7), 7 * 453_080_064 + pb.gpt3_embedding_params(tp4))

    def test_whole_model_at_tp1_is_gpt3_175b(self):
        # GPT-3 175B: 175 billion parameters, about 1.077 TFLOP per token (6N plus the attention term).
        full = dict(real("gpt3", "175b-tp4"), heads=96, ffn=49152, vocab_shard=50304, tp=1)
        n = pb.gpt3_params(full, 96)
        self.assertAlmostEqual(n / 175e9, 1.0, delta=0.005)
        per_token = pb.flops_per_step(full, 96) / 2048
        self.assertAlmostEqual(per_token / 1.077e12, 1.0, delta=0.005)


class Gpt3Flops(unittest.TestCase):
    def test_formula(self):
        tp4 = real("gpt3", "175b-tp4")
        tokens = 2048
        expected = 6.0 * pb.gpt3_params(tp4, 7) * tokens + 12.0 * 7 * 2048 * (24 * 128) * tokens
        self.assertEqual(pb.flops_per_step(tp4, 7), expected)

    def test_attention_term_uses_this_shards_heads(self):
        # Halving the heads per GPU (TP4 -> TP8) halves the attention term.
        attn = lambda cfg: pb.flops_per_step(cfg, 1) - 6.0 * pb.gpt3_params(cfg, 1) * 2048  # noqa: E731
        self.assertAlmostEqual(attn(real("gpt3", "175b-tp4")) / attn(real("gpt3", "175b-tp8")), 2.0)

    def test_formula_string_in_the_json_says_what_d_is(self):
        self.assertIn("6*N*tokens + 12*L*s*d*tokens", pb.FLOPS_FORMULA)
        self.assertIn("heads x head_dim", pb.FLOPS_FORMULA)


class Gpt3DefaultLayers(unittest.TestCase):
    def test_what_fits_an_80gb_h100(self):
        tp4, tp8 = real("gpt3", "175b-tp4"), real("gpt3", "175b-tp8")
        self.assertEqual(pb.default_layers(tp4), 7)
        self.assertEqual(pb.default_layers(tp8), 15)
        # and the state of those layers does fit the budget, one more layer does not
        for cfg, layers in ((tp4, 7), (tp8, 15)):
            self.assertLessEqual(18 * pb.gpt3_params(cfg, layers), pb.STATE_BUDGET_BYTES)
            self.assertGreater(18 * pb.gpt3_params(cfg, layers + 1), pb.STATE_BUDGET_BYTES)

    def test_capped_by_the_model_and_at_least_one(self):
        tp4 = real("gpt3", "175b-tp4")
        self.assertEqual(pb.default_layers(tp4, budget_bytes=1), 1)
        self.assertEqual(pb.default_layers(tp4, budget_bytes=2**60), tp4["model_layers"])

    def test_the_presets_own_count(self):
        t = tiny("gpt3")
        self.assertGreater(t["layers"], 0)
        self.assertEqual(pb.default_layers(t), t["layers"])
        self.assertEqual(pb.default_layers(t, budget_bytes=1), t["layers"])

    def test_bytes_per_parameter(self):
        self.assertEqual(pb.STATE_BYTES_PER_PARAM, 4 + 2 + 4 + 4 + 4)
        self.assertGreater(pb.default_layers(real("gpt3", "175b-tp4"), bytes_per_param=16), 7)


class Gpt3Schedule(unittest.TestCase):
    def test_warmup_then_cosine(self):
        o = real("gpt3", "175b-tp4")["optimizer"]
        W, T = o["warmup_steps"], o["decay_steps"]
        self.assertAlmostEqual(pb.lr_at(0, o) / (o["lr"] / W), 1.0, places=6)
        self.assertAlmostEqual(pb.lr_at(W - 1, o) / o["lr"], 1.0, places=6)
        self.assertAlmostEqual(pb.lr_at((W + T) // 2, o) / ((o["lr"] + o["min_lr"]) / 2), 1.0, places=6)
        self.assertAlmostEqual(pb.lr_at(10 * T, o) / o["min_lr"], 1.0, places=6)
        lrs = [pb.lr_at(s, o) for s in range(0, 2 * T, T // 5000)]
        peak = lrs.index(max(lrs))
        self.assertTrue(all(a <= b for a, b in zip(lrs[:peak], lrs[1:peak + 1])))
        self.assertTrue(all(a >= b for a, b in zip(lrs[peak:], lrs[peak + 1:])))

    def test_mlperf_hyperparameters(self):
        o = real("gpt3", "175b-tp4")["optimizer"]
        self.assertEqual((o["betas"], o["eps"], o["weight_decay"], o["clip_norm"]), ((0.9, 0.95), 1e-8, 0.1, 1.0))
        self.assertEqual((o["lr"], o["min_lr"]), (2e-5, 2e-6))


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

    def good_attrs(self, cfg, **changes):
        attrs = {"format": b"replay-tokens", "format_version": 1, "vocab_size": cfg["data_vocab"],
                 "seq_len": cfg["seq"], "num_sequences": 16}
        attrs.update(changes)
        return attrs

    def test_token_file_accepted(self):
        cfg = tiny("gpt3")
        rows = (16, cfg["seq"] + 1)
        self.assertIsNone(pb.token_file_problem(self.good_attrs(cfg), rows, True, cfg))
        self.assertIsNone(pb.token_file_problem(self.good_attrs(cfg, format="replay-tokens"), rows, True, cfg))

    def test_token_file_problems(self):
        cfg = tiny("gpt3")
        seq, vocab, mb = cfg["seq"], cfg["vocab"], cfg["micro_batch"]
        rows = (16, seq + 1)
        cases = [
            (self.good_attrs(cfg, format="other"), rows, True, "format is"),
            (self.good_attrs(cfg, format_version=2), rows, True, "format_version"),
            (self.good_attrs(cfg), None, True, "no dataset /tokens"),
            (self.good_attrs(cfg), (16, seq + 1, 1), True, "rank 3"),
            (self.good_attrs(cfg), rows, False, "not 32-bit integers"),
            (self.good_attrs(cfg, seq_len=0), (16, 1), True, "seq_len is 0"),
            (self.good_attrs(cfg, vocab_size=1.5), rows, True, "vocab_size is 1.5"),
            (self.good_attrs(cfg), (15, seq + 1), True, f"/tokens shape [15, {seq + 1}]"),
            (self.good_attrs(cfg, seq_len=seq // 2), (16, seq // 2 + 1), True, f"not the model's {seq}"),
            (self.good_attrs(cfg, vocab_size=vocab + 1), rows, True,
             f"larger than the model's vocabulary {vocab}"),
            (self.good_attrs(cfg, num_sequences=mb - 1), (mb - 1, seq + 1), True,
             f"{mb - 1} sequences hold no micro-batch of {mb}"),
        ]
        for attrs, shape, is_int32, fragment in cases:
            with self.subTest(fragment):
                self.assertIn(fragment, pb.token_file_problem(attrs, shape, is_int32, cfg) or "")


MEASURED = {"version": "2.11.0", "environment": {"gpu": "Test GPU"}, "settings": {},
            "attention_backend": "FLASH_ATTENTION",
            "memory": {"peak_bytes": 70e9, "reserved_bytes": 72e9, "arena_bytes": None,
                       "graph_extra_bytes": None},
            "graphs_info": {"count": 1, "nodes": 900, "capture_ms": 400.0, "instantiate_ms": 100.0},
            "weights_hash": "00ff"}


def document(cfg, layers, graphs="full", losses=(10.5, 10.25), floor=9.44):
    measured = dict(MEASURED, losses=list(losses), loss_floor=floor)
    run = {"preset": cfg["preset"], "graphs": graphs, "seed": 1234, "steps": 4, "warmup": 3, "data": "random"}
    return pb.workload_document(cfg, layers, run, [200.0, 210.0, 190.0, 205.0], [50.0, 60.0, 70.0, 80.0], 800.0,
                                measured)


class Gpt3Json(unittest.TestCase):
    def test_rates(self):
        cfg = tiny("gpt3")
        d = document(cfg, 2)
        self.assertEqual(d["step_ms"]["median"], 202.5)
        self.assertEqual(d["step_ms"]["count"], 4)
        self.assertAlmostEqual(d["throughput"]["tokens_per_s"], pb.tokens_per_step(cfg) / 0.2025)
        self.assertAlmostEqual(d["throughput"]["samples_per_s"], cfg["micro_batch"] / 0.2025)
        self.assertAlmostEqual(d["model_tflops"], pb.flops_per_step(cfg, 2) / 0.2025 / 1e12)
        self.assertAlmostEqual(d["mfu"], d["model_tflops"] / 800.0)
        self.assertEqual(d["host_enqueue_us"]["median"], 65.0)
        self.assertEqual(d["loss_hash"], pb.loss_hash([10.5, 10.25]))

    def test_mlperf_shard(self):
        tp4 = real("gpt3", "175b-tp4")
        d = document(tp4, 7)
        c = d["config"]
        self.assertEqual((c["layers"], c["heads"], c["ffn"], c["vocab"], c["vocab_shard"], c["data_vocab"]),
                         (7, 24, 12288, 50688, 12672, 50257))
        self.assertAlmostEqual(d["throughput"]["tokens_per_s"], 2048 / 0.2025)
        self.assertEqual((d["optimizer"]["warmup_steps"], d["optimizer"]["decay_steps"]), (407040, 166809600))
        self.assertEqual(d["optimizer"], dict(printed_optimizer(pb.run_print_config(BIN, "gpt3", "175b-tp4")[0]),
                                              betas=[0.9, 0.95], implementation=pb.OPTIMIZER_IMPLEMENTATION))

    def test_schema_keys(self):
        d = document(tiny("gpt3"), 2)
        for key in ("tool", "version", "workload", "preset", "graphs", "environment", "config",
                    "tensor_parallel_collectives", "step_ms", "host_enqueue_us", "throughput", "model_tflops",
                    "flops_per_step", "flops_formula", "mfu", "peaks", "memory", "graphs_info", "losses",
                    "loss_hash", "weights_hash", "loss_floor"):
            self.assertIn(key, d)
        for key in ("layers", "hidden", "heads", "head_dim", "ffn", "seq", "micro_batch", "microbatches",
                    "vocab", "vocab_shard", "tp", "dropout", "seed", "steps", "warmup", "precision"):
            self.assertIn(key, d["config"])
        self.assertEqual((d["tool"], d["workload"], d["config"]["layers"]), ("pytorch", "gpt3", 2))
        json.dumps(d, allow_nan=False)

    def test_every_key_is_documented(self):
        with open(os.path.join(SCRIPTS, "..", "reports", "SCHEMA.md")) as f:
            schema = f.read()
        d = document(tiny("gpt3"), 2)
        for key in list(d) + list(d["config"]) + list(d["memory"]) + list(d["optimizer"]):
            self.assertIn(f'"{key}"', schema, key)

    def test_report_accepts_it(self):
        cfg = tiny("gpt3")
        for graphs in ("none", "full"):
            name = f"pytorch_gpt3_{cfg['preset']}_{graphs}.json"
            d = report.validate_workload(document(cfg, 2, graphs), name)
            self.assertEqual(d["graphs"], graphs)
            self.assertEqual(report.workload_file_key(name), ("pytorch", "gpt3", cfg["preset"], graphs, 0))


class Llama31Shapes(unittest.TestCase):
    def test_tiny(self):
        t = tiny("llama31")
        self.assertLess(pb.llama31_params(t, pb.default_layers(t)), 10_000_000)
        self.assertEqual(t["vocab_shard"], t["vocab"])  # TP 1: the whole vocabulary
        self.assertLess(t["kv_heads"], t["heads"])      # GQA

    def test_layer_params_match_the_op_shapes(self):
        # The weights are exactly the GEMMs `ops` times for llama31_405b_tp8, plus two RMSNorm weights:
        # about 398M per layer per GPU.
        l8 = real("llama31", "405b-tp8")
        shard = pb.ops_shard(l8)
        weights = sum(n * k for _, n, k in shard["linears"])
        self.assertEqual(pb.llama31_layer_params(l8), weights + 2 * 16384)
        self.assertEqual(pb.llama31_layer_params(l8), 398_491_648)
        att = shard["attention"]
        self.assertEqual((att["q_heads"], att["kv_heads"], att["seq"], att["head_dim"]),
                         (l8["heads"], l8["kv_heads"], l8["seq"], l8["head_dim"]))

    def test_embedding_params_untied(self):
        l8 = real("llama31", "405b-tp8")
        self.assertEqual(pb.llama31_embedding_params(l8), 2 * 4000 * 16384 + 16384)
        self.assertEqual(pb.model_params(l8, 8), 8 * 398_491_648 + pb.llama31_embedding_params(l8))

    def test_whole_model_at_tp1_is_llama_405b(self):
        # With Llama 3.1's own 128256-token vocabulary the whole model is 405.85B parameters.
        full = dict(real("llama31", "405b-tp8"), heads=128, kv_heads=8, ffn=53248, vocab_shard=128256, tp=1)
        self.assertAlmostEqual(pb.model_params(full, 126) / 405.85e9, 1.0, delta=0.001)


class Llama31Flops(unittest.TestCase):
    def test_formula_uses_the_shards_query_width(self):
        l8 = real("llama31", "405b-tp8")
        tokens = 8192
        expected = 6.0 * pb.model_params(l8, 8) * tokens + 12.0 * 8 * 8192 * (16 * 128) * tokens
        self.assertEqual(pb.flops_per_step(l8, 8), expected)

    def test_microbatches_scale_the_tokens(self):
        l8, l8x4 = real("llama31", "405b-tp8"), real("llama31", "405b-tp8", 4)
        self.assertEqual(pb.tokens_per_step(l8x4), 4 * 8192)
        self.assertEqual(pb.flops_per_step(l8x4, 8), 4 * pb.flops_per_step(l8, 8))


class Llama31DefaultLayers(unittest.TestCase):
    def test_what_fits_an_80gb_h100(self):
        l8, l4 = real("llama31", "405b-tp8"), real("llama31", "405b-tp4")
        self.assertEqual(pb.default_layers(l8), 8)
        self.assertEqual(pb.default_layers(l4), 4)
        for cfg, layers in ((l8, 8), (l4, 4)):
            self.assertLessEqual(18 * pb.model_params(cfg, layers), pb.STATE_BUDGET_BYTES)
            self.assertGreater(18 * pb.model_params(cfg, layers + 1), pb.STATE_BUDGET_BYTES)

    def test_the_presets_own_count(self):
        t = tiny("llama31")
        self.assertEqual(pb.default_layers(t), t["layers"])


class Llama31Optimizer(unittest.TestCase):
    def test_replays_mlperf_settings(self):
        # workloads/llama31/llama31.cpp mlperf_training at a global batch of 4: 8e-5 x 4 / 1152 (as float32)
        # down to 8e-7, warm-up ceil(8000 x 1152 / 4), decay ceil(1,200,000 x 1152 / 4); AdamW 0.9/0.95,
        # eps 1e-5, weight decay 0.1, clip 1.0.
        o = real("llama31", "405b-tp8", 4)["optimizer"]
        self.assertEqual(o["lr"], pb.fp32_decimal(8e-5 * 4 / 1152))
        self.assertEqual((o["min_lr"], o["warmup_steps"], o["decay_steps"]), (8e-7, 2304000, 345600000))
        self.assertEqual((o["betas"], o["eps"], o["weight_decay"], o["clip_norm"]), ((0.9, 0.95), 1e-5, 0.1, 1.0))

    def test_global_batch_of_the_configuration(self):
        # The schedule follows the micro-batches the binary was asked for.
        o1, o4 = real("llama31", "405b-tp8")["optimizer"], real("llama31", "405b-tp8", 4)["optimizer"]
        self.assertEqual((o1["warmup_steps"], o4["warmup_steps"]), (4 * 2304000, 2304000))
        self.assertAlmostEqual(o4["lr"] / o1["lr"], 4.0, places=6)

    def test_schedule(self):
        o = real("llama31", "405b-tp8", 4)["optimizer"]
        self.assertEqual(pb.lr_at(2304000 - 1, o), to_f32(o["lr"]))
        self.assertEqual(pb.lr_at(345600000, o), to_f32(8e-7))


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
        arch = pb.WORKLOADS["llama31"]["architecture"]
        self.assertEqual((arch["norm_eps"], arch["rope_theta"]),
                         (pb.LLAMA31_NORM_EPS, pb.LLAMA31_ROPE["theta"]))


class Llama31Json(unittest.TestCase):
    def test_fields(self):
        l8x4 = real("llama31", "405b-tp8", 4)
        d = document(l8x4, 8, losses=(8.5, 8.25), floor=math.log(4000))
        self.assertEqual((d["tool"], d["workload"], d["preset"]), ("pytorch", "llama31", "405b-tp8"))
        c = d["config"]
        self.assertEqual((c["layers"], c["heads"], c["kv_heads"], c["ffn"], c["vocab_shard"], c["microbatches"]),
                         (8, 16, 1, 6656, 4000, 4))
        self.assertEqual(c["parameters"], pb.model_params(real("llama31", "405b-tp8"), 8))
        self.assertAlmostEqual(d["throughput"]["tokens_per_s"], 4 * 8192 / 0.2025)
        self.assertAlmostEqual(d["throughput"]["samples_per_s"], 4 / 0.2025)
        self.assertEqual(d["optimizer"]["eps"], 1e-5)
        self.assertEqual(d["optimizer"]["warmup_steps"], 2304000)
        self.assertEqual(d["flops_formula"], pb.FLOPS_FORMULA)
        json.dumps(d, allow_nan=False)

    def test_same_keys_as_gpt3_plus_kv_heads(self):
        # replay-llama31 reports config.kv_heads; every other key is gpt3's (and documented there).
        d, g = document(tiny("llama31"), 2), document(tiny("gpt3"), 2)
        self.assertEqual(set(d), set(g))
        self.assertEqual(set(d["config"]), set(g["config"]) | {"kv_heads"})
        self.assertEqual(list(d["config"])[:4], ["layers", "hidden", "heads", "kv_heads"])

    def test_report_accepts_it(self):
        cfg = tiny("llama31")
        for graphs in ("none", "full"):
            name = f"pytorch_llama31_{cfg['preset']}_{graphs}.json"
            d = report.validate_workload(document(cfg, 2, graphs), name)
            self.assertEqual(d["graphs"], graphs)
            self.assertEqual(report.workload_file_key(name), ("pytorch", "llama31", cfg["preset"], graphs, 0))


class LossHash(unittest.TestCase):
    def test_known_value_and_float32_bits(self):
        self.assertEqual(pb.loss_hash([]), "cbf29ce484222325")  # FNV-1a 64 offset basis
        self.assertEqual(pb.loss_hash([1.0, 2.5]), "09e6a9ee2dfe8d78")
        self.assertEqual(pb.loss_hash([1.0]), pb.loss_hash([1.0 + 1e-12]))  # same float32
        self.assertNotEqual(pb.loss_hash([0.0]), pb.loss_hash([-0.0]))
        self.assertNotEqual(pb.loss_hash([1.0, 2.0]), pb.loss_hash([2.0, 1.0]))


class CommandLine(unittest.TestCase):
    def setUp(self):
        self.tmp = tempfile.TemporaryDirectory()
        self.addCleanup(self.tmp.cleanup)
        self.empty_bin = os.path.join(self.tmp.name, "bin")
        os.mkdir(self.empty_bin)

    def config_file(self, workload, change=None):
        doc = tiny_doc(workload)
        if change:
            change(doc)
        return write_json_file(self.tmp.name, f"{workload}_tiny.json", doc)

    def assert_clear_error(self, p, fragment):
        self.assertEqual(p.returncode, 2, p.stderr)
        self.assertIn(fragment, p.stderr)
        self.assertNotIn("Traceback", p.stderr)

    def test_bad_regex_is_a_usage_error(self):
        p = run_cli("ops", "--json", os.devnull, "--only", "(")
        self.assertEqual(p.returncode, 2)
        self.assertIn("not a regular expression", p.stderr)

    @unittest.skipUnless(BINARIES, NO_BINARIES)
    def test_only_matching_nothing(self):
        p = run_cli("ops", "--replay-bin", BIN, "--json", os.devnull, "--only", "no_such_op")
        self.assert_clear_error(p, "matches no op")

    def test_ops_without_the_binaries(self):
        out = os.path.join(self.tmp.name, "out.json")
        p = run_cli("ops", "--replay-bin", self.empty_bin, "--json", out)
        self.assert_clear_error(p, f"no replay-gpt3 binary at {os.path.join(self.empty_bin, 'replay-gpt3')}")
        self.assertIn("--replay-bin DIR", p.stderr)
        self.assertNotIn("--config", p.stderr)  # ops has none
        self.assertFalse(os.path.exists(out))

    def test_repeats_must_be_positive(self):
        p = run_cli("ops", "--json", os.devnull, "--repeats", "0")
        self.assertEqual(p.returncode, 2)

    def test_budget_range_and_warmup(self):
        p = run_cli("ops", "--json", os.devnull, "--budget-ms", "-1")
        self.assertEqual(p.returncode, 2)
        self.assertIn("--budget-ms: must be in [0, 10000], got -1", p.stderr)
        p = run_cli("ops", "--json", os.devnull, "--warmup", "1")
        self.assert_clear_error(p, "--budget-ms needs --warmup 2 or more")
        # --budget-ms 0 lifts the need: the run goes on to the next check, the binaries
        p = run_cli("ops", "--json", os.devnull, "--warmup", "1", "--budget-ms", "0",
                    "--replay-bin", self.empty_bin)
        self.assert_clear_error(p, "no replay-gpt3 binary")

    @unittest.skipIf(TORCH_PRESENT, "torch is installed here (the no-torch path cannot be exercised)")
    @unittest.skipUnless(BINARIES, NO_BINARIES)
    def test_no_torch_is_a_clear_error(self):
        out = os.path.join(self.tmp.name, "out.json")
        p = run_cli("ops", "--replay-bin", BIN, "--json", out)
        self.assert_clear_error(p, "pytorch_baseline.py: error: PyTorch is not importable")
        self.assertFalse(os.path.exists(out))

    def test_gpt3_layers_beyond_the_model(self):
        depth = tiny("gpt3")["model_layers"]
        p = run_cli("gpt3", "--config", self.config_file("gpt3"), "--layers", str(depth + 1), "--json",
                    os.devnull)
        self.assert_clear_error(p, f"--layers {depth + 1}: the tiny model has {depth} layers")

    @unittest.skipUnless(BINARIES, NO_BINARIES)
    def test_gpt3_layers_beyond_the_mlperf_model(self):
        p = run_cli("gpt3", "--replay-bin", BIN, "--preset", "175b-tp4", "--layers", "97", "--json", os.devnull)
        self.assert_clear_error(p, "--layers 97: the 175b-tp4 model has 96 layers")

    def test_gpt3_full_graph_needs_warmup(self):
        p = run_cli("gpt3", "--graphs", "full", "--warmup", "0", "--replay-bin", self.empty_bin, "--json",
                    os.devnull)
        self.assert_clear_error(p, "--graphs full needs --warmup 1 or more")

    def test_gpt3_missing_data_file(self):
        p = run_cli("gpt3", "--data", "/no/such/tokens.h5", "--json", os.devnull)
        self.assert_clear_error(p, "--data /no/such/tokens.h5: no such file")

    def test_gpt3_json_directory_must_exist(self):
        p = run_cli("gpt3", "--json", "/no/such/dir/out.json")
        self.assert_clear_error(p, "does not exist")

    def test_gpt3_bad_choices(self):
        for args in (("--graphs", "layer"), ("--steps", "0"),
                     ("--replay-bin", self.empty_bin, "--config", self.config_file("gpt3"))):
            with self.subTest(args):
                p = run_cli("gpt3", *args, "--json", os.devnull)
                self.assertEqual(p.returncode, 2)
                self.assertIn("usage:", p.stderr)

    @unittest.skipUnless(BINARIES, NO_BINARIES)
    def test_gpt3_unknown_preset(self):
        p = run_cli("gpt3", "--replay-bin", BIN, "--preset", "175b-tp3", "--json", os.devnull)
        self.assert_clear_error(p, "175b-tp3 not in {")
        self.assertIn("175b-tp4", p.stderr)
        self.assertNotIn("usage:", p.stderr)

    def test_gpt3_without_the_binary(self):
        p = run_cli("gpt3", "--replay-bin", self.empty_bin, "--json", os.devnull)
        self.assert_clear_error(p, "no replay-gpt3 binary at")
        self.assertIn("--config FILE", p.stderr)

    def test_gpt3_malformed_config(self):
        path = os.path.join(self.tmp.name, "broken.json")
        with open(path, "w") as f:
            f.write("{\"workload\": \"gpt3\",")
        p = run_cli("gpt3", "--config", path, "--json", os.devnull)
        self.assert_clear_error(p, f"--config {path}: not JSON")
        p = run_cli("gpt3", "--config", self.config_file("gpt3", lambda d: d["config"].pop("ffn")), "--json",
                    os.devnull)
        self.assert_clear_error(p, "config.ffn is missing")
        p = run_cli("gpt3", "--config", self.config_file("llama31"), "--json", os.devnull)
        self.assert_clear_error(p, "\"workload\" is 'llama31', expected 'gpt3'")
        p = run_cli("gpt3", "--config", self.config_file("gpt3"), "--preset", "175b-tp4", "--json", os.devnull)
        self.assert_clear_error(p, "is the configuration of preset tiny")

    @unittest.skipIf(TORCH_PRESENT, "torch is installed here (the no-torch path cannot be exercised)")
    def test_gpt3_no_torch_is_a_clear_error(self):
        out = os.path.join(self.tmp.name, "out.json")
        p = run_cli("gpt3", "--config", self.config_file("gpt3"), "--json", out)
        self.assert_clear_error(p, "pytorch_baseline.py: error: PyTorch is not importable")
        self.assertFalse(os.path.exists(out))

    def test_llama31_layers_beyond_the_model(self):
        depth = tiny("llama31")["model_layers"]
        p = run_cli("llama31", "--config", self.config_file("llama31"), "--layers", str(depth + 1), "--json",
                    os.devnull)
        self.assert_clear_error(p, f"--layers {depth + 1}: the tiny model has {depth} layers")

    def test_llama31_full_graph_needs_warmup(self):
        p = run_cli("llama31", "--graphs", "full", "--warmup", "0", "--microbatches", "2", "--json", os.devnull)
        self.assert_clear_error(p, "--graphs full needs --warmup 1 or more")

    def test_llama31_bad_choices(self):
        for args in (("--graphs", "layer"), ("--microbatches", "0")):
            with self.subTest(args):
                p = run_cli("llama31", *args, "--json", os.devnull)
                self.assertEqual(p.returncode, 2)
                self.assertIn("usage:", p.stderr)

    @unittest.skipUnless(BINARIES, NO_BINARIES)
    def test_llama31_unknown_preset(self):
        p = run_cli("llama31", "--replay-bin", BIN, "--preset", "175b-tp4", "--json", os.devnull)
        self.assert_clear_error(p, "175b-tp4 not in {")
        self.assertIn("405b-tp8", p.stderr)

    def test_llama31_microbatches_and_config(self):
        p = run_cli("llama31", "--config", self.config_file("llama31"), "--microbatches", "2", "--json",
                    os.devnull)
        self.assert_clear_error(p, "--microbatches 2: --config")

    def test_gpt3_has_no_microbatches_flag(self):
        p = run_cli("gpt3", "--microbatches", "2", "--json", os.devnull)
        self.assertEqual(p.returncode, 2)
        self.assertIn("unrecognized arguments", p.stderr)

    @unittest.skipIf(TORCH_PRESENT, "torch is installed here (the no-torch path cannot be exercised)")
    def test_llama31_no_torch_is_a_clear_error(self):
        out = os.path.join(self.tmp.name, "out.json")
        p = run_cli("llama31", "--config", self.config_file("llama31"), "--microbatches", "1", "--json", out)
        self.assert_clear_error(p, "pytorch_baseline.py: error: PyTorch is not importable")
        self.assertFalse(os.path.exists(out))

    def test_schedule_flags_are_checked(self):
        for args, fragment in ((("--lr", "-1"), "--lr: must be in [0, 1000], got -1"),
                               (("--min-lr", "x"), "--min-lr: not a number: 'x'"),
                               (("--warmup-steps", "1.5"), "--warmup-steps: not an integer: '1.5'"),
                               (("--decay-steps", "0"), "--decay-steps: must be >= 1, got 0")):
            for workload in ("gpt3", "llama31"):
                with self.subTest(f"{workload} {args}"):
                    p = run_cli(workload, *args, "--replay-bin", self.empty_bin, "--json", os.devnull)
                    self.assertEqual(p.returncode, 2)
                    self.assertIn("usage:", p.stderr)
                    self.assertIn(fragment, p.stderr)

    def test_schedule_flags_override_the_config_file(self):
        path = self.config_file("gpt3")
        p = run_cli("gpt3", "--config", path, "--warmup-steps", "400", "--decay-steps", "400", "--json",
                    os.devnull)
        self.assert_clear_error(p, f"--config {path} with --warmup-steps 400 --decay-steps 400: "
                                   f"training.schedule.decay_steps is 400, expected an integer above "
                                   f"warmup_steps 400")

    def test_unknown_schedule_kind(self):
        def constant(doc):
            doc["training"]["schedule"]["kind"] = "warmup_constant"
        p = run_cli("llama31", "--config", self.config_file("llama31", constant), "--json", os.devnull)
        self.assert_clear_error(p, "training.schedule.kind is \"warmup_constant\", expected \"warmup_cosine\"")

    @unittest.skipUnless(BINARIES, NO_BINARIES)
    def test_schedule_flags_reach_the_binary(self):
        p = run_cli("gpt3", "--replay-bin", BIN, "--preset", "tiny", "--warmup-steps", "0", "--json", os.devnull)
        self.assert_clear_error(p, "`replay-gpt3 --preset tiny --warmup-steps 0 --print-config`")
        self.assertIn("warmup_steps must be >= 1", p.stderr)

    @unittest.skipIf(TORCH_PRESENT, "torch is installed here (the no-torch path cannot be exercised)")
    @unittest.skipUnless(BINARIES, NO_BINARIES)
    def test_schedule_flags_then_no_torch(self):
        p = run_cli("llama31", "--replay-bin", BIN, "--preset", "tiny", "--lr", "3e-4", "--min-lr", "3e-5",
                    "--warmup-steps", "5", "--decay-steps", "50", "--json",
                    os.path.join(self.tmp.name, "out.json"))
        self.assert_clear_error(p, "pytorch_baseline.py: error: PyTorch is not importable")

    @unittest.skipIf(TORCH_PRESENT, "torch is installed here (the no-torch path cannot be exercised)")
    @unittest.skipUnless(BINARIES, NO_BINARIES)
    def test_llama31_binary_then_no_torch(self):
        p = run_cli("llama31", "--replay-bin", BIN, "--preset", "tiny", "--microbatches", "2", "--json",
                    os.path.join(self.tmp.name, "out.json"))
        self.assert_clear_error(p, "pytorch_baseline.py: error: PyTorch is not importable")


def cuda_torch():
    """torch where it and a CUDA device are, else None."""
    if not TORCH_PRESENT:
        return None
    import torch
    return torch if torch.cuda.is_available() else None


class DeviceSchedule(unittest.TestCase):
    """pytorch_gpt3.MixedPrecisionTrainer's learning rate, computed on the device from its step counter,
    is lr_at to the bit (needs torch and a CUDA device; skipped otherwise)."""

    def test_trainer_learning_rate_is_lr_at(self):
        torch = cuda_torch()
        if torch is None:
            self.skipTest("needs torch with a CUDA device")
        from pytorch_gpt3 import MixedPrecisionTrainer
        small = {"schedule": "warmup_cosine", "lr": 0.5, "min_lr": 0.125, "warmup_steps": 3, "decay_steps": 10,
                 "betas": (0.9, 0.95), "eps": 1e-8, "weight_decay": 0.1, "clip_norm": 1.0}
        opts = [("small", small), ("tiny", tiny("gpt3")["optimizer"])]
        if BINARIES:
            opts += [(f"{w} {p}", real(w, p)["optimizer"])
                     for w, p in (("gpt3", "175b-tp4"), ("llama31", "405b-tp8"))]
        model = torch.nn.Linear(4, 4, device="cuda").to(torch.bfloat16)
        for name, o in opts:
            with self.subTest(name):
                trainer = MixedPrecisionTrainer(model, o)
                W, T = o["warmup_steps"], o["decay_steps"]
                steps = sorted(set(schedule_steps(W, T)) | set(range(0, 2 * T, max(1, T // 997))))
                for step in steps:
                    trainer.step_count.fill_(step)
                    self.assertEqual(trainer.learning_rate().item(), pb.lr_at(step, o), step)


if __name__ == "__main__":
    unittest.main()
