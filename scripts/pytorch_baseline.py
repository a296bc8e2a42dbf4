#!/usr/bin/env python3
"""pytorch_baseline.py: runs with PyTorch what replay's benchmarks run, under the same names, shapes and
FLOP formulas (reports/SCHEMA.md), so that scripts/report.py can put the two side by side.

    python3 scripts/pytorch_baseline.py ops --json out.json [--replay-bin DIR] [--warmup 10] [--repeats 50]
        [--lead-ms 50] [--budget-ms 20] [--only REGEX]
    python3 scripts/pytorch_baseline.py gpt3 --preset 175b-tp4 --graphs full --json out.json
        [--replay-bin DIR | --config FILE] [--steps 50] [--warmup 3] [--layers L] [--seed 1234]
        [--data tokens.h5] [--lr X] [--min-lr X] [--warmup-steps W] [--decay-steps T]
    python3 scripts/pytorch_baseline.py llama31 --preset 405b-tp8 --graphs full --json out.json
        [--replay-bin DIR | --config FILE] [--steps 50] [--warmup 3] [--layers L] [--seed 1234]
        [--microbatches 1] [--data tokens.h5] [--lr X] [--min-lr X] [--warmup-steps W] [--decay-steps T]
    python3 scripts/pytorch_baseline.py rnnt --mode graphed --ladder 384x64,432x72 --json out.json
        (scripts/pytorch_rnnt.py: RNN-T on replay-rnnt's ladder, eager or one graph per rung)
    python3 scripts/pytorch_baseline.py unet --batch 32 --graphs full --json out.json
        (scripts/pytorch_unet.py: the SD v2 UNet, diffusers' where importable, eager or one step graph)
    mpiexec -n 2 python3 scripts/pytorch_baseline.py tp --tp 2 --preset 175b-tp4 --layers 3 --graphs full
        --json out.json    (scripts/pytorch_tp.py: the shard split over real processes, collectives run)

Subcommands: `ops` times the shard GEMMs and attention and the GEMM and copy peaks; `gpt3` and `llama31`
train the GPT-3 175B and Llama 3.1 405B shards that replay-gpt3 and replay-llama31 train (one GPU's slice
of the tensor-parallel layout, collectives not run), eagerly or as one torch.cuda.graph over the whole
step, and report step time, throughput, MFU, peak memory and the losses.

The shapes are replay's own: every command asks the replay binary, `replay-<workload> --preset P
[--microbatches N] --print-config` in --replay-bin DIR (default $REPLAY_BUILD_DIR/bin, else
build/release/bin), or reads what that command printed from --config FILE; no shape is written here.
So are `gpt3`'s and `llama31`'s optimizer settings and learning-rate schedule, from the same document's
`training` block; --lr, --min-lr, --warmup-steps and --decay-steps, replay's own flags, reach that
command (or override the --config file's schedule as replay would), so one set of flags drives both tools.

torch is imported inside the functions that need it, so the formulas here can be imported and tested on a
machine without torch.
"""

import argparse
import copy
import json
import math
import numbers
import os
import re
import socket
import struct
import subprocess
import sys
import time
import warnings

# ---------------------------------------------------------------------------------------------------------
# Shapes and formulas (reports/SCHEMA.md)
# ---------------------------------------------------------------------------------------------------------

# The shards `ops` times, as (workload, preset): one GPU's slice of GPT-3 175B at TP4 and of Llama 3.1
# 405B at TP8. Their shapes come from replay-<workload> --preset <preset> --print-config (ops_shard).
OPS_PRESETS = (("gpt3", "175b-tp4"), ("llama31", "405b-tp8"))

GEMM_DIRECTIONS = ("fwd", "dgrad", "wgrad")
ATTENTION_DIRECTIONS = ("fwd", "fwd_bwd")
# SDPA backends timed explicitly for the forward+backward, besides the default selection: name suffix
# -> torch.nn.attention.SDPBackend member.
ATTENTION_BACKENDS = {"flash": "FLASH_ATTENTION", "cudnn": "CUDNN_ATTENTION"}
# The forward+backward also runs under torch.use_deterministic_algorithms(True), the default selection
# choosing (name suffix @deterministic): what PyTorch offers where runs must be bit-reproducible, as
# replay's workloads are. torch 2.11 then refuses cuDNN's attention ("cuDNN SDPA is not deterministic")
# and runs FlashAttention-2 with its deterministic backward.
ATTENTION_DETERMINISTIC = "deterministic"

PEAK_GEMM_SIZE = 8192
PEAK_COPY_BYTES = 2 << 30  # the copied buffer; the bandwidth counts it read once and written once
MIN_BUDGET_REPEATS = 5  # the fewest timed calls a time budget leaves a series (replay's kMinBudgetRepeats)


def gemm_shape(direction, M, N, K):
    """GEMM shape {m, n, k} of one direction of a linear layer Y[M,N] = X[M,K] W^T, W stored [N,K]."""
    if direction == "fwd":    # Y[M,N] = X[M,K] W^T
        return {"m": M, "n": N, "k": K}
    if direction == "dgrad":  # dX[M,K] = dY[M,N] W
        return {"m": M, "n": K, "k": N}
    if direction == "wgrad":  # dW[N,K] = dY^T X
        return {"m": N, "n": K, "k": M}
    raise ValueError(f"unknown GEMM direction {direction!r}")


def gemm_flops(shape):
    return 2.0 * shape["m"] * shape["n"] * shape["k"]


def attention_flops(shape, direction):
    """Causal attention: QK^T and PV are 2*S^2*D each per head, halved by the mask; the backward does five
    matrix products to the forward's two, so forward+backward is 3.5x the forward."""
    fwd = 4.0 * shape["batch"] * shape["q_heads"] * shape["seq"] ** 2 * shape["head_dim"] / 2
    if direction == "fwd":
        return fwd
    if direction == "fwd_bwd":
        return 3.5 * fwd
    raise ValueError(f"unknown attention direction {direction!r}")


def shard_name(cfg):
    """The op names' prefix for a shard: gpt3_175b_tp4 for gpt3's preset 175b-tp4."""
    return f"{cfg['workload']}_{cfg['preset'].replace('-', '_')}"


def shard_linears(cfg):
    """One layer's linear layers on this GPU as (name, N, K), W stored [N, K]: the fused QKV (this GPU's
    query heads, then its key and value heads), the output projection, FC1 (gate and up fused, 2 x ffn
    rows, for SwiGLU) and FC2."""
    h, d, f = cfg["hidden"], cfg["head_dim"], cfg["ffn"]
    return [("qkv", (cfg["heads"] + 2 * cfg["kv_heads"]) * d, h), ("proj", h, cfg["heads"] * d),
            ("fc1", 2 * f if cfg["mlp"] == "swiglu" else f, h), ("fc2", h, f)]


def ops_shard(cfg):
    """What `ops` times of one shard configuration (shard_config): tokens per micro-batch (the GEMMs' M),
    the linear layers (shard_linears) and the causal attention's shape."""
    return {"tokens": cfg["micro_batch"] * cfg["seq"], "linears": shard_linears(cfg),
            "attention": {"batch": cfg["micro_batch"], "q_heads": cfg["heads"], "kv_heads": cfg["kv_heads"],
                          "seq": cfg["seq"], "head_dim": cfg["head_dim"]}}


def op_specs(configs, only=None):
    """Every op `ops` times for these shard configurations (shard_config; `ops` uses OPS_PRESETS'), in
    order, as dicts {name, kind, shard, layer, direction, shape, flops, backend}; GEMMs also carry their
    layer's dims (M, N, K); backend is None for the default SDPA selection. `only` is a compiled regex
    matched (search) against the names."""
    specs = []
    for c in configs:
        shard, cfg = shard_name(c), ops_shard(c)
        M = cfg["tokens"]
        for layer, N, K in cfg["linears"]:
            for direction in GEMM_DIRECTIONS:
                shape = gemm_shape(direction, M, N, K)
                specs.append({"name": f"{shard}.{layer}.{direction}", "kind": "gemm", "shard": shard,
                              "layer": layer, "direction": direction, "dims": (M, N, K), "shape": shape,
                              "flops": gemm_flops(shape), "backend": None})
        shape = dict(cfg["attention"])
        variants = [(d, None) for d in ATTENTION_DIRECTIONS] + [("fwd_bwd", b) for b in ATTENTION_BACKENDS] \
            + [("fwd_bwd", ATTENTION_DETERMINISTIC)]
        for direction, backend in variants:
            name = f"{shard}.attention.{direction}" + (f"@{backend}" if backend else "")
            specs.append({"name": name, "kind": "attention", "shard": shard, "layer": "attention",
                          "direction": direction, "shape": shape,
                          "flops": attention_flops(shape, direction), "backend": backend})
    if only is not None:
        specs = [s for s in specs if only.search(s["name"])]
    return specs


# ---------------------------------------------------------------------------------------------------------
# Statistics and JSON entries (no torch)
# ---------------------------------------------------------------------------------------------------------

def percentile(values, q):
    """q-th percentile (0..100) with linear interpolation between closest ranks (numpy's default)."""
    if not values:
        raise ValueError("percentile of no values")
    s = sorted(values)
    pos = (len(s) - 1) * q / 100.0
    lo = int(pos)
    hi = min(lo + 1, len(s) - 1)
    return s[lo] + (s[hi] - s[lo]) * (pos - lo)


def summarize(times_ms):
    return {"median_ms": percentile(times_ms, 50), "p10_ms": percentile(times_ms, 10),
            "p90_ms": percentile(times_ms, 90)}


def make_result(spec, times_ms, peak_tflops, note=None, backend_used=None):
    """One `results` entry. times_ms None means not measured: times and rates are null, `note` says why."""
    entry = {"name": spec["name"], "kind": spec["kind"], "shape": dict(spec["shape"]), "dtype": "bf16"}
    if times_ms:
        entry.update(summarize(times_ms))
        entry["samples_ms"] = list(times_ms)
    else:
        entry.update({"median_ms": None, "p10_ms": None, "p90_ms": None})
    flops = spec["flops"]
    tflops = flops / (entry["median_ms"] * 1e-3) / 1e12 if entry["median_ms"] else None
    entry.update({"flops": flops, "bytes": None, "tflops": tflops, "gbps": None,
                  "fraction_of_peak": tflops / peak_tflops if tflops and peak_tflops else None})
    if spec["kind"] == "attention":
        entry["backend"] = backend_used
    if note:
        entry["note"] = note
    return entry


def write_json(path, doc):
    """Writes through a temporary file and a rename, so a failed run never leaves half a JSON."""
    tmp = f"{path}.tmp"
    with open(tmp, "w") as f:
        json.dump(doc, f, indent=2, allow_nan=False)
        f.write("\n")
    os.replace(tmp, path)


def progress(msg):
    print(msg, flush=True)


