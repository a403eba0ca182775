#!/bin/bash
# Call 7 (prepared for the next session, not run), one GPU, carry [".whl", "out/gpu_base"] (out/gpu_base: `git
# archive 02dcfb7 -- . ':!bench/results'`): #39's second point on the tree with the first-token read moved one gap
# later and the per-split cap: the interference bench's chunked arm, this tree then 02dcfb7; then the README serve
# workload with default flags at c64/c128 (what the cap costs in serving), the engine/kernel/defaults GPU tests
# (the first token's read through pinned memory has not run on CUDA yet), the decode step at 64/128 x 1k.
set -u
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 3
export NCCL_NVLS_ENABLE=0 PYTHONUNBUFFERED=1
R=/tmp/call7; mkdir -p $R $OUT
start=$(date +%s); t() { echo "$1 rc $2 at $(( $(date +%s) - start )) s"; }
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv > $R/gpu.txt 2>&1; cat $R/gpu.txt
for arm in new base; do
  tree=.; [ $arm = base ] && tree=out/gpu_base
  (cd $tree && PYTHONPATH=/tmp/site:. timeout -k 5 150 python3 -m bench.cli interference --model qwen2.5-7b \
     --device cuda:0 --streams 32 --context 1024 --arrivals 32000 --arms chunked --chunks 512 --gap-s 1 \
     --log-dir $R/intf-logs-$arm --out $R/intf-$arm > $R/intf-$arm.log 2>&1); t "interference $arm" $?
  grep -E "^\| colocated" $R/intf-$arm/report.md | head -4
  tar -C /tmp -czf $OUT/call7.tgz call7
done
export PYTHONPATH=/tmp/site:.
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
tar -C /tmp -czf $OUT/call7.tgz call7
timeout -k 5 120 python3 -m pytest -m gpu -q -p no:cacheprovider -rfE tests/test_engine_gpu.py tests/test_kernels_gpu.py \
  tests/test_defaults_gpu.py > $R/gpu-tests.log 2>&1; t "gpu tests (engine: the moved read on CUDA; kernels; defaults)" $?
tail -3 $R/gpu-tests.log; tar -C /tmp -czf $OUT/call7.tgz call7
timeout -k 10 70 python3 -m bench.cli decode --model qwen2.5-7b --batches 64,128 --contexts 1024 --hf none \
    --runs 10 --warmup 3 --out $R/decode > $R/decode.log 2>&1; t decode $?
grep -E "^\| (64|128) " $R/decode/report.md 2>/dev/null | head -4
tar -C /tmp -czf $OUT/call7.tgz call7
