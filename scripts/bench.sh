#!/usr/bin/env bash
# bench.sh: run replay's suite on the local GPU, building first, and write reports/<gpu>/<date>/.
#
#   scripts/bench.sh [--quick] [--out DIR] [--no-build] [--no-pytorch] [--report-only] [--only LIST]
#                    [--resume]
#
#   --quick        fewer repeats (a smoke run of a few minutes)
#   --out DIR      where to write (default reports/<gpu>/<date>)
#   --no-build     use the binaries already in the build folder
#   --no-pytorch   skip the PyTorch baselines even when torch is importable
#   --report-only  run nothing: write the reports again from the JSON in --out DIR (a suite run
#                  elsewhere, or scripts/report.py changed since); needs no GPU
#   --only LIST    run only these sections (comma-separated): ops, graphs, workloads, unet, moe,
#                  rnnt, multi_gpu, time_to_train
#   --resume       with --out DIR of an unfinished run: skip every run whose NAME.json is already
#                  there and valid (a suite split over several calls of a time-limited machine)
#
# Environment: REPLAY_BUILD_DIR (default build/release), REPLAY_SKIP_SETUP=1 (no installs: the GPU
# machine). Writes one JSON per run (schemas in reports/SCHEMA.md), the logs, summary.md and plots.
set -euo pipefail
cd "$(dirname "$0")/.."

quick=0
out=""
build=1
pytorch=1
report_only=0
only=""
resume=0
while [ $# -gt 0 ]; do
  case "$1" in
    --quick) quick=1 ;;
    --out) out="$2"; shift ;;
    --no-build) build=0 ;;
    --no-pytorch) pytorch=0 ;;
    --report-only) report_only=1 ;;
    --only) only="$2"; shift ;;
    --resume) resume=1 ;;
    -h|--help) sed -n '2,22p' "$0"; exit 0 ;;
    *) echo "bench.sh: unknown option '$1' (see --help)" >&2; exit 2 ;;
  esac
  shift
