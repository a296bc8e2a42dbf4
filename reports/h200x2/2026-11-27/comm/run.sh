#!/usr/bin/env bash
# Helper COMM's one call on two H100s (issue 27): the probe's MPI test, the bandwidth sweep and the
# step's sizes; the lead's mpi ctest on the current main build; PyTorch's Megatron TP2 of the GPT-3
# shard eager and graphed; replay-gpt3 TP2 at the PyTorch run's layers if time is left.
set -u
T0=$SECONDS
LIMIT=${LIMIT:-288}
left() { echo $((LIMIT - (SECONDS - T0))); }
tar xJf build/pack/device.tar.xz -C build
tar xJf build/pack-comm/device.tar.xz -C build
[ "$PWD" = /work/main ] || { mkdir -p /work && ln -sfn "$PWD" /work/main; }
rm -rf build/release build/h-comm
ln -sfn "$PWD/build/device" build/release
ln -sfn "$PWD/build/pack-comm-stage" build/h-comm
export PYTHONPATH=$PWD/.deps/python OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
R=$OUT/comm; mkdir -p $R
pack() { tar czf $OUT/comm.tgz -C $OUT comm; }
step() { local name=$1 t=$2; shift 2; local s=$SECONDS l; l=$(left)
  [ "$t" -gt $((l - 8)) ] && t=$((l - 8))
  if [ "$t" -le 5 ]; then echo "$name skipped: no time left" | tee -a $R/summary.txt; return; fi
  echo "+ $*" > $R/$name.log
  timeout -k 5 "$t" "$@" >> $R/$name.log 2>&1; local rc=$?
  echo "$name rc=$rc $((SECONDS - s)) s (limit $t s)" | tee -a $R/summary.txt; pack; }
{ nvidia-smi --query-gpu=name,memory.total,clocks.max.sm,driver_version --format=csv; nvidia-smi topo -m
  env | grep '^NCCL' ; python3 -c 'import torch; print("torch", torch.__version__, "nccl", torch.cuda.nccl.version())'; } > $R/gpus.txt 2>&1
P=build/pack-comm-stage/bin/replay-comm-probe
M="mpiexec -n 2 --oversubscribe"
step probe_mpi_test 60 ctest --test-dir build/h-comm -R test_comm_probe_mpi -V --timeout 60
step probe_sweep 70 $M $P --graph --json $R/probe_sweep.json
step probe_step_sizes 30 $M $P --sizes 48K,48M --dtypes bf16,fp32 --in-place --graph --json $R/probe_step_sizes.json
step lead_ctest_mpi 190 ctest --test-dir build/release -L mpi -V --timeout 240
L=3
for g in full none; do
  step pytorch_tp2_L${L}_$g 50 $M python3 scripts/pytorch_tp.py --tp 2 --preset 175b-tp4 --layers $L \
    --graphs $g --steps 20 --warmup 3 --json $R/pytorch_tp2_L${L}_$g.json
done
for g in full; do
  step replay_tp2_L${L}_$g 45 $M build/release/bin/replay-gpt3 --preset 175b-tp4 --tp 2 --layers $L \
    --graphs $g --steps 20 --seed 1234 --json $R/replay_gpt3_tp2_L${L}_$g.json
done
pack
exit 0
