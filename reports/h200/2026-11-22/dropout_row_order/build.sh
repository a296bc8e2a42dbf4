#!/usr/bin/env bash
# build.sh [BUILD] [OUT]: the row-order probes into OUT (default /tmp/dropout_row_order), linked against a configured
# build folder BUILD (default build/main). Each is 6300d1b's dropout.cu rewritten by row_order.py and timed by
# ../cache_hints/dropout_main.cu (the suite's stream protocol):
#   OUT/ro_<order>_w<waves>   ROW_ORDER 0 (as it is), 1 (even contiguous runs), 2 (interleaved runs); grids of
#                             1, 2 or 3 waves of resident blocks
#   OUT/ro_<order>_w1_t       the same with dbias summed by the tile's last block (TICKET=1), not by column_sums
#   OUT/slab_<S>_<T>          the backward in column slabs of S packs, T threads a block (slabs.py on ROW_ORDER 2)
#   OUT/cl_<K>_<S>_<T>        slabs of S packs shared by clusters of K blocks of T threads (clusters.py on ROW_ORDER 2)
#   OUT/tree                  the dropout of BUILD's library (the tree's, rows interleaved since 6300d1b)
#   OUT/ring_<S>_<B>          da4f0ab's dropout with the backward's loads staged by cp.async, S stages of B rows
#                             (ring.py); ring_<S>_<B>_ph1 with the masks drawn after the wait
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
root=$(git -C "$here" rev-parse --show-toplevel)
build=${1:-build/main}
out=${2:-/tmp/dropout_row_order}
mkdir -p "$out"
cd "$root"
nv="nvcc -I$root -I$here/../cache_hints -O3 -DNDEBUG --generate-code=arch=compute_90a,code=sm_90a --expt-relaxed-constexpr -std=c++17"
libs="$root/$build/common/libreplay_kernels.a $root/$build/common/libreplay_core.a -L/usr/lib/x86_64-linux-gnu/openmpi/lib -L/usr/lib/x86_64-linux-gnu/hdf5/serial -lmpi_cxx -lmpi -lhdf5 -lcudnn -lnccl -lcuda"
git show 6300d1b:common/kernels/dropout.cu > "$out/dropout_6300d1b.cu"
python3 "$here/row_order.py" "$out/dropout_6300d1b.cu" "$out/v.cu"
$nv -c "$here/../cache_hints/dropout_main.cu" -o "$out/dmain.o"
for cfg in "0 1" "1 1" "2 1" "1 2" "2 2" "1 3"; do
  set -- $cfg
  $nv -c "$out/v.cu" -DROW_ORDER=$1 -DWAVES=$2 -o "$out/ro_$1_w$2.o"
  $nv "$out/dmain.o" "$out/ro_$1_w$2.o" $libs -o "$out/ro_$1_w$2"
done
for o in 0 2; do
  $nv -c "$out/v.cu" -DROW_ORDER=$o -DTICKET=1 -o "$out/ro_${o}_w1_t.o"
  $nv "$out/dmain.o" "$out/ro_${o}_w1_t.o" $libs -o "$out/ro_${o}_w1_t"
done
python3 "$here/slabs.py" "$out/v.cu" "$out/v_slab.cu"
for cfg in "12 1020" "6 510" "16 1024"; do
  set -- $cfg
  $nv -c "$out/v_slab.cu" -DROW_ORDER=2 -DSLAB=$1 -DSLAB_THREADS=$2 -o "$out/slab_$1_$2.o"
  $nv "$out/dmain.o" "$out/slab_$1_$2.o" $libs -o "$out/slab_$1_$2"
done
python3 "$here/clusters.py" "$out/v.cu" "$out/v_cl.cu"
for cfg in "8 96 960" "4 48 1008" "2 24 1008"; do
  set -- $cfg
  $nv -c "$out/v_cl.cu" -DROW_ORDER=2 -DCL=$1 -DCL_S=$2 -DCL_T=$3 -o "$out/cl_$1_$2_$3.o"
  $nv "$out/dmain.o" "$out/cl_$1_$2_$3.o" $libs -o "$out/cl_$1_$2_$3"
done
$nv "$out/dmain.o" $libs -o "$out/tree"
git show da4f0ab:common/kernels/dropout.cu > "$out/dropout_da4f0ab.cu"
python3 "$here/ring.py" "$out/dropout_da4f0ab.cu" "$out/v_ring.cu"
for cfg in "2 4" "3 4" "3 2" "4 2"; do
  set -- $cfg
  $nv -c "$out/v_ring.cu" -DSTAGES=$1 -DRB=$2 -o "$out/ring_$1_$2.o"
  $nv "$out/dmain.o" "$out/ring_$1_$2.o" $libs -o "$out/ring_$1_$2"
done
for cfg in "2 4" "3 4"; do
  set -- $cfg
  $nv -c "$out/v_ring.cu" -DSTAGES=$1 -DRB=$2 -DPH=1 -o "$out/ring_$1_$2_ph1.o"
  $nv "$out/dmain.o" "$out/ring_$1_$2_ph1.o" $libs -o "$out/ring_$1_$2_ph1"
done
echo "build.sh: probes in $out"
