#!/usr/bin/env python3
"""Data and tensor parallelism across two GPUs (label mpi; exit 77 with fewer than two GPUs or without mpiexec):
for the tiny preset of GPT-3 and Llama 3.1, `mpiexec -n 2 replay-<w> --dp 2`

1. trains 20 steps in none, layer and full mode with bit-identical losses and weights (the
   reduce-scatter of the gradients, the all-reduced grad norm and loss and the all-gather of the
   weights are captured in the graphs; the capture check passed on both ranks);
2. agrees with one GPU running the same global batch as two micro-batches (`--microbatches 2`, the
   same batches in the same order): step 0's loss within 1e-5 and every loss of 20 steps within 0.02
   nats (the gradient sums are ordered differently, so not bitwise);
3. stops with the differing collective named when rank 1 captured one more (--inject
   collective-mismatch), instead of hanging at the first replay; and when rank 1's host stops
   enqueuing (--inject rank-stall), ends within seconds of --comm-timeout-s with the watchdog's
   message instead of hanging;
   With --dp-bucket-size 100000 (several gradient buckets, reduce-scattered during the backward,
   overlapped on a side stream in none and full mode): the same, bit-identical across modes.
4. resumes bit-exactly: 10 steps, a save (the optimizer's shares gathered into one file), a load
   (each rank takes its share) and 10 more give the losses and weights of 20 straight steps; and
   holds half the optimizer state per rank: its arena is smaller than the one-GPU run's.

5. with --tp 2 (one model split over the two processes: all-reduces after the row-parallel layers
   and of the column-parallel layers' input gradients, the vocab-parallel embedding and
   cross-entropy) trains 20 steps in none, layer and full mode with bit-identical losses and
   weights, and the loss falls; and agrees with one GPU running the whole model on the same data:
   every sharded weight is drawn as its slice of the full matrix (train/params.h TpSplit), so both
   start from the same model; step 0's loss within 5e-3 (the row-parallel layers' partial sums are
   rounded to bf16 before the all-reduce adds them, one GPU rounds once after the whole sum) and
   every loss of 20 steps within 0.02 nats.

6. with --tp 2 --sequence-parallel the same in none, layer and full mode, bit-identical across the
   modes, a smaller arena than TP2's, step 0's loss that of TP2 (also with dropout 0.1: each rank
   draws its slice of the whole mask), and every loss within 0.02 nats of one GPU.

7. TP2 checkpoints hold the whole model: the file records --tp 2 and each split tensor's layout,
   and its tensors have the one-GPU checkpoint's names and shapes. TP2 saved at step 10 and resumed
   at TP2 (layer mode) gives the losses of 20 straight steps (full mode) and, at step 20, a
   checkpoint with the same data hash (both ranks' weights, masters and moments, bit for bit). The
   TP2 checkpoint loaded by one GPU (--tp 1, resharding) continues with step 10's loss within 5e-3
   of TP2's and every loss of 10 steps within 0.02 nats: both start from the same bytes and batch,
   and differ only as TP2 and one GPU do from scratch (the row-parallel partial sums rounded to bf16
   before the all-reduce: step 0 within 5e-3, 20 steps within 0.02). The one-GPU checkpoint loaded
   at TP2 the same way round.

REPLAY_BIN_DIR names the build's binaries (CTest sets it); with REPLAY_DP_OUT set, the measured
differences are written there as JSON; REPLAY_MULTI_GPU_ONLY=dp,tp,tp-checkpoints runs only those
parts (1-4, 5-7, 7)."""

import json
import os
import shutil
import struct
import sys
import tempfile
import time

from gpu_checks import check, gpu_count, load, run, skip

STEPS = 20
FIRST_STEP_TOLERANCE = 1e-5
LOSS_TOLERANCE = 0.02
TP_FIRST_STEP_TOLERANCE = 5e-3


