#!/bin/bash
# Call 2 (#38 acceptance), one GPU, carry [".whl"], gpu_b37/ = `git archive ccf45f5` unpacked (the tree before
# #38: admission reserves prompt + max_new_tokens, no preemption, no shared blocks). Colocated, qwen2.5-7b, default
# flags unless named:
# 1. this tree: 384 requests of 1,024 prompt tokens asking max_new_tokens 4,096, each client ending its request
#    after a uniform 1..4,096 tokens (serve --stop-after 1,4096), concurrency 256; then 64 requests over one
#    4,096-token opening + 64 tokens each (serve --shared-prefix 4096; the warm-up request caches the opening);
#    then 32 conversations x 5 turns (2,048 tokens, +384 a turn, 128 out), prefix cache skipped then used;
# 2. this tree with --no-prefix-cache: the shared-opening load again;
# 3. the tree before #38: the --stop-after load again.
set -u
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 3
export NCCL_NVLS_ENABLE=0 PYTHONUNBUFFERED=1
R=$OUT/c2; mkdir -p $R
exec > >(tee $R/run.log) 2>&1
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv > $R/gpu.txt
start=$(date +%s)
summary() {  # result.json -> one line
  python3 -c "
import json,sys; r=json.load(open(sys.argv[1])); b=r.get('server_batch') or {}
if r.get('kind') == 'serve_multiturn':
    print(r['headline'], {n: {k: p.get(k) for k in ('completed','failed','hits_by_tier')} for n, p in r['passes'].items()}); sys.exit()
print({k: r.get(k) for k in ('completed','failed','failed_by_code','total_output_tokens','output_throughput','median_ttft_ms','p99_ttft_ms','median_itl_ms')} | {'pool': r.get('pool')} | {k: b.get(k) for k in ('running_p50','running_max','shared_blocks_max','free_blocks_min')})" $1 2>&1 | cut -c1-900
}
serve() {  # name, limit s, serve flags... (the client is always this tree's bench)
  local name=$1 lim=$2; shift 2
  PYTHONPATH=/tmp/site:. timeout $lim python3 -m bench.cli serve --addr 127.0.0.1:50051 \
    --model qwen2.5-7b --out $R/serve-$name "$@" > $R/serve-$name.log 2>&1
  echo "serve $name rc $? at $(( $(date +%s) - start )) s"; summary $R/serve-$name/result.json
}
server() {  # tree dir, tag, decode flags...
  local dir=$1; TAG=$2; shift 2
  (cd $dir && PYTHONPATH=/tmp/site:. exec python3 -m decode_server --colocated --model qwen2.5-7b --listen 127.0.0.1:50051 \
    --metrics-port 9101 "$@" > $R/decode-$TAG.log 2>&1) & DPID=$!
  PYTHONPATH=/tmp/site:. python3 -c "from bench.measure.launch import wait_serving; wait_serving('127.0.0.1:50051', [], timeout=200)" \
    || { echo "decode $TAG never SERVING"; tail -20 $R/decode-$TAG.log; }
  echo "$TAG serving at $(( $(date +%s) - start )) s: $(grep -o 'KV pool.*' $R/decode-$TAG.log | head -1 | cut -c1-200)"
}
stop_server() { kill -TERM $DPID; wait $DPID; sleep 2; tar -C $OUT -czf $OUT/call2.tgz c2; }
M=http://127.0.0.1:9101/metrics
STOP="--server-metrics $M --num-prompts 384 --concurrency 256 --input-len 1024 --output-len 4096 --stop-after 1,4096 --warmup 1 --timeout 400 --max-duration 150"
SHARED="--server-metrics $M --num-prompts 64 --concurrency 64 --shared-prefix 4096 --input-len 64 --output-len 16 --warmup 1 --timeout 120"
server . new
serve new-stop 200 $STOP
serve new-shared 60 $SHARED
serve new-turns 150 --multi-turn --num-prompts 32 --concurrency 32 --turns 5 --input-len 2048 --user-len 384 --output-len 128 --timeout 300
stop_server
server . nocache --no-prefix-cache
serve nocache-shared 60 $SHARED
stop_server
server gpu_b37 b37
serve b37-stop 200 $STOP
stop_server
echo "total $(( $(date +%s) - start )) s"