done
sections="ops graphs workloads unet moe rnnt multi_gpu time_to_train"
for sec in ${only//,/ }; do
  [[ " $sections " == *" $sec "* ]] || { echo "bench.sh: --only: unknown section '$sec' (one of: $sections)" >&2; exit 2; }
done
want() { [ -z "$only" ] || [[ ",$only," == *",$1,"* ]]; }  # want SECTION: is it to be run

# Reports: per-section markdown and plots from the JSON in $out, then one summary.md. Only what is there
# is reported; a run that is missing or failed shows as missing in its tables.
write_reports() {
  {
    echo "# replay suite on $gpu_name"
    echo
    echo "Command: \`$(cat "$out/COMMAND")\`"
    echo
  } >"$out/summary.md"
  if [ -f "$out/replay_ops.json" ]; then
    args=(ops --replay "$out/replay_ops.json" --out "$out")
    [ -f "$out/ops_attention_nondeterministic.json" ] \
      && args+=(--attention-nondeterministic "$out/ops_attention_nondeterministic.json")
    [ "$have_torch" = 1 ] && [ -f "$out/pytorch_ops.json" ] && args+=(--pytorch "$out/pytorch_ops.json")
    python3 scripts/report.py "${args[@]}" && cat "$out/ops_summary.md" >>"$out/summary.md"
  fi
  if [ -f "$out/graphs_bench.json" ]; then
    python3 scripts/report.py graphs --json "$out/graphs_bench.json" --out "$out" \
      && cat "$out/graphs_summary.md" >>"$out/summary.md"
  fi
  if ls "$out"/replay_*_*_*.json >/dev/null 2>&1; then
    python3 scripts/report.py workloads --dir "$out" --out "$out" && cat "$out/workloads_summary.md" >>"$out/summary.md"
  fi
  if ls "$out"/llama31_mb4/replay_*.json >/dev/null 2>&1; then
    python3 scripts/report.py workloads --dir "$out/llama31_mb4" --out "$out/llama31_mb4" && {
      printf '\n# Llama 3.1 405B TP8 with 4 micro-batches per step: per-layer against full-iteration graphs\n\n'
      cat "$out/llama31_mb4/workloads_summary.md"
    } >>"$out/summary.md"
  fi
  if ls "$out"/time_to_train/replay_*.json >/dev/null 2>&1; then
    python3 scripts/report.py time-to-train --dir "$out/time_to_train" --out "$out/time_to_train" \
      && { echo; cat "$out/time_to_train/time_to_train_summary.md"; } >>"$out/summary.md"
  fi
  if ls "$out"/multi_gpu/replay_*.json >/dev/null 2>&1; then
    python3 scripts/report.py multi-gpu --dir "$out/multi_gpu" \
      && { echo; cat "$out/multi_gpu/multi_gpu_summary.md"; } >>"$out/summary.md"
  fi
  if [ -f "$out/multi_gpu/comm/probe_sweep.json" ]; then
    python3 scripts/report.py comm --json "$out/multi_gpu/comm/probe_sweep.json" --out "$out/multi_gpu/comm" \
      && { echo; cat "$out/multi_gpu/comm/comm_summary.md"; } >>"$out/summary.md"
  fi
  if ls "$out"/moe/pytorch_moe_671b-ep32_*.json >/dev/null 2>&1; then  # replay's shard against PyTorch's
    mkdir -p "$out/moe/vs_pytorch"  # report.py workloads reads only <tool>_<workload>_<preset>_<mode>.json
    for f in "$out"/moe/{replay,pytorch}_moe_671b-ep32_{none,layer,full}.json; do
      [ -f "$f" ] && cp "$f" "$out/moe/vs_pytorch/"
    done
    python3 scripts/report.py workloads --dir "$out/moe/vs_pytorch" --out "$out/moe/vs_pytorch" \
      && { echo; cat "$out/moe/vs_pytorch/workloads_summary.md"; } >>"$out/summary.md"
  fi
  local dir title
  for dir in unet moe rnnt multi_gpu; do
    case $dir in
      unet) title="Stable Diffusion v2 UNet (replay-unet): graph modes, batch sweep, PyTorch" ;;
      moe) title="DeepSeek-V3 shard (replay-moe): graph modes and scopes" ;;
      rnnt) title="RNN-T (replay-rnnt): graph modes on the ladder" ;;
      multi_gpu) title="Many GPUs: tensor and data parallelism against the one-GPU shard" ;;
    esac
    if ls "$out/$dir"/*.json >/dev/null 2>&1; then
      python3 scripts/report.py runs --dir "$out/$dir" --out "$out/$dir" --title "$title" \
        && { echo; cat "$out/$dir/runs_summary.md"; } >>"$out/summary.md"
    fi
  done
  echo "bench.sh: wrote $out/summary.md"
}

if [ "$report_only" = 1 ]; then
  [ -n "$out" ] && [ -f "$out/COMMAND" ] \
    || { echo "bench.sh: --report-only needs --out DIR, a folder a suite run wrote (with its COMMAND file)" >&2; exit 2; }
  gpu_name=$(python3 -c '
import glob, json, sys
for path in [sys.argv[1] + "/replay_ops.json", *sorted(glob.glob(sys.argv[1] + "/**/*.json", recursive=True))]:
    try:
        print(json.load(open(path))["environment"]["gpu"])
        break
    except Exception:
        continue
else:
    print("(GPU not recorded in any run JSON)")' "$out")
  have_torch=$pytorch  # the PyTorch JSON that is there, unless --no-pytorch
  write_reports
  exit 0
fi

build_dir=${REPLAY_BUILD_DIR:-build/release}
bin="$build_dir/bin"

command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1 \
  || { echo "bench.sh: no NVIDIA GPU visible (nvidia-smi -L failed): the suite needs a Hopper GPU" >&2; exit 1; }

if [ "$build" = 1 ]; then
  [ "${REPLAY_SKIP_SETUP:-0}" = 1 ] || scripts/setup.sh
  mkdir -p "$build_dir"
  if [ ! -f "$build_dir/build.ninja" ]; then
    cmake -S . -B "$build_dir" -G Ninja -DCMAKE_BUILD_TYPE=Release -Wno-dev >"$build_dir/configure.log" 2>&1 \
      || { cat "$build_dir/configure.log"; exit 1; }
  fi
  cmake --build "$build_dir" -j "$(nproc)"
