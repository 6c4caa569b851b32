#!/usr/bin/env bash
# Set up both supported TransformerLens lines in fresh virtual environments and run the whole test suite in each:
#   .venv-tl4  TransformerLens 4.x (TransformerBridge)
#   .venv-tl3  TransformerLens 3.9 (HookedTransformer and TransformerBridge)
# Extra arguments go to pytest (e.g. scripts/test.sh -k deficit).
#
# The two lines run at the same time, one CPU thread each (OMP_NUM_THREADS=1): most of a test's time is Python
# (TransformerLens's hook machinery, small matrices), which one process cannot spread over two cores, so two
# one-threaded processes finish far sooner than two two-threaded runs one after the other. Each line's output
# goes to .test-logs/<line>.log and is printed when that line ends. TL_STEERING_SERIAL=1 runs the lines one
# after the other (with torch's default threads) instead.
set -euo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
cd "$root"
for line in tl4 tl3; do
  echo "=== [$line] setting up .venv-$line"
  start=$(date +%s)
  bash scripts/setup_env.sh "$line" 2>&1 | { grep -v "is ignored: it is neither" || true; }
  echo "=== [$line] set up in $(( $(date +%s) - start ))s"
done

run_line() {  # run_line LINE [pytest args...]: the suite on one line; its exit status
  local line="$1"; shift
  local start rc=0
  start=$(date +%s)
  # --durations: the slowest tests of each line are listed at the end (the 20-minute budget, CONTRIBUTING.md)
  ".venv-$line/bin/python" -m pytest -m "not slow" -p no:cacheprovider --durations=15 "$@" || rc=$?
  if [ "$rc" = 0 ]; then
    echo "=== [$line] passed in $(( $(date +%s) - start ))s"
  else
    # pytest exit 5 = no tests collected: that is a failure of this script's purpose, not a pass
    echo "=== [$line] FAILED (pytest exit $rc) after $(( $(date +%s) - start ))s"
  fi
  return "$rc"
}

status=0
start=$(date +%s)
if [ "${TL_STEERING_SERIAL:-0}" = 1 ]; then
  for line in tl4 tl3; do run_line "$line" "$@" || status=1; done
else
  mkdir -p .test-logs
  declare -A pids
  for line in tl4 tl3; do
    echo "=== [$line] running tests (log: .test-logs/$line.log)"
    ( export OMP_NUM_THREADS=1 MKL_NUM_THREADS=1; run_line "$line" "$@" ) > ".test-logs/$line.log" 2>&1 &
    pids[$line]=$!
  done
  for line in tl4 tl3; do
    rc=0
    wait "${pids[$line]}" || rc=$?
    echo; echo "=================================== [$line] ==================================="
    cat ".test-logs/$line.log"
    [ "$rc" = 0 ] || status=1
  done
fi
echo "=== both lines done in $(( $(date +%s) - start ))s: $([ "$status" = 0 ] && echo passed || echo FAILED)"
exit $status
