#!/bin/bash
# Call B, one GPU, carry [".whl"]: the fused mixed attention (kvtransfer/kernels/triton_mixed_attention.py) on a GPU,
# everything in one call: its kernel GPU tests; the 512-row step's profile (64 decode rows at 1k) with the fused
# kernel and with the two kernels on the side stream (the previous default); the README serve workload against the
# colocated decode server at default flags in the same two arms (runner.MIXED_ATTENTION set in the server's process
# before it starts; 4 prompts a unit of concurrency: the session's device time left ~330 s); then the engine's
# GPU tests (mixed graphs, the ladder) in what time is left.
set -u
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 3
export NCCL_NVLS_ENABLE=0 PYTHONUNBUFFERED=1 PYTHONPATH=/tmp/site:.
R=/tmp/callB; mkdir -p $R $OUT
start=$(date +%s); t() { echo "$1 rc $2 at $(( $(date +%s) - start )) s"; }
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv > $R/gpu.txt 2>&1; cat $R/gpu.txt
timeout -k 5 50 python3 -m pytest -m gpu -q -p no:cacheprovider -rfE tests/test_kernels_gpu.py \
  -k "mixed_attention" > $R/gpu-tests-kernels.log 2>&1
t "gpu tests (the fused kernel's)" $?; tail -2 $R/gpu-tests-kernels.log
for arm in fused two; do
  timeout -k 5 45 python3 -m bench.probes.profile_mixed --model qwen2.5-7b --mixed 512 --batch 64 --context 1024 \
    --attention $arm > $R/profile-$arm.log 2>&1; t "profile $arm" $?
  grep -E "^step|^kernels|^    attn" $R/profile-$arm.log
done
tar -C /tmp -czf $OUT/callB.tgz callB  # what ran so far comes back if the call's limit cuts the rest
for arm in fused two; do
  (exec python3 -c 'import runpy, sys; import kvtransfer.engine.runner as r; r.MIXED_ATTENTION = sys.argv.pop(1); runpy.run_module("decode_server", run_name="__main__", alter_sys=True)' \
     $arm --colocated --model qwen2.5-7b --listen 127.0.0.1:50051 --metrics-port 9101 > $R/decode-server-$arm.log 2>&1) & DPID=$!
  python3 -c "from bench.measure.launch import wait_serving; wait_serving('127.0.0.1:50051', [], timeout=90)"
  t "server $arm" $?
  timeout -k 10 100 python3 -m bench.cli serve --addr 127.0.0.1:50051 --model qwen2.5-7b --num-prompts 1 \
      --prompts-per-concurrency 4 --concurrency 64,128 --input-len 1024 --input-len-range 0.5 --output-len 128 \
      --warmup 4 --timeout 300 --max-duration 100 --server-metrics http://127.0.0.1:9101/metrics \
      --out $R/serve-$arm > $R/serve-$arm.log 2>&1; t "serve $arm" $?
  grep -E "^\| (64|128) " $R/serve-$arm/report.md 2>/dev/null | head -4
  kill -TERM $DPID 2>/dev/null; wait $DPID 2>/dev/null
  tar -C /tmp -czf $OUT/callB.tgz callB
done
timeout -k 5 $(( 315 - $(date +%s) + start )) python3 -m pytest -m gpu -q -p no:cacheprovider -rfE tests/test_engine_gpu.py \
  > $R/gpu-tests-engine.log 2>&1; t "gpu tests engine" $?; tail -2 $R/gpu-tests-engine.log
tar -C /tmp -czf $OUT/callB.tgz callB