fi

gpu_name=$(nvidia-smi --query-gpu=name --format=csv,noheader | head -n 1)
gpu_tag=$(echo "$gpu_name" | tr '[:upper:]' '[:lower:]' | grep -oE 'gh200|h200|h100|h800|b200|gb200|a100' | head -n 1)
[ -n "$gpu_tag" ] || gpu_tag=$(echo "$gpu_name" | tr '[:upper:] ' '[:lower:]-')
[ -n "$out" ] || out="reports/$gpu_tag/$(date +%Y-%m-%d)"
mkdir -p "$out"
echo "bench.sh: $gpu_name -> $out"
command_line="scripts/bench.sh $([ $quick = 1 ] && echo --quick) $([ -n "$only" ] && echo "--only $only") (commit $(git rev-parse --short HEAD 2>/dev/null || echo unknown), $(date -u +%Y-%m-%dT%H:%M:%SZ))"
if [ "$resume" = 1 ] && [ -f "$out/COMMAND" ]; then
  echo "$(cat "$out/COMMAND"); resumed: $command_line --resume" >"$out/COMMAND"
else
  echo "$command_line" >"$out/COMMAND"
fi

repeats=50; warmup=10
[ "$quick" = 1 ] && { repeats=10; warmup=3; }

run() {  # run NAME CMD...: output to the terminal and to $out/NAME.log; a failure is reported, not fatal
  local name=$1; shift
  if [ "$resume" = 1 ] && python3 -c 'import json, sys; json.load(open(sys.argv[1]))' "$out/$name.json" 2>/dev/null; then
    echo "bench.sh: $name: done in an earlier call (--resume): skipped"
    return 0
  fi
  echo "bench.sh: $name: $*"
  if "$@" 2>&1 | tee "$out/$name.log"; then return 0; fi
  echo "bench.sh: $name FAILED (log: $out/$name.log)" >&2
  failures+=("$name")
}
failures=()

# GEMMs near the power limit run a few percent faster or slower from one minute to the next, so the two
# tools take turns (replay, PyTorch, three times each) and each op keeps its best median of the three.
# (After the idle lead, a series of dense GEMMs holds its clocks for some 25-85 ms and then drops them,
# whichever tool issues them: reports/h200/2026-11-22/clocks_and_cudnn. 50 calls of a 2.2-2.7 ms Llama
# fc2 GEMM straddled the drop, and their median moved with it. Both tools now time as many calls as fit
# 20 ms (--budget-ms, at least 5), so a series ends before the drop. The report also gives the ratios
# at the fastest tenth.)
have_torch=0
if [ "$pytorch" = 1 ] && python3 -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)" 2>/dev/null; then
  have_torch=1
else
  echo "bench.sh: PyTorch with CUDA not importable: baselines skipped"
fi
if want ops; then
op_rounds=3
mkdir -p "$out/rounds"
for round in $(seq "$op_rounds"); do
  run rounds/replay_ops_$round "$bin/replay-ops" --warmup "$warmup" --repeats "$repeats" \
    --json "$out/rounds/replay_ops_$round.json"
  if [ "$have_torch" = 1 ]; then
    PYTHONUNBUFFERED=1 run rounds/pytorch_ops_$round python3 scripts/pytorch_baseline.py ops --replay-bin "$bin" \
      --warmup "$warmup" --repeats "$repeats" --json "$out/rounds/pytorch_ops_$round.json"
  fi