class BaselineError(Exception):
    """An error the user can act on: printed as one line, exit code 2."""


# ---------------------------------------------------------------------------------------------------------
# GPT-3 shard: parameter counts, FLOPs, default layers, schedule, data order (no torch)
# ---------------------------------------------------------------------------------------------------------

# Bytes of training state per parameter that the default layer count budgets for, as replay counts them
# (replay keeps fp32 master weights and stores the parameters in bf16): fp32 master (4), bf16 parameter
# (2), fp32 gradient (4), Adam m and v (4 + 4). PyTorch's autograd also makes a bf16 gradient per
# parameter; the baseline frees each one as soon as it is copied to its fp32 master gradient (a
# post-accumulate-grad hook), so it holds 18 bytes per parameter plus one bf16 gradient at a time, like
# replay.
STATE_BYTES_PER_PARAM = 18
# What the training state may take of an 80 GB H100 (80 GiB): three quarters; the rest is left for
# activations, logits, library workspaces and the allocator's slack. 175b-tp4 -> 7 layers (SCHEMA.md's
# example), 175b-tp8 -> 15; llama31 405b-tp8 -> 8, 405b-tp4 -> 4. replay-gpt3's default must come from the
# same budget, so both run one shard.
STATE_BUDGET_BYTES = 60 * 2**30

# The JSON's optimizer.implementation: how the baseline applies replay's printed optimizer and schedule.
OPTIMIZER_IMPLEMENTATION = ("torch.optim.AdamW(fused=True, capturable=True) on fp32 masters, lr a device "
                            "tensor set each step from the device step counter by replay's formula (fp64, "
                            "rounded to float32 once); clip_grad_norm_(foreach=True)")
FLOPS_FORMULA = ("6*N*tokens + 12*L*s*d*tokens (per GPU shard: N = this shard's parameters, "
                      "d = this shard's attention width, heads x head_dim)")
HASH_METHOD = ("loss_hash: FNV-1a 64 over the little-endian float32 bits of every loss in order; "
               "weights_hash: first 16 hex digits of SHA-256 over the final bf16 parameters' bytes in "
               "module order")


def gpt3_layer_params(cfg):
    """Parameters of one transformer layer on this GPU: LayerNorm, QKV (with bias), output projection,
    LayerNorm, FC1, FC2 (with biases). Row-parallel biases and LayerNorms are replicated on every rank,
    so each shard holds them whole."""
    h, a, f = cfg["hidden"], cfg["heads"] * cfg["head_dim"], cfg["ffn"]
    ln = 2 * h
    qkv = h * 3 * a + 3 * a
    proj = a * h + h
    fc1 = h * f + f
    fc2 = f * h + h
    return ln + qkv + proj + ln + fc1 + fc2


def gpt3_embedding_params(cfg):
    """Token embedding shard (tied with the LM head), learned positions, final LayerNorm."""
    h = cfg["hidden"]
    return cfg["vocab_shard"] * h + cfg["seq"] * h + 2 * h


def gpt3_params(cfg, layers):
    return layers * gpt3_layer_params(cfg) + gpt3_embedding_params(cfg)


# ---------------------------------------------------------------------------------------------------------
# Llama 3.1 405B shard: parameter counts, RoPE frequencies (no torch)
# ---------------------------------------------------------------------------------------------------------

