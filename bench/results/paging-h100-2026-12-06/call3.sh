#!/bin/bash
# Issue #37, call 3, one GPU, carry [".whl"], gpu_base/ = `git archive 02dcfb7` (the fixed-slot tree) unpacked. As
# call 2, after the pool's small host-to-device copies (a lease's table row, gather/scatter indices) went through
# pinned memory with no host wait (call 2's waited for the stream, a decode step, on the serving thread):
# 1. kvtransfer-bench decode, the pool in 64-token blocks scattered (this tree) then the slot layout (this tree,
#    --kv-block-tokens 0): 1 x 1k, 64 x 1k, 1 x 8k, 64 x 8k;
# 2. the README serve workload (input 1024 +-50%, output 128), one colocated decode server, qwen2.5-7b preset: this
#    tree with default flags (paged) at concurrency 64 and 128; the fixed-slot tree hand-tuned (--max-batch 64
#    --max-seq-len 2048 at 64; --max-batch 128 --max-seq-len 2048 at 128; --max-inflight 1024 --admission-wait-s 600).
set -u
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 3
export NCCL_NVLS_ENABLE=0 PYTHONUNBUFFERED=1
R=$OUT/c3; mkdir -p $R
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv > $R/gpu.txt
start=$(date +%s)
for round in 1; do
  for page in 64 0; do
    t0=$(date +%s)
    PYTHONPATH=/tmp/site:. timeout 80 python3 -m bench.cli decode --model qwen2.5-7b --batches 1,64 --contexts 1024,8192 \
      --hf none --kv-block-tokens $page --out $R/decode-page$page-$round > $R/decode-page$page-$round.log 2>&1
    echo "decode page $page round $round rc $? ($(( $(date +%s) - t0 )) s)"; grep "decode: engine" $R/decode-page$page-$round.log
  done
done
tar -C $OUT -czf $OUT/call3.tgz c3
serve() {  # tree name, concurrency, prompts, decode flags
  local dir=$1 c=$2 n=$3; shift 3
  timeout 150 bash -c "cd $dir && PYTHONPATH=/tmp/site:. python3 -m bench.cli serve --addr 127.0.0.1:50051 --model qwen2.5-7b \
    --num-prompts $n --concurrency $c --input-len 1024 --input-len-range 0.5 --output-len 128 --warmup 4 --timeout 600 \
    --server-metrics http://127.0.0.1:9101/metrics --out $R/serve-$TAG-c$c" > $R/serve-$TAG-c$c.log 2>&1
  echo "serve $TAG c$c rc $?: $(tail -1 $R/serve-$TAG-c$c.log | python3 -c "import json,sys; r=json.loads(sys.stdin.read()); print({k: r.get(k) for k in ('completed','failed','output_throughput','median_ttft_ms','p99_ttft_ms','median_itl_ms','p99_itl_ms')})" 2>&1 | cut -c1-400)"
}
server() {  # tree dir, tag, decode flags...
  local dir=$1; TAG=$2; shift 2
  (cd $dir && PYTHONPATH=/tmp/site:. exec python3 -m decode_server --colocated --model qwen2.5-7b --listen 127.0.0.1:50051 \
    --metrics-port 9101 "$@" > $R/decode-$TAG.log 2>&1) & DPID=$!
  PYTHONPATH=/tmp/site:. python3 -c "from bench.measure.launch import wait_serving; wait_serving('127.0.0.1:50051', [], timeout=200)" \
    || { echo "decode $TAG never SERVING"; tail -20 $R/decode-$TAG.log; }
  echo "$TAG serving at $(( $(date +%s) - start )) s: $(grep -o 'KV pool.*' $R/decode-$TAG.log | head -1 | cut -c1-300)"
}
stop_server() { kill -TERM $DPID; wait $DPID; sleep 2; }
server . paged
serve . 64 512; serve . 128 768
stop_server; tar -C $OUT -czf $OUT/call3.tgz c3
server gpu_base slots64 --max-batch 64 --max-seq-len 2048 --max-inflight 1024 --admission-wait-s 600
serve gpu_base 64 512
stop_server; tar -C $OUT -czf $OUT/call3.tgz c3
server gpu_base slots128 --max-batch 128 --max-seq-len 2048 --max-inflight 1024 --admission-wait-s 600
serve gpu_base 128 768
stop_server; tar -C $OUT -czf $OUT/call3.tgz c3
echo "total $(( $(date +%s) - start )) s"