def three_modes(workload, layout, launch, tmp, failures):
    """Trains STEPS steps with `launch` in none, layer and full mode: each runs, the capture check
    passes in the graph modes, and losses and weights are bit-identical. Returns {mode: its JSON}."""
    runs = {}
    for mode in ("none", "layer", "full"):
        out = os.path.join(tmp, f"{workload}-{layout.lower()}-{mode}.json")
        rc, text = run([*launch, "--graphs", mode, "--steps", str(STEPS), "--json", out])
        check(rc == 0, f"{workload}: {layout} {mode} runs", failures)
        if rc == 0:
            runs[mode] = load(out)
            if mode != "none":
                check("the same on all 2 ranks" in text,
                      f"{workload}: {layout} {mode}: the capture check passed", failures)
    if len(runs) == 3:
        hashes = {m: (d["loss_hash"], d["weights_hash"]) for m, d in runs.items()}
        check(len(set(hashes.values())) == 1,
              f"{workload}: {layout} losses and weights bit-identical in none, layer and full ({hashes})",
              failures)
    return runs


def against_one_gpu(workload, layout, runs, one_gpu, what, first_tolerance, tmp, failures):
    """Runs `one_gpu` (a command without --json) and compares its losses with the full-mode run of
    `runs`: step 0 within `first_tolerance`, every step within LOSS_TOLERANCE (the sums are ordered
    differently, so not bitwise). With REPLAY_DP_OUT set the measured differences go there. Returns
    the one-GPU run's JSON (None when it failed)."""
    one = os.path.join(tmp, f"{workload}-{layout.lower()}-1gpu.json")
    rc, _ = run([*one_gpu, "--json", one])
    check(rc == 0, f"{workload}: {what} runs", failures)
    if rc != 0:
        return None
    if "full" not in runs:
        return load(one)
    a, b = runs["full"]["losses"], load(one)["losses"]
    first, worst = abs(a[0] - b[0]), max(abs(x - y) for x, y in zip(a, b))
    print(f"{workload}: {layout} {a[0]:.6f} -> {a[-1]:.6f}, one GPU {b[0]:.6f} -> {b[-1]:.6f}; step 0 differs "
          f"by {first:.2e}, the worst step by {worst:.2e}")
    out_dir = os.environ.get("REPLAY_DP_OUT")
    if out_dir:  # the measured differences, kept when the test passes too
        os.makedirs(out_dir, exist_ok=True)
        key = layout.lower()
        with open(os.path.join(out_dir, f"{workload}-{key}-vs-1gpu.json"), "w") as f:
            json.dump({"workload": workload, f"{key}_losses": a, "one_gpu_losses": b, "step0_diff": first,
                       "worst_diff": worst, f"{key}_hashes": {m: d["loss_hash"] for m, d in runs.items()}},
                      f, indent=2)
    check(first <= first_tolerance, f"{workload}: {layout}'s step 0 loss matches one GPU's ({first:.2e})",
          failures)
    check(worst <= LOSS_TOLERANCE,
          f"{workload}: {layout}'s {STEPS} losses within {LOSS_TOLERANCE} of one GPU's ({worst:.2e})", failures)
    return load(one)