# RMSNorm's epsilon, and the RoPE base and Llama 3.1 frequency scaling (common/kernels/rope.h
# RopeScaling::llama31()), as pytorch_llama31 implements them; shard_config checks that replay's
# configuration names the same.
LLAMA31_NORM_EPS = 1e-5
LLAMA31_ROPE = {"theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                "original_max_position": 8192.0}


def llama31_qkv_width(cfg):
    """The fused QKV row per GPU: the q heads, then the k heads, then the v heads."""
    return (cfg["heads"] + 2 * cfg["kv_heads"]) * cfg["head_dim"]


def llama31_layer_params(cfg):
    """Parameters of one layer on this GPU: RMSNorm, QKV, output projection, RMSNorm, the fused gate+up
    FC1 (2 x ffn wide), FC2; no biases. The RMSNorm weights are replicated on every rank."""
    h, a, f = cfg["hidden"], cfg["heads"] * cfg["head_dim"], cfg["ffn"]
    return h + h * llama31_qkv_width(cfg) + a * h + h + h * 2 * f + f * h


def llama31_embedding_params(cfg):
    """Token embedding shard, the untied LM head's shard, final RMSNorm (no position table: RoPE)."""
    return 2 * cfg["vocab_shard"] * cfg["hidden"] + cfg["hidden"]


def llama31_params(cfg, layers):
    return layers * llama31_layer_params(cfg) + llama31_embedding_params(cfg)


def rope_frequencies(head_dim, rope=LLAMA31_ROPE):
    """f_i = theta^(-2i / head_dim) for i < head_dim / 2, rescaled as Llama 3.1 does (rope.cu, in fp64):
    wavelengths 2 pi / f above original_max_position / low_freq_factor are divided by `factor`, those
    below original_max_position / high_freq_factor are kept, those between interpolate smoothly."""
    low = rope["original_max_position"] / rope["low_freq_factor"]
    high = rope["original_max_position"] / rope["high_freq_factor"]
    out = []
    for i in range(head_dim // 2):
        f = 1.0 / rope["theta"] ** (2.0 * i / head_dim)
        wavelen = 2.0 * math.pi / f
        if wavelen > low:
            f = f / rope["factor"]
        elif wavelen >= high:
            smooth = ((rope["original_max_position"] / wavelen - rope["low_freq_factor"])
                      / (rope["high_freq_factor"] - rope["low_freq_factor"]))
            f = (1.0 - smooth) * f / rope["factor"] + smooth * f
        out.append(f)
    return out


# ---------------------------------------------------------------------------------------------------------
# Either workload: parameters, FLOPs, default layers (no torch)
# ---------------------------------------------------------------------------------------------------------

# Per workload: the preset the command runs by default, whether its attention passes enable_gqa to SDPA
# (without it the PyTorch module has as many key/value heads as query heads), its parameter counts, the
# config keys its JSON reports (as the replay tool's `config`: Llama's adds the key/value heads), and the
# architecture its PyTorch module implements, which replay's `config.model` must name (shard_config checks
# it: otherwise the two tools would not run one model). The optimizer and the learning-rate schedule are
# replay's too, from the same document's `training` (training_config).
WORKLOADS = {
    "gpt3": {"default_preset": "175b-tp4", "enable_gqa": False,
             "layer_params": gpt3_layer_params,
             "embedding_params": gpt3_embedding_params,
             "config_keys": ("hidden", "heads", "head_dim", "ffn", "seq", "micro_batch", "microbatches",
                             "vocab", "vocab_shard", "tp"),
             "module": "pytorch_gpt3.GPT3Shard",
             "architecture": {"norm": "layernorm", "norm_eps": 1e-5, "mlp": "gelu", "position": "learned",
                              "bias": True, "tied_embedding": True}},
    "llama31": {"default_preset": "405b-tp8", "enable_gqa": True,
                "layer_params": llama31_layer_params,
                "embedding_params": llama31_embedding_params,
                "config_keys": ("hidden", "heads", "kv_heads", "head_dim", "ffn", "seq", "micro_batch",
                                "microbatches", "vocab", "vocab_shard", "tp"),
                "module": "pytorch_llama31.Llama31Shard",
                "architecture": {"norm": "rmsnorm", "norm_eps": LLAMA31_NORM_EPS, "mlp": "swiglu",
                                 "position": "rope", "rope_theta": LLAMA31_ROPE["theta"],
                                 "rope_llama31_scaling": True, "bias": False, "tied_embedding": False}},
}


def model_params(cfg, layers):
    """N of the FLOP formula: this shard's parameters with `layers` layers."""
    w = WORKLOADS[cfg["workload"]]
    return layers * w["layer_params"](cfg) + w["embedding_params"](cfg)


def tokens_per_step(cfg):
    return cfg["micro_batch"] * cfg["microbatches"] * cfg["seq"]


def flops_per_step(cfg, layers):
    """Model FLOPs of one training step on this GPU (FLOPS_FORMULA): 6N per token for the matrix products
    forward and backward, plus 12*L*s*d per token for the attention scores and their product with V (no
    discount for the causal mask; d is the query width, heads x head_dim, with GQA too)."""
    tokens = tokens_per_step(cfg)
    d = cfg["heads"] * cfg["head_dim"]
    return 6.0 * model_params(cfg, layers) * tokens + 12.0 * layers * cfg["seq"] * d * tokens


def default_layers(cfg, budget_bytes=STATE_BUDGET_BYTES, bytes_per_param=STATE_BYTES_PER_PARAM):
    """The preset's own layer count where it has one (config.layers above 0, as tiny's); otherwise as many
    layers as fit the training-state budget (at least 1, at most the model's layers), as replay chooses
    them for the full-model presets."""
    if cfg["layers"] > 0:
        return cfg["layers"]
    w = WORKLOADS[cfg["workload"]]
    free = budget_bytes - bytes_per_param * w["embedding_params"](cfg)
    fit = int(free // (bytes_per_param * w["layer_params"](cfg)))
    return max(1, min(cfg["model_layers"], fit))


def fp32(x):
    """x rounded to the nearest float32, as a Python float."""
    return struct.unpack("<f", struct.pack("<f", x))[0]


def fp32_decimal(x):
    """The shortest decimal that reads back as float32(x), as a Python float: how replay prints its float32
    settings (bench::decimal), 2e-05 for 2e-5f."""
    v = fp32(x)
    for digits in range(1, 10):
        d = float(f"{v:.{digits}g}")
        if fp32(d) == v:
            return d
    return v


def schedule_constants(opt):
    """(lr, min_lr, warmup_steps, decay_steps) of a warmup_cosine schedule (training_config's optimizer) as
    replay holds them: the rates as its float32 LrSchedule fields (which the printed decimals read back as
    exactly), the steps as integers. Another kind is a ValueError."""
    if opt["schedule"] != SCHEDULE_KIND:
        raise ValueError(f"schedule kind {opt['schedule']!r}: only {SCHEDULE_KIND!r} is implemented")
    return fp32(opt["lr"]), fp32(opt["min_lr"]), opt["warmup_steps"], opt["decay_steps"]


def lr_at(step, opt):
    """Learning rate of 0-based optimizer step `step` as replay computes it (train/schedule.h lr_at, kind
    warmup_cosine), in fp64 and rounded to float32 once: with W warmup_steps and T decay_steps, s < W:
    lr (s + 1) / W; W <= s < T: min_lr + (lr - min_lr) (1 + cos(pi (s - W) / (T - W))) / 2; s >= T:
    min_lr. The training step (pytorch_gpt3.MixedPrecisionTrainer.learning_rate) computes the same on the
    device from its step counter."""
    base, lo, w, t = schedule_constants(opt)
    if step < w:
        lr = base * (step + 1) / w
    elif step < t:
        p = (step - w) / (t - w)
        lr = lo + (base - lo) * 0.5 * (1.0 + math.cos(math.pi * p))
    else:
        lr = lo
    return fp32(lr)


def sequential_batches(num_sequences, micro_batch, count, first=0):
    """Rows of `count` consecutive batches of a token file read in order, from batch `first`: batch i of an
    epoch is rows [i*mb, (i+1)*mb); the num_sequences mod mb rows left over are skipped; then the next
    epoch begins (replay's --data-order sequential)."""
    per_epoch = num_sequences // micro_batch
    if per_epoch == 0:
        raise ValueError(f"{num_sequences} sequences hold no micro-batch of {micro_batch}")
    return [list(range((i % per_epoch) * micro_batch, (i % per_epoch + 1) * micro_batch))
            for i in range(first, first + count)]


def replay_training_rows(num_sequences, micro_batch):
    """The rows of a token file replay trains on: all but the held-out split at the end, min(64, N / 16)
    rows rounded down to whole micro-batches (workloads/transformer/workload.cpp, held_out_rows)."""
    h = min(64, num_sequences // 16) // micro_batch * micro_batch
    return num_sequences - h if num_sequences - h >= micro_batch else num_sequences


def shard_entropy(data_vocab, vocab_shard):
    """Loss floor of uniform random tokens over data_vocab mapped into the shard (id mod vocab_shard): the
    entropy, in nats, of the mapped ids' distribution (some shard ids receive one more source id)."""
    base, extra = divmod(data_vocab, vocab_shard)
    h = 0.0
    for count, n in ((base + 1, extra), (base, vocab_shard - extra)):
        if count and n:
            p = count / data_vocab
            h -= n * p * math.log(p)
    return h


def loss_hash(losses):
    """FNV-1a 64 over the little-endian float32 bits of each loss, as 16 hex digits."""
    h = 0xCBF29CE484222325
    for byte in b"".join(struct.pack("<f", v) for v in losses):
        h = ((h ^ byte) * 0x100000001B3) & 0xFFFFFFFFFFFFFFFF
    return f"{h:016x}"


def step_stats(times_ms):
    return {"median": percentile(times_ms, 50), "p10": percentile(times_ms, 10),
            "p90": percentile(times_ms, 90), "mean": sum(times_ms) / len(times_ms), "count": len(times_ms)}


def workload_document(cfg, layers, run, step_ms, host_us, peak_tflops, measured):
    """The workload-run JSON (reports/SCHEMA.md) from the configuration (shard_config),
    the run's settings (graphs, seed, steps, warmup, data, preset) and what was measured (environment,
    settings, memory, graphs_info, losses, weights_hash, attention_backend, loss_floor, version)."""
    stats = step_stats(step_ms)
    seconds = stats["median"] * 1e-3
    flops = flops_per_step(cfg, layers)
    tflops = flops / seconds / 1e12
    config = {k: cfg[k] for k in WORKLOADS[cfg["workload"]]["config_keys"]}
    config = {"layers": layers, **config, "dropout": 0.0, "seed": run["seed"], "steps": run["steps"],
              "warmup": run["warmup"], "precision": "bf16", "data_vocab": cfg["data_vocab"],
              "data": run["data"], "parameters": model_params(cfg, layers)}
    losses = measured["losses"]
    opt = cfg["optimizer"]
    return {
        "tool": "pytorch",
        "version": measured["version"],
        "workload": cfg["workload"],
        "preset": run["preset"],
        "graphs": run["graphs"],
        "environment": measured["environment"],
        "settings": measured["settings"],
        "config": config,
        "optimizer": dict(opt, betas=list(opt["betas"]), implementation=OPTIMIZER_IMPLEMENTATION),
        "attention_backend": measured["attention_backend"],
        "tensor_parallel_collectives": "not run (1 process)",
        "step_ms": stats,
        "host_enqueue_us": {"median": percentile(host_us, 50), "p90": percentile(host_us, 90)},
        "throughput": {"tokens_per_s": tokens_per_step(cfg) / seconds,
                       "samples_per_s": cfg["micro_batch"] * cfg["microbatches"] / seconds},
        "model_tflops": tflops,
        "flops_per_step": flops,
        "flops_formula": FLOPS_FORMULA,
        "mfu": tflops / peak_tflops if peak_tflops else None,
        "peaks": {"bf16_gemm_tflops": peak_tflops},
        "memory": measured["memory"],
        "graphs_info": measured["graphs_info"],
        "losses": losses,
        "loss_hash": loss_hash(losses),
        "weights_hash": measured["weights_hash"],
        "hash_method": HASH_METHOD,
        "loss_floor": measured["loss_floor"],
    }


# ---------------------------------------------------------------------------------------------------------
# Shard configurations: what replay-<workload> --print-config says (no torch)
# ---------------------------------------------------------------------------------------------------------

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# The shard's numbers shard_config reads from `config` (all integers above 0) and from `config.model`.
SHARD_KEYS = ("hidden", "heads", "head_dim", "ffn", "seq", "micro_batch", "microbatches", "vocab",
              "vocab_shard", "tp")
MODEL_KEYS = ("layers", "heads", "kv_heads", "ffn", "data_vocab")
# The optimizer MixedPrecisionTrainer runs and the one schedule kind it implements; training_config
# refuses a document that names others.
OPTIMIZER_NAME = "adamw"
SCHEDULE_KIND = "warmup_cosine"
# The flags that override the preset's schedule, as replay's own (train/flags.cpp): the key in
# `training.schedule` -> the flag. They reach `--print-config`, or override a --config file's values.
SCHEDULE_FLAGS = {"lr": "--lr", "min_lr": "--min-lr", "warmup_steps": "--warmup-steps",
                  "decay_steps": "--decay-steps"}


def default_replay_bin():
    """--replay-bin's default: $REPLAY_BUILD_DIR/bin, else build/release/bin; a relative folder is taken
    from the repository's root, as scripts/bench.sh and scripts/test.sh take REPLAY_BUILD_DIR."""
    return os.path.join(REPO, os.environ.get("REPLAY_BUILD_DIR") or os.path.join("build", "release"), "bin")


def parse_config_text(text, source):
    """The JSON document `replay-<workload> --print-config` printed; `source` names it in errors."""
    try:
        return json.loads(text)
    except ValueError as e:
        raise BaselineError(f"{source}: not JSON ({e})") from None


def read_config_file(path):
    """The document in a --config FILE."""
    try:
        with open(path) as f:
            text = f.read()
    except OSError as e:
        raise BaselineError(f"--config {path}: cannot read it ({e.strerror or e})") from None
    return parse_config_text(text, f"--config {path}")


def schedule_args(schedule):
    """The replay flags of schedule overrides {key of SCHEDULE_FLAGS: value}, in SCHEDULE_FLAGS' order."""
    schedule = schedule or {}
    unknown = set(schedule) - set(SCHEDULE_FLAGS)
    if unknown:
        raise ValueError(f"not schedule settings: {sorted(unknown)}")
    return [a for key, flag in SCHEDULE_FLAGS.items() if schedule.get(key) is not None
            for a in (flag, repr(schedule[key]))]


def run_print_config(bin_dir, workload, preset, microbatches=None, alternative="", schedule=None):
    """Runs `replay-<workload> --preset PRESET [--microbatches N] [--lr X] [--min-lr X] [--warmup-steps W]
    [--decay-steps T] --print-config` from bin_dir (no GPU needed), the last four from `schedule`
    ({key of SCHEDULE_FLAGS: value}); returns (its document, a name of the command for errors). A missing
    binary, or one that refuses (an unknown preset: its message names the presets; a schedule it
    rejects), is a BaselineError; `alternative` ends the missing binary's message."""
    path = os.path.join(bin_dir, f"replay-{workload}")
    if not (os.path.isfile(path) and os.access(path, os.X_OK)):
        raise BaselineError(f"no replay-{workload} binary at {path}: build replay first, or give the folder "
                            f"of its binaries with --replay-bin DIR{alternative}")
    args = ["--preset", preset] + (["--microbatches", str(microbatches)] if microbatches is not None else []) \
        + schedule_args(schedule)
    command = f"replay-{workload} {' '.join(args)} --print-config"
    try:
        p = subprocess.run([path, *args, "--print-config"], capture_output=True, text=True, timeout=120)
    except (OSError, subprocess.SubprocessError) as e:
        raise BaselineError(f"{path}: cannot run `{command}` ({e})") from None
    if p.returncode != 0:
        lines = [line.strip() for line in p.stderr.splitlines() if line.strip()]
        why = "; ".join(re.sub(r"\s*\(run with --help for the flags\)$", "", line) for line in lines[-3:])
        raise BaselineError(f"`{command}` ({path}) failed with exit status {p.returncode}: "
                            + (why or "nothing on stderr"))
    return parse_config_text(p.stdout, f"the output of `{command}` ({path})"), f"`{command}`"


def _is_int(v, lowest):
    return isinstance(v, int) and not isinstance(v, bool) and v >= lowest


def _same_value(got, want):
    """JSON's value `got` names the architecture's `want` (a number as a number, a flag as a flag)."""
    if isinstance(want, bool) or isinstance(want, str):
        return type(got) is type(want) and got == want
    return isinstance(got, (int, float)) and not isinstance(got, bool) and float(got) == float(want)


def _number(v):
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


def training_config(doc, source="the configuration"):
    """The optimizer and learning-rate schedule of a `replay-<workload> --print-config` document, from its
    `training` block, as the baseline's trainer uses them: lr, min_lr, warmup_steps, decay_steps (from
    `training.schedule`, whose kind must be warmup_cosine: lr_at), schedule (that kind), betas (beta1,
    beta2), eps, weight_decay and clip_norm (from `training.optimizer`, which must be adamw). The values are
    the printed ones (replay's float32 settings as their shortest decimals); lr_at rounds the rates back to
    float32. The schedule is checked as replay checks it (warmup_steps >= 1, decay_steps above it); a
    missing or malformed value, another kind or optimizer, or loss scaling (the baseline has none) is a
    BaselineError naming `source`."""
    def bad(what):
        raise BaselineError(f"{source}: {what}")

    training = doc.get("training") if isinstance(doc, dict) else None
    if not isinstance(training, dict):
        bad("no \"training\" object (replay's optimizer and learning-rate schedule)")
    blocks = {}
    for key in ("optimizer", "schedule"):
        blocks[key] = training.get(key)
        if not isinstance(blocks[key], dict):
            bad(f"no \"training.{key}\" object")
    optimizer, schedule = blocks["optimizer"], blocks["schedule"]

    def value(obj, where, key, ok, expected):
        v = obj.get(key)
        if not ok(v):
            bad(f"training.{where}.{key} is " + ("missing" if key not in obj else json.dumps(v))
                + f", expected {expected}")
        return v

    value(optimizer, "optimizer", "name", lambda v: v == OPTIMIZER_NAME,
          f"{json.dumps(OPTIMIZER_NAME)} (pytorch_baseline.py runs torch.optim.AdamW)")
    kind = value(schedule, "schedule", "kind", lambda v: v == SCHEDULE_KIND,
                 f"{json.dumps(SCHEDULE_KIND)}: pytorch_baseline.py implements only that schedule (linear "
                 f"warm-up, then cosine decay)")
    if training.get("loss_scaling") is not None:
        bad(f"training.loss_scaling is {json.dumps(training['loss_scaling'])}: pytorch_baseline.py trains "
            f"without loss scaling")
    beta = lambda v: _number(v) and 0 <= v < 1  # noqa: E731
    betas = tuple(value(optimizer, "optimizer", k, beta, "a number in [0, 1)") for k in ("beta1", "beta2"))
    eps = value(optimizer, "optimizer", "eps", lambda v: _number(v) and v > 0, "a number above 0")
    weight_decay = value(optimizer, "optimizer", "weight_decay", lambda v: _number(v) and v >= 0,
                         "a number >= 0")
    clip_norm = value(optimizer, "optimizer", "clip_norm", lambda v: _number(v) and v > 0,
                      "a number above 0 (pytorch_baseline.py always clips)")
    rate = lambda v: _number(v) and v >= 0  # noqa: E731
    lr = value(schedule, "schedule", "lr", rate, "a number >= 0")
    min_lr = value(schedule, "schedule", "min_lr", rate, "a number >= 0")
    warmup = value(schedule, "schedule", "warmup_steps", lambda v: _is_int(v, 1), "an integer >= 1")
    decay = value(schedule, "schedule", "decay_steps", lambda v: _is_int(v, warmup + 1),
                  f"an integer above warmup_steps {warmup}")
    return {"schedule": kind, "lr": lr, "min_lr": min_lr, "warmup_steps": warmup, "decay_steps": decay,
            "betas": betas, "eps": eps, "weight_decay": weight_decay, "clip_norm": clip_norm}


def override_schedule(doc, schedule):
    """A copy of a --config document with the schedule overrides ({key of SCHEDULE_FLAGS: value}) in its
    `training.schedule`, as replay applies its flags: the rates stored as float32 and printed as their
    shortest decimals (fp32_decimal), the steps as given. training_config then checks the result."""
    schedule = {k: v for k, v in (schedule or {}).items() if v is not None}
    schedule_args(schedule)  # only known keys
    if not schedule:
        return doc
    doc = copy.deepcopy(doc)
    training = doc.get("training") if isinstance(doc, dict) else None
    block = training.get("schedule") if isinstance(training, dict) else None
    if isinstance(block, dict):  # else training_config says what is missing
        for key, v in schedule.items():
            block[key] = fp32_decimal(v) if key in ("lr", "min_lr") else v
    return doc


def shard_config(doc, workload, source="the configuration"):
    """One GPU's shard from a `replay-<workload> --print-config` document, as the baseline uses it:
    workload, preset, hidden, heads, kv_heads, head_dim, ffn (per GPU), seq, micro_batch, microbatches,
    vocab (padded), vocab_shard (this GPU's rows), data_vocab, tp, layers (the preset's own count, 0 for
    the full-model presets, whose count comes from the memory budget), model_layers (the whole model's
    depth, the most --layers may ask), mlp, and the optimizer and schedule replay prints in `training`
    (training_config). Checks that the document is well formed, that the shard is the whole model split
    over tp, and that the model is the one the workload's PyTorch module implements; anything else is a
    BaselineError naming `source`."""
    w = WORKLOADS[workload]

    def bad(what):
        raise BaselineError(f"{source}: {what}")

    if not isinstance(doc, dict):
        bad(f"not a JSON object but {type(doc).__name__}")
    if doc.get("workload") != workload:
        bad(f"\"workload\" is {doc.get('workload')!r}, expected {workload!r}")
    preset = doc.get("preset")
    if not isinstance(preset, str) or not preset:
        bad(f"\"preset\" is {preset!r}, expected a preset's name")
    config = doc.get("config")
    if not isinstance(config, dict):
        bad("no \"config\" object")
    model = config.get("model")
    if not isinstance(model, dict):
        bad("no \"config.model\" object (the whole model's numbers)")

    def integer(obj, where, key, lowest=1):
        v = obj.get(key)
        if not _is_int(v, lowest):
            bad(f"{where}.{key} is " + ("missing" if key not in obj else repr(v))
                + f", expected an integer >= {lowest}")
        return v

    cfg = {"workload": workload, "preset": preset}
    for key in SHARD_KEYS:
        cfg[key] = integer(config, "config", key)
    cfg["layers"] = integer(config, "config", "layers", lowest=0)
    whole = {key: integer(model, "config.model", key) for key in MODEL_KEYS}
    tp = cfg["tp"]
    if "kv_heads" in w["config_keys"] or "kv_heads" in config:
        cfg["kv_heads"] = integer(config, "config", "kv_heads")
    elif whole["kv_heads"] % tp:
        bad(f"config.model.kv_heads {whole['kv_heads']} does not split over tp {tp}")
    else:
        cfg["kv_heads"] = whole["kv_heads"] // tp
    for key, shard, total in (("heads", cfg["heads"], whole["heads"]), ("kv_heads", cfg["kv_heads"],
                              whole["kv_heads"]), ("ffn", cfg["ffn"], whole["ffn"])):
        if shard * tp != total:
            bad(f"config.{key} {shard} x tp {tp} is not config.model.{key} {total}")
    if cfg["vocab_shard"] * tp != cfg["vocab"]:
        bad(f"config.vocab_shard {cfg['vocab_shard']} x tp {tp} is not config.vocab {cfg['vocab']}")
    if cfg["vocab"] < whole["data_vocab"]:
        bad(f"config.vocab {cfg['vocab']} is smaller than config.model.data_vocab {whole['data_vocab']}")
    if cfg["heads"] % cfg["kv_heads"]:
        bad(f"config.heads {cfg['heads']} is not a multiple of the key/value heads {cfg['kv_heads']}")
    if not w["enable_gqa"] and cfg["kv_heads"] != cfg["heads"]:
        bad(f"{cfg['kv_heads']} key/value heads for {cfg['heads']} query heads: {w['module']} has as many "
            f"of each")
    if cfg["layers"] > whole["layers"]:
        bad(f"config.layers {cfg['layers']} is more than the model's {whole['layers']}")
    for key, want in w["architecture"].items():
        got = model.get(key)
        if not _same_value(got, want):
            bad(f"config.model.{key} is " + ("missing" if key not in model else json.dumps(got))
                + f": {w['module']} implements {json.dumps(want)}")
    cfg.update(data_vocab=whole["data_vocab"], model_layers=whole["layers"], mlp=model["mlp"],
               optimizer=training_config(doc, source))
    return cfg


def load_shard_config(workload, preset=None, microbatches=None, replay_bin=None, config_path=None,
                      schedule=None):
    """shard_config of the --config FILE document when config_path is given (--preset and --microbatches,
    when given, must agree with it), else of what `replay-<workload> --preset PRESET [--microbatches N]
    [schedule flags] --print-config` prints, run from replay_bin (default_replay_bin()); preset None is
    the workload's default preset. `schedule` ({key of SCHEDULE_FLAGS: value or None}) holds the
    --lr, --min-lr, --warmup-steps and --decay-steps given: they reach the binary, or override the file's
    `training.schedule` as the binary would (override_schedule)."""
    schedule = {k: v for k, v in (schedule or {}).items() if v is not None}
    if config_path is not None:
        source = f"--config {config_path}"
        doc = override_schedule(read_config_file(config_path), schedule)
        flags = " ".join(schedule_args(schedule))
        cfg = shard_config(doc, workload, source + (f" with {flags}" if flags else ""))
        if preset is not None and preset != cfg["preset"]:
            raise BaselineError(f"--preset {preset}: {source} is the configuration of preset {cfg['preset']}")
        if microbatches is not None and microbatches != cfg["microbatches"]:
            raise BaselineError(f"--microbatches {microbatches}: {source} has microbatches "
                                f"{cfg['microbatches']}")
        return cfg
    preset = preset if preset is not None else WORKLOADS[workload]["default_preset"]
    return replay_config(replay_bin or default_replay_bin(), workload, preset, microbatches,
                         f" (or what `replay-{workload} --preset {preset} --print-config` printed, with "
                         f"--config FILE)", schedule)


def replay_config(bin_dir, workload, preset, microbatches=None, alternative="", schedule=None):
    """shard_config of what run_print_config prints, which must be the preset, micro-batches and schedule
    overrides asked for."""
    doc, source = run_print_config(bin_dir, workload, preset, microbatches, alternative, schedule)
    cfg = shard_config(doc, workload, source)
    if cfg["preset"] != preset:
        raise BaselineError(f"{source} printed the configuration of preset {cfg['preset']!r}")
    if microbatches is not None and cfg["microbatches"] != microbatches:
        raise BaselineError(f"{source} printed microbatches {cfg['microbatches']}")
    for key, v in (schedule or {}).items():
        want = fp32_decimal(v) if key in ("lr", "min_lr") else v
        if v is not None and cfg["optimizer"][key] != want:
            raise BaselineError(f"{source} printed training.schedule.{key} {cfg['optimizer'][key]!r}, not "
                                f"the {SCHEDULE_FLAGS[key]} {v!r} asked for")
    return cfg


# ---------------------------------------------------------------------------------------------------------
# Device side (torch)
# ---------------------------------------------------------------------------------------------------------

def require_cuda():
    """Imports torch and checks for a CUDA device; returns torch."""
    try:
        import torch
    except ImportError as e:
        raise BaselineError(f"PyTorch is not importable ({e}); this baseline needs torch with CUDA") from None
    if not torch.cuda.is_available():
        raise BaselineError(f"no CUDA device available to torch {torch.__version__} "
                            f"(built for CUDA {torch.version.cuda})")
    return torch


def repeats_within(budget_ms, call_ms, min_repeats, max_repeats):
    """The timed calls that fit budget_ms at call_ms a call, as replay's bench::repeats_within:
    floor(budget_ms / call_ms), at least min(min_repeats, max_repeats), at most max_repeats; no budget
    (budget_ms <= 0), or a call too fast to time, gives max_repeats."""
    if budget_ms <= 0 or not call_ms > 0:
        return max_repeats
    return int(min(max(math.floor(budget_ms / call_ms), min(min_repeats, max_repeats)), max_repeats))


def check_budget(warmup, budget_ms):
    """A time budget needs two or more warm-up calls: the calls after the first give the time a call takes."""
    if budget_ms > 0 and warmup < 2:
        raise BaselineError("--budget-ms needs --warmup 2 or more (the calls after the first give the time a "
                            "call takes); --budget-ms 0 times --repeats calls")


class Timer:
    """Warm-up calls, then `repeats` calls each between its own pair of CUDA events on the current stream;
    returns the per-call times in ms.

    Before the timed calls a sleep kernel holds the GPU while the host enqueues them all, so host launch
    gaps (Python, autograd) fall outside the events and the times are GPU time, as replay's C++ tools see
    it. The sleep is sized from the host time of the warm-up calls after the first (which builds plans),
    and lasts at least lead_ms: replay-ops --lead-ms idles the GPU for the same time before each series,
    so that both tools' timed calls start from the same clocks (a GPU fresh from dense GEMMs sits at its
    power limit).

    budget_ms > 0 cuts the timed calls to those that fit the budget at the median time of the warm-up
    calls after the first (each between events; needs warmup >= 2), as replay-ops --budget-ms does: a
    series of dense GEMMs holds its clocks for some 25-85 ms after the lead and then drops them, so a series
    that ends first is timed at one clock level. time(fn, budget=False) ignores it (the peaks)."""

    def __init__(self, warmup, repeats, lead_ms=0.0, budget_ms=0.0):
        import torch
        check_budget(warmup, budget_ms)
        self.warmup, self.repeats, self.lead_ms, self.budget_ms = warmup, repeats, lead_ms, budget_ms
        self.cycles_per_ms = None
        if hasattr(torch.cuda, "_sleep"):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            cycles = 20_000_000
            torch.cuda._sleep(cycles // 10)  # first launch loads the kernel
            start.record()
            torch.cuda._sleep(cycles)
            end.record()
            end.synchronize()
            self.cycles_per_ms = cycles / start.elapsed_time(end)

    def time(self, fn, budget=True):
        import torch
        torch.cuda.synchronize()
        budgeted = budget and self.budget_ms > 0
        host_ms_per_call = 0.0
        warm = []
        if self.warmup:
            fn()
            t0 = time.perf_counter()
            if budgeted:
                warm = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
                        for _ in range(self.warmup - 1)]
                for start, end in warm:
                    start.record()
                    fn()
                    end.record()
            else:
                for _ in range(self.warmup - 1):
                    fn()
            host_ms_per_call = (time.perf_counter() - t0) * 1e3 / max(self.warmup - 1, 1)
        torch.cuda.synchronize()
        repeats = self.repeats
        if budgeted:
            call_ms = percentile([start.elapsed_time(end) for start, end in warm], 50)
            repeats = repeats_within(self.budget_ms, call_ms, MIN_BUDGET_REPEATS, self.repeats)
        events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
                  for _ in range(repeats)]
        if self.cycles_per_ms:
            lead_ms = max(self.lead_ms, min(1.0 + 1.25 * host_ms_per_call * repeats, 2000.0))
            torch.cuda._sleep(int(lead_ms * self.cycles_per_ms))
        elif self.lead_ms:
            time.sleep(self.lead_ms / 1e3)  # the GPU is drained: it idles
        for start, end in events:
            start.record()
            fn()
            end.record()
        torch.cuda.synchronize()
        return [start.elapsed_time(end) for start, end in events]


def _libcuda_driver_version():
    """CUDA driver API version (cuDriverGetVersion, as replay's cuda_driver), or None."""
    import ctypes
    try:
        lib = ctypes.CDLL("libcuda.so.1")
        v = ctypes.c_int(0)
        if lib.cuDriverGetVersion(ctypes.byref(v)) != 0:
            return None
        return f"{v.value // 1000}.{v.value % 1000 // 10}"
    except OSError:
        return None


def _nvidia_driver_version():
    """The kernel driver release (one per host), from nvidia-smi, or None."""
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=20)
    except (OSError, subprocess.SubprocessError):
        return None
    lines = out.stdout.split()
    return lines[0] if out.returncode == 0 and lines else None


def environment():
    """The environment block, keys as replay's Context::environment() where they mean the same thing."""
    import platform
    import torch
    dev = torch.cuda.current_device()
    p = torch.cuda.get_device_properties(dev)
    cudnn = torch.backends.cudnn.version() if torch.backends.cudnn.is_available() else None
    l2 = getattr(p, "L2_cache_size", None)
    env = {
        "host": socket.gethostname(),
        "gpu": p.name,
        "compute_capability": f"{p.major}.{p.minor}",
        "sm_count": str(p.multi_processor_count),
        "memory_gib": f"{p.total_memory / 2**30:.2f}",
        "l2_mib": str(l2 // 2**20) if l2 else None,
        "cuda_driver": _libcuda_driver_version(),
        "nvidia_driver": _nvidia_driver_version(),
        "cuda_runtime": torch.version.cuda,
        "cudnn": f"{cudnn // 10000}.{cudnn % 10000 // 100}.{cudnn % 100}" if cudnn else None,
        "torch": torch.__version__,
        "python": platform.python_version(),
    }
    return env


def torch_settings():
    """The numerics and attention-backend switches the timings ran under (all left at their defaults)."""
    import torch
    b = torch.backends
    settings = {
        "matmul.allow_bf16_reduced_precision_reduction": b.cuda.matmul.allow_bf16_reduced_precision_reduction,
        "matmul.allow_tf32": b.cuda.matmul.allow_tf32,
        "cudnn.allow_tf32": b.cudnn.allow_tf32,
        "flash_sdp_enabled": b.cuda.flash_sdp_enabled(),
        "mem_efficient_sdp_enabled": b.cuda.mem_efficient_sdp_enabled(),
        "math_sdp_enabled": b.cuda.math_sdp_enabled(),
        "cudnn_sdp_enabled": b.cuda.cudnn_sdp_enabled() if hasattr(b.cuda, "cudnn_sdp_enabled") else None,
    }
    if hasattr(b.cuda, "preferred_blas_library"):
        settings["preferred_blas_library"] = str(b.cuda.preferred_blas_library())
    return settings


def measure_gemm_peak(timer):
    """bf16 GEMM peak in TFLOP/s: an 8192^3 x @ w^T, as replay's peaks.h. Its buffers are free when it
    returns (torch.cuda.empty_cache gives them back to the device)."""
    import torch
    n = PEAK_GEMM_SIZE
    a = torch.randn(n, n, dtype=torch.bfloat16, device="cuda")
    bt = torch.randn(n, n, dtype=torch.bfloat16, device="cuda").t()
    c = torch.empty(n, n, dtype=torch.bfloat16, device="cuda")
    ms = percentile(timer.time(lambda: torch.matmul(a, bt, out=c), budget=False), 50)
    return 2.0 * n ** 3 / (ms * 1e-3) / 1e12


def measure_copy_peak(timer):
    """Device-to-device copy bandwidth in GB/s of a 2 GiB buffer, counting bytes read plus written."""
    import torch
    src = torch.randn(PEAK_COPY_BYTES // 2, dtype=torch.bfloat16, device="cuda")
    dst = torch.empty_like(src)
    ms = percentile(timer.time(lambda: dst.copy_(src), budget=False), 50)
    return 2.0 * PEAK_COPY_BYTES / (ms * 1e-3) / 1e9


def measure_peaks(timer):
    """bf16 GEMM peak and copy bandwidth (SCHEMA.md `peaks`), each measurement's buffers released after it."""
    import torch
    gemm = measure_gemm_peak(timer)
    torch.cuda.empty_cache()
    copy = measure_copy_peak(timer)
    torch.cuda.empty_cache()
    return {"bf16_gemm_tflops": gemm, "copy_gbps": copy}


def time_gemms(timer, M, N, K, directions):
    """Times the requested directions of one linear layer; returns {direction: times_ms}."""
    import torch
    bf16 = dict(dtype=torch.bfloat16, device="cuda")
    x, w, dy = torch.randn(M, K, **bf16), torch.randn(N, K, **bf16), torch.randn(M, N, **bf16)
    calls = {
        "fwd": (x, w.t(), torch.empty(M, N, **bf16)),    # Y = X W^T
        "dgrad": (dy, w, torch.empty(M, K, **bf16)),     # dX = dY W
        "wgrad": (dy.t(), x, torch.empty(N, K, **bf16)),  # dW = dY^T X
    }
    out = {}
    for d in directions:
        a, b, c = calls[d]
        out[d] = timer.time(lambda: torch.matmul(a, b, out=c))
    return out


def _backend_name(q, k, v, gqa):
    """Name of the SDPA backend the default selection picks for these inputs, or None if torch won't say."""
    import torch
    from torch.nn.attention import SDPBackend
    try:
        choice = torch._fused_sdp_choice(q, k, v, None, 0.0, True, scale=None, enable_gqa=gqa)
    except (AttributeError, TypeError, RuntimeError):
        return None
    for name, member in SDPBackend.__members__.items():
        if int(member.value) == int(choice):
            return name
    return None


def time_attention(timer, shape, direction, backend):
    """Times causal SDPA, forward alone or forward+backward (autograd.grad with a random grad_output), on
    q, k, v laid out as a transformer feeds them: views [B, H, S, D] into one token-major QKV tensor
    [B, S, Hq + 2 Hkv, D], what the QKV linear layer produces (and what replay-ops gives cuDNN). A
    contiguous [B, H, S, D] copy would cost PyTorch a transpose kernel per tensor that this timing would
    not count. backend None is the default selection; ATTENTION_DETERMINISTIC the default selection under
    torch.use_deterministic_algorithms(True) (restored after); otherwise the ATTENTION_BACKENDS key forced
    through sdpa_kernel. Returns (times_ms or None, backend name, note)."""
    import torch
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel
    B, Hq, Hkv, S, D = (shape[k] for k in ("batch", "q_heads", "kv_heads", "seq", "head_dim"))
    gqa = Hkv != Hq
    bf16 = dict(dtype=torch.bfloat16, device="cuda")
    # The fused tensor requires grad, so the forward is the training forward (it keeps the softmax
    # statistics the backward needs), as in a training step.
    qkv = torch.randn(B, S, Hq + 2 * Hkv, D, **bf16).requires_grad_()
    dout = torch.randn(B, Hq, S, D, **bf16)

    def views():
        return (qkv[:, :, :Hq].transpose(1, 2), qkv[:, :, Hq:Hq + Hkv].transpose(1, 2),
                qkv[:, :, Hq + Hkv:].transpose(1, 2))

    q, k, v = views()

    def fwd():
        q, k, v = views()
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=gqa)

    def fwd_bwd():
        torch.autograd.grad(fwd(), (qkv,), grad_outputs=dout)

    fn = fwd if direction == "fwd" else fwd_bwd
    if backend is None:
        return timer.time(fn), _backend_name(q, k, v, gqa) or "default", None
    if backend == ATTENTION_DETERMINISTIC:
        # Deterministic mode also fills every new uninitialized tensor (outputs, gradients) with NaN by
        # default: kernels that are not the attention's, so they are switched off for the timing.
        det_utils = getattr(torch.utils, "deterministic", None)
        was = torch.are_deterministic_algorithms_enabled()
        was_fill = getattr(det_utils, "fill_uninitialized_memory", None)
        torch.use_deterministic_algorithms(True)
        if was_fill is not None:
            det_utils.fill_uninitialized_memory = False
        try:
            return timer.time(fn), _backend_name(q, k, v, gqa) or "default", None
        except RuntimeError as e:
            torch.cuda.synchronize()
            return None, "default", f"refused under deterministic algorithms: {str(e).splitlines()[0]}"
        finally:
            torch.use_deterministic_algorithms(was)
            if was_fill is not None:
                det_utils.fill_uninitialized_memory = was_fill
    member = getattr(SDPBackend, ATTENTION_BACKENDS[backend])
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            with sdpa_kernel(member):
                return timer.time(fn), member.name, None
        except RuntimeError as e:
            torch.cuda.synchronize()
            reasons = [str(w.message).strip() for w in caught]
            note = f"{member.name} refused: " + "; ".join(reasons + [str(e).splitlines()[0]])
            return None, member.name, note


def cmd_ops(args):
    check_budget(args.warmup, args.budget_ms)
    only = re.compile(args.only) if args.only else None
    bin_dir = args.replay_bin or default_replay_bin()
    configs = [replay_config(bin_dir, workload, preset) for workload, preset in OPS_PRESETS]
    specs = op_specs(configs, only)
    if not specs:
        raise BaselineError(f"--only {args.only!r} matches no op; names look like gpt3_175b_tp4.qkv.fwd")
    out_dir = os.path.dirname(os.path.abspath(args.json))
    if not os.path.isdir(out_dir):
        raise BaselineError(f"--json {args.json}: directory {out_dir} does not exist")
    torch = require_cuda()
    torch.manual_seed(0)
    env, settings = environment(), torch_settings()
    progress(f"pytorch_baseline ops: torch {env['torch']}, {env['gpu']}, CUDA {env['cuda_runtime']}, "
             f"cuDNN {env['cudnn']}; warmup {args.warmup}, repeats {args.repeats} (budget {args.budget_ms} ms), "
             f"{len(specs)} ops")
    progress("settings: " + ", ".join(f"{k}={v}" for k, v in settings.items()))
    timer = Timer(args.warmup, args.repeats, args.lead_ms, args.budget_ms)
    peaks = measure_peaks(timer)
    progress(f"peaks: bf16 GEMM {peaks['bf16_gemm_tflops']:.1f} TFLOP/s, copy {peaks['copy_gbps']:.1f} GB/s")

    results = []

    def record(spec, times, backend=None, note=None):
        r = make_result(spec, times, peaks["bf16_gemm_tflops"], note=note, backend_used=backend)
        results.append(r)
        if r["median_ms"] is None:
            progress(f"[{len(results)}/{len(specs)}] {r['name']}: not measured ({note})")
        else:
            progress(f"[{len(results)}/{len(specs)}] {r['name']}: median {r['median_ms']:.4f} ms "
                     f"(p10 {r['p10_ms']:.4f}, p90 {r['p90_ms']:.4f}), {r['tflops']:.1f} TFLOP/s, "
                     f"{r['fraction_of_peak']:.2f} of peak" + (f" [{backend}]" if backend else ""))

    i = 0
    while i < len(specs):
        spec = specs[i]
        if spec["kind"] == "gemm":
            # The selected directions of one layer share its tensors.
            group = [s for s in specs[i:] if s["kind"] == "gemm" and s["shard"] == spec["shard"]
                     and s["layer"] == spec["layer"]]
            times = time_gemms(timer, *spec["dims"], [s["direction"] for s in group])
            for s in group:
                record(s, times[s["direction"]])
            i += len(group)
        else:
            times, backend, note = time_attention(timer, spec["shape"], spec["direction"], spec["backend"])
            record(spec, times, backend, note)
            i += 1
        torch.cuda.empty_cache()

    doc = {
        "tool": "pytorch",
        "version": torch.__version__,
        "environment": env,
        "settings": settings,
        "protocol": {"warmup": args.warmup, "repeats": args.repeats, "lead_ms": args.lead_ms,
                     "budget_ms": args.budget_ms, "min_repeats": min(MIN_BUDGET_REPEATS, args.repeats),
                     "timer": "cuda events around each repeat",
                     "host_lead": timer.cycles_per_ms is not None,
                     "percentiles": "linear interpolation between closest ranks"},
        "peaks": peaks,
        "results": results,
    }
    write_json(args.json, doc)
    progress(f"wrote {args.json}")
    return 0


# ---------------------------------------------------------------------------------------------------------
# Shard training (torch): data, graph capture, the timed run
# ---------------------------------------------------------------------------------------------------------

def _attr_text(v):
    return v.decode() if isinstance(v, bytes) else v


def token_file_problem(attrs, shape, is_int32, cfg):
    """Why a replay-tokens file (datasets/gpt3.md) cannot feed this model, or None. attrs: the root
    attributes; shape: /tokens dims (None when there is no dataset /tokens); is_int32: its element type."""
    if _attr_text(attrs.get("format")) != "replay-tokens":
        return f"format is {attrs.get('format')!r}, expected 'replay-tokens'"
    if attrs.get("format_version") != 1:
        return f"format_version is {attrs.get('format_version')!r}, expected 1"
    if shape is None:
        return "no dataset /tokens"
    if len(shape) != 2:
        return f"/tokens has rank {len(shape)}, expected 2"
    if not is_int32:
        return "/tokens is not 32-bit integers"
    for key in ("vocab_size", "seq_len", "num_sequences"):
        v = attrs.get(key)
        if isinstance(v, bool) or not isinstance(v, numbers.Integral) or v <= 0:
            return f"{key} is {v!r}, expected a positive integer"
    vocab, seq, n = (int(attrs[k]) for k in ("vocab_size", "seq_len", "num_sequences"))
    if tuple(shape) != (n, seq + 1):
        return f"/tokens shape {list(shape)} is not [num_sequences, seq_len + 1] = [{n}, {seq + 1}]"
    if seq != cfg["seq"]:
        return f"seq_len {seq} is not the model's {cfg['seq']}"
    if vocab > cfg["vocab"]:
        return f"vocab_size {vocab} is larger than the model's vocabulary {cfg['vocab']}"
    if n < cfg["micro_batch"]:
        return f"{n} sequences hold no micro-batch of {cfg['micro_batch']}"
    return None


def read_token_file(path, cfg, count, first=0, rows_limit=None):
    """[count, micro_batch, seq + 1] int64 ids (count micro-batches) from a replay-tokens HDF5 file, batches in sequential order
    (replay shuffles by default; the order does not change the step time), and the file's entropy rate
    when it is the loss floor (TP 1: ids are not remapped)."""
    try:
        import h5py
        import numpy as np
    except ImportError as e:
        raise BaselineError(f"--data needs h5py and numpy ({e})") from None
    import torch
    try:
        with h5py.File(path, "r") as f:
            attrs = dict(f.attrs)
            ds = f.get("tokens")
            ds = ds if isinstance(ds, h5py.Dataset) else None
            problem = token_file_problem(attrs, ds.shape if ds is not None else None,
                                         ds is not None and ds.dtype.kind == "i" and ds.dtype.itemsize == 4,
                                         cfg)
            if problem:
                raise BaselineError(f"--data {path}: {problem}")
            n = ds.shape[0] if rows_limit is None else min(rows_limit, ds.shape[0])
            rows = [ds[r[0]:r[-1] + 1] for r in sequential_batches(n, cfg["micro_batch"], count, first)]
    except OSError as e:
        raise BaselineError(f"--data {path}: cannot read as HDF5: {e}") from None
    ids = np.stack(rows).astype(np.int64)
    vocab = int(attrs["vocab_size"])
    if ids.min() < 0 or ids.max() >= vocab:
        raise BaselineError(f"--data {path}: holds token ids outside [0, {vocab})")
    floor = attrs.get("entropy_rate") if cfg["vocab_shard"] >= vocab else None
    return torch.from_numpy(ids), float(floor) if floor is not None else None


def step_tokens(cfg, count, seed, data_path, first=0, rows_limit=None):
    """Every step's tokens, [count, microbatches, micro_batch, seq + 1], mapped into this rank's vocabulary
    shard, in pinned host memory (each step copies its own slice, so no host write races an earlier
    asynchronous copy); and the loss floor. From a file: micro-batches from index `first` on, in the
    file's order within its first `rows_limit` rows (replay's training split)."""
    import torch
    n = count * cfg["microbatches"]
    if data_path is None:
        g = torch.Generator().manual_seed(seed)
        ids = torch.randint(0, cfg["data_vocab"], (n, cfg["micro_batch"], cfg["seq"] + 1), generator=g)
        floor = shard_entropy(cfg["data_vocab"], cfg["vocab_shard"])
    else:
        ids, floor = read_token_file(data_path, cfg, n, first, rows_limit)
    ids = ids.view(count, cfg["microbatches"], cfg["micro_batch"], cfg["seq"] + 1)
    return (ids % cfg["vocab_shard"]).pin_memory(), floor


def graph_node_count(raw_graph):
    """Nodes of a cudaGraph_t (the driver's CUgraph) through cuGraphGetNodes, or None."""
    import ctypes
    try:
        lib = ctypes.CDLL("libcuda.so.1")
    except OSError:
        return None
    lib.cuGraphGetNodes.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.POINTER(ctypes.c_size_t)]
    n = ctypes.c_size_t(0)
    return n.value if lib.cuGraphGetNodes(ctypes.c_void_p(raw_graph), None, ctypes.byref(n)) == 0 else None


def capture_step(trainer, static_tokens):
    """Captures one whole training step (forward, backward, clip, optimizer, masters -> bf16 params) into
    a torch.cuda.graph; returns (graph, (loss, grad_norm) static outputs, graphs_info, graph pool bytes).
    Called after warm-up steps on a side stream, as PyTorch documents for whole-network capture."""
    import torch
    try:
        graph, keep = torch.cuda.CUDAGraph(keep_graph=True), True  # instantiate separately, count nodes
    except TypeError:
        graph, keep = torch.cuda.CUDAGraph(), False
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    reserved = torch.cuda.memory_reserved()
    try:
        with torch.cuda.graph(graph):
            t0 = time.perf_counter()
            outputs = trainer.step(static_tokens)
    except torch.cuda.OutOfMemoryError:
        raise
    except RuntimeError as e:
        raise BaselineError(f"capturing the training step failed: {str(e).splitlines()[0]}") from e
    capture_ms = (time.perf_counter() - t0) * 1e3
    nodes = instantiate_ms = None
    if keep:
        nodes = graph_node_count(graph.raw_cuda_graph())
        t0 = time.perf_counter()
        graph.instantiate()
        instantiate_ms = (time.perf_counter() - t0) * 1e3
    info = {"count": 1, "nodes": nodes, "capture_ms": capture_ms, "instantiate_ms": instantiate_ms}
    if not keep:
        info["note"] = "capture_ms includes instantiation (this torch has no CUDAGraph(keep_graph=True))"
    return graph, outputs, info, torch.cuda.memory_reserved() - reserved


def weights_hash(params):
    """HASH_METHOD's weights_hash of the bf16 parameters, or None without numpy."""
    import hashlib
    import torch
    h = hashlib.sha256()
    try:
        for p in params:
            h.update(p.detach().contiguous().view(torch.int16).cpu().numpy().tobytes())
    except (ImportError, RuntimeError):
        return None
    return h.hexdigest()[:16]


def fmt_ms(v):
    return "n/a" if v is None else f"{v:.1f}"


def build_model(cfg, layers):
    """The workload's shard module (pytorch_gpt3.GPT3Shard or pytorch_llama31.Llama31Shard), bf16."""
    import torch
    if cfg["workload"] == "gpt3":
        from pytorch_gpt3 import GPT3Shard as Shard
    else:
        from pytorch_llama31 import Llama31Shard as Shard
    with torch.device("cuda"):
        return Shard(cfg, layers).to(torch.bfloat16)


def model_backend(cfg):
    """The SDPA backend torch picks for the model's q, k, v: [B, H, S, D] views of the token-major fused
    QKV output [B, S, Hq + 2 Hkv, D] that need grads (GQA when the shard has fewer KV heads)."""
    import torch
    hq, hkv = cfg["heads"], cfg["kv_heads"]
    qkv = torch.empty(cfg["micro_batch"], cfg["seq"], hq + 2 * hkv, cfg["head_dim"], dtype=torch.bfloat16,
                      device="cuda", requires_grad=True)
    return _backend_name(qkv[:, :, :hq].transpose(1, 2), qkv[:, :, hq:hq + hkv].transpose(1, 2),
                         qkv[:, :, hq + hkv:].transpose(1, 2), WORKLOADS[cfg["workload"]]["enable_gqa"])


def timed_steps(steps, first, load, graph, static_loss, trainer, static_tokens):
    """`steps` timed steps (batches first, first + 1, ...), each between its own pair of events, read
    after the run; the host does not wait for the device, so the times include any gap the host leaves
    between launches. Replays `graph` (its loss in `static_loss`) when there is one, else runs
    trainer.step eagerly. Returns (step ms, host enqueue us, the losses as a device tensor)."""
    import torch
    events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
              for _ in range(steps)]
    losses = torch.empty(steps, dtype=torch.float32, device="cuda")
    host_us = []
    for i, (start, end) in enumerate(events):
        t0 = time.perf_counter()
        start.record()
        load(first + i)
        if graph is not None:
            graph.replay()
            loss = static_loss
        else:
            loss, _ = trainer.step(static_tokens)
        end.record()
        host_us.append((time.perf_counter() - t0) * 1e6)
        losses[i].copy_(loss)
    torch.cuda.synchronize()
    return [start.elapsed_time(end) for start, end in events], host_us, losses


def run_workload(args, cfg, layers):
    """Builds the shard, warms up, captures (--graphs full), times args.steps steps; returns the JSON."""
    torch = require_cuda()
    from pytorch_gpt3 import MixedPrecisionTrainer
    torch.manual_seed(args.seed)
    env, settings = environment(), torch_settings()
    peak = measure_gemm_peak(Timer(5, 20))
    kv = f" (kv {cfg['kv_heads']})" if cfg["kv_heads"] != cfg["heads"] else ""
    progress(f"pytorch_baseline {cfg['workload']} {cfg['preset']}: torch {env['torch']}, {env['gpu']}; "
             f"graphs {args.graphs}, layers {layers}, hidden {cfg['hidden']}, heads {cfg['heads']}{kv}"
             f"x{cfg['head_dim']}, ffn {cfg['ffn']}, seq {cfg['seq']}, micro-batch {cfg['micro_batch']} x "
             f"{cfg['microbatches']}, vocab shard {cfg['vocab_shard']} of {cfg['vocab']}, "
             f"{model_params(cfg, layers) / 1e6:.1f}M parameters; steps {args.steps}, warmup {args.warmup}, "
             f"seed {args.seed}, data {args.data or 'random tokens'}; bf16 GEMM peak {peak:.1f} TFLOP/s")
    o = cfg["optimizer"]
    progress(f"schedule (replay's): {o['schedule']}, linear warm-up over {o['warmup_steps']} steps to "
             f"{o['lr']:g}, cosine decay to {o['min_lr']:g} at step {o['decay_steps']}; AdamW betas "
             f"{o['betas'][0]:g}/{o['betas'][1]:g}, eps {o['eps']:g}, weight decay {o['weight_decay']:g}, "
             f"clip {o['clip_norm']:g}")
    first, rows_limit, ckpt = 0, None, None
    if args.load:
        from pytorch_checkpoint import read_checkpoint
        ckpt, _, _ = read_checkpoint(args.load, cfg["workload"])
        first = int(ckpt["data.position"].item())
        rows_limit = training_rows_of(args.data, cfg["micro_batch"])
    tokens, floor = step_tokens(cfg, args.warmup + args.steps, args.seed, args.data, first, rows_limit)

    model = build_model(cfg, layers)
    opt = cfg["optimizer"]
    trainer = MixedPrecisionTrainer(model, opt)
    resumed = 0
    if ckpt is not None:
        from pytorch_checkpoint import load_trainer_state, load_weights
        load_weights(model, ckpt, cfg["workload"], args.load)
        resumed = load_trainer_state(trainer, model, ckpt, cfg["workload"])
        progress(f"resumed from {args.load}: optimizer step {resumed}, data from micro-batch {first} "
                 f"(the file's order)")
    static_tokens = torch.empty(tokens.shape[1:], dtype=tokens.dtype, device="cuda")
    backend = model_backend(cfg)
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()

    def load(i):
        static_tokens.copy_(tokens[i], non_blocking=True)

    static_loss = None  # the graph's loss output (--graphs full)
    graph, graphs_info, pool_bytes = None, {"count": 0, "nodes": 0, "capture_ms": None,
                                            "instantiate_ms": None}, None
    if args.graphs == "full":
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for i in range(args.warmup):
                load(i)
                trainer.step(static_tokens)
        torch.cuda.current_stream().wait_stream(side)
        graph, (static_loss, _), graphs_info, pool_bytes = capture_step(trainer, static_tokens)
        progress(f"captured the step: {graphs_info['nodes']} nodes, capture "
                 f"{graphs_info['capture_ms']:.1f} ms, instantiate {fmt_ms(graphs_info['instantiate_ms'])} ms")
    else:
        for i in range(args.warmup):
            load(i)
            trainer.step(static_tokens)
    torch.cuda.synchronize()

    step_ms, host_us, losses = timed_steps(args.steps, args.warmup, load, graph, static_loss, trainer,
                                           static_tokens)

    # The schedule ran on the device: its last value must be lr_at of the last step, to the bit.
    taken = resumed + args.warmup + args.steps
    lr, count, expected = trainer.lr.item(), trainer.step_count.item(), lr_at(taken - 1, opt)
    if count != taken or lr != expected:
        raise BaselineError(f"device schedule disagrees with lr_at: {count:g} steps taken (expected {taken}), "
                            f"lr {lr!r} (expected {expected!r})")
    measured = {
        "version": torch.__version__, "environment": env, "settings": settings, "attention_backend": backend,
        "memory": {"peak_bytes": torch.cuda.max_memory_allocated(),
                   "reserved_bytes": torch.cuda.max_memory_reserved(),
                   "arena_bytes": None, "graph_extra_bytes": pool_bytes},
        "graphs_info": graphs_info,
        "losses": losses.tolist(),
        "weights_hash": weights_hash(trainer.params),
        "loss_floor": floor,
    }
    run = {"preset": cfg["preset"], "graphs": args.graphs, "seed": args.seed, "steps": args.steps,
           "warmup": args.warmup, "data": os.path.abspath(args.data) if args.data else "random"}
    if args.load:
        run["load"] = os.path.abspath(args.load)
    return workload_document(cfg, layers, run, step_ms, host_us, peak, measured)


def cmd_train(args):
    """`gpt3` and `llama31`: checks the arguments, takes the shard's shapes from replay (--config FILE or
    the replay binary's --print-config), runs, writes the JSON."""
    if args.graphs == "full" and args.warmup < 1:
        raise BaselineError("--graphs full needs --warmup 1 or more: the optimizer creates its state on its "
                            "first step, which must not happen inside the capture")
    out_dir = os.path.dirname(os.path.abspath(args.json))
    if not os.path.isdir(out_dir):
        raise BaselineError(f"--json {args.json}: directory {out_dir} does not exist")
    if args.data is not None and not os.path.isfile(args.data):
        raise BaselineError(f"--data {args.data}: no such file")
    if args.load:
        if args.data is None:
            raise BaselineError("--load: give --data, the token file the checkpoint's run trained on")
        if args.warmup != 0 or args.graphs != "none":
            raise BaselineError("--load: warm-up steps would train on batches replay did not see; give "
                                "--warmup 0 --graphs none")
        require_cuda()
        from pytorch_checkpoint import read_checkpoint
        _, _, cfg = read_checkpoint(args.load, args.command)
    else:
        cfg = load_shard_config(args.command, args.preset, getattr(args, "microbatches", None),
                                args.replay_bin, args.config, schedule_overrides(args))
    layers = args.layers if args.layers is not None else default_layers(cfg)
    if layers > cfg["model_layers"]:
        raise BaselineError(f"--layers {layers}: the {cfg['preset']} model has {cfg['model_layers']} layers")
    torch = require_cuda()
    try:
        doc = run_workload(args, cfg, layers)
    except torch.cuda.OutOfMemoryError as e:
        raise BaselineError(f"out of GPU memory with {layers} layers ({str(e).splitlines()[0]}); "
                            f"try a smaller --layers") from None
    s, t, mem = doc["step_ms"], doc["throughput"], doc["memory"]
    progress(f"step {s['median']:.3f} ms median (p10 {s['p10']:.3f}, p90 {s['p90']:.3f}), "
             f"host enqueue {doc['host_enqueue_us']['median']:.0f} us, {t['tokens_per_s']:.0f} tokens/s, "
             f"{doc['model_tflops']:.1f} TFLOP/s, MFU {doc['mfu']:.3f}, peak memory "
             f"{mem['peak_bytes'] / 2**30:.2f} GiB (reserved {mem['reserved_bytes'] / 2**30:.2f}); "
             f"loss {doc['losses'][0]:.4f} -> {doc['losses'][-1]:.4f}"
             + (f" (floor {doc['loss_floor']:.4f})" if doc["loss_floor"] is not None else "")
             + f", hash {doc['loss_hash']}")
    write_json(args.json, doc)
    progress(f"wrote {args.json}")
    return 0


def training_rows_of(path, micro_batch):
    """replay_training_rows of a token file's sequence count."""
    try:
        import h5py
    except ImportError as e:
        raise BaselineError(f"--data needs h5py ({e})") from None
    with h5py.File(path, "r") as f:
        return replay_training_rows(f["tokens"].shape[0], micro_batch)


def cmd_gradcheck(args):
    """`gradcheck`: one step's loss and gradients, replay's (--dump-step) against the baseline's on the
    checkpoint's weights and the same batch (pytorch_checkpoint.gradcheck). Exit 0 when every tensor is
    within the tolerance, 1 when one is not."""
    for path, flag in ((args.checkpoint, "--checkpoint"), (args.step, "--step")):
        if not os.path.isfile(path):
            raise BaselineError(f"{flag} {path}: no such file")
    require_cuda()
    from pytorch_checkpoint import gradcheck
    doc = gradcheck(args.workload, args.checkpoint, args.step, build_model)
    worst = max(doc["tensors"], key=lambda r: r["rel_err_replay"] / r["limit"])
    l = doc["loss"]
    progress(f"gradcheck {args.workload} {doc['preset']}: loss replay {l['replay']:.6f}, torch bf16 "
             f"{l['torch_bf16']:.6f}, fp32 {l['torch_fp32']:.6f}; {len(doc['tensors'])} gradients, worst "
             f"{worst['name']} relative error {worst['rel_err_replay']:.2e} (torch bf16 "
             f"{worst['rel_err_torch_bf16']:.2e}, limit {worst['limit']:.2e}): "
             + ("pass" if doc["pass"] else "FAIL"))
    for r in doc["tensors"]:
        if not r["pass"]:
            progress(f"  {r['name']}: replay {r['rel_err_replay']:.3e} > limit {r['limit']:.3e}")
    if args.json:
        write_json(args.json, doc)
    return 0 if doc["pass"] else 1


def schedule_overrides(args):
    """{key of SCHEDULE_FLAGS: value} of the schedule flags given on the command line."""
    return {key: getattr(args, key) for key in SCHEDULE_FLAGS if getattr(args, key, None) is not None}


def _int_at_least(lowest):
    def parse(text):
        try:
            v = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"not an integer: {text!r}") from None
        if v < lowest:
            raise argparse.ArgumentTypeError(f"must be >= {lowest}, got {v}")
        return v
    return parse


