#!/usr/bin/env bash
# The GPU check of kvmix's Triton kernels, decode step and batched runtime, in under 8 minutes
# on one H200 (every step has its own time limit), then every target of the GPU decode step
# (shape 32:8 × 128, float16) with its measured figure, in targets.txt:
#   1. the kernel, encoder and step tests compiled for CUDA (no interpreter): outputs against
#      the reference path (per sequence, and the batched pass over a ragged batch, split and
#      unsplit), encoded blocks bit for bit against the torch encoder, equal launch arguments
#      from step to step;
#   2. the batched decode kernels alone on an 8B-like layer (32 query heads, 8 KV heads, head
#      dim 128), batch 1/8/32, contexts 16K/64K, float16: µs per layer step (and the host's
#      share, without graphs) beside float SDPA and the float variant of the same kernels, and
#      the fraction of the device's measured copy bandwidth;
#   3. the decode step without host work (scripts/gpu_step.py): steps under
#      torch.cuda.set_sync_debug_mode("error"), a step's attention captured as a CUDA graph and
#      replayed after new tokens and sealed pages (== eager), host µs per layer step;
#   4. throughput at equal memory on a random-weight 1B-class model built from a config
#      (scripts/gpu_throughput.py): generate beside DynamicCache, and served output tokens/s of
#      kvmix's continuous batching against transformers' paged float continuous batching with
#      its CUDA graphs on.
# Usage: scripts/gpu_check.sh [OUT_DIR] [WHEELS_DIR]
#   OUT_DIR defaults to $OUT (the device tool's folder) or ./gpu-check; WHEELS_DIR, if it
#   exists, holds wheels to install first (the transformers release kvmix needs and its
#   dependencies: pip download -d wheels transformers==5.24.0 rich).
set -uo pipefail
out=${1:-${OUT:-gpu-check}}
wheels=${2:-wheels}
mkdir -p "$out"
cd "$(dirname "$0")/.."
if [ -d "$wheels" ]; then
  python -m pip install --quiet --no-index --find-links "$wheels" transformers==5.24.0 rich \
    2>&1 | tail -n 3
fi
export PYTHONPATH="$PWD/src:$PWD/tests${PYTHONPATH:+:$PYTHONPATH}"
unset TRITON_INTERPRET
python - <<'PY' 2>&1 | tee "$out/env.txt"
import sys, torch, transformers, triton
assert torch.cuda.is_available(), "no CUDA device"
print(sys.version.split()[0], torch.__version__, transformers.__version__, triton.__version__,
      torch.cuda.get_device_name())
PY
# 1. tests on the device (mostly kernel compilation)
timeout 100 python -m pytest -q -x -p no:cacheprovider tests/core/test_fused.py \
  tests/runtime/test_triton.py 2>&1 | tail -n 30 | tee "$out/tests.txt"
timeout 40 python -m pytest -q -x -p no:cacheprovider tests/runtime/test_step.py -k triton \
  2>&1 | tail -n 30 | tee -a "$out/tests.txt"
# 2. the batched kernels on an 8B-like layer
timeout 130 python -m kvmix.cli bench --shape 32,8,128 --context 16384,65536 \
  --batch 1,8,32 --methods kivi2,pnmix1 --device cuda --dtype float16 --backend triton \
  --new-tokens 20 --rounds 2 --out "$out/shape-8b-fp16" 2>&1 | tee "$out/shape-8b-fp16.txt"
# 3. the decode step without host work
timeout 70 python scripts/gpu_step.py --out "$out/step" --context 15000 --batch 1,8 \
  --steps 40 2>&1 | tee "$out/step.txt"
# 4. throughput at equal memory
timeout 150 python scripts/gpu_throughput.py --out "$out/throughput" --requests 96 \
  2>&1 | tee "$out/throughput.txt"
# 5. kvmix inside vLLM: the plugin's step without an engine (its plan and layer cache over a
#    block table laid out as vLLM's, on the device: decode rows through kvmix's Triton kernels
#    compiled for it, prefill chunks, sealing) against the reference path on the CPU; where
#    mainline vLLM is installed, the plugin's tests with --attention-backend CUSTOM too
timeout 150 python -m pytest -q -x -p no:cacheprovider tests/vllm/test_plan.py -k triton \
  2>&1 | tail -n 30 | tee "$out/vllm-step.txt"
if python -c "import vllm" 2>/dev/null; then
  timeout 300 python -m pytest -q -x -p no:cacheprovider tests/vllm 2>&1 | tail -n 30 \
    | tee "$out/vllm.txt"
else
  echo "vllm is not installed: the plugin's section is skipped" | tee "$out/vllm.txt"
fi
# every target with its figure (a missing figure says so)
python scripts/gpu_targets.py "$out" 2>&1 | tee "$out/targets.txt"
