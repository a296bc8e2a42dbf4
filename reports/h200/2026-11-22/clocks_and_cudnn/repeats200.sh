#!/usr/bin/env bash
# repeats200.sh: the suite's op rounds (replay-ops, then the PyTorch baseline, three times; each op keeps its
# best median) with 200 timed calls per op instead of 50, then scripts/report.py. Run from the repository
# root on the GPU machine, with the build in build/main:
#   bash reports/h200/2026-11-22/clocks_and_cudnn/repeats200.sh OUT_DIR
set -euo pipefail
out=${1:?usage: repeats200.sh OUT_DIR}
bin=build/main/bin
mkdir -p "$out/rounds"
for round in 1 2 3; do
  t0=$(date +%s)
  "$bin/replay-ops" --warmup 10 --repeats 200 --json "$out/rounds/replay_ops_$round.json" \
    > "$out/rounds/replay_ops_$round.log" 2>&1
  t1=$(date +%s)
  python3 scripts/pytorch_baseline.py ops --warmup 10 --repeats 200 --json "$out/rounds/pytorch_ops_$round.json" \
    > "$out/rounds/pytorch_ops_$round.log" 2>&1
  echo "repeats200.sh: round $round: replay-ops $((t1 - t0)) s, PyTorch $(( $(date +%s) - t1 )) s"
done
# best_of and the report, as scripts/bench.sh does them
out=$out have_torch=1 bash -c 'source <(sed -n "/^best_of() {/,/^}/p" scripts/bench.sh)
  for tool in replay pytorch; do best_of "$out/${tool}_ops.json" "$out"/rounds/${tool}_ops_[0-9]*.json; done'
python3 scripts/report.py ops --replay "$out/replay_ops.json" --pytorch "$out/pytorch_ops.json" --out "$out"
