#!/usr/bin/env bash
# Set up both supported TransformerLens lines in fresh virtual environments and run the whole test suite in each:
#   .venv-tl4  TransformerLens 4.x (TransformerBridge)
#   .venv-tl3  TransformerLens 3.9 (HookedTransformer and TransformerBridge)
# then the numerically sensitive rooms a second time under another CPU kernel path (AVX2-only MKL and ATen
# dispatch: other summation orders than the AVX-512 kernels most machines here take), so that a tolerance tuned to
# one CPU's rounding fails here and not on a user's laptop (CONTRIBUTING.md, "Kernel paths").
# Extra arguments go to pytest (e.g. scripts/test.sh -k deficit); the second kernel pass then runs only with
# TL_STEERING_KERNEL_PASS=1.
#
# Set-up: the two lines install at the same time. Tests: the two lines run at the same time, one CPU thread each
# (OMP_NUM_THREADS=1): most of a test's time is Python (TransformerLens's hook machinery, small matrices), which one
# process cannot spread over two cores. Each line then runs its share of the kernel pass. Each line's
# output goes to .test-logs/<line>.log and is printed when that line ends. TL_STEERING_SERIAL=1 runs the lines one
# after the other (with torch's default threads) instead.
set -euo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
cd "$root"
mkdir -p .test-logs
start=$(date +%s)

# -- set-up: both lines at once ------------------------------------------------------------------------------------
declare -A setup_pids
for line in tl4 tl3; do
  echo "=== [$line] setting up .venv-$line (log: .test-logs/setup-$line.log)"
  ( bash scripts/setup_env.sh "$line" 2>&1 | { grep -v "is ignored: it is neither" || true; } ) \
    > ".test-logs/setup-$line.log" 2>&1 &
  setup_pids[$line]=$!
done
for line in tl4 tl3; do
  if ! wait "${setup_pids[$line]}"; then
    cat ".test-logs/setup-$line.log"
    echo "=== [$line] set-up FAILED"
    exit 1
  fi
  tail -n 1 ".test-logs/setup-$line.log"
done
echo "=== both lines set up in $(( $(date +%s) - start ))s"

# The rooms whose numbers depend on summation order (geometry, metrics, statistics, the probe's kernels, the
# solvers, the protocols, the planner), run again under AVX2-only kernels. Not test_scan.py: it checks how shards
# and processes split and resume (its numbers are compared within one kernel path), in child processes; not the
# d = 576 planted landscape (30 s; its d = 12-32 siblings and the d = 576 flow tests run here).
# The rooms are split over the two lines, each pass after its line's suite, so that the two lines end together:
# critical/ and the statistics (most of their tests run on TL 4.x only) after TL 4.x, the rest after TL 3.9.
declare -A KERNEL_ROOMS=(
  [tl4]="tests/unit/critical tests/unit/test_geometry.py tests/unit/test_metrics.py tests/unit/test_stats.py"
  [tl3]="tests/unit/probing tests/unit/parallel tests/unit/protocols")
KERNEL_ENV=(MKL_ENABLE_INSTRUCTIONS=AVX2 ATEN_CPU_CAPABILITY=avx2)

run_line() {  # run_line LINE [pytest args...]: the suite on one line; its exit status
  local line="$1"; shift
  local t0 rc=0
  t0=$(date +%s)
  # --durations: the slowest tests of each line are listed at the end (the 20-minute budget, CONTRIBUTING.md)
  ".venv-$line/bin/python" -m pytest -m "not slow" -p no:cacheprovider --durations=15 "$@" || rc=$?
  if [ "$rc" = 0 ]; then
    echo "=== [$line] passed in $(( $(date +%s) - t0 ))s"
  else
    # pytest exit 5 = no tests collected: that is a failure of this script's purpose, not a pass
    echo "=== [$line] FAILED (pytest exit $rc) after $(( $(date +%s) - t0 ))s"
  fi
  return "$rc"
}

run_kernel_pass() {  # run_kernel_pass LINE: the sensitive rooms under AVX2-only dispatch; its exit status
  local line="$1" t0 rc=0 rooms
  read -r -a rooms <<< "${KERNEL_ROOMS[$line]}"
  if [ "$#" -gt 1 ] || { [ "${extra_args:-0}" = 1 ] && [ "${TL_STEERING_KERNEL_PASS:-0}" != 1 ]; }; then
    echo "=== [$line, AVX2 kernels] skipped (pytest arguments given; TL_STEERING_KERNEL_PASS=1 runs it)"
    return 0
  fi
  t0=$(date +%s)
  echo "=== [$line, AVX2 kernels] ${KERNEL_ENV[*]}: ${rooms[*]}"
  env "${KERNEL_ENV[@]}" ".venv-$line/bin/python" -c \
    "import torch; c = torch.backends.cpu.get_cpu_capability(); print('ATen CPU capability:', c); assert c in ('AVX2', 'DEFAULT'), c" \
    || return 1
  env "${KERNEL_ENV[@]}" ".venv-$line/bin/python" -m pytest -m "not slow" -p no:cacheprovider -q \
    --ignore=tests/unit/probing/test_scan.py "${rooms[@]}" \
    --deselect tests/unit/critical/test_landscape.py::test_default_finder_finds_every_planted_equilibrium_d576 || rc=$?
  if [ "$rc" = 0 ]; then
    echo "=== [$line, AVX2 kernels] passed in $(( $(date +%s) - t0 ))s"
  else
    echo "=== [$line, AVX2 kernels] FAILED (pytest exit $rc) after $(( $(date +%s) - t0 ))s"
  fi
  return "$rc"
}

extra_args=0
[ "$#" -gt 0 ] && extra_args=1
status=0
t_tests=$(date +%s)
if [ "${TL_STEERING_SERIAL:-0}" = 1 ]; then
  for line in tl4 tl3; do run_line "$line" "$@" || status=1; done
  for line in tl4 tl3; do run_kernel_pass "$line" || status=1; done
else
  declare -A pids
  for line in tl4 tl3; do
    echo "=== [$line] running tests (log: .test-logs/$line.log)"
    (
      export OMP_NUM_THREADS=1 MKL_NUM_THREADS=1
      rc=0
      run_line "$line" "$@" || rc=1
      run_kernel_pass "$line" || rc=1
      exit "$rc"
    ) > ".test-logs/$line.log" 2>&1 &
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
echo "=== tests done in $(( $(date +%s) - t_tests ))s; set-up and tests $(( $(date +%s) - start ))s:" \
  "$([ "$status" = 0 ] && echo passed || echo FAILED)"
exit $status
