#!/usr/bin/env bash
# series.sh: the Llama fc1/fc2 GEMMs' per-call times (samples_ms) from replay-ops and the PyTorch baseline,
# taking turns, at the suite's protocol (10 warm-up calls, 50 ms idle lead, 50 timed calls) and with 200
# timed calls. Run from the repository root on the GPU machine, with the build in build/main:
#   bash reports/h200/2026-11-22/clocks_and_cudnn/series.sh OUT_DIR
set -euo pipefail
out=${1:?usage: series.sh OUT_DIR}
bin=build/main/bin
only='llama31.*(fc1|fc2)'
mkdir -p "$out"
for round in 1 2 3; do
  for repeats in 50 200; do
    "$bin/replay-ops" --only "$only" --warmup 10 --repeats $repeats --lead-ms 50 \
      --json "$out/replay_r${repeats}_$round.json" > "$out/replay_r${repeats}_$round.log" 2>&1
    python3 scripts/pytorch_baseline.py ops --only "$only" --warmup 10 --repeats $repeats --lead-ms 50 \
      --json "$out/torch_r${repeats}_$round.json" > "$out/torch_r${repeats}_$round.log" 2>&1
  done
  echo "series.sh: round $round done"
done
