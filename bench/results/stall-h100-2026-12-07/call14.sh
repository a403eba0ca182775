#!/bin/bash
# Call 14 (ran 2026-12-07 16:50 UTC on 3f5bc05, see COMMAND.md), one GPU, carry [".whl"]: #39's first point on this tree (the rope+store
# length a runtime int, the local prefill's warm-up at start): the README serve workload with default flags at
# c64 / c128 (output tok/s against the roofline measured in the run, ITL p50), then the decode step at 64 / 128 x 1k
# (the ITL ratio's denominator). The same commands as bench/results/fused-h100-2026-12-07/call7.sh. ~300 s.
# The whole GPU suite on this tree: `call12.sh a`, then `call12.sh b`.
set -u
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 3
export NCCL_NVLS_ENABLE=0 PYTHONUNBUFFERED=1 PYTHONPATH=/tmp/site:.
R=/tmp/call14; mkdir -p $R $OUT
start=$(date +%s); t() { echo "$1 rc $2 at $(( $(date +%s) - start )) s"; }
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv > $R/gpu.txt 2>&1; cat $R/gpu.txt
(exec python3 -m decode_server --colocated --model qwen2.5-7b --listen 127.0.0.1:50051 --metrics-port 9101 \
   > $R/decode-server.log 2>&1) & DPID=$!
python3 -c "from bench.measure.launch import wait_serving; wait_serving('127.0.0.1:50051', [], timeout=150)"
t server $?
timeout -k 10 150 python3 -m bench.cli serve --addr 127.0.0.1:50051 --model qwen2.5-7b --num-prompts 1 \
    --prompts-per-concurrency 8 --concurrency 64,128 --input-len 1024 --input-len-range 0.5 --output-len 128 \
    --warmup 4 --timeout 300 --max-duration 100 --server-metrics http://127.0.0.1:9101/metrics \
    --out $R/serve > $R/serve.log 2>&1; t serve $?
grep -E "^\| (64|128) " $R/serve/report.md 2>/dev/null | head -4
kill -TERM $DPID 2>/dev/null; wait $DPID 2>/dev/null
tar -C /tmp -czf $OUT/call14.tgz call14
timeout -k 10 70 python3 -m bench.cli decode --model qwen2.5-7b --batches 64,128 --contexts 1024 --hf none \
    --runs 10 --warmup 3 --out $R/decode > $R/decode.log 2>&1; t decode $?
grep -E "^\| (64|128) " $R/decode/report.md 2>/dev/null | head -4
tar -C /tmp -czf $OUT/call14.tgz call14
