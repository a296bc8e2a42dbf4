#!/usr/bin/env bash
# build_ops.sh [OUT]: the replay-ops binaries of the side-by-side runs (output/ops_ab_*), each built in one scratch
# worktree of this repository (configured with the project's preset defaults) into OUT (default /tmp/cache_hints_ops):
#   replay-ops-O  2827a1d: streaming loads with plain stores everywhere
#   replay-ops-A  O + dropout loads through L2 only (.cg) + cross-entropy backward streaming stores
#   replay-ops-B  9659982 = A + streaming stores in the norms (forward and backward) and SwiGLU/GeLU
#                 (the H100 runs call it N)
#   replay-ops-C  A + L2-only loads (.cg) in the norms and SwiGLU/GeLU, plain stores
# The tree's kernels are 83d9b60's: B with plain stores again in the norm backward.
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
root=$(git -C "$here" rev-parse --show-toplevel)
out=${1:-/tmp/cache_hints_ops}
wt=$out/worktree
mkdir -p "$out"
[ -d "$wt" ] || git -C "$root" worktree add --detach "$wt" 2827a1d
[ -d "$wt/.deps" ] || ln -s "$root/.deps" "$wt/.deps"
[ -f "$out/build/build.ninja" ] || cmake -S "$wt" -B "$out/build" -G Ninja -DCMAKE_BUILD_TYPE=Release > /dev/null
variant() {  # variant NAME COMMIT [SED-ON-NORMS SED-ON-ACTIVATIONS]
  git -C "$wt" checkout -q --detach "$2"
  if [ $# -gt 2 ]; then sed -i "$3" "$wt/common/kernels/norms.cu"; sed -i "$4" "$wt/common/kernels/activations.cu"; fi
  ninja -C "$out/build" bin/replay-ops > /dev/null
  cp "$out/build/bin/replay-ops" "$out/replay-ops-$1"
  git -C "$wt" checkout -q -- .
}
undo_norms='s|__stcs(reinterpret_cast<uint4\*>(row) + p, \*reinterpret_cast<const uint4\*>(v.w));|reinterpret_cast<uint4*>(row)[p] = *reinterpret_cast<const uint4*>(v.w);|'
undo_act='s/\.store_cs(/.store(/g'
variant O 2827a1d
variant B 9659982
variant A 9659982 "$undo_norms" "$undo_act"
variant C 9659982 "$undo_norms; s|__ldcs(reinterpret_cast<const uint4\*>(row) + p)|__ldcg(reinterpret_cast<const uint4*>(row) + p)|" "$undo_act; s/PackBF16::load_cs(/PackBF16::load_cg(/g"
echo "build_ops.sh: replay-ops-{O,A,B,C} in $out"
