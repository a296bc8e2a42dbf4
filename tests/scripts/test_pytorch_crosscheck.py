#!/usr/bin/env python3
"""replay against PyTorch from the same checkpoint, for the tiny preset of every transformer workload (GPU;
exit 77 where torch with CUDA, safetensors or h5py is missing, or the build has no binaries):

1. numerics: replay trains 40 steps and saves; from that checkpoint replay takes one step and writes its
   loss, gradients and batch (--dump-step); `pytorch_baseline.py gradcheck` loads the same checkpoint into
   its model and computes the same step in bf16 and fp32: every gradient of replay's must be within the
   tolerance of pytorch_checkpoint.py (relative L2 error against fp32 at most twice PyTorch's own bf16
   error, or 2%), the loss within 2e-3;
2. training: both tools train 300 steps from that checkpoint on the same file in the same (sequential)
   order with the schedule the checkpoint's configuration states: the two loss curves agree within noise
   (means over windows of 50 steps within 0.05 nats) and both approach the data's floor.

REPLAY_BIN_DIR names the build's binaries (CTest sets it)."""

import json
import os
import re
import sys
import tempfile

import gpu_checks
from gpu_checks import check, skip

HERE = os.path.dirname(os.path.abspath(__file__))
SCRIPTS = os.path.join(HERE, "..", "..", "scripts")
STEPS_BEFORE, STEPS_AFTER, WINDOW = 40, 300, 50
WINDOW_TOLERANCE = 0.05  # nats between the two tools' window means
FLOOR_MARGIN = 0.5       # the last window's mean within this of the floor, for both


def run(cmd):
    return gpu_checks.run(cmd, tail=25)


def windows(losses):
    return [sum(losses[i:i + WINDOW]) / WINDOW for i in range(0, len(losses) - WINDOW + 1, WINDOW)]


def crosscheck(workload, bin_dir, tmp, failures):
    binary = os.path.join(bin_dir, f"replay-{workload}")
    common = ["--preset", "tiny", "--graphs", "full", "--dropout", "0", "--data-order", "sequential",
              "--log-interval", "50"]
    ckpt_dir = os.path.join(tmp, workload)
    rc, out = run([binary, *common, "--seed", "11", "--steps", str(STEPS_BEFORE), "--save", ckpt_dir])
    check(rc == 0, f"{workload}: {STEPS_BEFORE} steps and a checkpoint", failures)
    if rc != 0:
        return
    data = re.search(r"^# data: (\S+) \(", out, re.M).group(1)  # the file line, not the flag echo
    ckpt = os.path.join(ckpt_dir, f"step-{STEPS_BEFORE:08d}.safetensors")

    step = os.path.join(tmp, f"{workload}-step.safetensors")
    rc, _ = run([binary, *common, "--steps", "1", "--load", ckpt, "--dump-step", step])
    check(rc == 0, f"{workload}: one step from the checkpoint, dumped", failures)
    grad_json = os.path.join(tmp, f"{workload}-gradcheck.json")
    rc, _ = run([sys.executable, os.path.join(SCRIPTS, "pytorch_baseline.py"), "gradcheck", workload,
                 "--checkpoint", ckpt, "--step", step, "--json", grad_json])
    check(rc == 0, f"{workload}: loss and every gradient agree with PyTorch's (gradcheck)", failures)

    replay_json = os.path.join(tmp, f"{workload}-replay.json")
    rc, _ = run([binary, *common, "--steps", str(STEPS_AFTER), "--load", ckpt, "--json", replay_json])
    check(rc == 0, f"{workload}: replay trains {STEPS_AFTER} steps from the checkpoint", failures)
    torch_json = os.path.join(tmp, f"{workload}-torch.json")
    rc2, _ = run([sys.executable, os.path.join(SCRIPTS, "pytorch_baseline.py"), workload, "--load", ckpt,
                  "--data", data, "--steps", str(STEPS_AFTER), "--warmup", "0", "--graphs", "none",
                  "--json", torch_json])
    check(rc2 == 0, f"{workload}: PyTorch trains {STEPS_AFTER} steps from the checkpoint", failures)
    if rc or rc2:
        return
    with open(replay_json) as f:
        r = json.load(f)
    with open(torch_json) as f:
        t = json.load(f)
    wr, wt = windows(r["losses"]), windows(t["losses"])
    floor = r["loss_floor"]
    print(f"{workload}: window means (replay / torch), floor {floor:.4f}:")
    for i, (a, b) in enumerate(zip(wr, wt)):
        print(f"  steps {STEPS_BEFORE + i * WINDOW:4d}-{STEPS_BEFORE + (i + 1) * WINDOW - 1:4d}: "
              f"{a:.4f} / {b:.4f}  ({a - b:+.4f})")
    worst = max(abs(a - b) for a, b in zip(wr, wt))
    check(worst <= WINDOW_TOLERANCE,
          f"{workload}: the loss curves agree within {WINDOW_TOLERANCE} nats per {WINDOW}-step window "
          f"(worst {worst:.4f})", failures)
    for name, w in (("replay", wr), ("torch", wt)):
        check(w[-1] < w[0] - 0.05 and w[-1] <= floor + FLOOR_MARGIN,
              f"{workload}: {name}'s loss falls toward the floor ({w[0]:.4f} -> {w[-1]:.4f}, floor "
              f"{floor:.4f} + {FLOOR_MARGIN})", failures)
    summary = {"workload": workload, "steps_before": STEPS_BEFORE, "steps_after": STEPS_AFTER,
               "window": WINDOW, "replay_windows": wr, "torch_windows": wt, "worst_window_gap": worst,
               "loss_floor": floor}
    out_dir = os.environ.get("REPLAY_CROSSCHECK_OUT")
    if out_dir:
        os.makedirs(out_dir, exist_ok=True)
        with open(os.path.join(out_dir, f"{workload}-curves.json"), "w") as f:
            json.dump(summary, f, indent=2)
        for src in (grad_json, replay_json, torch_json):
            if os.path.exists(src):
                with open(src) as fi, open(os.path.join(out_dir, os.path.basename(src)), "w") as fo:
                    fo.write(fi.read())


def main():
    try:
        import torch
    except ImportError:
        skip("torch is not importable")
    if not torch.cuda.is_available():
        skip("no CUDA device")
    for module in ("safetensors", "h5py"):
        try:
            __import__(module)
        except ImportError:
            skip(f"{module} is not importable")
    bin_dir = os.environ.get("REPLAY_BIN_DIR", "")
    if not os.path.isfile(os.path.join(bin_dir, "replay-gpt3")):
        skip(f"no replay binaries in REPLAY_BIN_DIR={bin_dir!r}")
    failures = []
    with tempfile.TemporaryDirectory(prefix="replay-crosscheck-") as tmp:
        for workload in ("gpt3", "llama31"):
            crosscheck(workload, bin_dir, tmp, failures)
    if failures:
        print(f"{len(failures)} check(s) failed")
        return 1
    print("all checks passed")
    return 0


if __name__ == "__main__":
    sys.exit(main())
