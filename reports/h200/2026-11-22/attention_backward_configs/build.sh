#!/usr/bin/env bash
# build.sh [OUT]: builds attn_knobs (OUT, default /tmp/attn_knobs) against the cuDNN frontend headers the project
# stages (.deps/cudnn-frontend) and the toolkit's cuDNN.   usage: attn_knobs <kv heads> <deterministic 0|1> <budget s>
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
root=$(git -C "$here" rev-parse --show-toplevel)
out=${1:-/tmp/attn_knobs}
g++ -O1 -std=c++17 -w -DCUDNN_FRONTEND_SKIP_JSON_LIB -I"$root/.deps/cudnn-frontend/include" -I/usr/local/cuda/include \
  "$here/attn_knobs.cpp" -o "$out" -L/usr/local/cuda/lib64 -lcudart -lcudnn -lnvrtc -lcuda -ldl
echo "build.sh: $out"
