#!/usr/bin/env bash
# Run the chaos mix (tests/test_chaos.py::test_the_chaos_mix_is_exactly_once) N times in a row,
# with BURNERS CPU burners (`yes > /dev/null`) running throughout; stop at the first failure.
#   scripts/chaos_loop.sh [N=20] [BURNERS=2]
# Prints one line per run (number, result, seconds, load) and the total; exit 1 on a failure
# (its pytest output is kept in $CHAOS_LOGS/run-N.log; pytest's folders under $CHAOS_LOGS too).
set -u
cd "$(dirname "$0")/.."
runs=${1:-20}
burners=${2:-2}
logs=${CHAOS_LOGS:-$(mktemp -d -t genq-chaos-XXXX)}
mkdir -p "$logs"
pids=()
cleanup() { for pid in "${pids[@]}"; do kill "$pid" 2>/dev/null; done; }
trap cleanup EXIT
for _ in $(seq "$burners"); do
  yes > /dev/null &
  pids+=($!)
done
echo "chaos loop: $runs runs, $burners CPU burners, started $(date -u +%FT%TZ), load: $(cut -d' ' -f1-3 /proc/loadavg)"
passed=0
for run in $(seq "$runs"); do
  start=$(date +%s)
  log="$logs/run-$run.log"
  if .venv/bin/python -m pytest tests/test_chaos.py -q -x -p no:cacheprovider --basetemp="$logs/tmp-$run" \
      -k test_the_chaos_mix_is_exactly_once > "$log" 2>&1; then
    passed=$((passed + 1))
    echo "run $run: passed in $(( $(date +%s) - start ))s, load $(cut -d' ' -f1-3 /proc/loadavg)"
    rm -rf "$log" "$logs/tmp-$run"
  else
    echo "run $run: FAILED in $(( $(date +%s) - start ))s, load $(cut -d' ' -f1-3 /proc/loadavg); see $log"
    echo "chaos loop: $passed of $runs passed in a row before the failure"
    exit 1
  fi
done
echo "chaos loop: $passed of $runs passed in a row, ended $(date -u +%FT%TZ)"
