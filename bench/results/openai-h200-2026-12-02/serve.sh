#!/bin/bash
# #26's serve acceptance on one H200 (nvidia-h200), from the repo root, carry [".whl"] (.whl: the front's wheels;
# .whl/stock: guidellm's, bench/stock/gpu-wheels.txt). One colocated decode server with default flags
# (qwen2.5-7b preset) and kvtransfer-api in front of it (the preset's word tokenizer, bench/stock/tokenizer.py).
# The README serve workload (input 1024 +-50%, output 128, 1,024 prompts at concurrency 32), sent by
# `kvtransfer-bench serve` over gRPC and over HTTP, alternating (grpc, http, grpc, http), then by guidellm
# (bench/stock/run_stock.sh) through HTTP.
set -u
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/stocksite .whl/stock/*.whl
export PYTHONPATH=/tmp/site:. NCCL_NVLS_ENABLE=0 PYTHONUNBUFFERED=1
mkdir -p $OUT/r
python3 -m bench.stock.tokenizer --model qwen2.5-7b --out /tmp/qwen-words
python3 -m decode_server --colocated --model qwen2.5-7b --listen 127.0.0.1:50051 --metrics-port 9101 \
  > $OUT/r/decode.log 2>&1 & dpid=$!
python3 -m api_server --backend 127.0.0.1:50051 --listen 127.0.0.1:8000 --tokenizer /tmp/qwen-words \
  --metrics-port 9102 > $OUT/r/api.log 2>&1 & apid=$!
t0=$(date +%s)
python3 -c "from bench.measure.launch import wait_serving; wait_serving('127.0.0.1:50051', [], timeout=300)" \
  || { echo "decode never SERVING"; tail -20 $OUT/r/decode.log; }
for i in $(seq 60); do curl -sf http://127.0.0.1:8000/health > /dev/null && break; sleep 2; done
echo "serving after $(( $(date +%s) - t0 )) s; api health: $(curl -s http://127.0.0.1:8000/health)"
curl -s http://127.0.0.1:8000/v1/models; echo
curl -s http://127.0.0.1:8000/v1/completions -H 'Content-Type: application/json' \
  -d '{"model": "qwen2.5-7b", "prompt": "w17 w42 w99", "max_tokens": 8, "temperature": 0}' | cut -c1-400; echo
W="--model qwen2.5-7b --num-prompts 1024 --concurrency 32 --input-len 1024 --input-len-range 0.5 --output-len 128 \
   --warmup 4 --timeout 600"
for round in 1 2; do
  for door in grpc http; do
    flag=$([ $door = http ] && echo "--api http://127.0.0.1:8000" || echo "--addr 127.0.0.1:50051")
    timeout 200 python3 -m bench.cli serve $flag $W --server-metrics http://127.0.0.1:9101/metrics \
      --out $OUT/r/serve-$door-$round > $OUT/r/serve-$door-$round.log 2>&1
    echo "$door-$round rc $?: $(tail -1 $OUT/r/serve-$door-$round.log | python3 -c "import json,sys; r=json.loads(sys.stdin.read()); print({k: r.get(k) for k in ('completed','failed','output_throughput','sustained_output_throughput','median_ttft_ms','median_itl_ms','p99_itl_ms')})" 2>&1 | cut -c1-400)"
  done
  tar -C $OUT -czf $OUT/serve.tgz r
done
timeout 240 bash bench/stock/run_stock.sh --site /tmp/stocksite --target http://127.0.0.1:8000 --model qwen2.5-7b \
  --tokenizer /tmp/qwen-words --out $OUT/r/guidellm > $OUT/r/guidellm.log 2>&1
echo "guidellm rc $?: $(cat $OUT/r/guidellm/summary.json 2>/dev/null | cut -c1-600)"
rm -f $OUT/r/guidellm/prompts.jsonl
kill -TERM $apid $dpid; wait $apid $dpid; echo "servers exited $?"
tar -C $OUT -czf $OUT/serve.tgz r && rm -rf $OUT/r