done
best_of() {  # best_of OUT IN...: per op, the run with the lowest median
  python3 - "$@" <<'PY'
import json, sys
out, runs = sys.argv[1], [json.load(open(p)) for p in sys.argv[2:]]
merged = dict(runs[0]); best = {}
for run in runs:
    for r in run["results"]:
        m = r.get("median_ms")
        if r["name"] not in best or (m is not None and (best[r["name"]].get("median_ms") is None or m < best[r["name"]]["median_ms"])):
            best[r["name"]] = r
merged["results"] = [best[r["name"]] for r in runs[0]["results"]]
merged.setdefault("protocol", {})["runs"] = f"best median of {len(runs)} interleaved runs"
json.dump(merged, open(out, "w"), indent=2)
PY
}
# What the deterministic attention backward costs: replay with cuDNN's non-deterministic one (PyTorch's
# default algorithm), reported in its own section; no workload uses it.
run ops_attention_nondeterministic "$bin/replay-ops" --only 'attention' --attention-nondeterministic \
  --warmup "$warmup" --repeats "$repeats" --json "$out/ops_attention_nondeterministic.json"
for tool in replay pytorch; do
  ls "$out"/rounds/${tool}_ops_[0-9]*.json >/dev/null 2>&1 \
    && best_of "$out/${tool}_ops.json" "$out"/rounds/${tool}_ops_[0-9]*.json
done
fi
if want graphs && [ -x "$bin/replay-graphs-bench" ]; then
  run graphs_bench "$bin/replay-graphs-bench" --json "$out/graphs_bench.json" \
    $([ "$quick" = 1 ] && echo "--repeats 5")
fi

# Workloads: each in all three graph modes on its MLPerf shard preset, PyTorch's eager and graphed step
# on the same shapes and layer count, and a host-delay sweep on the tiny preset (where launches matter).
run_workload() {  # run_workload NAME PRESET STEPS: replay's three modes, then PyTorch's two
  local wl=$1 preset=$2 steps=$3 mode layers
  [ -x "$bin/replay-$wl" ] || { echo "bench.sh: $bin/replay-$wl not built: skipped"; return 0; }
  for mode in none layer full; do
    run "replay_${wl}_${preset}_$mode" "$bin/replay-$wl" --preset "$preset" --graphs "$mode" --steps "$steps" \
      --seed 1234 --json "$out/replay_${wl}_${preset}_$mode.json" --mllog "$out/replay_${wl}_${preset}_$mode.mllog"
  done
  layers=$(python3 -c 'import json, sys; print(json.load(open(sys.argv[1]))["config"]["layers"])' \
    "$out/replay_${wl}_${preset}_none.json" 2>/dev/null || true)
  if [ -f "$out/replay_${wl}_${preset}_full.mllog" ]; then
    run "mllog_check_${wl}_${preset}" bash scripts/mlperf/check_mllog.sh "$out/replay_${wl}_${preset}_full.mllog"
  fi
  if [ "$have_torch" = 1 ] && [ -n "$layers" ]; then
    for mode in none full; do
      PYTHONUNBUFFERED=1 run "pytorch_${wl}_${preset}_$mode" python3 scripts/pytorch_baseline.py "$wl" \
        --replay-bin "$bin" --preset "$preset" --graphs "$mode" --steps "$steps" --layers "$layers" --seed 1234 \
        --json "$out/pytorch_${wl}_${preset}_$mode.json"
    done
  fi
}
if want workloads; then
run_workload gpt3 175b-tp4 "$([ "$quick" = 1 ] && echo 10 || echo 50)"
run_workload llama31 405b-tp8 "$([ "$quick" = 1 ] && echo 5 || echo 20)"
# Llama 3.1 with 4 micro-batches per step, as NVIDIA's GB200 submissions graph it: per-layer graphs
# against one full-iteration graph holding every micro-batch's forward and backward.
if [ -x "$bin/replay-llama31" ]; then
  mkdir -p "$out/llama31_mb4"
  for mode in layer full; do
    run "llama31_mb4/replay_llama31_405b-tp8_$mode" "$bin/replay-llama31" --preset 405b-tp8 --microbatches 4 \
      --graphs "$mode" --steps "$([ "$quick" = 1 ] && echo 3 || echo 10)" --seed 1234 \
      --json "$out/llama31_mb4/replay_llama31_405b-tp8_$mode.json"
  done
fi
if [ -x "$bin/replay-gpt3" ]; then
  for delay in 0 5 20 50; do
    for mode in none full; do
      run "replay_gpt3_tiny_${mode}_delay${delay}us" "$bin/replay-gpt3" --preset tiny --graphs "$mode" \
        --steps 20 --seed 1234 --host-delay-us "$delay" --json "$out/replay_gpt3_tiny_${mode}_delay${delay}us.json"
    done
  done
