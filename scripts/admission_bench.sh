#!/usr/bin/env bash
# Issue 41's side-by-side: vLLM's own benchmark client (24 clients x 512 random prompt tokens +
# 96 output tokens, EOS ignored) against `kvmix serve` at 90 MiB of KV with a float16 and a
# float32 residual, and against vLLM's CPU engine with its fp8 cache in the same bytes, one
# after the other on 127.0.0.1.
#
#     scripts/admission_bench.sh MODEL_DIR [OUT_DIR] [kvmix|vllm|both]
#
# MODEL_DIR: the default model saved as a float folder with its tokenizer (kvmix.models.loading
# .save_float). Needs .venv and .venv-vllm (make vllm).
set -euo pipefail
model=${1:?MODEL_DIR}
out=${2:-results/admission}
which=${3:-both}
mkdir -p "$out"
port=18731

wait_up() {  # pid: until its /health answers, or it exits
  for _ in $(seq 600); do
    curl -sf "http://127.0.0.1:$port/health" >/dev/null && return 0
    kill -0 "$1" 2>/dev/null || break
    sleep 1
  done
  echo "server did not start" >&2
  return 1
}

bench() {  # name
  .venv-vllm/bin/python -m kvmix.vllm.tools.bench --backend openai --base-url "http://127.0.0.1:$port" \
    --model "$model" --tokenizer "$model" --dataset-name random --random-input-len 512 \
    --random-output-len 96 --num-prompts 24 --max-concurrency 24 --ignore-eos \
    --save-result --result-dir "$out" --result-filename "$1.json" 2>&1 | tee "$out/$1.log" | tail -25
}

[ "$which" = vllm ] || for method in kivi2 kivi2:residual_dtype=float32; do
  .venv/bin/kvmix serve --model "$model" --method "$method" --memory 90MiB --max-tokens 96 \
    --host 127.0.0.1 --port $port > "$out/server-${method//[:=]/-}.log" 2>&1 &
  server=$!
  wait_up $server
  grep -m1 "requests of" "$out/server-${method//[:=]/-}.log" || true
  bench "kvmix-${method//[:=]/-}"
  kill -TERM $server
  wait $server || true
done

# vLLM: pages of 128 tokens, as many as 90 MiB holds (30 layers x 3 KV heads x 64 x 2 per token,
# 1 byte each for fp8, 4 for the float32 model's own cache: KV=auto); fp8 needs AVX-512 or AMX on
# CPU. The CPU backend reserves --gpu-memory-utilization of the RAM up front.
[ "$which" = kvmix ] && exit 0
kv=${KV:-fp8}
width=$([ "$kv" = auto ] && echo 4 || echo 1)
blocks=$(( 90 * 1024 * 1024 / (128 * 30 * 3 * 64 * 2 * width) ))
VLLM_CPU_OMP_THREADS_BIND=auto .venv-vllm/bin/python -m vllm.entrypoints.openai.api_server \
  --model "$model" --dtype float32 --enforce-eager --kv-cache-dtype "$kv" \
  --num-gpu-blocks-override $blocks --gpu-memory-utilization 0.5 --max-model-len 1024 \
  --host 127.0.0.1 --port $port > "$out/server-vllm-$kv.log" 2>&1 &
server=$!
if wait_up $server; then
  bench "vllm-$kv"
fi
kill -TERM $server
wait $server || true
