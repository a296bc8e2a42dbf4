#!/usr/bin/env bash
# sanitize.sh: compute-sanitizer's four tools on the tiny preset of every workload in every graph
# mode, restricted to replay's own kernels, with one log per run and a summary (issue 31).
#
#   scripts/sanitize.sh [--out DIR] [--bin DIR] [--tools "memcheck initcheck synccheck racecheck"]
#                       [--workloads "gpt3 llama31 moe unet rnnt"] [--modes "none layer full"]
#                       [--steps N] [--warmup N] [--jobs N] [--timeout S] [--deadline S]
#                       [--scope replay|all] [--sanitizer PATH] [--sanitizer-args "ARGS"]
#                       [--tests "test_pointwise_gpu test_x_gpu:FILTER ..."] [--tests-dir DIR]
#
# Each run is `compute-sanitizer --tool T [--leak-check full] --kernel-name kns=6replay
# replay-W --preset tiny --graphs M --steps 2 --warmup 1 --seed 1 --skip-peak`: memcheck checks leaks
# too; the filter makes the tool check only kernels whose mangled name holds "6replay" (namespace
# replay: every kernel of replay's own, templates instantiated with replay's types included), so
# cuBLASLt, cuDNN, CUB and NCCL kernels run unchecked (--scope all checks every kernel, and the
# summary then lists library findings by kernel). --skip-peak leaves out the start-up bf16 GEMM peak
# measurement (cuBLASLt, 8192^3), which under racecheck alone took minutes. API errors and leaks are
# reported whatever the filter, and given to replay or a library by their saved host backtrace.
#
# --tests adds GPU unit tests (binaries in --tests-dir, default the build's tests/ beside --bin) as
# runs of their own, mode "test", under each tool with the same filter: the hand-written kernels
# checked alone against their CPU references, without the libraries around them (where a tool
# cannot get through a workload's library kernels, racecheck on Hopper for one). `--workloads ""`
# runs only the tests. NAME:FILTER runs the binary with --gtest_filter=FILTER (a tool that is slow
# on a test's largest cases can check its small ones); its logs are named with the filter.
# Several sanitizer processes at once (--jobs > 1) break memcheck on nested conditional nodes (an IF
# inside a WHILE: an illegal address with no kernel named; compute-sanitizer's, lab/nested_conditional):
# check test_conditional_gpu with --jobs 1.
#
# Writes DIR/<tool>_<workload>_<mode>.log (compute-sanitizer's report and the program's output) and
# .meta (exit code, seconds), DIR/not_run.txt (runs --deadline left out), and DIR/summary.json and
# summary.md (scripts/sanitize_summary.py). Exit 1 when any finding is in replay's own code, 2 when
# a run did not complete or was not run, 0 when every run completed clean.
set -uo pipefail
cd "$(dirname "$0")/.."

out=""
bin=build/release/bin
tools="memcheck initcheck synccheck racecheck"
workloads="gpt3 llama31 moe unet rnnt"
modes="none layer full"
steps=2
warmup=1
jobs=8
timeout_s=600
deadline=0
scope=replay
sanitizer=""
extra=""
tests=""
tests_dir=""

usage() { sed -n '2,10p' "$0" | sed 's/^# \{0,1\}//'; }
while [ $# -gt 0 ]; do
  case "$1" in
    --out) out=$2; shift 2 ;;
    --bin) bin=$2; shift 2 ;;
    --tools) tools=$2; shift 2 ;;
    --workloads) workloads=$2; shift 2 ;;
    --modes) modes=$2; shift 2 ;;
    --steps) steps=$2; shift 2 ;;
    --warmup) warmup=$2; shift 2 ;;
    --jobs) jobs=$2; shift 2 ;;
    --timeout) timeout_s=$2; shift 2 ;;
    --deadline) deadline=$2; shift 2 ;;
    --scope) scope=$2; shift 2 ;;
    --sanitizer) sanitizer=$2; shift 2 ;;
    --sanitizer-args) extra=$2; shift 2 ;;  # more compute-sanitizer options, for every run
    --tests) tests=$2; shift 2 ;;
    --tests-dir) tests_dir=$2; shift 2 ;;
    --one) shift; break ;;  # internal: one run (xargs calls the script back)
    -h|--help) usage; exit 0 ;;
    *) echo "sanitize.sh: unknown option '$1' (--help lists them)" >&2; exit 2 ;;
  esac
done

