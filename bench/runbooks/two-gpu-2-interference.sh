#!/bin/bash
# Two-GPU call 2 of 3 (issue #14 item 2): the interference bench's disaggregated arm on two GPUs (prefill cuda:0,
# decode cuda:1) over nccl and over cuda_ipc, beside colocated and chunked on cuda:1 of the same machine, the
# workload of ../results/interference-h200-2026-12-01/. ~8 min (hard limits 450 s). Preamble and $OUT as in two-gpu-1-smoke.sh.
set -u
source "$(dirname "$0")/need_gpus.sh" 2
export NCCL_DEBUG=${NCCL_DEBUG:-WARN} NCCL_NVLS_ENABLE=0
mkdir -p "$OUT"
step() {
  local name=$1 secs=$2; shift 2
  timeout -k 40 "$secs" "$@" > "$OUT/$name.log" 2>&1; echo "$name rc=$? $(tail -c 600 "$OUT/$name.log" | tail -1)"
}
common=(--model qwen2.5-7b --device cuda:1 --prefill-device cuda:0 --streams 32 --context 1024
        --arrivals 4096,16384,32000 --gap-s 1)
step intf-nccl 300 python3 -m bench.cli interference "${common[@]}" --arms colocated,chunked,disagg \
    --chunks 512 --transport nccl --log-dir "$OUT/logs-intf-nccl" --out "$OUT/intf-nccl"
step intf-cuda-ipc 150 python3 -m bench.cli interference "${common[@]}" --arms disagg --transport cuda_ipc \
    --log-dir "$OUT/logs-intf-ipc" --out "$OUT/intf-cuda-ipc"
