#!/usr/bin/env bash
# check_mllog.sh: runs the MLPerf compliance checker on an mllog file with replay's shard rules.
#
#   scripts/mlperf/check_mllog.sh FILE [more checker flags, e.g. --werror]
#
# Exit status: 0 the file passes, 1 it fails (the checker's messages are printed), 2 bad usage,
# 77 python3 or mlperf_logging is not importable (CTest's skip code; scripts/setup.sh installs it).
# Where mlperf_logging is staged in the repository's .deps/python (scripts/setup.sh --bundle), that
# folder is put on PYTHONPATH first.
set -euo pipefail

here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
root=$(cd "$here/../.." && pwd)

if [[ $# -lt 1 || ! -f $1 ]]; then
  echo "usage: $0 MLLOG_FILE [checker flags]  (file not found: ${1:-none})" >&2
  exit 2
fi
file=$1
shift

if [[ -d $root/.deps/python ]]; then
  export PYTHONPATH="$root/.deps/python${PYTHONPATH:+:$PYTHONPATH}"
fi
if ! command -v python3 >/dev/null ||
   ! python3 -c 'import mlperf_logging.compliance_checker.mlp_compliance' 2>/dev/null; then
  echo "check_mllog: python3 with mlperf_logging (and PyYAML) is not importable; run scripts/setup.sh" >&2
  exit 77
fi

# The checker writes a copy of its messages to --log_output; keep it out of the working directory.
checker_log=$(mktemp)
trap 'rm -f "$checker_log"' EXIT
# --config must be an absolute path: the checker joins it to its own package folder.
python3 -m mlperf_logging.compliance_checker --usage training --ruleset 6.1.0 \
  --config "$here/shard.yaml" --log_output "$checker_log" "$@" "$file" || exit 1
