#!/usr/bin/env bash
# setup.sh: install whatever replay needs and is missing. Idempotent; prints nothing when all is there.
#
#   scripts/setup.sh            install missing Debian packages and Python packages
#   scripts/setup.sh --check    only report what is missing (exit 1 if anything is)
#   scripts/setup.sh --bundle   also stage .deps/ (git-ignored): what the GPU machine lacks, so the same
#                               tree builds and tests there: the cuDNN frontend headers and the
#                               mlperf-logging, safetensors and diffusers Python packages
set -euo pipefail
cd "$(dirname "$0")/.."

check_only=0
bundle=0
for arg in "$@"; do
  case "$arg" in
    --check) check_only=1 ;;
    --bundle) bundle=1 ;;
    -h|--help) sed -n '2,9p' "$0"; exit 0 ;;
    *) echo "setup.sh: unknown option '$arg' (see --help)" >&2; exit 2 ;;
  esac
done

say() { echo "setup: $*"; }
die() { echo "setup: error: $*" >&2; exit 1; }

# --- CUDA toolkit: not installable from Debian's packages at version 13; say so clearly. -------------
if ! command -v nvcc >/dev/null 2>&1; then
  for d in /usr/local/cuda/bin /usr/local/cuda-13*/bin; do
    [ -x "$d/nvcc" ] && export PATH="$d:$PATH" && break
  done
fi
command -v nvcc >/dev/null 2>&1 || die "nvcc not found: install the CUDA 13 toolkit (with cuBLASLt, cuDNN 9 and NCCL) and put its bin/ on PATH"
cuda_root=$(dirname "$(dirname "$(command -v nvcc)")")
# Where this machine's headers live, as cmake/FindCUDNN.cmake and FindNCCL.cmake search: CUDNN_ROOT /
# NCCL_ROOT, the toolkit and its targets/<arch>-linux, Debian's multiarch folder, the pip wheels
# (site-packages/nvidia/cudnn, nvidia/nccl). x86_64: x86_64-linux, x86_64-linux-gnu; aarch64 (Grace,
# GH200): sbsa-linux, aarch64-linux-gnu.
case "$(dpkg --print-architecture 2>/dev/null || uname -m)" in
  amd64|x86_64) cuda_target=x86_64-linux; multiarch=x86_64-linux-gnu ;;
  arm64|aarch64) cuda_target=sbsa-linux; multiarch=aarch64-linux-gnu ;;
  ppc64el|ppc64le) cuda_target=ppc64le-linux; multiarch=powerpc64le-linux-gnu ;;
  *) cuda_target="$(uname -m)-linux"; multiarch="$(uname -m)-linux-gnu" ;;
