#!/usr/bin/env bash
# GPU check of the parallel executor (< 8 min on one GPU): equivalence tests on CUDA + the speedup benchmark.
#   usage: benchmarks/gpu_check.sh            (from the repository root, on a machine with a CUDA GPU)
# Uses an existing venv (.venv-tl4, else .venv-tl3) if its torch sees CUDA; otherwise the system python3's
# torch if that sees CUDA; otherwise creates .venv-tl4 via scripts/setup_env.sh (a CPU torch there cannot
# use the GPU: the script then says so and stops).
set -uo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
cd "$root"
out="${OUT:-$root/benchmarks/out}"
mkdir -p "$out"
has_cuda() { "$1" -c 'import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)' 2>/dev/null; }
py=""
for cand in .venv-tl4/bin/python .venv-tl3/bin/python; do
  if [ -x "$cand" ] && has_cuda "$cand"; then py="$cand"; break; fi
done
if [ -z "$py" ] && command -v python3 >/dev/null && has_cuda python3 && python3 -c 'import transformer_lens' 2>/dev/null; then
  py=python3
fi
if [ -z "$py" ]; then
  [ -x .venv-tl4/bin/python ] || timeout 300 bash scripts/setup_env.sh tl4
  if has_cuda .venv-tl4/bin/python; then py=.venv-tl4/bin/python; else
    echo "gpu_check: no Python here has a CUDA torch (torch.cuda.is_available() is False in .venv-tl4/.venv-tl3/python3)."
    echo "gpu_check: install a CUDA build of torch into the venv (pip install torch --index-url https://download.pytorch.org/whl/cu124) and rerun."
    exit 3
  fi
fi
echo "[gpu_check] python: $py"
"$py" -c 'import torch, transformer_lens; print("[gpu_check] torch", torch.__version__, "cuda", torch.version.cuda, torch.cuda.get_device_name(0))'
set -x
# 1) equivalence on CUDA (unit: tiny models incl. streams=True; the gpu-marked tests run here), ~1-2 min
timeout 240 "$py" -m pytest tests/unit/test_parallel.py -q -p no:cacheprovider -m gpu -x 2>&1 | tail -5
# 2) the benchmark on CUDA (SmolLM2-135M), ~3 min
timeout 300 "$py" benchmarks/parallel_speedup.py --device cuda --repeats 30 --sub-repeats 15 --unfused \
  --json "$out/parallel_speedup_cuda.json" 2>&1 | tail -40
# 3) scale-out probe scan on NCCL: 1..N processes, one GPU each (N = number of GPUs; one GPU: the 1-process row)
ngpu=$("$py" -c 'import torch; print(torch.cuda.device_count())')
nprocs=$(seq -s, 1 "$ngpu")
timeout 300 "$py" benchmarks/scale_scan.py --device cuda --nprocs "$nprocs" --windows 256 --length 128 \
  --shard-windows 32 --batch-size 32 --json "$out/scale_scan_cuda.json" 2>&1 | tail -12
