#!/usr/bin/env python3
"""Tests of scripts/pytorch_tp.py's pure parts, run without torch or GPUs: the ranks it reads from
mpiexec's, PMI's and torchrun's variables; the shard's configuration from replay-gpt3 --print-config (a
fake binary that, like the real one, prints nothing when it sees a launcher's variables: the script must
run it without them) or --config FILE; the step's collectives and bytes against replay's count for the
same TP2 step; which parameters are replicated; the command line's refusals. Importing the script must
not import torch."""

import contextlib
import io
import json
import os
import stat
import sys
import tempfile
import unittest
from unittest import mock

SCRIPTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "scripts")
sys.path.insert(0, SCRIPTS)
TORCH_BEFORE = "torch" in sys.modules
import pytorch_tp as tp  # noqa: E402

# A GPT-3 shape at TP2 as replay-gpt3 --preset P --tp 2 --print-config prints it (the keys read).
TP2_DOC = {
    "tool": "replay-gpt3", "workload": "gpt3", "preset": "tiny", "config": {
        "layers": 2, "hidden": 128, "heads": 1, "head_dim": 64, "ffn": 256, "seq": 128, "micro_batch": 2,
        "microbatches": 1, "vocab": 512, "vocab_shard": 256, "tp": 2, "dropout": 0.0,
        "model": {"layers": 96, "heads": 2, "kv_heads": 2, "ffn": 512, "data_vocab": 512, "norm": "layernorm",
                  "norm_eps": 1e-05, "mlp": "gelu", "position": "learned", "rope_theta": 10000.0,
                  "rope_llama31_scaling": False, "bias": True, "tied_embedding": True}},
    "training": {"optimizer": {"name": "adamw", "beta1": 0.9, "beta2": 0.95, "eps": 1e-08,
                               "weight_decay": 0.1, "clip_norm": 1.0},
                 "schedule": {"kind": "warmup_cosine", "lr": 0.001, "min_lr": 0.0001, "warmup_steps": 20,
                              "decay_steps": 400},
                 "loss_scaling": None}}

LAUNCH = {"OMPI_COMM_WORLD_RANK": "1", "OMPI_COMM_WORLD_SIZE": "2", "OMPI_COMM_WORLD_LOCAL_RANK": "1"}


def run_main(*argv, env=None):
    """pytorch_tp.main's exit status and stderr (argparse's own exits included)."""
    err = io.StringIO()
    with mock.patch.dict(os.environ, env or {}, clear=False), contextlib.redirect_stderr(err):
        for key in ("OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE", "RANK", "WORLD_SIZE", "PMI_RANK", "PMI_SIZE"):
            if env is None or key not in env:
                os.environ.pop(key, None)
        try:
            code = tp.main(list(argv))
        except SystemExit as e:
            code = e.code
    return code, err.getvalue()


class Import(unittest.TestCase):
    def test_no_torch_at_import(self):
        if not TORCH_BEFORE:
            self.assertNotIn("torch", sys.modules)


class World(unittest.TestCase):
    def test_launchers(self):
        self.assertEqual(tp.world_from_env(LAUNCH), (1, 2, 1))
        self.assertEqual(tp.world_from_env({"PMI_RANK": "3", "PMI_SIZE": "4", "MPI_LOCALRANKID": "1"}), (3, 4, 1))
        self.assertEqual(tp.world_from_env({"RANK": "2", "WORLD_SIZE": "4", "LOCAL_RANK": "0"}), (2, 4, 0))
        self.assertEqual(tp.world_from_env({"RANK": "5", "WORLD_SIZE": "8"}), (5, 8, 5))  # no local rank
        self.assertEqual(tp.world_from_env({}), (0, 1, 0))
        # mpiexec's variables win over torchrun's when both are there.
        self.assertEqual(tp.world_from_env({**LAUNCH, "RANK": "0", "WORLD_SIZE": "1"}), (1, 2, 1))

    def test_bad_values(self):
        with self.assertRaisesRegex(tp.pb.BaselineError, "not integers"):
            tp.world_from_env({"RANK": "x", "WORLD_SIZE": "2"})


class Collectives(unittest.TestCase):
    def test_the_step_of_replay(self):
        # replay-gpt3 --preset 175b-tp4 --tp 2 --layers 3 counted 16 collectives and 704,692,232 bytes a
        # step on two GPUs: fourteen 2048 x 12288 bf16 all-reduces, its cross-entropy all-gather (48 KiB)
        # and one of 8 bytes. PyTorch runs the same fourteen, Megatron's three cross-entropy all-reduces
        # and the norm's.
        cfg = {"micro_batch": 1, "seq": 2048, "hidden": 12288}
        big, small = tp.tp_collectives_per_step(3)
        self.assertEqual((big, small), (14, 4))
        tensor = 2048 * 12288 * 2
        self.assertEqual(tp.tp_comm_bytes(cfg, 3), 14 * tensor + 3 * 2048 * 4 + 4)
        self.assertEqual(704692232 - (49152 + 8), 14 * tensor)

    def test_replicated_parameters(self):
        replicated = ["blocks.0.ln1.weight", "blocks.0.ln1.bias", "blocks.3.ln2.weight", "blocks.0.proj_bias",
                      "blocks.1.fc2_bias", "wpe.weight", "ln_f.weight", "ln_f.bias"]
        split = ["wte.weight", "blocks.0.qkv.weight", "blocks.0.qkv.bias", "blocks.0.proj.weight",
                 "blocks.0.fc1.weight", "blocks.0.fc1.bias", "blocks.0.fc2.weight"]
        self.assertTrue(all(tp.is_replicated(n) for n in replicated))
        self.assertFalse(any(tp.is_replicated(n) for n in split))


