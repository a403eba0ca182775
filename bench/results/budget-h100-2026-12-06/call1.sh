#!/bin/bash
# Issues #37 (item 6, acceptance) and #39 (item 1), call 1, one GPU, carry [".whl"], gpu_base/ = `git archive 02dcfb7`
# unpacked (the fixed-slot tree, the baseline). The README serve workload (input 1024 +-50%, output 128), colocated,
# qwen2.5-7b preset, gRPC, against one decode server at a time:
#   new      this tree, default flags (mixed steps of up to 512 rows on a ladder 128/256/512, 256 rows): c64, c128,
#            c256; then the burst: 4 prompts of 30,000 tokens and 200 of 1,000 sent at once (--seed 19 draws exactly
#            4 long ones at share 0.02);
#   base64   the fixed-slot tree hand-tuned: --max-batch 64 --max-seq-len 2048: c64;
#   base128  --max-batch 128 --max-seq-len 2048: c128, c256 (both with --max-inflight 1024 --admission-wait-s 600
#            so that it queues instead of refusing);
#   new1024  this tree, --prefill-chunk 1024 (steps up to 1,024 rows): c64, c128, c256.
set -u
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 3
export NCCL_NVLS_ENABLE=0 PYTHONUNBUFFERED=1
R=$OUT/c1; mkdir -p $R
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv > $R/gpu.txt
start=$(date +%s)
serve() {  # tree dir, concurrency, prompts, more serve flags
  local dir=$1 c=$2 n=$3 name=${4:-c$2}; shift 4
  timeout 150 bash -c "cd $dir && PYTHONPATH=/tmp/site:. python3 -m bench.cli serve --addr 127.0.0.1:50051 --model qwen2.5-7b \
    --num-prompts $n --concurrency $c --input-len 1024 --input-len-range 0.5 --output-len 128 --warmup 4 --timeout 600 \
    --server-metrics http://127.0.0.1:9101/metrics --out $R/serve-$TAG-$name $*" > $R/serve-$TAG-$name.log 2>&1
  echo "serve $TAG $name rc $? at $(( $(date +%s) - start )) s: $(tail -1 $R/serve-$TAG-$name.log | python3 -c "import json,sys; r=json.loads(sys.stdin.read()); b=r.get('server_batch') or {}; print({k: r.get(k) for k in ('completed','failed','output_throughput','median_ttft_ms','p99_ttft_ms','median_itl_ms','p99_itl_ms')} | {k: b.get(k) for k in ('mixed_steps_by_rows','running_p50','device_busy')})" 2>&1 | cut -c1-500)"
}
server() {  # tree dir, tag, decode flags...
  local dir=$1; TAG=$2; shift 2
  (cd $dir && PYTHONPATH=/tmp/site:. exec python3 -m decode_server --colocated --model qwen2.5-7b --listen 127.0.0.1:50051 \
    --metrics-port 9101 "$@" > $R/decode-$TAG.log 2>&1) & DPID=$!
  PYTHONPATH=/tmp/site:. python3 -c "from bench.measure.launch import wait_serving; wait_serving('127.0.0.1:50051', [], timeout=200)" \
    || { echo "decode $TAG never SERVING"; tail -20 $R/decode-$TAG.log; }
  echo "$TAG serving at $(( $(date +%s) - start )) s: $(grep -o 'KV pool.*' $R/decode-$TAG.log | head -1 | cut -c1-200)"
  grep -h "captured" $R/decode-$TAG.log | cut -c1-250
}
stop_server() { kill -TERM $DPID; wait $DPID; sleep 2; tar -C $OUT -czf $OUT/call1.tgz c1; }
server . new
serve . 64 512 c64; serve . 128 768 c128; serve . 256 768 c256
serve . 204 204 burst --input-len 1000 --input-len-range 0 --long-share 0.02 --long-len-range 30000,30000 --seed 19
stop_server
server gpu_base base64 --max-batch 64 --max-seq-len 2048 --max-inflight 1024 --admission-wait-s 600
serve gpu_base 64 512 c64
stop_server
server gpu_base base128 --max-batch 128 --max-seq-len 2048 --max-inflight 1024 --admission-wait-s 600
serve gpu_base 128 768 c128; serve gpu_base 256 768 c256
stop_server
server . new1024 --prefill-chunk 1024
serve . 64 512 c64; serve . 128 768 c128; serve . 256 768 c256
stop_server
echo "total $(( $(date +%s) - start )) s"
