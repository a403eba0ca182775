#!/bin/bash
# Call 1, one GPU, carry [".whl"]: the fused mixed attention (the default since d65ceb9's parent) in serving, as an
# A/B in one call: the README serve workload (default flags, colocated, 8 prompts a unit of concurrency, c64/c128)
# against a decode server with runner.MIXED_ATTENTION "fused" (the default) and then "two" (the side-stream pair,
# the previous default), set in the server's process before it starts; the decode step at 64/128 over 1k (the ITL
# reference, same call); then the kernel and engine GPU tests in what time is left. Each stage tars to $OUT.
# First: the decode kernel at one split with and without the merge launch (attn_final.py); the kernels' GPU tests
# after serving.
set -u
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 3
export NCCL_NVLS_ENABLE=0 PYTHONUNBUFFERED=1 PYTHONPATH=/tmp/site:.
R=/tmp/call1; mkdir -p $R $OUT
start=$(date +%s); t() { echo "$1 rc $2 at $(( $(date +%s) - start )) s"; }
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv > $R/gpu.txt 2>&1; cat $R/gpu.txt
timeout -k 5 60 python3 bench/results/fused-h100-2026-12-07/attn_final.py > $R/attn-final.log 2>&1
t "decode kernel at one split, final vs merge" $?; cat $R/attn-final.log | tail -4
for arm in fused two; do
  (exec python3 -c 'import runpy, sys; import kvtransfer.engine.runner as r; r.MIXED_ATTENTION = sys.argv.pop(1); runpy.run_module("decode_server", run_name="__main__", alter_sys=True)' \
     $arm --colocated --model qwen2.5-7b --listen 127.0.0.1:50051 --metrics-port 9101 > $R/decode-server-$arm.log 2>&1) & DPID=$!
  python3 -c "from bench.measure.launch import wait_serving; wait_serving('127.0.0.1:50051', [], timeout=150)"
  t "server $arm" $?
  timeout -k 10 150 python3 -m bench.cli serve --addr 127.0.0.1:50051 --model qwen2.5-7b --num-prompts 1 \
      --prompts-per-concurrency 8 --concurrency 64,128 --input-len 1024 --input-len-range 0.5 --output-len 128 \
      --warmup 4 --timeout 300 --max-duration 100 --server-metrics http://127.0.0.1:9101/metrics \
      --out $R/serve-$arm > $R/serve-$arm.log 2>&1; t "serve $arm" $?
  grep -E "^\| (64|128) " $R/serve-$arm/report.md 2>/dev/null | head -4
  kill -TERM $DPID 2>/dev/null; wait $DPID 2>/dev/null
  tar -C /tmp -czf $OUT/call1.tgz call1
done
timeout -k 5 90 python3 -m pytest -m gpu -q -p no:cacheprovider -rfE tests/test_kernels_gpu.py \
  > $R/gpu-tests-kernels.log 2>&1; t "gpu tests (kernels)" $?; tail -2 $R/gpu-tests-kernels.log
tar -C /tmp -czf $OUT/call1.tgz call1
timeout -k 10 80 python3 -m bench.cli decode --model qwen2.5-7b --batches 64,128 --contexts 1024 --hf none \
    --runs 20 --warmup 3 --out $R/decode > $R/decode.log 2>&1; t decode $?
grep -E "^\| (64|128) " $R/decode/report.md 2>/dev/null | head -4
tar -C /tmp -czf $OUT/call1.tgz call1
left=$(( ${CAP:-575} - $(date +%s) + start )); [ $left -ge 20 ] || { echo "no time left for the tests"; exit 0; }
timeout -k 5 $left python3 -m pytest -m gpu -q -p no:cacheprovider -rfE tests/test_engine_gpu.py \
  > $R/gpu-tests-engine.log 2>&1; t "gpu tests (engine; ${left} s)" $?; tail -3 $R/gpu-tests-engine.log
tar -C /tmp -czf $OUT/call1.tgz call1
