#!/usr/bin/env bash
# GPU check of the parallel executor (< 8 min on one GPU): equivalence on CUDA + the speedup benchmark.
#   usage: benchmarks/gpu_check.sh [quick|noscan]   (from the repository root, on a machine with a CUDA GPU)
#
# Python: an existing venv (.venv-tl4, else .venv-tl3) whose torch sees CUDA; otherwise the system python3 if its
# torch sees CUDA, with TransformerLens either installed or carried as wheels in .whl/ (installed with --no-deps into
# /tmp/site: the lent GPU machines have torch and transformers but no TransformerLens and no network); otherwise
# .venv-tl4 via scripts/setup_env.sh (a CPU torch there cannot use the GPU: the script says so and stops).
#
# Weights: a lent GPU machine takes a 64 MiB working tree, and SmolLM2's GGUF is 94 MB. Where the offline weights
# are absent but .gpu/smollm2-135m-config/ holds SmolLM2's config.json and tokenizer (copied from the weight cache's
# entry, ~/.cache/tl_steering/dequantized/smollm2-135m-*/, without model.safetensors), the speedup benchmark times a
# RANDOM-INIT model of SmolLM2's exact architecture (timings do not depend on the weights' values) with the plan
# given by PLAN_LAYERS (chosen on CPU with the real weights; its held-out dCE comes from that CPU run).
set -uo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
cd "$root"
mode="${1:-full}"
out="${OUT:-$root/benchmarks/out}"
mkdir -p "$out"
# the report's chosen plan on SmolLM2 at k = 15 (attribution_abs with the affine refit; docs/parallel.md)
PLAN_LAYERS="${PLAN_LAYERS:-6,7,8,9,14,15,18,20,21,22,23,24,25,26,27}"
has_cuda() { "$1" -c 'import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)' 2>/dev/null; }
py=""
for cand in .venv-tl4/bin/python .venv-tl3/bin/python; do
  if [ -x "$cand" ] && has_cuda "$cand"; then py="$cand"; break; fi
done
if [ -z "$py" ] && command -v python3 >/dev/null && has_cuda python3; then
  if ! python3 -c 'import transformer_lens' 2>/dev/null && ls .whl/*.whl >/dev/null 2>&1; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
      && export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
  fi
  python3 -c 'import transformer_lens' && py=python3
fi
if [ -z "$py" ]; then
  [ -x .venv-tl4/bin/python ] || timeout 300 bash scripts/setup_env.sh tl4
  if has_cuda .venv-tl4/bin/python; then py=.venv-tl4/bin/python; else
    echo "gpu_check: no Python here has a CUDA torch (torch.cuda.is_available() is False in .venv-tl4/.venv-tl3/python3)."
    echo "gpu_check: install a CUDA build of torch into the venv (pip install torch --index-url https://download.pytorch.org/whl/cu124) and rerun."
    exit 3
  fi
fi
export PYTHONUNBUFFERED=1
echo "[gpu_check] python: $py"
"$py" -c 'import torch, transformers, tl_steering as ts; print("[gpu_check] torch", torch.__version__, "cuda", torch.version.cuda, torch.cuda.get_device_name(0), "| transformers", transformers.__version__, "| TL", ts.tl_version())'
if "$py" -c 'from tl_steering.backends import smollm2_gguf_path as p; p()' 2>/dev/null; then
  model_args=(--model smollm2-135m)
elif [ -f .gpu/smollm2-135m-config/config.json ]; then
  model_args=(--hf-config .gpu/smollm2-135m-config --layers "$PLAN_LAYERS")
  echo "[gpu_check] SmolLM2 weights absent: timing a random-init model of its architecture, plan $PLAN_LAYERS"
else
  model_args=(--model tiny-llama)
fi
set -x
# 1) equivalence on CUDA: the gpu-marked unit tests (tiny models, streams on/off)
timeout 240 "$py" -m pytest tests/unit/parallel/test_apply.py -q -p no:cacheprovider -m gpu -x 2>&1 | tail -5
# 2) protocols on the device equal the CPU, parallelize equals the hook surrogate, forward times (no weights needed)
PYTHONPATH=".${PYTHONPATH:+:$PYTHONPATH}" timeout 200 "$py" benchmarks/gpu_shape_check.py --device cuda --repeats 20 --json "$out/gpu_shape_check.json" 2>&1 | tail -30
# 3) the speedup benchmark on CUDA: TL model vs the executor's sequential model vs the parallel model
for dt in float32 bfloat16; do
  reps=30; [ "$mode" = quick ] && reps=10
  timeout 300 "$py" benchmarks/parallel_speedup.py --device cuda --dtype "$dt" --repeats "$reps" --sub-repeats 10 \
    --controls unfused "${model_args[@]}" --json "$out/parallel_speedup_cuda_$dt.json" 2>&1 | tail -14
done
# mode "noscan": stop here (the scan's one-GPU row needs no new run)
if [ "$mode" = quick ] || [ "$mode" = noscan ]; then exit 0; fi
# 4) scale-out probe scan on NCCL: 1..N processes, one GPU each (N = number of GPUs; one GPU: the 1-process row)
ngpu=$("$py" -c 'import torch; print(torch.cuda.device_count())')
nprocs=$(seq -s, 1 "$ngpu")
scan_model=smollm2-135m; [ "${model_args[0]}" = --model ] || scan_model=tiny-llama
timeout 300 "$py" benchmarks/scale_scan.py --model "$scan_model" --device cuda --nprocs "$nprocs" --windows 256 \
  --length 128 --shard-windows 32 --batch-size 32 --json "$out/scale_scan_cuda.json" 2>&1 | tail -12