esac
wheel_dirs=()
if command -v python3 >/dev/null 2>&1; then
  mapfile -t wheel_dirs < <(python3 -c 'import os, sys
for p in sys.path:
    d = os.path.join(p, "nvidia")
    if p and os.path.isdir(d): print(os.path.abspath(d))' 2>/dev/null || true)
fi
have_header() {  # have_header NAME ROOT_ENV_VALUE WHEEL_SUBDIR
  local d
  for d in ${2:+"$2/include"} "$cuda_root/include" "$cuda_root/targets/$cuda_target/include" \
           /usr/include "/usr/include/$multiarch" /usr/local/include; do
    [ -e "$d/$1" ] && return 0
  done
  for d in "${wheel_dirs[@]}"; do
    [ -e "$d/$3/include/$1" ] && return 0
  done
  return 1
}
have_header cudnn_version.h "${CUDNN_ROOT:-}" cudnn \
  || die "cuDNN 9 headers not found (CUDNN_ROOT, $cuda_root, its targets/$cuda_target, /usr/include[/$multiarch], pip's nvidia-cudnn-cu13)"
have_header nccl.h "${NCCL_ROOT:-}" nccl \
  || die "NCCL (nccl.h) not found (NCCL_ROOT, $cuda_root, its targets/$cuda_target, /usr/include[/$multiarch], pip's nvidia-nccl-cu13)"

# --- Debian packages ---------------------------------------------------------------------------------
debs=(cmake ninja-build g++ libhdf5-dev libopenmpi-dev openmpi-bin libcli11-dev nlohmann-json3-dev
      libgtest-dev python3-pip)
missing_debs=()
for p in "${debs[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing_debs+=("$p")
done

# --- Python packages ---------------------------------------------------------------------------------
# nvidia-cudnn-frontend is installed for its C++ headers only, hence --no-deps.
pips=(nvidia-cudnn-frontend matplotlib mlperf-logging safetensors)
missing_pips=()
for p in "${pips[@]}"; do
  python3 -c "import importlib.metadata as m, sys; m.version(sys.argv[1])" "$p" >/dev/null 2>&1 \
    || missing_pips+=("$p")
done

if [ "$check_only" = 1 ]; then
  [ ${#missing_debs[@]} -eq 0 ] && [ ${#missing_pips[@]} -eq 0 ] && exit 0
  say "missing Debian packages: ${missing_debs[*]:-none}; missing Python packages: ${missing_pips[*]:-none}"
  exit 1
fi

if [ ${#missing_debs[@]} -gt 0 ]; then
  say "installing ${missing_debs[*]}"
  sudo_cmd=()
  [ "$(id -u)" = 0 ] || sudo_cmd=(sudo)
  "${sudo_cmd[@]}" apt-get update -qq
  DEBIAN_FRONTEND=noninteractive "${sudo_cmd[@]}" apt-get install -y -qq --no-install-recommends \
    "${missing_debs[@]}" >/dev/null
fi

for p in "${missing_pips[@]}"; do
  say "installing Python package $p"
  flags=(-q --disable-pip-version-check)
  [ "$p" = nvidia-cudnn-frontend ] && flags+=(--no-deps)
  python3 -m pip install "${flags[@]}" "$p" 2>&1 | grep -v "Running pip as the 'root' user" || true
  python3 -c "import importlib.metadata as m, sys; m.version(sys.argv[1])" "$p" >/dev/null 2>&1 \
    || die "could not install the Python package $p"
done

# --- The bundle for the GPU machine ------------------------------------------------------------------
if [ "$bundle" = 1 ]; then
  fe_include=$(python3 - <<'EOF'
import importlib.metadata as m, pathlib
for f in m.files('nvidia-cudnn-frontend') or []:
    if str(f).endswith('include/cudnn_frontend.h'):
        print(pathlib.Path(f.locate()).parent.resolve()); break
EOF
)
  [ -n "$fe_include" ] || die "cuDNN frontend headers not found in the nvidia-cudnn-frontend package"
  rm -rf .deps/cudnn-frontend .deps/python
  mkdir -p .deps/cudnn-frontend .deps/python
  cp -r "$fe_include" .deps/cudnn-frontend/include
  mll=$(python3 -c "import mlperf_logging, os; print(os.path.dirname(mlperf_logging.__file__))")
  cp -r "$mll" .deps/python/
  # safetensors: checkpoints in PyTorch (its extension is abi3: any Python 3 of the GPU machine).
  st=$(python3 -c "import safetensors, os; print(os.path.dirname(safetensors.__file__))")
  cp -r "$st" .deps/python/
  # diffusers (scripts/pytorch_unet.py's baseline: UNet2DConditionModel), pure Python, pinned. What it
  # imports besides is on the GPU machine (torch, huggingface_hub >= 1.32, safetensors >= 0.8, numpy,
  # regex, requests, filelock, Pillow, packaging; on Python >= 3.8 the standard importlib.metadata,
  # not the importlib_metadata package), so only diffusers travels, without the parts the model does
  # not import: the pipelines and the modular pipelines (all but their __init__.py, which the package
  # reads), the commands, the experimental code (30 MB down to 11; the loaders the model imports read
  # the schedulers).
  diffusers_version=0.42.1
  tmp=$(mktemp -d)
  python3 -m pip install -q --disable-pip-version-check --no-deps --no-compile --target "$tmp" \
    "diffusers==$diffusers_version" 2>&1 | grep -v "Running pip as the 'root' user" || true
  [ -f "$tmp/diffusers/__init__.py" ] || die "could not fetch diffusers $diffusers_version"
  for d in pipelines modular_pipelines commands experimental; do
    [ -d "$tmp/diffusers/$d" ] || continue
    find "$tmp/diffusers/$d" -mindepth 1 -maxdepth 1 ! -name __init__.py -exec rm -rf {} +
  done
  cp -r "$tmp/diffusers" "$tmp/diffusers-$diffusers_version.dist-info" .deps/python/
  rm -rf "$tmp"
  find .deps -name __pycache__ -prune -exec rm -rf {} +
  say "staged .deps/ ($(du -sh .deps | cut -f1)): cuDNN frontend headers, mlperf_logging, safetensors, diffusers $diffusers_version"
fi