fi
fi

# The Stable Diffusion v2 UNet at NVIDIA's 32 images per GPU in the three modes, a batch sweep where
# launches matter (1 and 8 images), and a PyTorch UNet of the same architecture, eager and captured.
if want unet && [ -x "$bin/replay-unet" ]; then
  mkdir -p "$out/unet"
  for mode in none layer full; do
    run "unet/replay_unet_sd2-b32_$mode" "$bin/replay-unet" --preset sd2-b32 --graphs "$mode" \
      --steps "$([ "$quick" = 1 ] && echo 10 || echo 30)" --seed 1234 --json "$out/unet/replay_unet_sd2-b32_$mode.json"
  done
  # The batch sweep (32 is the runs above): where the whole-step graph starts to pay, with the host's
  # enqueue time beside the GPU's step time in each JSON.
  for b in 1 2 8 64; do
    for mode in none full; do
      run "unet/replay_unet_b${b}_$mode" "$bin/replay-unet" --preset "$([ "$b" = 64 ] && echo sd2-b64 || echo sd2-b32)" \
        --batch "$b" --graphs "$mode" --steps 10 --seed 1234 --json "$out/unet/replay_unet_b${b}_$mode.json"
    done
  done
  # Where an eager step's time goes, by op class (convolutions, GroupNorm, LayerNorm, attention, ...),
  # with each class's achieved rate and the slowest nodes.
  run "unet/replay_unet_sd2-b32_op_times" "$bin/replay-unet" --preset sd2-b32 --graphs none --steps 6 \
    --warmup 2 --seed 1234 --op-times "$out/unet/op_times_sd2-b32.json"
  if [ "$have_torch" = 1 ]; then
    # diffusers' UNet2DConditionModel (staged in .deps/python by setup.sh --bundle): a run without it
    # fails and says so rather than timing another model.
    for mode in none full; do
      PYTHONUNBUFFERED=1 run "unet/pytorch_unet_sd2-b32_$mode" python3 scripts/pytorch_baseline.py unet \
        --model diffusers --batch 32 --graphs "$mode" --steps 10 --json "$out/unet/pytorch_unet_sd2-b32_$mode.json"
    done
  fi
fi

# The DeepSeek-V3 shard (one GPU of TP2 x PP8 x EP32) in the three modes and Megatron's scoped graphs,
# the parts timed alone (router and dispatch against the experts), and PyTorch's grouped expert GEMMs.
if want moe && [ -x "$bin/replay-moe" ]; then
  mkdir -p "$out/moe"
  moe_steps=$([ "$quick" = 1 ] && echo 5 || echo 10)
  for mode in none layer full; do
    run "moe/replay_moe_671b-ep32_$mode" "$bin/replay-moe" --preset 671b-ep32 --graphs "$mode" --steps "$moe_steps" \
      --seed 1234 --json "$out/moe/replay_moe_671b-ep32_$mode.json"
  done
  run moe/replay_moe_671b-ep32_scoped "$bin/replay-moe" --preset 671b-ep32 --graphs layer \
    --graph-scope attn,moe_router,moe_preprocess --steps "$moe_steps" --seed 1234 \
    --json "$out/moe/replay_moe_671b-ep32_scoped.json"
  [ -x "$bin/replay-moe-parts" ] && run moe/replay_moe_parts bash -c \
    "'$bin/replay-moe-parts' --preset 671b-ep32 --seed 1234 | tail -n 1 > '$out/moe/replay_moe_parts.json'"
  [ "$have_torch" = 1 ] && run moe/pytorch_moe python3 scripts/pytorch_moe.py --json "$out/moe/pytorch_moe_gemms.json"
  # The whole shard in PyTorch (scripts/pytorch_moe.py train): as many MoE blocks as replay fitted,
  # eager and as one graph of the whole step with static expert capacity.
  if [ "$have_torch" = 1 ] && [ -f "$out/moe/replay_moe_671b-ep32_full.json" ]; then
    for mode in none full; do
      PYTHONUNBUFFERED=1 run "moe/pytorch_moe_671b-ep32_$mode" python3 scripts/pytorch_baseline.py moe --replay-bin "$bin" \
        --layers-from "$out/moe/replay_moe_671b-ep32_full.json" --fit --graphs "$mode" --steps "$moe_steps" \
        --json "$out/moe/pytorch_moe_671b-ep32_$mode.json"
    done
  fi
