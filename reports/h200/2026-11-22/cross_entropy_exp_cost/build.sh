#!/usr/bin/env bash
# build.sh [BUILD] [OUT]: builds the cross-entropy exp-cost probe against a configured build folder
# (default build/release; its libreplay_core.a is linked) into OUT (default /tmp/ce_exp_cost): 13e5598's
# cross_entropy.cu five times, each in its own namespace (replay::e0 .. e4), with the statistics kernel's
# exp of each logit replaced by EXP_TERM from exp_term.cuh under EXP_MODE 0 .. 4, linked with main.cu.
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
root=$(git -C "$here" rev-parse --show-toplevel)
build=${1:-build/release}
out=${2:-/tmp/ce_exp_cost}
mkdir -p "$out"
git -C "$root" show 13e5598:common/kernels/cross_entropy.cu > "$out/ce_head.cu"
nv="nvcc -I$root -I$here -O3 -DNDEBUG --generate-code=arch=compute_90a,code=sm_90a --expt-relaxed-constexpr -std=c++17"
libs="$root/$build/common/libreplay_core.a -L/usr/lib/x86_64-linux-gnu/openmpi/lib -L/usr/lib/x86_64-linux-gnu/hdf5/serial -lmpi_cxx -lmpi -lhdf5 -lcudnn -lnccl -lcuda"
objs=()
for n in 0 1 2 3 4; do
  {
    printf '#define EXP_MODE %d\n#include "exp_term.cuh"\n' "$n"
    sed -e "0,/^namespace replay {/s//namespace replay { namespace e$n {/" \
        -e "s|^}  // namespace replay|} }  // namespace replay::e$n|" \
        -e 's|sums\[k % 4\] += exp2_approx(fmaf(v\[k\], kLog2e, -m_log2));|sums[k % 4] += EXP_TERM(v[k], m_log2, k);|' \
        "$out/ce_head.cu"
  } > "$out/e$n.cu"
  grep -q EXP_TERM "$out/e$n.cu" || { echo "build.sh: the exp line of cross_entropy.cu was not found" >&2; exit 1; }
  $nv -c "$out/e$n.cu" -o "$out/e$n.o"
  objs+=("$out/e$n.o")
done
$nv -c "$here/main.cu" -o "$out/main.o"
$nv "$out/main.o" "${objs[@]}" $libs -o "$out/ce_exp_cost"
echo "build.sh: $out/ce_exp_cost"
