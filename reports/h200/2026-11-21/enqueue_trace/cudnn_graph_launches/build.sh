# Builds probe.cpp against a configured replay build (default build/release), from the project root:
#   bash reports/h200/2026-11-21/enqueue_trace/cudnn_graph_launches/build.sh [BUILD] [OUT]
set -euo pipefail
build=${1:-build/release}
out=${2:-$build/bin/cudnn-graph-launch-probe}
dir=$(dirname "$0")
g++ -std=c++17 -O2 -I. -I/usr/local/cuda/include -c "$dir/probe.cpp" -o "$out.o"
/usr/local/cuda/bin/nvcc "$out.o" "$build"/common/libreplay_attention.a "$build"/common/libreplay_kernels.a \
  "$build"/common/libreplay_gemm.a "$build"/common/libreplay_core.a \
  -L/usr/lib/x86_64-linux-gnu/openmpi/lib -L/usr/lib/x86_64-linux-gnu/hdf5/serial \
  -lcublasLt -lnvrtc -lmpi_cxx -lmpi -lhdf5 -lcudnn -lnccl -lcuda -o "$out"
rm -f "$out.o"
echo "$out"
