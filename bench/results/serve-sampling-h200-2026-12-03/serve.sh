#!/bin/bash
# One H200 (nvidia-h200), carry [".whl"], from the repo root: the README serve workload (input 1024 +-50%, output
# 128, 1,024 prompts at concurrency 32) against one colocated decode server with default flags (qwen2.5-7b preset)
# on the final tree of 2026-12-03: greedy over gRPC, then every request sampling (temperature 1, top_p 0.9) over
# gRPC and over HTTP (kvtransfer-api in front, token ids, no tokenizer).
set -u
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 3
export PYTHONPATH=/tmp/site:. NCCL_NVLS_ENABLE=0 PYTHONUNBUFFERED=1
mkdir -p $OUT/r
t0=$(date +%s)
python3 -m decode_server --colocated --model qwen2.5-7b --listen 127.0.0.1:50051 --metrics-port 9101 \
  > $OUT/r/decode.log 2>&1 & dpid=$!
python3 -m api_server --backend 127.0.0.1:50051 --listen 127.0.0.1:8000 --metrics-port 9102 > $OUT/r/api.log 2>&1 & apid=$!
python3 -c "from bench.measure.launch import wait_serving; wait_serving('127.0.0.1:50051', [], timeout=240)" \
  || { echo "decode never SERVING"; tail -20 $OUT/r/decode.log; }
for i in $(seq 60); do curl -sf http://127.0.0.1:8000/health > /dev/null && break; sleep 2; done
echo "serving after $(( $(date +%s) - t0 )) s"
W="--model qwen2.5-7b --num-prompts 1024 --concurrency 32 --input-len 1024 --input-len-range 0.5 --output-len 128 \
   --warmup 4 --timeout 600 --server-metrics http://127.0.0.1:9101/metrics"
for run in grpc-greedy grpc-sampling http-sampling; do
  door=$([ ${run%%-*} = http ] && echo "--api http://127.0.0.1:8000" || echo "--addr 127.0.0.1:50051")
  samp=$([ ${run##*-} = sampling ] && echo "--temperature 1 --top-p 0.9" || echo "")
  timeout 150 python3 -m bench.cli serve $door $W $samp --out $OUT/r/serve-$run > $OUT/r/serve-$run.log 2>&1
  echo "$run rc $?: $(tail -1 $OUT/r/serve-$run.log | python3 -c "import json,sys; r=json.loads(sys.stdin.read()); print({k: r.get(k) for k in ('completed','failed','output_throughput','sustained_output_throughput','median_ttft_ms','median_itl_ms','p99_itl_ms')})" 2>&1 | cut -c1-400)"
  tar -C $OUT -czf $OUT/serve.tgz r
done
kill -TERM $apid $dpid; wait $apid $dpid; echo "servers exited $?"
tar -C $OUT -czf $OUT/serve.tgz r && rm -rf $OUT/r
