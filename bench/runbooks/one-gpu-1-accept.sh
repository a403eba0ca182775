#!/bin/bash
# One-GPU call (issues #37 and #40), written ahead of the machine: what the session of 2026-12-06 could not run.
# ~8 min (hard limits 540 s in all), on nvidia-h100-x1 or nvidia-h200 after the usual preamble (README.md here);
# everything lands under $OUT.
# 1. The gpu tests not run on the final tree: the batch-invariant step on qwen2.5-7b (alone, beside 7 and 63
#    neighbours, CUDA graphs, bit for bit; if it passes, runner.INVARIANT_ON_CUDA can turn the servers' mode on)
#    and the defaults' server starts.
# 2. #37: TTFT over gRPC at 4,096 tokens, both workers on this one GPU, this tree; then, in the same call, the
#    fixed-slot tree if gpu_base/ is there (make it before the call: mkdir gpu_base && git archive 02dcfb7 -- .
#    ':!bench/results' | tar -x -C gpu_base; it travels as an untracked folder).
set -u
export NCCL_NVLS_ENABLE=0
mkdir -p "$OUT"
{ git log -1 --format=%h 2>/dev/null; nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv; } \
    > "$OUT/machine.txt" 2>&1
step() {  # step NAME SECONDS CMD...: its log under $OUT, the last line (the result JSON) cut to 600 chars
  local name=$1 secs=$2; shift 2
  timeout -k 40 "$secs" "$@" > "$OUT/$name.log" 2>&1; echo "$name rc=$? $(tail -c 600 "$OUT/$name.log" | tail -1)"
}
step gpu-tests 200 python3 -m pytest -m gpu -q -p no:cacheprovider tests/test_batch_invariant_gpu.py \
    tests/test_defaults_gpu.py
TTFT=(-m bench.cli ttft --model qwen2.5-7b --transport grpc --prefill-device cuda:0 --decode-device cuda:0
      --lengths 4096 --runs 5 --warmup 1 --decode-tokens 4)
step ttft-grpc 140 python3 "${TTFT[@]}" --log-dir "$OUT/logs-ttft-grpc" --out "$OUT/ttft-grpc"
if [ -d gpu_base ]; then
  (cd gpu_base && step ttft-grpc-base 140 python3 "${TTFT[@]}" --log-dir "$OUT/logs-ttft-grpc-base" \
      --out "$OUT/ttft-grpc-base")
else
  echo "ttft-grpc-base: no gpu_base/ (the fixed-slot tree), not run"
fi
