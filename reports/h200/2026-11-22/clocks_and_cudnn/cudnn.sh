#!/usr/bin/env bash
# Ran on the GPU machine from the repository root, with the staged build in build/main; prints its table
# and leaves its JSON and logs under /tmp (tarred into $OUT), copied here into output/.
# Which cuDNN / cuBLASLt the device's PyTorch uses, and replay's attention (and fc2 GEMMs) on them.
export PYTHONPATH=$PWD/.deps/python
bin=build/main/bin
mkdir -p /tmp/p
nvidia-smi --query-gpu=name,clocks.max.sm,power.limit --format=csv,noheader
sp=$(python3 -c "import torch, os; print(os.path.dirname(os.path.dirname(torch.__file__)))")
echo "site-packages: $sp"
ls $sp/nvidia 2>&1 | tr '\n' ' '; echo
ls -la $sp/nvidia/cudnn/lib $sp/nvidia/cublas/lib 2>&1 | head -30
python3 -c "import torch; print('torch cudnn', torch.backends.cudnn.version(), 'cublas', torch.version.cuda)"
ldd $bin/replay-ops | grep -E "cudnn|cublas"
CUDNN=$sp/nvidia/cudnn/lib
CUBLAS=$sp/nvidia/cublas/lib
echo "with torch's cuDNN:"; LD_LIBRARY_PATH=$CUDNN ldd $bin/replay-ops | grep -E "cudnn|cublas"
t0=$(date +%s)
for round in 1 2 3; do
  $bin/replay-ops --only attention --warmup 10 --repeats 50 --json /tmp/p/sys_det_$round.json > /tmp/p/sys_det_$round.log 2>&1
  LD_LIBRARY_PATH=$CUDNN $bin/replay-ops --only attention --warmup 10 --repeats 50 --json /tmp/p/t_det_$round.json > /tmp/p/t_det_$round.log 2>&1
  $bin/replay-ops --only attention --attention-nondeterministic --warmup 10 --repeats 50 --json /tmp/p/sys_nd_$round.json > /tmp/p/sys_nd_$round.log 2>&1
  LD_LIBRARY_PATH=$CUDNN $bin/replay-ops --only attention --attention-nondeterministic --warmup 10 --repeats 50 --json /tmp/p/t_nd_$round.json > /tmp/p/t_nd_$round.log 2>&1
  python3 scripts/pytorch_baseline.py ops --only attention --warmup 10 --repeats 50 --json /tmp/p/torch_$round.json > /tmp/p/torch_$round.log 2>&1
  echo "round $round done at $(( $(date +%s) - t0 )) s"
done
for round in 1 2; do
  $bin/replay-ops --only 'llama31.*fc2' --warmup 10 --repeats 50 --json /tmp/p/sys_fc2_$round.json > /tmp/p/sys_fc2_$round.log 2>&1
  LD_LIBRARY_PATH=$CUBLAS:$CUDNN $bin/replay-ops --only 'llama31.*fc2' --warmup 10 --repeats 50 --json /tmp/p/t_fc2_$round.json > /tmp/p/t_fc2_$round.log 2>&1
  python3 scripts/pytorch_baseline.py ops --only 'llama31.*fc2' --warmup 10 --repeats 50 --json /tmp/p/torch_fc2_$round.json > /tmp/p/torch_fc2_$round.log 2>&1
  echo "fc2 round $round done at $(( $(date +%s) - t0 )) s"
done
python3 - <<'PY'
import json, glob, os
for f in sorted(glob.glob('/tmp/p/*.json')):
    d = json.load(open(f))
    env = d.get('environment', {})
    vers = {k: env.get(k) for k in ('cudnn', 'cublaslt') if k in env}
    rows = [f"{r['name'].split('.',1)[0][:5]}.{r['name'].split('.',1)[1]}={r.get('median_ms')}" for r in d['results']]
    print(os.path.basename(f), vers, ' '.join(rows))
PY
start=$(date +%s)
LD_LIBRARY_PATH=$CUDNN timeout 200 ctest --test-dir build/main -L gpu --output-on-failure > /tmp/p/ctest_gpu_torch_cudnn.txt 2>&1; echo "ctest (torch cuDNN) rc=$? took $(( $(date +%s) - start )) s"; tail -3 /tmp/p/ctest_gpu_torch_cudnn.txt
tar czf $OUT/p.tgz -C /tmp p
