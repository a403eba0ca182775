#!/bin/bash
# Call 1, one GPU, carry [".whl"] (issue #40). runner.INVARIANT_ON_CUDA is turned on in this copy only.
# 1. tests/test_batch_invariant_gpu.py (the invariant step on qwen2.5-7b shapes, bf16, CUDA graphs) and
#    tests/test_batch_invariant_servers_gpu.py (real servers, tiny preset in bf16: neighbours, chunking, prefix
#    cache, a cuda_ipc pair), in parallel while the --batch-invariant qwen2.5-7b server starts (nothing is timed
#    until both tests have ended);
# 2. on that server: the README serve workload at c64 (512 prompts, 1,024 +-50% in, 128 out), then
#    `kvtransfer-bench invariance` (the same 512 prompts served twice in two orders, 16 of them seeded);
# 3. the same serve load on a server without the mode (the price: mode on vs off, this call). Both servers get
#    --kv-pool-gib 20 (the tests share the GPU while the first one sizes its pool; c64 needs ~6 GiB); rows default.
set -u
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 3
export NCCL_NVLS_ENABLE=0 PYTHONUNBUFFERED=1 PYTHONPATH=/tmp/site:.
R=$OUT/call1; mkdir -p $R
exec > >(tee $R/run.log) 2>&1
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv > $R/gpu.txt; cat $R/gpu.txt
start=$(date +%s)
at() { echo "$(( $(date +%s) - start )) s"; }
save() { tar -C $OUT -czf $OUT/call1.tgz call1; }
sed -i 's/^INVARIANT_ON_CUDA = False/INVARIANT_ON_CUDA = True/' kvtransfer/engine/runner.py
grep -n "^INVARIANT_ON_CUDA" kvtransfer/engine/runner.py
timeout 170 python3 -m pytest -m gpu -q -p no:cacheprovider tests/test_batch_invariant_gpu.py > $R/test-engine.log 2>&1 & E=$!
timeout 170 python3 -m pytest -m gpu -q -p no:cacheprovider tests/test_batch_invariant_servers_gpu.py > $R/test-servers.log 2>&1 & S=$!
server() {  # server NAME FLAGS...: a colocated qwen2.5-7b server in the background (DPID)
  local name=$1; shift
  (exec python3 -m decode_server --colocated --model qwen2.5-7b --listen 127.0.0.1:50051 --metrics-port 9101 \
     --kv-pool-gib 20 "$@" > $R/decode-$name.log 2>&1) & DPID=$!
}
ready() {
  python3 -c "from bench.measure.launch import wait_serving; wait_serving('127.0.0.1:50051', [], timeout=200)" \
    || { echo "$1: never SERVING"; tail -20 $R/decode-$1.log; }
  echo "$1 serving at $(at): $(grep -o 'engine defaults.*' $R/decode-$1.log | head -1 | cut -c1-220)"
}
load() {  # load NAME: the README serve workload at c64
  timeout 150 python3 -m bench.cli serve --addr 127.0.0.1:50051 --model qwen2.5-7b --num-prompts 512 --concurrency 64 \
    --input-len 1024 --input-len-range 0.5 --output-len 128 --warmup 4 --timeout 300 --max-duration 140 \
    --server-metrics http://127.0.0.1:9101/metrics --out $R/serve-$1 > $R/serve-$1.log 2>&1
  echo "serve $1 rc $? at $(at)"
  python3 -c "
import json; r=json.load(open('$R/serve-$1/result.json')); print({k: r.get(k) for k in ('completed','failed','output_throughput','median_ttft_ms','p99_ttft_ms','median_itl_ms','p99_itl_ms','median_tpot_ms','of_roofline','roofline_output_tok_s')})" | cut -c1-600
}
server invariant --batch-invariant
wait $E; erc=$?; wait $S; src=$?
echo "engine test rc $erc: $(tail -1 $R/test-engine.log)"; echo "servers test rc $src: $(tail -1 $R/test-servers.log)"; at
grep -E "^E  |differs" $R/test-engine.log $R/test-servers.log | head -20 | cut -c1-300
save
ready invariant
load invariant; save
left=$(( 430 - ($(date +%s) - start) ))
timeout $left python3 -m bench.cli invariance --addr 127.0.0.1:50051 --model qwen2.5-7b --num-prompts 512 \
  --concurrency 64 --seeded 16 --out $R/invariance > $R/invariance.log 2>&1
echo "invariance rc $? at $(at)"; grep "│" $R/invariance.log | cut -c1-200
kill -TERM $DPID; wait $DPID; sleep 1; save
server default; ready default; load default
kill -TERM $DPID; wait $DPID
save; echo "total $(at)"
