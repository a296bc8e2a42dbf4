#!/usr/bin/env bash
# build.sh [BUILD] [OUT]: builds the cross-entropy layout probes against a configured build folder
# (default build/release; its libreplay_core.a is linked) into OUT (default /tmp/ce_layouts).
#
#   OUT/flat   flat.cu: grid-stride reads of the logits with a trivial xor, with the statistics' math,
#              and with the math but no exps, next to 14bf607's statistics and forward
#   OUT/rows   rows.cu: a block a row of 64, 128 or 256 threads walking the row with 2, 4 or 8
#              packs a thread, with the one-block mean or with a ticket (the last block sums)
#   OUT/rows2  rows2.cu: the same without the block barrier, persistent blocks, and the grid-stride
#              read with one block reduction at its end
#   OUT/ab     ab/: 14bf607's cross_entropy.cu ("base") against 3a0fc0c's ("new", the long-row layout,
#              reverted after it) and the variants in ab/new_tu.cu; ab/output.txt (H200) and
#              ab/output_h100.txt
# The probes that call replay's cross-entropy are linked with 14bf607's file, not the tree's.
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
root=$(git -C "$here" rev-parse --show-toplevel)
build=${1:-build/release}
out=${2:-/tmp/ce_layouts}
mkdir -p "$out"
git -C "$root" show 14bf607:common/kernels/cross_entropy.cu > "$out/ce_14bf607.cu"
sed -e '0,/^namespace replay {/s//namespace replay { namespace base {/' \
    -e 's|^}  // namespace replay|} }  // namespace replay::base|' \
    "$out/ce_14bf607.cu" > "$out/base_ce.cu"
nv="nvcc -I$root -O3 -DNDEBUG --generate-code=arch=compute_90a,code=sm_90a --expt-relaxed-constexpr -std=c++17"
libs="$root/$build/common/libreplay_core.a -L/usr/lib/x86_64-linux-gnu/openmpi/lib -L/usr/lib/x86_64-linux-gnu/hdf5/serial -lmpi_cxx -lmpi -lhdf5 -lcudnn -lnccl -lcuda"
cp "$out/ce_14bf607.cu" "$out/ce_14bf607_tu.cu"
# ab/new_tu.cu includes "common/kernels/cross_entropy.cu": found first under OUT/new (3a0fc0c's).
mkdir -p "$out/new/common/kernels"
git -C "$root" show 3a0fc0c:common/kernels/cross_entropy.cu > "$out/new/common/kernels/cross_entropy.cu"
$nv -c "$out/ce_14bf607_tu.cu" -o "$out/ce_14bf607.o"
for p in flat rows rows2; do
  $nv -c "$here/$p.cu" -o "$out/$p.o"
  $nv "$out/$p.o" "$out/ce_14bf607.o" $libs -o "$out/$p"
done
$nv -c "$here/ab/main.cu" -o "$out/ab_main.o"
$nv -c "$out/base_ce.cu" -o "$out/ab_base.o"
${nv/-I$root/-I$out/new -I$root} -c "$here/ab/new_tu.cu" -o "$out/ab_new.o"
$nv "$out/ab_main.o" "$out/ab_base.o" "$out/ab_new.o" $libs -o "$out/ab"
echo "build.sh: probes in $out"
