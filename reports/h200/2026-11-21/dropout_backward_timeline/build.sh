#!/usr/bin/env bash
# build.sh [BUILD] [OUT]: builds the dropout backward timeline probe against a configured build folder
# (default build/release; its libreplay_core.a is linked) into OUT (default /tmp/dropout_timeline): dropout.cu
# as of c8c990b with dropout_timeline.patch applied, as in the tree (drtl_base) and with other row runs a
# block and rows a batch, and with an L2 prefetch of the rows ahead (PF):
#
#   OUT/drtl_<variant> [rows] [C]      rows and C default to 2048 x 12288 (the GPT-3 175B TP4 shard)
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
root=$(git -C "$here" rev-parse --show-toplevel)
build=${1:-build/release}
out=${2:-/tmp/dropout_timeline}
mkdir -p "$out"
git -C "$root" show c8c990b:common/kernels/dropout.cu > "$out/dropout_timed.cu"
patch -s "$out/dropout_timed.cu" < "$here/dropout_timeline.patch"
nv="nvcc -I$root -O3 -DNDEBUG --generate-code=arch=compute_90a,code=sm_90a --expt-relaxed-constexpr -std=c++17"
libs="$root/$build/common/libreplay_core.a -L/usr/lib/x86_64-linux-gnu/openmpi/lib -L/usr/lib/x86_64-linux-gnu/hdf5/serial -lmpi_cxx -lmpi -lhdf5 -lcudnn -lnccl -lcuda"
$nv -c "$here/main.cu" -o "$out/main.o"
variant() {  # variant NAME LANES BATCH PF: kBwdLanes row runs a block, kBwdRowBatch rows a batch, L2 prefetch
  sed -e "s/constexpr int kBwdLanes = 4;/constexpr int kBwdLanes = $2;/" \
      -e "s/constexpr int kBwdRowBatch = 4;/constexpr int kBwdRowBatch = $3;/" "$out/dropout_timed.cu" > "$out/dt_$1.cu"
  $nv -DPF="$4" -c "$out/dt_$1.cu" -o "$out/dt_$1.o"
  $nv "$out/main.o" "$out/dt_$1.o" $libs -o "$out/drtl_$1"
}
variant base 4 4 0   # as in the tree: 1024 threads a block, 4 rows a batch
variant l3_b6 3 6 0  # 768 threads, 6 rows a batch (80 registers)
variant l3_b8 3 8 0  # 768 threads, 8 rows a batch (spills)
variant l2_b8 2 8 0  # 512 threads, 8 rows a batch (122 registers)
variant pf1 4 4 1    # as in the tree, plus a bulk L2 prefetch of each lane's rows 1 batch ahead
variant pf2 4 4 2    # ... 2 batches ahead
variant pf3 4 4 3    # ... 3 batches ahead
echo "build.sh: probes in $out"