def _float_in(lowest, highest):
    def parse(text):
        try:
            v = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"not a number: {text!r}") from None
        if not lowest <= v <= highest:
            raise argparse.ArgumentTypeError(f"must be in [{lowest:g}, {highest:g}], got {text}")
        return v
    return parse


def _regex(text):
    try:
        re.compile(text)
    except re.error as e:
        raise argparse.ArgumentTypeError(f"not a regular expression: {e}")
    return text


REPLAY_BIN_DEFAULT_HELP = ("default: $REPLAY_BUILD_DIR/bin, else build/release/bin; relative to the "
                           "repository")


def build_parser():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    ops = sub.add_parser("ops", help="time the shard GEMMs and attention (reports/SCHEMA.md names)")
    ops.add_argument("--json", required=True, help="output JSON path")
    ops.add_argument("--replay-bin", metavar="DIR", default=None,
                     help="folder of replay's binaries: the shapes are what "
                          + " and ".join(f"replay-{w} --preset {p}" for w, p in OPS_PRESETS)
                          + f" print with --print-config ({REPLAY_BIN_DEFAULT_HELP})")
    ops.add_argument("--warmup", type=_int_at_least(0), default=10, help="untimed calls per op (default 10)")
    ops.add_argument("--repeats", type=_int_at_least(1), default=50, help="timed calls per op (default 50)")
    ops.add_argument("--only", type=_regex, default=None, help="time only the ops whose name matches")
    ops.add_argument("--lead-ms", type=float, default=50.0,
                     help="GPU idle before each op's timed calls, at least (default 50, as replay-ops)")
    ops.add_argument("--budget-ms", type=_float_in(0.0, 10000.0), default=20.0,
                     help="device time of each op's timed calls: --repeats calls or as many as fit this budget "
                          "at the warm-up's time a call, whichever is fewer, at least 5; 0 for always --repeats "
                          "(default 20, as replay-ops)")
    ops.set_defaults(func=cmd_ops)

    helps = {"gpt3": ("train the GPT-3 175B shard replay-gpt3 trains", "7 for 175b-tp4, 15 for 175b-tp8"),
             "llama31": ("train the Llama 3.1 405B shard replay-llama31 trains", "8 for 405b-tp8, 4 for 405b-tp4")}
    for name, (what, layers) in helps.items():
        w = WORKLOADS[name]
        p = sub.add_parser(name, help=f"{what}, eager or one full-step graph (reports/SCHEMA.md, workload runs)")
        p.add_argument("--preset", default=None,
                       help=f"replay-{name}'s preset: shapes and tensor-parallel degree (default "
                            f"{w['default_preset']}; with --config, the file's)")
        source = p.add_mutually_exclusive_group()
        source.add_argument("--replay-bin", metavar="DIR", default=None,
                            help=f"folder of replay's binaries: the shapes are what replay-{name} prints "
                                 f"with --print-config ({REPLAY_BIN_DEFAULT_HELP})")
        source.add_argument("--config", metavar="FILE", default=None,
                            help=f"the JSON `replay-{name} --preset P"
                                 + (" [--microbatches N]" if name == "llama31" else "")
                                 + " --print-config` printed, instead of running it")
        p.add_argument("--graphs", choices=("none", "full"), default="none",
                       help="none: eager; full: the whole step, optimizer included, as one CUDA graph")
        p.add_argument("--steps", type=_int_at_least(1), default=50, help="timed steps (default 50)")
        p.add_argument("--warmup", type=_int_at_least(0), default=3,
                       help="untimed steps first, before the capture with --graphs full (default 3)")
        p.add_argument("--layers", type=_int_at_least(1), default=None,
                       help="layers on this GPU (default: the preset's own count where it has one, as "
                            "tiny does; else what fits an 80 GB H100 at 18 bytes of state per parameter: "
                            f"{layers})")
        p.add_argument("--seed", type=_int_at_least(0), default=1234, help="weights and random tokens")
        if name == "llama31":
            p.add_argument("--microbatches", type=_int_at_least(1), default=None,
                           help="micro-batches accumulated per step, inside the graph too (default 1, or "
                                "the --config file's); "
                                "the learning-rate schedule follows the global batch, as replay's")
        p.add_argument("--data", default=None,
                       help="replay-tokens HDF5 file (datasets/gpt3.md; needs h5py); default random tokens")
        sched = p.add_argument_group(
            "learning-rate schedule",
            f"replay-{name}'s own flags, which override its preset's schedule: passed to its --print-config "
            f"(with --config FILE, they override the file's training.schedule the same way); the optimizer and "
            f"schedule are what it then prints")
        sched.add_argument("--lr", type=_float_in(0.0, 1e3), default=None, help="peak learning rate")
        sched.add_argument("--min-lr", type=_float_in(0.0, 1e3), default=None,
                           help="learning rate the decay ends at")
        sched.add_argument("--warmup-steps", type=_int_at_least(0), default=None, help="linear warm-up steps")
        sched.add_argument("--decay-steps", type=_int_at_least(1), default=None,
                           help="the step the decay ends at, warm-up included")
        p.add_argument("--load", metavar="CHECKPOINT", default=None,
                       help="start from a replay checkpoint (--save's step-N.safetensors): its weights, fp32 "
                            "masters, Adam moments and step; its configuration instead of --print-config's; "
                            "the --data file from the checkpoint's data position in the file's order "
                            "(replay's --data-order sequential); needs --warmup 0 --graphs none")
        p.add_argument("--json", required=True, help="output JSON path")
        p.set_defaults(func=cmd_train)
    g = sub.add_parser("gradcheck", help="one step's loss and gradients against replay's --dump-step, on a "
                                         "replay checkpoint's weights")
    g.add_argument("workload", choices=("gpt3", "llama31"))
    g.add_argument("--checkpoint", required=True, help="the checkpoint replay's step started from")
    g.add_argument("--step", required=True, help="what `--load CHECKPOINT --steps 1 --dump-step FILE` wrote")
    g.add_argument("--json", default=None, help="write every tensor's errors here")
    g.set_defaults(func=cmd_gradcheck)
    sub.add_parser("moe", add_help=False,
                   help="train replay-moe's DeepSeek-V3 shard (671b-ep32), eager or one full-step graph with "
                        "static expert capacity: scripts/pytorch_moe.py train, whose flags follow (moe --help)")
    sub.add_parser("rnnt", add_help=False,
                   help="train MLPerf's RNN-T on replay-rnnt's ladder of padded shapes, eager (torchaudio's "
                        "loss) or each rung's whole step as one graph (a plain-PyTorch transducer loss): "
                        "scripts/pytorch_rnnt.py, whose flags follow (rnnt --help)")
    sub.add_parser("unet", add_help=False,
                   help="train the Stable Diffusion v2 UNet at replay-unet's sd2 shapes (diffusers' "
                        "UNet2DConditionModel where importable, else a PyTorch UNet of the same architecture), "
                        "eager or one full-step graph: scripts/pytorch_unet.py, whose flags follow (unet --help)")
    sub.add_parser("tp", add_help=False,
                   help="train the GPT-3 shard with tensor parallelism over T processes (mpiexec -n T or "
                        "torchrun), eager or one full-step graph: scripts/pytorch_tp.py, whose flags follow "
                        "(tp --help)")
    return parser


def main(argv=None):
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] == ["moe"]:  # its own flags: scripts/pytorch_moe.py train
        from pytorch_moe import main as moe_main
        return moe_main(["train"] + argv[1:])
    if argv[:1] == ["rnnt"]:  # its own flags: scripts/pytorch_rnnt.py
        from pytorch_rnnt import main as rnnt_main
        return rnnt_main(argv[1:])
    if argv[:1] == ["unet"]:  # its own flags: scripts/pytorch_unet.py
        from pytorch_unet import main as unet_main
        return unet_main(argv[1:])
    if argv[:1] == ["tp"]:  # its own flags: scripts/pytorch_tp.py
        from pytorch_tp import main as tp_main
        return tp_main(argv[1:])
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except BaselineError as e:
        print(f"pytorch_baseline.py: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