fi

# RNN-T at NVIDIA's 192 utterances per GPU: the ladder in three modes (none at each batch's own
# shape, and on the ladder for the same-rung memory comparison), evaluation by the WHILE node, the
# host loop and NVIDIA's unrolled graph, and PyTorch's eager and graphed step on the same ladder.
if want rnnt && [ -x "$bin/replay-rnnt" ]; then
  mkdir -p "$out/rnnt/pytorch"
  rs=$([ "$quick" = 1 ] && echo 10 || echo 30)
  re=$((rs / 2))  # two evaluations: the last, which report.py reads, has no capture in it
  for mode in none layer full; do
    run "rnnt/replay_rnnt_mlperf-b192_$mode" "$bin/replay-rnnt" --preset mlperf-b192 --graphs "$mode" \
      --steps "$rs" --eval-interval "$re" --seed 1234 --json "$out/rnnt/replay_rnnt_mlperf-b192_$mode.json"
  done
  for dec in host unrolled; do
    run "rnnt/replay_rnnt_mlperf-b192_none-ladder_$dec" "$bin/replay-rnnt" --preset mlperf-b192 --graphs none \
      --pad ladder --decoder "$dec" --steps "$rs" --eval-interval "$re" --seed 1234 \
      --json "$out/rnnt/replay_rnnt_mlperf-b192_none-ladder_$dec.json"
  done
  if [ "$have_torch" = 1 ] && [ -f "$out/rnnt/replay_rnnt_mlperf-b192_full.json" ]; then
    ladder=$(python3 -c 'import json, sys; print(",".join("%dx%d" % (s["frames"], s["labels"]) for s in json.load(open(sys.argv[1]))["config"]["shapes"]))' \
      "$out/rnnt/replay_rnnt_mlperf-b192_full.json")
    for mode in eager graphed; do  # graphed: the whole step per rung, with a capturable plain-PyTorch loss
      run "rnnt/pytorch_rnnt_$mode" python3 scripts/pytorch_baseline.py rnnt --mode "$mode" --ladder "$ladder" \
        --batch 192 --json "$out/rnnt/pytorch/pytorch_rnnt_$mode.json"
    done
  fi
fi

