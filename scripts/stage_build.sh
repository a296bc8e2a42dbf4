#!/usr/bin/env bash
# stage_build.sh: copy from a build folder what running the tests and benchmarks needs (executables,
# stripped, and CTest's files) into a small folder that can travel to a GPU machine which cannot build.
#
#   scripts/stage_build.sh [BUILD] [DEST]      defaults: build/release build/device
#
# CTest's files hold the build folder's absolute path. On the GPU machine, make that path resolve to
# the staged copy before running ctest, e.g. for BUILD=/work/main/build/release staged to build/device:
#   [ "$PWD" = /work/main ] || { mkdir -p /work && ln -sfn "$PWD" /work/main; }
#   ln -sfn "$PWD/build/device" build/release && ctest --test-dir build/release -L gpu
set -euo pipefail
cd "$(dirname "$0")/.."
src=${1:-build/release}
dest=${2:-build/device}
[ -f "$src/CTestTestfile.cmake" ] || { echo "stage_build.sh: $src is not a configured build folder" >&2; exit 2; }
rm -rf "$dest"
mkdir -p "$dest"
(cd "$src" && find . -name CTestTestfile.cmake -not -path '*/CMakeFiles/*') | while read -r f; do
  mkdir -p "$dest/$(dirname "$f")" && cp "$src/$f" "$dest/$f"
done
for d in bin tests; do
  [ -d "$src/$d" ] || continue
  find "$src/$d" -maxdepth 1 -type f -perm -u+x | while read -r f; do
    mkdir -p "$dest/$d" && strip -o "$dest/$d/$(basename "$f")" "$f"
  done
done
echo "stage_build.sh: $src -> $dest ($(du -sh "$dest" | cut -f1))"
