#!/bin/bash
# Call 3, one GPU, carry [".whl"]: what ~230 s of device time allows after calls 1-2 found no machine: the decode
# kernel at one split with and without the merge launch (attn_final.py); the new one-split and the fused kernel's
# GPU tests; the README serve workload (default flags: the fused mixed attention) at c64/c128 with the roofline
# measured in the run; the decode step at 64/128 over 1k (the ITL reference). Each stage tars to $OUT.
set -u
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 3
export NCCL_NVLS_ENABLE=0 PYTHONUNBUFFERED=1 PYTHONPATH=/tmp/site:.
R=/tmp/call3; mkdir -p $R $OUT
start=$(date +%s); t() { echo "$1 rc $2 at $(( $(date +%s) - start )) s"; }
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv > $R/gpu.txt 2>&1; cat $R/gpu.txt
timeout -k 5 40 python3 bench/results/fused-h100-2026-12-07/attn_final.py > $R/attn-final.log 2>&1
t "decode kernel at one split, final vs merge" $?; cat $R/attn-final.log | tail -4
timeout -k 5 40 python3 -m pytest -m gpu -q -p no:cacheprovider -rfE tests/test_kernels_gpu.py \
  -k "one_split or mixed_attention" > $R/gpu-tests-kernels.log 2>&1; t "gpu tests (one split, fused)" $?
tail -2 $R/gpu-tests-kernels.log
tar -C /tmp -czf $OUT/call3.tgz call3
(exec python3 -m decode_server --colocated --model qwen2.5-7b --listen 127.0.0.1:50051 --metrics-port 9101 \
   > $R/decode-server.log 2>&1) & DPID=$!
python3 -c "from bench.measure.launch import wait_serving; wait_serving('127.0.0.1:50051', [], timeout=90)"
t server $?
timeout -k 10 100 python3 -m bench.cli serve --addr 127.0.0.1:50051 --model qwen2.5-7b --num-prompts 1 \
    --prompts-per-concurrency 8 --concurrency 64,128 --input-len 1024 --input-len-range 0.5 --output-len 128 \
    --warmup 4 --timeout 300 --max-duration 100 --server-metrics http://127.0.0.1:9101/metrics \
    --out $R/serve > $R/serve.log 2>&1; t serve $?
grep -E "^\| (64|128) " $R/serve/report.md 2>/dev/null | head -4
kill -TERM $DPID 2>/dev/null; wait $DPID 2>/dev/null
tar -C /tmp -czf $OUT/call3.tgz call3
timeout -k 10 60 python3 -m bench.cli decode --model qwen2.5-7b --batches 64,128 --contexts 1024 --hf none \
    --runs 10 --warmup 3 --out $R/decode > $R/decode.log 2>&1; t decode $?
grep -E "^\| (64|128) " $R/decode/report.md 2>/dev/null | head -4
tar -C /tmp -czf $OUT/call3.tgz call3
