#!/bin/bash
# Two-GPU call 1 of 3 (issue #14 items 1 and 4): the GPU tests on both GPUs, raw links, then TTFT prefill
# cuda:0 -> decode cuda:1 over nccl and over cuda_ipc. ~8 min (hard limits 480 s in all). Run from the repo root on nvidia-h200-x2 after
# the usual preamble (PYTHONPATH with the grpcio wheels, NCCL_NVLS_ENABLE=0); everything lands under $OUT.
# Each step has a hard `timeout`: a bench stopped by it prints its stacks and its servers' (kvtransfer/rpc/stacks.py).
set -u
source "$(dirname "$0")/need_gpus.sh" 2
export NCCL_DEBUG=${NCCL_DEBUG:-WARN} NCCL_NVLS_ENABLE=0
mkdir -p "$OUT"
{ git log -1 --format=%h; nvidia-smi topo -m; nvidia-smi --query-gpu=name,memory.total --format=csv; } > "$OUT/machine.txt" 2>&1
step() {  # step NAME SECONDS CMD...: its log under $OUT, the last line (the result JSON) cut to 600 chars
  local name=$1 secs=$2; shift 2
  timeout -k 40 "$secs" "$@" > "$OUT/$name.log" 2>&1; echo "$name rc=$? $(tail -c 600 "$OUT/$name.log" | tail -1)"
}
step gpu-tests 150 python3 -m pytest -m "gpu or gpu2" -q -p no:cacheprovider
step link 60 python3 -m bench.cli link --model qwen2.5-7b --length 32768 --out "$OUT/link"
for t in nccl cuda_ipc; do
  step "ttft-$t" 135 python3 -m bench.cli ttft --model qwen2.5-7b --dtype bfloat16 --transport "$t" \
      --prefill-device cuda:0 --decode-device cuda:1 --lengths 1024,32760 --runs 5 --warmup 1 --decode-tokens 2 \
      --log-dir "$OUT/logs-ttft-$t" --out "$OUT/ttft-$t"
done
