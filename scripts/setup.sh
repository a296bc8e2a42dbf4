#!/usr/bin/env bash
# setup.sh: install whatever replay needs and is missing. Idempotent; prints nothing when all is there.
#
#   scripts/setup.sh            install missing Debian packages and Python packages
#   scripts/setup.sh --check    only report what is missing (exit 1 if anything is)
#   scripts/setup.sh --bundle   also stage .deps/ (git-ignored): what the GPU machine lacks, so the same
#                               tree builds and tests there: the cuDNN frontend headers and the
#                               mlperf-logging and safetensors Python packages
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
[ -e "$cuda_root/include/cudnn_version.h" ] || [ -e /usr/include/cudnn_version.h ] \
  || [ -e /usr/include/x86_64-linux-gnu/cudnn_version.h ] || die "cuDNN 9 headers not found next to $cuda_root or in /usr/include"
[ -e "$cuda_root/include/nccl.h" ] || [ -e /usr/include/nccl.h ] || [ -e /usr/local/include/nccl.h ] \
  || die "NCCL (nccl.h) not found next to $cuda_root or in /usr/include"

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
  find .deps -name __pycache__ -prune -exec rm -rf {} +
  say "staged .deps/ ($(du -sh .deps | cut -f1)): cuDNN frontend headers, mlperf_logging, safetensors"
fi