def safetensors_header(path):
    """The JSON header of a safetensors file: each tensor's dtype and shape, and "__metadata__"."""
    with open(path, "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        return json.loads(f.read(n))


def tensor_shapes(header):
    return {k: v["shape"] for k, v in header.items() if k != "__metadata__"}


def tp_checkpoints(workload, binary, launch, tmp, failures):
    """TP2 checkpoints: one file of whole tensors, a bit-exact TP2 resume, and resharding to one GPU
    and back (test 7 above)."""
    one_gpu = [binary, "--tp", "1", *launch[launch.index("--preset"):]]
    tp2_dir, tp2_again, one_dir = (os.path.join(tmp, f"{workload}-{x}") for x in ("tp2-ckpt", "tp2-resumed", "1gpu-ckpt"))
    step10, step20 = "step-00000010.safetensors", "step-00000020.safetensors"
    straight, resumed = os.path.join(tmp, f"{workload}-tp2-straight.json"), os.path.join(tmp, f"{workload}-tp2-half.json")
    rc, _ = run([*launch, "--graphs", "full", "--steps", str(STEPS), "--save", tp2_dir, "--save-interval", "10",
                 "--json", straight])
    rc2, text = run([*launch, "--graphs", "layer", "--steps", str(STEPS // 2), "--load",
                     os.path.join(tp2_dir, step10), "--save", tp2_again, "--json", resumed])
    check(rc == 0 and rc2 == 0, f"{workload}: TP2 save at 10 and resume at TP2", failures)
    one_json = os.path.join(tmp, f"{workload}-1gpu-ckpt.json")
    rc3, _ = run([*one_gpu, "--graphs", "full", "--steps", str(STEPS), "--save", one_dir, "--save-interval", "10",
                  "--json", one_json])
    check(rc3 == 0, f"{workload}: one GPU saves at 10", failures)
    if rc == 0:
        h = safetensors_header(os.path.join(tp2_dir, step10))
        meta = h["__metadata__"]
        layouts = json.loads(meta.get("tensor_parallel_layout", "{}"))
        check(meta.get("tensor_parallel") == "2" and layouts.get("layer0.attn.proj.weight") == "cols" and
              layouts.get("layer0.attn.qkv.weight", "").startswith("rows "),
              f"{workload}: the TP2 checkpoint records --tp 2 and the layouts ({meta.get('tensor_parallel')}, "
              f"{len(layouts)} split tensors)", failures)
        if rc3 == 0:
            mine, whole = tensor_shapes(h), tensor_shapes(safetensors_header(os.path.join(one_dir, step10)))
            differ = sorted(k for k in set(mine) | set(whole) if mine.get(k) != whole.get(k))
            check(not differ, f"{workload}: the TP2 checkpoint holds the whole model: {len(mine)} tensors with the "
                  f"one-GPU checkpoint's names and shapes (differing: {differ[:3]})", failures)
    if rc == 0 and rc2 == 0:
        w, hf = load(straight), load(resumed)
        check(w["losses"][STEPS // 2:] == hf["losses"] and w["weights_hash"] == hf["weights_hash"],
              f"{workload}: TP2 resume bit-exact (losses and rank 0's weights of 20 straight steps)", failures)
        a = safetensors_header(os.path.join(tp2_dir, step20))["__metadata__"].get("replay.data_hash")
        b = safetensors_header(os.path.join(tp2_again, step20))["__metadata__"].get("replay.data_hash")
        check(a is not None and a == b,
              f"{workload}: TP2 resumed and straight step-20 checkpoints hold the same bytes ({a} vs {b})", failures)
    # Resharding: TP2's step 10 on one GPU, and one GPU's step 10 at TP2, each against the run
    # that wrote it.
    measured = {}
    for name, cmd, ref, ok in (
            ("TP2->1GPU", [*one_gpu, "--load", os.path.join(tp2_dir, step10)], straight, rc == 0),
            ("1GPU->TP2", [*launch, "--load", os.path.join(one_dir, step10)], one_json, rc3 == 0)):
        if not ok:
            continue
        out = os.path.join(tmp, f"{workload}-{name.replace('>', '')}.json")
        rc4, text = run([*cmd, "--graphs", "full", "--steps", str(STEPS // 2), "--json", out])
        check(rc4 == 0 and "written at --tp" in text, f"{workload}: {name} loads and runs", failures)
        if rc4 != 0:
            continue
        a, b = load(ref)["losses"][STEPS // 2:], load(out)["losses"]
        first, worst = abs(a[0] - b[0]), max(abs(x - y) for x, y in zip(a, b))
        measured[name] = {"writer_losses": a, "reader_losses": b, "first_diff": first, "worst_diff": worst}
        print(f"{workload}: {name}: step 10 differs by {first:.2e}, the worst of {len(b)} steps by {worst:.2e}")
        check(len(b) == STEPS // 2 and first <= TP_FIRST_STEP_TOLERANCE,
              f"{workload}: {name}: step 10's loss within {TP_FIRST_STEP_TOLERANCE} of the writer's ({first:.2e})",
              failures)
        check(worst <= LOSS_TOLERANCE,
              f"{workload}: {name}: {len(b)} losses within {LOSS_TOLERANCE} of the writer's ({worst:.2e})", failures)
    out_dir = os.environ.get("REPLAY_DP_OUT")
    if out_dir and measured:
        os.makedirs(out_dir, exist_ok=True)
        with open(os.path.join(out_dir, f"{workload}-tp-checkpoint.json"), "w") as f:
            json.dump({"workload": workload, **measured}, f, indent=2)


def crosscheck(workload, bin_dir, mpiexec, tmp, failures):
    binary = os.path.join(bin_dir, f"replay-{workload}")
    common = ["--preset", "tiny", "--dropout", "0", "--seed", "7", "--warmup", "2", "--log-interval", "5"]
    launch = [mpiexec, "-n", "2", "--oversubscribe", binary, "--dp", "2", *common]
    runs = three_modes(workload, "DP2", launch, tmp, failures)
    if "full" in runs:
        p = runs["full"]["parallel"]
        check(p["world_size"] == 2 and p["data_parallel"] == 2 and len(p["rank_step_ms"]) == 2 and
              (p.get("collectives_per_step") or 0) >= 3 and (p.get("comm_bytes_per_step") or 0) > 0,
              f"{workload}: the JSON's parallel block, with a step's collectives counted ({p})", failures)
    one = against_one_gpu(workload, "DP2", runs,
                          [binary, *common, "--microbatches", "2", "--graphs", "full", "--steps", str(STEPS)],
                          "one GPU with two micro-batches", FIRST_STEP_TOLERANCE, tmp, failures)
    if one is not None and "full" in runs:
        # ZeRO-1: each rank holds half the fp32 master weights and Adam moments (12 bytes a
        # parameter whole), so the arena shrinks by about 6 bytes a parameter.
        a, b = runs["full"]["memory"]["arena_bytes"], one["memory"]["arena_bytes"]
        check(a < b, f"{workload}: DP2's arena is smaller than one GPU's (the optimizer state is a share: "
              f"{a} < {b} bytes, {b - a} saved)", failures)

    # Gradient buckets: with --dp-bucket-size small enough for several, each bucket is
    # reduce-scattered after the region that finishes it, on a side stream overlapping the rest
    # of the backward (eagerly between the layer graphs in layer mode). Bit-identical across the modes;
    # step 0 is the one-bucket run's (the shares differ, so the norm's sums and later steps may
    # round differently), and the one-GPU comparison holds.
    bucketed = three_modes(workload, "DP2-buckets", [*launch, "--dp-bucket-size", "100000"], tmp, failures)
    if "full" in bucketed and "full" in runs:
        d = bucketed["full"]
        check(d["parallel"]["grad_buckets"] > 1 and runs["full"]["parallel"]["grad_buckets"] == 1,
              f"{workload}: DP2 with --dp-bucket-size 100000 has {d['parallel']['grad_buckets']} buckets, "
              f"the default {runs['full']['parallel']['grad_buckets']}", failures)
        first = abs(d["losses"][0] - runs["full"]["losses"][0])
        check(first == 0.0, f"{workload}: the bucketed DP2's step 0 loss is the one-bucket run's ({first:.2e})",
              failures)
    against_one_gpu(workload, "DP2-buckets", bucketed,
                    [binary, *common, "--microbatches", "2", "--graphs", "full", "--steps", str(STEPS)],
                    "one GPU with two micro-batches", FIRST_STEP_TOLERANCE, tmp, failures)

    # --inject collective-mismatch: rank 1 captures one extra all-reduce; the capture check stops
    # the run before the first replay (which would hang) and names the extra collective.
    rc, text = run([*launch, "--graphs", "full", "--steps", "2", "--inject", "collective-mismatch"])
    check(rc != 0 and "captured different collective sequences" in text and
          "all_reduce(f32 x 1, sum) on 'data-parallel' on rank 1" in text,
          f"{workload}: the planted collective mismatch is named, not hung", failures)

    # --inject rank-stall: rank 1's host stops enqueuing before step 2; rank 0's GPU waits in the
    # step's first collective, its watchdog gives up after --comm-timeout-s, aborts the
    # communicators and names what it waited for, and the job ends instead of hanging.
    t0 = time.monotonic()
    rc, text = run([*launch, "--graphs", "full", "--steps", str(STEPS), "--inject", "rank-stall",
                    "--comm-timeout-s", "5"], timeout=240)
    elapsed = time.monotonic() - t0
    check(rc not in (0, 124) and "waited 5 s (--comm-timeout-s)" in text and "Another rank is stalled" in text,
          f"{workload}: the stalled rank is reported by the watchdog and the job ends ({elapsed:.0f} s)", failures)

    ckpt = os.path.join(tmp, f"{workload}-ckpt")
    whole = os.path.join(tmp, f"{workload}-whole.json")
    # With several buckets, so each rank's share is a part of every bucket (saved whole, loaded back
    # into the shares).
    buckets = ["--dp-bucket-size", "100000"]
    rc, _ = run([*launch, *buckets, "--graphs", "full", "--steps", str(STEPS), "--save", ckpt, "--save-interval",
                 "10", "--json", whole])
    half = os.path.join(tmp, f"{workload}-half.json")
    rc2, _ = run([*launch, *buckets, "--graphs", "layer", "--steps", str(STEPS // 2), "--load",
                  os.path.join(ckpt, "step-00000010.safetensors"), "--json", half])
    check(rc == 0 and rc2 == 0, f"{workload}: DP2 save at 10 and resume", failures)
    if rc == 0 and rc2 == 0:
        w, h = load(whole), load(half)
        check(w["losses"][STEPS // 2:] == h["losses"] and w["weights_hash"] == h["weights_hash"],
              f"{workload}: DP2 resume bit-exact (losses and weights of 20 straight steps)", failures)


def tp_launch(workload, bin_dir, mpiexec):
    """The TP2 tests' binary and launch command."""
    binary = os.path.join(bin_dir, f"replay-{workload}")
    # --skip-peak: no start-up GEMM peak measurement, whose buffers would otherwise set the tiny arena's
    # size and hide what sequence parallelism saves.
    return binary, [mpiexec, "-n", "2", "--oversubscribe", binary, "--tp", "2", "--preset", "tiny", "--dropout",
                    "0", "--seed", "7", "--warmup", "2", "--log-interval", "5", "--skip-peak"]


def tensor_parallel(workload, bin_dir, mpiexec, tmp, failures):
    """TP2: one model split over two processes, its all-reduces and all-gathers in the graphs."""
    binary, launch = tp_launch(workload, bin_dir, mpiexec)
    runs = three_modes(workload, "TP2", launch, tmp, failures)
    if "full" in runs:
        d = runs["full"]
        check(d["parallel"]["tensor_parallel"] == 2 and d["tensor_parallel_collectives"].startswith("run"),
              f"{workload}: TP2's JSON says the collectives ran ({d['tensor_parallel_collectives']})", failures)
        losses = d["losses"]
        check(sum(losses[-5:]) / 5 < sum(losses[:5]) / 5 - 0.1,
              f"{workload}: TP2's loss falls ({losses[0]:.4f} -> {losses[-1]:.4f})", failures)
    one_gpu = [binary, "--tp", "1", *launch[launch.index("--preset"):], "--graphs", "full", "--steps", str(STEPS)]
    against_one_gpu(workload, "TP2", runs, one_gpu, "the whole model on one GPU", TP_FIRST_STEP_TOLERANCE, tmp,
                    failures)
    tp_checkpoints(workload, binary, launch, tmp, failures)

    # Sequence parallelism: the same split with the residual stream, the norms and the hidden dropout
    # on half the tokens each, reduce-scatters and all-gathers in place of the all-reduces.
    sp = three_modes(workload, "TP2-SP", [*launch, "--sequence-parallel"], tmp, failures)
    if "full" in sp and "full" in runs:
        d, t = sp["full"], runs["full"]
        check(d["config"]["sequence_parallel"] is True and "sequence parallel" in d["tensor_parallel_collectives"],
              f"{workload}: TP2-SP's JSON says so ({d['tensor_parallel_collectives']})", failures)
        a, b = d["memory"]["arena_bytes"], t["memory"]["arena_bytes"]
        check(a < b, f"{workload}: TP2-SP's arena is smaller than TP2's ({a} < {b} bytes)", failures)
        first = abs(d["losses"][0] - t["losses"][0])
        check(first <= FIRST_STEP_TOLERANCE,
              f"{workload}: TP2-SP's step 0 loss is TP2's ({first:.2e}; the same sums, cut differently)", failures)
    against_one_gpu(workload, "TP2-SP", sp, one_gpu, "the whole model on one GPU", TP_FIRST_STEP_TOLERANCE, tmp,
                    failures)
    # With dropout: a sequence-parallel rank draws its slice of the whole tensor's hidden-dropout mask, so
    # step 0's loss (dropout in the forward) is TP2's; masks drawn from row 0 of each slice would differ.
    losses = {}
    for name, extra in (("TP2", []), ("TP2-SP", ["--sequence-parallel"])):
        out = os.path.join(tmp, f"{workload}-{name.lower()}-dropout.json")
        with_dropout = [x if prev != "--dropout" else "0.1" for prev, x in zip([None, *launch], launch)]
        rc, _ = run([*with_dropout, *extra, "--graphs", "full", "--steps", "3", "--json", out])
        check(rc == 0, f"{workload}: {name} with dropout 0.1 runs", failures)
        if rc == 0:
            losses[name] = load(out)["losses"]
    if len(losses) == 2:
        first = abs(losses["TP2"][0] - losses["TP2-SP"][0])
        check(first <= FIRST_STEP_TOLERANCE,
              f"{workload}: with dropout, TP2-SP's step 0 loss is TP2's ({first:.2e})", failures)


def main():
    if gpu_count() < 2:
        skip("fewer than two GPUs")
    mpiexec = shutil.which("mpiexec")
    if mpiexec is None:
        skip("no mpiexec")
    bin_dir = os.environ.get("REPLAY_BIN_DIR", "")
    if not os.path.isfile(os.path.join(bin_dir, "replay-gpt3")):
        skip(f"no replay binaries in REPLAY_BIN_DIR={bin_dir!r}")
    # REPLAY_MULTI_GPU_ONLY=dp,tp,tp-checkpoints (a comma list) runs only those parts; tp includes
    # tp-checkpoints (test 7).
    only = set(filter(None, os.environ.get("REPLAY_MULTI_GPU_ONLY", "").split(",")))
    unknown = only - {"dp", "tp", "tp-checkpoints"}
    if unknown:
        print(f"REPLAY_MULTI_GPU_ONLY: unknown part(s) {sorted(unknown)} (dp, tp, tp-checkpoints)")
        return 2
    failures = []
    with tempfile.TemporaryDirectory(prefix="replay-dp-") as tmp:
        for workload in ("gpt3", "llama31"):
            if not only or "dp" in only:
                crosscheck(workload, bin_dir, mpiexec, tmp, failures)
            if not only or "tp" in only:
                tensor_parallel(workload, bin_dir, mpiexec, tmp, failures)
            elif "tp-checkpoints" in only:
                tp_checkpoints(workload, *tp_launch(workload, bin_dir, mpiexec), tmp, failures)
    print(f"{len(failures)} check(s) failed" if failures else "all checks passed")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
