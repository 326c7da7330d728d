#!/usr/bin/env bash
# The GPU check of kvmix's Triton kernels, in under 8 minutes on one H200:
#   1. the kernel and encoder tests compiled for CUDA (no interpreter): outputs against the
#      reference path, encoded blocks bit for bit against the torch encoder;
#   2. the attention op alone on an 8B-like shape (32 query heads, 8 KV heads, head dim 128),
#      contexts 16K-128K, batch 1 and 8, float16: kivi2 and pnmix1 beside float16 SDPA and the
#      float16 variant of the same split-K kernels (µs per layer-step, GB/s, ratios, encode µs);
#   3. the same on the default model's shape (SmolLM2-135M: 9 query heads, 3 KV heads, D 64).
# Usage: scripts/gpu_check.sh [OUT_DIR] [WHEELS_DIR]
#   OUT_DIR defaults to $OUT (the device tool's folder) or ./gpu-check; WHEELS_DIR, if it
#   exists, holds wheels to install first (e.g. the transformers release kvmix needs).
set -euo pipefail
out=${1:-${OUT:-gpu-check}}
wheels=${2:-wheels}
mkdir -p "$out"
cd "$(dirname "$0")/.."
if [ -d "$wheels" ]; then
  python -m pip install --quiet --no-deps --no-index "$wheels"/*.whl
fi
export PYTHONPATH="$PWD/src:$PWD/tests${PYTHONPATH:+:$PYTHONPATH}"
unset TRITON_INTERPRET
python - <<'PY' | tee "$out/env.txt"
import torch, transformers, triton
assert torch.cuda.is_available(), "no CUDA device"
print(torch.__version__, transformers.__version__, triton.__version__,
      torch.cuda.get_device_name())
PY
# 1. tests on the device (about 2-3 minutes, mostly kernel compilation)
timeout 240 python -m pytest -q -x -p no:cacheprovider tests/core/test_fused.py \
  tests/runtime/test_triton.py 2>&1 | tail -n 30 | tee "$out/tests.txt"
# 2. 8B-like attention shape
timeout 240 python -m kvmix.cli bench --shape 32,8,128 --context 16384,32768,65536,131072 \
  --batch 1,8 --methods kivi2,pnmix1 --device cuda --dtype float16 --backend triton \
  --new-tokens 30 --rounds 3 --out "$out/shape-8b" 2>&1 | tee "$out/shape-8b.txt"
# 3. the default model's attention shape
timeout 90 python -m kvmix.cli bench --shape 9,3,64 --context 16384,65536 --batch 1,8 \
  --methods kivi2,pnmix1 --device cuda --dtype float16 --backend triton \
  --new-tokens 30 --rounds 3 --out "$out/shape-smollm2" 2>&1 | tee "$out/shape-smollm2.txt"
