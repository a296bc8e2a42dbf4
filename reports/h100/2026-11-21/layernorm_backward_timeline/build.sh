#!/usr/bin/env bash
# build.sh [BUILD] [OUT]: builds the LayerNorm backward timeline probe against a configured build folder
# (default build/release; its libreplay_core.a is linked) into OUT (default /tmp/ln_timeline): norms.cu as
# of afb3429 with norms_timeline.patch applied, once per variant below, each linked with main.cu.
#
#   OUT/lntl_<variant> [rows] [C] [0|1|2]   rows and C default to 2048 x 12288 (the GPT-3 175B TP4 shard);
#                                           the last argument: 0 as in the tree, 1 no cluster (every block
#                                           writes its own partial row), 2 the cluster's distributed
#                                           shared memory loads all issued before the adds
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
root=$(git -C "$here" rev-parse --show-toplevel)
build=${1:-build/release}
out=${2:-/tmp/ln_timeline}
mkdir -p "$out"
git -C "$root" show afb3429:common/kernels/norms.cu > "$out/norms_timed.cu"
patch -s "$out/norms_timed.cu" < "$here/norms_timeline.patch"
nv="nvcc -I$root -O3 -DNDEBUG --generate-code=arch=compute_90a,code=sm_90a --expt-relaxed-constexpr -std=c++17"
libs="$root/$build/common/libreplay_core.a -L/usr/lib/x86_64-linux-gnu/openmpi/lib -L/usr/lib/x86_64-linux-gnu/hdf5/serial -lmpi_cxx -lmpi -lhdf5 -lcudnn -lnccl -lcuda"
$nv -c "$here/main.cu" -o "$out/main.o"
variant() {  # variant NAME MACROS...
  local name=$1; shift
  $nv "$@" -c "$out/norms_timed.cu" -o "$out/nt_$name.o"
  $nv "$out/main.o" "$out/nt_$name.o" $libs -o "$out/lntl_$name"
}
variant base
variant store_cs -DSTORE_HINT=1                    # dx stores st.global.cs
variant store_evict_first -DSTORE_HINT=2           # dx stores with an L2 evict_first policy
variant partials_evict_last -DPARTIAL_HINT=1       # partial stores with an L2 evict_last policy
variant discard -DCS_DISCARD=1                     # column_sums discards the partials' L2 lines
variant evict_last_discard -DPARTIAL_HINT=1 -DCS_DISCARD=1
variant evict_last_loads_evict_first -DPARTIAL_HINT=1 -DCS_LOAD_HINT=1
echo "build.sh: probes in $out"