# Many GPUs, when more than one is visible: GPT-3 175B at real tensor parallelism over every GPU (up
# to 4), with and without sequence parallelism, beside the same shard on one GPU with its collectives
# not run (the cost of communication) and PyTorch with the same Megatron split; data parallelism over
# 2 GPUs (the distributed optimizer, its gradient buckets overlapped with the backward, and with one
# bucket after it) beside its one-GPU shard; NCCL's bus bandwidth at the step's message sizes. With
# eight GPUs, also the TP8 layouts of NVIDIA's submissions (GPT-3 and Llama 3.1, sequence parallel).
ngpus=$(nvidia-smi -L | grep -c '^GPU ' || true)
if want multi_gpu && [ "$ngpus" -ge 2 ] && command -v mpiexec >/dev/null 2>&1 && [ -x "$bin/replay-gpt3" ]; then
  mkdir -p "$out/multi_gpu"
  [ "$(id -u)" = 0 ] && export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
  tp=$([ "$ngpus" -ge 4 ] && echo 4 || echo 2)
  mg_steps=$([ "$quick" = 1 ] && echo 10 || echo 30)
  mg_layers=$([ "$tp" -ge 4 ] && echo 4 || echo 3)  # PyTorch's TP2 shard of 4 layers needs ~71 GB
  mg=(--preset 175b-tp4 --layers "$mg_layers" --steps "$mg_steps" --seed 1234)
  for mode in none layer full; do
    run "multi_gpu/replay_gpt3_175b_tp${tp}_${mode}" mpiexec -n "$tp" "$bin/replay-gpt3" --tp "$tp" "${mg[@]}" \
      --graphs "$mode" --json "$out/multi_gpu/replay_gpt3_175b_tp${tp}_$mode.json"
    run "multi_gpu/replay_gpt3_175b_tp${tp}sp_${mode}" mpiexec -n "$tp" "$bin/replay-gpt3" --tp "$tp" \
      --sequence-parallel "${mg[@]}" --graphs "$mode" --json "$out/multi_gpu/replay_gpt3_175b_tp${tp}sp_$mode.json"
    run "multi_gpu/replay_gpt3_175b_tp${tp}shard_1gpu_${mode}" "$bin/replay-gpt3" --tp "$tp" "${mg[@]}" \
      --graphs "$mode" --json "$out/multi_gpu/replay_gpt3_175b_tp${tp}shard_1gpu_$mode.json"
    run "multi_gpu/replay_gpt3_175b-tp4_dp2_${mode}" mpiexec -n 2 "$bin/replay-gpt3" --dp 2 "${mg[@]}" \
      --graphs "$mode" --json "$out/multi_gpu/replay_gpt3_175b-tp4_dp2_$mode.json"
  done
  if [ "$tp" -ge 4 ] && [ -x "$bin/replay-llama31" ]; then
    # Llama 3.1 405B at its H200 layout (TP4, sequence parallel as NVIDIA runs it), 2 layers, beside
    # its one-GPU shard (no PyTorch TP baseline for Llama: scripts/pytorch_tp.py models GPT-3).
    ll=(--preset 405b-tp4 --layers 2 --steps "$([ "$quick" = 1 ] && echo 5 || echo 20)" --seed 1234)
    for mode in none layer full; do
      run "multi_gpu/replay_llama31_405b_tp4sp_${mode}" mpiexec -n 4 "$bin/replay-llama31" --tp 4 --sequence-parallel \
        "${ll[@]}" --graphs "$mode" --json "$out/multi_gpu/replay_llama31_405b_tp4sp_$mode.json"
    done
    run "multi_gpu/replay_llama31_405b_tp4shard_1gpu_full" "$bin/replay-llama31" --tp 4 "${ll[@]}" --graphs full \
      --json "$out/multi_gpu/replay_llama31_405b_tp4shard_1gpu_full.json"
  fi
  run "multi_gpu/replay_gpt3_175b-tp4_dp2_onebucket_full" mpiexec -n 2 "$bin/replay-gpt3" --dp 2 --dp-bucket-size 0 \
    "${mg[@]}" --graphs full --json "$out/multi_gpu/replay_gpt3_175b-tp4_dp2_onebucket_full.json"
  run "multi_gpu/replay_gpt3_175b-tp4_1gpu_full" "$bin/replay-gpt3" "${mg[@]}" --graphs full \
    --json "$out/multi_gpu/replay_gpt3_175b-tp4_1gpu_full.json"
  if [ -x "$bin/replay-comm-probe" ]; then
    mkdir -p "$out/multi_gpu/comm"
    run "multi_gpu/comm/probe_sweep" mpiexec -n "$tp" "$bin/replay-comm-probe" --graph \
      --json "$out/multi_gpu/comm/probe_sweep.json"
    # At the sizes of the bandwidth-bound collectives the runs above timed in their warm-ups
    # (parallel.collectives), which report.py multi-gpu sets side by side.
    step_sizes=$(python3 -c '
import glob, json, sys
sizes = set()
for path in glob.glob(sys.argv[1] + "/replay_*_full.json"):
    try:
        sizes |= {c["bytes"] for c in json.load(open(path))["parallel"]["collectives"] if c["bytes"] >= 1 << 20}
    except Exception:
        pass
print(",".join(str(b) for b in sorted(sizes)) or "48K,48M")' "$out/multi_gpu")
    run "multi_gpu/comm/probe_step_sizes" mpiexec -n "$tp" "$bin/replay-comm-probe" --sizes "$step_sizes" --in-place \
      --graph --json "$out/multi_gpu/comm/probe_step_sizes.json"
  fi
  if [ "$have_torch" = 1 ]; then
    for mode in none full; do
      PYTHONUNBUFFERED=1 run "multi_gpu/pytorch_gpt3_175b_tp${tp}_$mode" mpiexec -n "$tp" python3 \
        scripts/pytorch_baseline.py tp --replay-bin "$bin" --tp "$tp" --preset 175b-tp4 --layers "$mg_layers" \
        --graphs "$mode" --steps "$mg_steps" --json "$out/multi_gpu/pytorch_gpt3_175b_tp${tp}_$mode.json"
    done
  fi
  # Eight GPUs: NVIDIA's submission layouts, GPT-3 175b-tp8 and Llama 3.1 405b-tp8 at TP8 with
  # sequence parallelism (4 layers each), in the three modes, beside each preset's one-GPU shard and
  # PyTorch's TP8 GPT-3; report.py pairs them by name as it does the TP4 runs.
  if [ "$ngpus" -ge 8 ]; then
    t8=(--tp 8 --layers 4 --steps "$mg_steps" --seed 1234)
    for mode in none layer full; do
      run "multi_gpu/replay_gpt3_175b_tp8sp_${mode}" mpiexec -n 8 "$bin/replay-gpt3" --preset 175b-tp8 \
        --sequence-parallel "${t8[@]}" --graphs "$mode" --json "$out/multi_gpu/replay_gpt3_175b_tp8sp_$mode.json"
      if [ -x "$bin/replay-llama31" ]; then
        run "multi_gpu/replay_llama31_405b_tp8sp_${mode}" mpiexec -n 8 "$bin/replay-llama31" --preset 405b-tp8 \
          --sequence-parallel "${t8[@]}" --graphs "$mode" --json "$out/multi_gpu/replay_llama31_405b_tp8sp_$mode.json"
      fi
    done
    run "multi_gpu/replay_gpt3_175b_tp8shard_1gpu_full" "$bin/replay-gpt3" --preset 175b-tp8 "${t8[@]}" \
      --graphs full --json "$out/multi_gpu/replay_gpt3_175b_tp8shard_1gpu_full.json"
    if [ -x "$bin/replay-llama31" ]; then
      run "multi_gpu/replay_llama31_405b_tp8shard_1gpu_full" "$bin/replay-llama31" --preset 405b-tp8 "${t8[@]}" \
        --graphs full --json "$out/multi_gpu/replay_llama31_405b_tp8shard_1gpu_full.json"
    fi
    if [ "$have_torch" = 1 ]; then
      for mode in none full; do
        PYTHONUNBUFFERED=1 run "multi_gpu/pytorch_gpt3_175b_tp8_$mode" mpiexec -n 8 python3 \
          scripts/pytorch_baseline.py tp --replay-bin "$bin" --tp 8 --preset 175b-tp8 --layers 4 \
          --graphs "$mode" --steps "$mg_steps" --json "$out/multi_gpu/pytorch_gpt3_175b_tp8_$mode.json"
      done
    fi
  fi
fi

# Time to train: GPT-3 Small (125M) from scratch to its data's floor + 0.05 nats (--quick: + 0.5),
# evaluated every 250 steps, in each graph mode: where graphs show end to end, not per step.
if want time_to_train && [ -x "$bin/replay-gpt3" ]; then
  mkdir -p "$out/time_to_train"
  for mode in none layer full; do
    run "time_to_train/replay_gpt3_small_$mode" "$bin/replay-gpt3" --preset small --graphs "$mode" \
      --steps "$([ "$quick" = 1 ] && echo 1500 || echo 8000)" --seed 1234 --eval-interval 250 \
      --target-above-floor "$([ "$quick" = 1 ] && echo 0.5 || echo 0.05)" --log-interval 250 \
      --json "$out/time_to_train/replay_gpt3_small_$mode.json" --mllog "$out/time_to_train/replay_gpt3_small_$mode.mllog"
  done
fi

write_reports
if [ ${#failures[@]} -gt 0 ]; then
  echo "bench.sh: failed: ${failures[*]}" >&2
  exit 1
fi
