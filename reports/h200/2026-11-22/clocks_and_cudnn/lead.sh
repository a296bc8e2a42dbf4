#!/usr/bin/env bash
# Ran on the GPU machine from the repository root, with the staged build in build/main; prints its table
# and leaves its JSON and logs under /tmp (tarred into $OUT), copied here into output/.
export PYTHONPATH=$PWD/.deps/python
bin=build/main/bin
mkdir -p /tmp/l
t0=$(date +%s)
only='llama31.*(fc1|fc2)'
for round in 1 2; do
  for lead in 50 300 1000; do
    $bin/replay-ops --only "$only" --warmup 10 --repeats 50 --lead-ms $lead --json /tmp/l/replay_l${lead}_$round.json > /tmp/l/replay_l${lead}_$round.log 2>&1
    python3 scripts/pytorch_baseline.py ops --only "$only" --warmup 10 --repeats 50 --lead-ms $lead --json /tmp/l/torch_l${lead}_$round.json > /tmp/l/torch_l${lead}_$round.log 2>&1
    echo "round $round lead $lead done at $(( $(date +%s) - t0 )) s"
  done
done
python3 - <<'PY'
import json, glob, os
for f in sorted(glob.glob('/tmp/l/*.json'), key=lambda f: (int(f.split('_l')[1].split('_')[0]), f)):
    d = json.load(open(f))
    print(os.path.basename(f)[:-5].ljust(18), ' '.join(f"{r['name'].split('.',1)[1]}={r['p10_ms']:.3f}/{r['median_ms']:.3f}/{r['p90_ms']:.3f}" for r in d['results']))
PY
tar czf $OUT/l.tgz -C /tmp l