class Config(unittest.TestCase):
    def setUp(self):
        self.dir = tempfile.TemporaryDirectory()
        self.addCleanup(self.dir.cleanup)
        self.doc_path = os.path.join(self.dir.name, "doc.json")
        with open(self.doc_path, "w") as f:
            json.dump(TP2_DOC, f)
        self.args_path = os.path.join(self.dir.name, "args.txt")
        # Like replay-gpt3 under mpiexec: a launcher's variables make it rank 1 of 2, which prints nothing.
        fake = os.path.join(self.dir.name, "replay-gpt3")
        with open(fake, "w") as f:
            f.write("#!/bin/sh\n"
                    f'echo "$@" > "{self.args_path}"\n'
                    'if [ -n "${OMPI_COMM_WORLD_SIZE:-}${PMI_SIZE:-}${PMIX_RANK:-}${SLURM_NTASKS:-}" ]; then exit 0; fi\n'
                    f'cat "{self.doc_path}"\n')
        os.chmod(fake, os.stat(fake).st_mode | stat.S_IXUSR)

    def args(self, *extra):
        return tp.build_parser().parse_args(["--tp", "2", "--json", "x.json", "--replay-bin", self.dir.name, *extra])

    def test_print_config_without_the_launcher(self):
        with mock.patch.dict(os.environ, {**LAUNCH, "PMIX_RANK": "1", "SLURM_NTASKS": "2"}):
            cfg = tp.shard_config_tp(self.args("--layers", "3", "--preset", "tiny"))
        self.assertEqual((cfg["tp"], cfg["heads"], cfg["ffn"], cfg["vocab_shard"]), (2, 1, 256, 256))
        with open(self.args_path) as f:
            self.assertEqual(f.read().split(), ["--preset", "tiny", "--tp", "2", "--layers", "3", "--print-config"])

    def test_config_file(self):
        args = tp.build_parser().parse_args(["--tp", "2", "--json", "x.json", "--config", self.doc_path])
        self.assertEqual(tp.shard_config_tp(args)["tp"], 2)
        args = tp.build_parser().parse_args(["--tp", "4", "--json", "x.json", "--config", self.doc_path])
        with self.assertRaisesRegex(tp.pb.BaselineError, "--tp 4: the configuration's shard is cut for tp 2"):
            tp.shard_config_tp(args)
        args = tp.build_parser().parse_args(["--tp", "2", "--json", "x.json", "--config", self.doc_path,
                                             "--preset", "175b-tp4"])
        with self.assertRaisesRegex(tp.pb.BaselineError, "is preset tiny"):
            tp.shard_config_tp(args)

    def test_binary_printing_nothing_is_named(self):
        with open(self.doc_path, "w") as f:
            f.write("not json")
        with self.assertRaisesRegex(tp.pb.BaselineError, "printed no JSON .*stdout 'not json"):
            tp.shard_config_tp(self.args())

    def test_missing_binary(self):
        args = tp.build_parser().parse_args(["--tp", "2", "--json", "x.json", "--replay-bin", "/nonexistent"])
        with self.assertRaisesRegex(tp.pb.BaselineError, "no replay-gpt3 binary at /nonexistent"):
            tp.shard_config_tp(args)


class CommandLine(unittest.TestCase):
    def test_refusals(self):
        code, err = run_main("--tp", "2", "--json", "/tmp/x.json")
        self.assertEqual(code, 2)
        self.assertIn("--tp 2 needs 2 processes, one per GPU (mpiexec -n 2 or torchrun --nproc-per-node 2); "
                      "this launch has 1", err)
        code, err = run_main("--tp", "2", "--json", "/tmp/x.json", env={**LAUNCH, "OMPI_COMM_WORLD_SIZE": "4"})
        self.assertEqual(code, 2)
        self.assertIn("this launch has 4", err)
        code, err = run_main("--tp", "2", "--graphs", "full", "--warmup", "0", "--json", "/tmp/x.json", env=LAUNCH)
        self.assertEqual(code, 2)
        self.assertIn("--graphs full needs --warmup 1 or more", err)
        code, err = run_main("--tp", "2", "--json", "/nonexistent/x.json", env=LAUNCH)
        self.assertEqual(code, 2)
        self.assertIn("directory /nonexistent does not exist", err)
        code, err = run_main("--tp", "1", "--json", "/tmp/x.json")
        self.assertEqual(code, 2)
        self.assertIn("--tp", err)
        code, err = run_main("--tp", "2", "--json", "/tmp/x.json", "--graphs", "layer")
        self.assertEqual(code, 2)
        self.assertIn("invalid choice: 'layer'", err)

    def test_baseline_dispatches(self):
        err = io.StringIO()
        with contextlib.redirect_stderr(err), mock.patch.dict(os.environ, {}, clear=False):
            for key in ("OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE", "RANK", "WORLD_SIZE"):
                os.environ.pop(key, None)
            code = tp.pb.main(["tp", "--tp", "2", "--json", "/tmp/x.json"])
        self.assertEqual(code, 2)
        self.assertIn("pytorch_tp.py: error: --tp 2 needs 2 processes", err.getvalue())


if __name__ == "__main__":
    unittest.main()
