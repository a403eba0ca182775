#!/bin/bash
# Call 1, one GPU, carry [".whl"]: this tree (the split rule at 2 programs an SM) measured for #39: the 512-row mixed
# step's profile (with the kernels' union: the step's gaps), the kernel and engine GPU tests, the README serve
# workload at c64/c128 (default flags, colocated) and the decode step at 64/128 over 1k. ~540 s of timeouts.
set -u
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 3
export NCCL_NVLS_ENABLE=0 PYTHONUNBUFFERED=1 PYTHONPATH=/tmp/site:.
R=/tmp/call1; mkdir -p $R $OUT
start=$(date +%s); t() { echo "$1 rc $2 at $(( $(date +%s) - start )) s"; }
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv > $R/gpu.txt 2>&1; cat $R/gpu.txt
timeout -k 5 70 python3 -m bench.probes.profile_mixed --model qwen2.5-7b --mixed 512 --batch 64 --context 1024 \
  > $R/profile-mixed.log 2>&1; t profile $?
grep -E "^step|^kernels|^  [a-z]|^    (attn_|gate_up|down|silu)" $R/profile-mixed.log
timeout -k 5 170 python3 -m pytest -m gpu -q -p no:cacheprovider tests/test_kernels_gpu.py tests/test_engine_gpu.py \
  > $R/gpu-tests.log 2>&1; t "gpu tests" $?; tail -3 $R/gpu-tests.log
(exec python3 -m decode_server --colocated --model qwen2.5-7b --listen 127.0.0.1:50051 --metrics-port 9101 \
   > $R/decode-server.log 2>&1) & DPID=$!
python3 -c "from bench.measure.launch import wait_serving; wait_serving('127.0.0.1:50051', [], timeout=150)"
t server $?
timeout -k 10 160 python3 -m bench.cli serve --addr 127.0.0.1:50051 --model qwen2.5-7b --num-prompts 1 \
    --prompts-per-concurrency 8 --concurrency 64,128 --input-len 1024 --input-len-range 0.5 --output-len 128 \
    --warmup 4 --timeout 300 --max-duration 100 --server-metrics http://127.0.0.1:9101/metrics \
    --out $R/serve > $R/serve.log 2>&1; t serve $?
grep -E "^\| (64|128) " $R/serve/report.md 2>/dev/null | head -4
kill -TERM $DPID 2>/dev/null; wait $DPID 2>/dev/null
timeout -k 10 80 python3 -m bench.cli decode --model qwen2.5-7b --batches 64,128 --contexts 1024 --hf none \
    --runs 20 --warmup 3 --out $R/decode > $R/decode.log 2>&1; t decode $?
grep -E "^\| (64|128) " $R/decode/report.md 2>/dev/null | head -4
tar -C /tmp -czf $OUT/call1.tgz call1
