#!/bin/bash
# Issues #37/#39, call 2, one GPU, carry [".whl"]: this tree only.
# 1. gpu tests of the step ladder and the defaults (tests/test_engine_gpu.py, tests/test_defaults_gpu.py);
# 2. the README serve workload (as call 1) at other token budgets, for the ITL-vs-throughput curve:
#    new1024 (--prefill-chunk 1024: steps up to 1,024 rows, 256 rows) and new256 (--prefill-chunk 256: up to 256
#    rows, 128 rows: the previous default's shape, on the ladder), c64 and c128 each.
set -u
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 3
export NCCL_NVLS_ENABLE=0 PYTHONUNBUFFERED=1
R=$OUT/c2; mkdir -p $R
exec > >(tee $R/run.log) 2>&1
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
stop_server() { kill -TERM $DPID; wait $DPID; sleep 2; tar -C $OUT -czf $OUT/call2.tgz c2; }
PYTHONPATH=/tmp/site:. timeout 200 python3 -m pytest -q -s tests/test_engine_gpu.py tests/test_defaults_gpu.py \
  -k "ladder or mixed_graph or graph_replay or default" > $R/gpu-tests.log 2>&1
echo "gpu tests rc $? at $(( $(date +%s) - start )) s: $(tail -1 $R/gpu-tests.log)"
server . new1024 --prefill-chunk 1024
serve . 64 512 c64; serve . 128 768 c128
stop_server
server . new256 --prefill-chunk 256
serve . 64 512 c64; serve . 128 768 c128
stop_server
echo "total $(( $(date +%s) - start )) s"
