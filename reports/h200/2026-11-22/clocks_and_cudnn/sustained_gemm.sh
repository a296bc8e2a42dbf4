#!/usr/bin/env bash
# Ran on the GPU machine from the repository root, with the staged build in build/main; prints its table
# and leaves its JSON and logs under /tmp (tarred into $OUT), copied here into output/.
# fc GEMMs under three warm-up protocols, replay and PyTorch taking turns.
export PYTHONPATH=$PWD/.deps/python
bin=build/main/bin
mkdir -p /tmp/s
t0=$(date +%s)
only='llama31.*(fc1|fc2|proj)'
for round in 1 2; do
  for cfg in "10 50" "100 0" "250 0"; do
    set -- $cfg
    $bin/replay-ops --only "$only" --warmup $1 --repeats 50 --lead-ms $2 --json /tmp/s/replay_w$1_l$2_$round.json > /tmp/s/replay_w$1_l$2_$round.log 2>&1
    python3 scripts/pytorch_baseline.py ops --only "$only" --warmup $1 --repeats 50 --lead-ms $2 --json /tmp/s/torch_w$1_l$2_$round.json > /tmp/s/torch_w$1_l$2_$round.log 2>&1
    echo "round $round cfg $cfg done at $(( $(date +%s) - t0 )) s"
  done
done
python3 - <<'PY'
import json, glob, os
for f in sorted(glob.glob('/tmp/s/*.json'), key=lambda f: (f.split('_w')[1], f)):
    d = json.load(open(f))
    print(os.path.basename(f)[:-5].ljust(22), ' '.join(f"{r['name'].split('.',1)[1]}={r['p10_ms']:.3f}/{r['median_ms']:.3f}/{r['p90_ms']:.3f}" for r in d['results']))
PY
tar czf $OUT/s.tgz -C /tmp s
