#!/usr/bin/env bash
# test.sh: set up what is missing, configure, build everything (every .cu compiles), run CTest.
# Exits non-zero on any failure. Without a GPU, GPU tests exit 77 and CTest counts them as skipped.
#
#   scripts/test.sh                 all tests
#   scripts/test.sh -L gpu          CTest arguments pass through (here: only GPU tests)
#
# Environment: REPLAY_BUILD_DIR (default build/release), REPLAY_JOBS (default: all cores),
#              REPLAY_SKIP_SETUP=1 to skip scripts/setup.sh (the GPU machine, where nothing installs).
set -euo pipefail
cd "$(dirname "$0")/.."

build_dir=${REPLAY_BUILD_DIR:-build/release}
jobs=${REPLAY_JOBS:-$(nproc)}

[ "${REPLAY_SKIP_SETUP:-0}" = 1 ] || scripts/setup.sh

start=$(date +%s)
mkdir -p "$build_dir"
cmake -S . -B "$build_dir" -G Ninja -DCMAKE_BUILD_TYPE=Release -Wno-dev >"$build_dir/configure.log" 2>&1 \
  || { cat "$build_dir/configure.log"; echo "test.sh: configure failed" >&2; exit 1; }
echo "test.sh: configured $build_dir ($(grep -m1 -o 'CUDA compiler identification is.*' "$build_dir/configure.log" || true))"
cmake --build "$build_dir" -j "$jobs"
echo "test.sh: built in $(( $(date +%s) - start )) s"
ctest --test-dir "$build_dir" --output-on-failure -j "$jobs" "$@"