# One run: --one TOOL WORKLOAD MODE INDEX, with the settings in the environment (mode "test": WORKLOAD
# is a unit test's binary).
if [ "${SANITIZE_ONE:-}" = 1 ]; then
  tool=$1 wl=$2 mode=$3 index=$4  # INDEX: the run's own number, for its port
  test_cmd=()
  if [ "$mode" = test ]; then  # NAME or NAME:FILTER; the run is named without the filter's symbols
    test_cmd=("$SANITIZE_TESTS_DIR/${wl%%:*}")
    [ "$wl" != "${wl%%:*}" ] && test_cmd+=("--gtest_filter=${wl#*:}")
    wl=$(printf '%s' "$wl" | tr -c 'A-Za-z0-9_.-' '-')
  fi
  base="$SANITIZE_OUT/${tool}_${wl}_${mode}"
  if [ "$SANITIZE_END" -gt 0 ] && [ "$(date +%s)" -ge "$SANITIZE_END" ]; then
    echo "$tool $wl $mode (the deadline passed before it started)" >> "$SANITIZE_OUT/not_run.txt"
    exit 0
  fi
  # Each run its own base port for the sanitizer's connection to its target (runs in parallel).
  args=(--tool "$tool" --print-limit 1000 --port $(( 49152 + 16 * index )))
  [ "$tool" = memcheck ] && args+=(--leak-check full)
  [ "$SANITIZE_SCOPE" = replay ] && args+=(--kernel-name kns=6replay)
  # shellcheck disable=SC2206
  [ -n "$SANITIZE_EXTRA" ] && args+=($SANITIZE_EXTRA)
  limit=$SANITIZE_TIMEOUT
  if [ "$SANITIZE_END" -gt 0 ]; then
    left=$(( SANITIZE_END - $(date +%s) ))
    [ "$left" -lt "$limit" ] && limit=$left
  fi
  t0=$(date +%s%N)
  if [ "$mode" = test ]; then
    cmd=("${test_cmd[@]}")
  else
    cmd=("$SANITIZE_BIN/replay-$wl" --preset tiny --graphs "$mode" --steps "$SANITIZE_STEPS"
         --warmup "$SANITIZE_WARMUP" --seed 1 --skip-peak --log-interval 1)
  fi
  {
    echo "# $SANITIZE_TOOL ${args[*]} ${cmd[*]}"
    timeout -k 10 "$limit" "$SANITIZE_TOOL" "${args[@]}" "${cmd[@]}" 2>&1
  } > "$base.log"
  rc=$?
  secs=$(awk -v a="$t0" -v b="$(date +%s%N)" 'BEGIN { printf "%.1f", (b - a) / 1e9 }')
  printf 'tool=%s\nworkload=%s\nmode=%s\nrc=%s\nseconds=%s\n' "$tool" "$wl" "$mode" "$rc" "$secs" \
    > "$base.meta"
  echo "sanitize.sh: $tool $wl $mode rc=$rc ${secs%.*}s"
  exit 0
fi

case "$scope" in replay|all) ;; *) echo "sanitize.sh: --scope is replay or all" >&2; exit 2 ;; esac
for t in $tools; do
  case "$t" in memcheck|initcheck|synccheck|racecheck) ;;
    *) echo "sanitize.sh: unknown tool '$t'" >&2; exit 2 ;; esac
done
for m in $modes; do
  case "$m" in none|layer|full) ;; *) echo "sanitize.sh: unknown mode '$m'" >&2; exit 2 ;; esac
done
if [ -z "$sanitizer" ]; then
  sanitizer=$(command -v compute-sanitizer || true)
  for c in /usr/local/cuda/bin/compute-sanitizer /usr/local/cuda/compute-sanitizer/compute-sanitizer \
           /usr/local/cuda-*/bin/compute-sanitizer /opt/nvidia/compute-sanitizer/compute-sanitizer; do
    [ -z "$sanitizer" ] && [ -x "$c" ] && sanitizer=$c
  done
fi
[ -n "$sanitizer" ] && [ -x "$sanitizer" ] ||
  { echo "sanitize.sh: compute-sanitizer not found (give --sanitizer PATH)" >&2; exit 2; }
for w in $workloads; do
  [ -x "$bin/replay-$w" ] || { echo "sanitize.sh: $bin/replay-$w not found (build it, or --bin)" >&2; exit 2; }
done
[ -n "$tests_dir" ] || tests_dir=$bin/../tests
for t in $tests; do
  [ -x "$tests_dir/${t%%:*}" ] ||
    { echo "sanitize.sh: test $tests_dir/${t%%:*} not found (build it, or --tests-dir)" >&2; exit 2; }
done
[ -n "$workloads$tests" ] || { echo "sanitize.sh: nothing to run (--workloads and --tests both empty)" >&2; exit 2; }
[ -n "$out" ] || out=reports/sanitize-$(date -u +%Y-%m-%d)
mkdir -p "$out"
rm -f "$out"/*.log "$out"/*.meta "$out/not_run.txt"
out=$(cd "$out" && pwd)

export SANITIZE_ONE=1 SANITIZE_OUT=$out SANITIZE_BIN=$(cd "$bin" && pwd) SANITIZE_TOOL=$sanitizer
export SANITIZE_STEPS=$steps SANITIZE_WARMUP=$warmup SANITIZE_TIMEOUT=$timeout_s SANITIZE_SCOPE=$scope
export SANITIZE_EXTRA=$extra
[ -z "$tests" ] || SANITIZE_TESTS_DIR=$(cd "$tests_dir" && pwd)
export SANITIZE_TESTS_DIR
export SANITIZE_END=$(( deadline > 0 ? $(date +%s) + deadline : 0 ))
# Generated data (each workload's default) in one place, made once before the parallel runs.
export REPLAY_DATA_DIR=${REPLAY_DATA_DIR:-$out/data}
mkdir -p "$REPLAY_DATA_DIR"
"$sanitizer" --version | tail -n 1 > "$out/sanitizer_version.txt" 2>&1
# Each binary once without the sanitizer (its exit code at the end of plain_<workload>.txt).
for w in $workloads; do
  ( "$bin/replay-$w" --preset tiny --graphs none --steps "$steps" --warmup "$warmup" --seed 1 --skip-peak \
      > "$out/plain_$w.txt" 2>&1; echo "# exit $?" >> "$out/plain_$w.txt" ) &
done
wait

# Every tool x workload x mode, then every tool x test, the tools in the order given (memcheck and
# initcheck first by default); each line numbered (its port).
{
  for t in $tools; do for w in $workloads; do for m in $modes; do echo "$t $w $m"; done; done; done
  for t in $tools; do for x in $tests; do echo "$t $x test"; done; done
} | awk '{ print $0, NR }' | xargs -P "$jobs" -L 1 bash "$0" --one
python3 scripts/sanitize_summary.py "$out"
