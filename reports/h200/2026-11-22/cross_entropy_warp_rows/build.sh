#!/usr/bin/env bash
# build.sh [BUILD] [OUT]: builds the cross-entropy forward A/B probe against a configured build folder
# (default build/release; its libreplay_core.a is linked) into OUT (default /tmp/ce_warp_rows).
#
#   OUT/cef_warp_rows  13e5598's cross_entropy.cu ("base", renamed into replay::base) against the same file
#                      with warp_rows.patch applied ("new": one warp a row); output.txt is its output
#   OUT/cef_variants   base against the variants in variants_tu.cu (compiled next to 13e5598's file);
#                      variants_output.txt is its output
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
root=$(git -C "$here" rev-parse --show-toplevel)
build=${1:-build/release}
out=${2:-/tmp/ce_warp_rows}
mkdir -p "$out/common/kernels"
git -C "$root" show 13e5598:common/kernels/cross_entropy.cu > "$out/common/kernels/cross_entropy.cu"
sed -e '0,/^namespace replay {/s//namespace replay { namespace base {/' \
    -e 's|^}  // namespace replay|} }  // namespace replay::base|' \
    "$out/common/kernels/cross_entropy.cu" > "$out/base_ce.cu"
cp "$out/common/kernels/cross_entropy.cu" "$out/new_ce.cu"
patch -s "$out/new_ce.cu" < <(sed -n '/^diff --git a\/common/,/^diff --git a\/tests/p' "$here/warp_rows.patch" | sed '$d')
# The variants include "common/kernels/cross_entropy.cu": found first under OUT (13e5598's copy).
cat > "$out/plain_tu.cu" <<'TU'
#include "new_ce.cu"
namespace replay {
int exp_variants() { return 0; }
const char* exp_name(int) { return ""; }
void exp_forward(int, float*, float*, float*, int32_t*, const __nv_bfloat16*, const int32_t*,
                 const CrossEntropyShape&, cudaStream_t) {}
}  // namespace replay
TU
nv="nvcc -I$out -I$root -O3 -DNDEBUG --generate-code=arch=compute_90a,code=sm_90a --expt-relaxed-constexpr -std=c++17"
libs="$root/$build/common/libreplay_core.a -L/usr/lib/x86_64-linux-gnu/openmpi/lib -L/usr/lib/x86_64-linux-gnu/hdf5/serial -lmpi_cxx -lmpi -lhdf5 -lcudnn -lnccl -lcuda"
$nv -c "$here/main.cu" -o "$out/main.o"
$nv -c "$out/base_ce.cu" -o "$out/base_ce.o"
$nv -c "$out/plain_tu.cu" -o "$out/new_ce.o"
$nv -c "$here/variants_tu.cu" -o "$out/variants.o"
$nv "$out/main.o" "$out/base_ce.o" "$out/new_ce.o" $libs -o "$out/cef_warp_rows"
$nv "$out/main.o" "$out/base_ce.o" "$out/variants.o" $libs -o "$out/cef_variants"
echo "build.sh: probes in $out"
