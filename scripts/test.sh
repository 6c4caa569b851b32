#!/usr/bin/env bash
# Set up both supported TransformerLens lines in fresh virtual environments and run the whole test suite in each:
#   .venv-tl4  TransformerLens 4.x (TransformerBridge)
#   .venv-tl3  TransformerLens 3.9 (HookedTransformer and TransformerBridge)
# Extra arguments go to pytest (e.g. scripts/test.sh -k deficit).
set -euo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
cd "$root"
status=0
for line in tl4 tl3; do
  echo "=== [$line] setting up .venv-$line"
  start=$(date +%s)
  bash scripts/setup_env.sh "$line" 2>&1 | { grep -v "is ignored: it is neither" || true; }
  echo "=== [$line] running tests ($(( $(date +%s) - start ))s set-up)"
  start=$(date +%s)
  # --durations: the slowest tests of each line are listed at the end (the 20-minute budget, CONTRIBUTING.md)
  if ".venv-$line/bin/python" -m pytest -m "not slow" -p no:cacheprovider --durations=15 "$@"; then
    echo "=== [$line] passed in $(( $(date +%s) - start ))s"
  else
    rc=$?
    # pytest exit 5 = no tests collected: that is a failure of this script's purpose, not a pass
    echo "=== [$line] FAILED (pytest exit $rc) after $(( $(date +%s) - start ))s"
    status=1
  fi
done
exit $status
