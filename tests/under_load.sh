#!/usr/bin/env bash
# Test files (or the whole suite) TIMES times in a row while every core is kept busy by other processes:
#   bash tests/under_load.sh 3 tests/test_real_vllm.py tests/test_servers.py tests/test_async.py ...
#   bash tests/under_load.sh 1                      # the whole suite, once
# No test may depend on the machine's speed (docs/tests.md): this is how that is checked. It stops at the first run
# that fails. The busy processes, one per core, run in a process group of their own, stopped however the runs end.
set -euo pipefail
cd "$(dirname "$0")/.."
times=${1:?usage: bash tests/under_load.sh TIMES [test files or pytest args]}
shift
cores=$(nproc)
setsid bash -c 'for _ in $(seq "$1"); do python3 -c "while True: pass" & done; wait' load "$cores" &
load=$!
trap 'kill -TERM -- "-$load" 2>/dev/null || true' EXIT
for i in $(seq "$times"); do
  echo "[under_load] run $i of $times, beside $cores busy processes (one per core)"
  start=$(date +%s)
  bash run.sh test "$@"
  echo "[under_load] run $i passed in $(($(date +%s) - start)) s"
done
