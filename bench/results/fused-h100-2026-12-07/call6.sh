#!/bin/bash
# Call 6, one GPU, carry [".whl"]: with LONG_CHUNK = 1024 (the decode kernel's per-split cap): the interference
# bench's chunked arm (as call 4), then the decode step at 64/128 x 1k.
set -u
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 3
export NCCL_NVLS_ENABLE=0 PYTHONUNBUFFERED=1 PYTHONPATH=/tmp/site:.
R=/tmp/call6; mkdir -p $R $OUT
start=$(date +%s); t() { echo "$1 rc $2 at $(( $(date +%s) - start )) s"; }
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv > $R/gpu.txt 2>&1; cat $R/gpu.txt
grep -n "^LONG_CHUNK" kvtransfer/kernels/triton_attention.py
timeout -k 5 120 python3 -m bench.cli interference --model qwen2.5-7b --device cuda:0 --streams 32 --context 1024 \
   --arrivals 32000 --arms chunked --chunks 512 --gap-s 1 --log-dir $R/intf-logs --out $R/intf > $R/intf.log 2>&1
t interference $?; grep -E "^\| colocated" $R/intf/report.md | head -4
tar -C /tmp -czf $OUT/call6.tgz call6
timeout -k 10 70 python3 -m bench.cli decode --model qwen2.5-7b --batches 64,128 --contexts 1024 --hf none \
    --runs 10 --warmup 3 --out $R/decode > $R/decode.log 2>&1; t decode $?
grep -E "^\| (64|128) " $R/decode/report.md 2>/dev/null | head -4
tar -C /tmp -czf $OUT/call6.tgz call6
