#!/usr/bin/env bash
# build.sh [BUILD] [OUT]: builds this folder's probes into OUT (default /tmp/cache_hints) against a configured build
# folder BUILD (default build/main; its libreplay_kernels.a and libreplay_core.a are linked). The kernels are
# 2827a1d's (before the cache-hint change), variants made by this folder's scripts:
#   OUT/copy_probe                    copy structures and cudaMemcpyAsync at 2 x 50 MB (copy_probe.cu)
#   OUT/dbits_{base,bits16,stcs,plain,bits16_stcs}
#                                     dropout as at 2827a1d; 16 random bits an element (bits16.py); __stcs stores;
#                                     plain loads; both
#   OUT/dbits_short_r<R>_l<L>_s<S>    dropout backward in short blocks of 32 packs x L lanes, R rows a thread,
#                                     S = 1 for __stcs stores (short_blocks.py)
#   OUT/dbits_short_{late,byval}      R 4, L 8, S 1 with the Philox stream built after the loads, or (a diagnostic)
#                                     with the seed by value instead of read from the RNG slot
#   OUT/d_<ld><st>_<bits>[_b<n>]      dropout with the loads and stores of hints.py (ld 0 plain 1 cs 2 cg 3 lu 4 nc;
#                                     st 0 plain 1 cs 2 cg 3 wb), 32 or 16 random bits, n rows a batch
#   OUT/c_<ld><st>                    cross-entropy with the loads and stores of hints.py
#   OUT/dtree, OUT/dcoop{2,1}         83d9b60's dropout, and with dbias summed after a grid barrier (grid_barrier.py)
# Each dropout probe runs dropout_main.cu, each cross-entropy probe ce_main.cu.
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
root=$(git -C "$here" rev-parse --show-toplevel)
build=${1:-build/main}
out=${2:-/tmp/cache_hints}
mkdir -p "$out"
cd "$root"
nv="nvcc -I$root -O3 -DNDEBUG --generate-code=arch=compute_90a,code=sm_90a --expt-relaxed-constexpr -std=c++17"
libs="$root/$build/common/libreplay_kernels.a $root/$build/common/libreplay_core.a -L/usr/lib/x86_64-linux-gnu/openmpi/lib -L/usr/lib/x86_64-linux-gnu/hdf5/serial -lmpi_cxx -lmpi -lhdf5 -lcudnn -lnccl -lcuda"
git show 2827a1d:common/kernels/dropout.cu > "$out/dropout_2827a1d.cu"
git show 2827a1d:common/kernels/cross_entropy.cu > "$out/cross_entropy_2827a1d.cu"
src=$out/dropout_2827a1d.cu
$nv "$here/copy_probe.cu" -o "$out/copy_probe"
$nv -c "$here/dropout_main.cu" -o "$out/dmain.o"
$nv -c "$here/ce_main.cu" -o "$out/cmain.o"
link_d() { $nv -c "$out/$2.cu" $3 -o "$out/$1.o" && $nv "$out/dmain.o" "$out/$1.o" $libs -o "$out/$1"; }
link_c() { $nv -c "$out/$2.cu" $3 -o "$out/$1.o" && $nv "$out/cmain.o" "$out/$1.o" $libs -o "$out/$1"; }
# 16 random bits, store and load variants by sed, short blocks
stcs='s/o\.store(\([a-z]*\) + (r0 + u) \* C + p \* 8);/__stcs(reinterpret_cast<int4*>(\1 + (r0 + u) * C + p * 8), *reinterpret_cast<const int4*>(o.v));/'
cp "$src" "$out/v_base.cu"
python3 "$here/bits16.py" "$src" "$out/v_bits16.cu"
sed "$stcs" "$src" > "$out/v_stcs.cu"
sed 's/load_cs(/load(/g' "$src" > "$out/v_plain.cu"
sed "$stcs" "$out/v_bits16.cu" > "$out/v_bits16_stcs.cu"
for v in base bits16 stcs plain bits16_stcs; do link_d dbits_$v v_$v ""; done
python3 "$here/short_blocks.py" "$src" "$out/v_short.cu"
for cfg in "4 8 0" "4 8 1" "2 16 1" "1 32 1" "4 16 1" "2 8 1" "8 4 1"; do
  set -- $cfg
  link_d dbits_short_r$1_l$2_s$3 v_short "-DKR=$1 -DKL=$2 -DKST=$3"
done
for m in late byval; do  # the Philox stream built after the loads; a diagnostic that never reads the RNG slot
  python3 "$here/short_blocks.py" "$src" "$out/v_short_$m.cu" $m
  link_d dbits_short_$m v_short_$m "-DKR=4 -DKL=8 -DKST=1"
done
# the load/store hint matrix
python3 "$here/hints.py" dropout "$src" "$out/h32.cu"
python3 "$here/hints.py" dropout "$out/v_bits16.cu" "$out/h16.cu"
python3 "$here/hints.py" ce "$out/cross_entropy_2827a1d.cu" "$out/hc.cu"
for l in 0 1 2 3 4; do for s in 0 1 2 3; do
  link_d d_$l${s}_32 h32 "-DLDH=$l -DSTH=$s"
  link_c c_$l$s hc "-DLDH=$l -DSTH=$s"
done; done
for p in "0 0" "1 1" "0 1" "2 2" "1 2" "2 0" "4 0"; do set -- $p; link_d d_$1$2_16 h16 "-DLDH=$1 -DSTH=$2"; done
for b in 2 3; do
  sed "s/constexpr int kBwdRowBatch = 4;/constexpr int kBwdRowBatch = $b;/" "$out/h32.cu" > "$out/h32_b$b.cu"
  link_d d_20_32_b$b h32_b$b "-DLDH=2 -DSTH=0"
done
# 83d9b60's dropout (.cg loads) as it is (dtree) and with dbias finished after a grid barrier (grid_barrier.py):
# dcoop2 launched cooperative and as a programmatic dependent, dcoop1 cooperative only
git show 83d9b60:common/kernels/dropout.cu > "$out/dropout_83d9b60.cu"
link_d dtree dropout_83d9b60 ""
python3 "$here/grid_barrier.py" "$out/dropout_83d9b60.cu" "$out/v_coop.cu"
for a in 2 1; do link_d dcoop$a v_coop "-DCOOP_ATTRS=$a"; done
echo "build.sh: probes in $out"
