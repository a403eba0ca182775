#!/bin/bash
# Call 3, one GPU, carry [".whl"]. Colocated, qwen2.5-7b:
# 1. #38: 32 conversations x 5 turns (2,048 tokens, +384 a turn, 128 out) with a device pool (--kv-pool-gib 4:
#    1,170 blocks, ~75k tokens) and a host tier (--host-cache-gib 3, ~56k tokens) both smaller than the load
#    (~134k tokens of conversations): every turn served, preemptions and the host tier's reload/recompute decisions
#    (the break-even rule) counted from /metrics before and after; then on the same server a --stop-after load at
#    --memory-pressure 4;
# 2. the gpu tests not reached in call 1 (test_defaults_gpu left out: it passed in the previous session);
# 3. #37: kvtransfer-bench ttft over gRPC at 4,096 tokens, this tree (both workers on ONE GPU).
set -u
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 3
export NCCL_NVLS_ENABLE=0 PYTHONUNBUFFERED=1
R=$OUT/c3; mkdir -p $R
exec > >(tee $R/run.log) 2>&1
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv > $R/gpu.txt
start=$(date +%s)
left() { echo $(( 540 - ($(date +%s) - start) )); }
metrics() { python3 -c "import urllib.request; print(urllib.request.urlopen('http://127.0.0.1:9101/metrics', timeout=5).read().decode())" | grep -E "^kvt_(preemptions|prefix_host_decisions|prefix_hits|prefix_reload_bytes)" > $R/metrics-$1.txt; cat $R/metrics-$1.txt; }
(PYTHONPATH=/tmp/site:. exec python3 -m decode_server --colocated --model qwen2.5-7b --listen 127.0.0.1:50051 \
  --metrics-port 9101 --kv-pool-gib 4 --host-cache-gib 3 > $R/decode-tight.log 2>&1) & DPID=$!
PYTHONPATH=/tmp/site:. python3 -c "from bench.measure.launch import wait_serving; wait_serving('127.0.0.1:50051', [], timeout=200)" \
  || { echo "decode never SERVING"; tail -20 $R/decode-tight.log; }
echo "serving at $(( $(date +%s) - start )) s: $(grep -o 'KV pool.*' $R/decode-tight.log | head -1 | cut -c1-200)"
metrics before
PYTHONPATH=/tmp/site:. timeout 200 python3 -m bench.cli serve --addr 127.0.0.1:50051 --model qwen2.5-7b --multi-turn \
  --num-prompts 32 --concurrency 32 --turns 5 --input-len 2048 --user-len 384 --output-len 128 --timeout 300 \
  --out $R/serve-turns-tight > $R/serve-turns-tight.log 2>&1
echo "turns rc $? at $(( $(date +%s) - start )) s"
python3 -c "
import json; r=json.load(open('$R/serve-turns-tight/result.json')); print(r['headline']); print({n: {k: p.get(k) for k in ('completed','failed','hits_by_tier','reload_bytes')} for n, p in r['passes'].items()})" | cut -c1-900
metrics after-turns
PYTHONPATH=/tmp/site:. timeout 120 python3 -m bench.cli serve --addr 127.0.0.1:50051 --model qwen2.5-7b \
  --server-metrics http://127.0.0.1:9101/metrics --memory-pressure 4 --num-prompts 192 --input-len 1024 \
  --output-len 512 --stop-after 1,512 --warmup 1 --timeout 300 --max-duration 90 --out $R/serve-pressure > $R/serve-pressure.log 2>&1
echo "pressure rc $? at $(( $(date +%s) - start )) s"
python3 -c "
import json; r=json.load(open('$R/serve-pressure/result.json')); print({k: r.get(k) for k in ('completed','failed','failed_by_code','output_throughput','median_ttft_ms')}, r.get('pool'))" | cut -c1-700
metrics after-pressure
kill -TERM $DPID; wait $DPID; sleep 2
tar -C $OUT -czf $OUT/call3.tgz c3
lim=$(( $(left) - 130 )); [ $lim -gt 150 ] && lim=150
PYTHONPATH=/tmp/site:. timeout $lim python3 -m pytest -m gpu -q -p no:cacheprovider tests/test_engine_gpu.py tests/test_gpu.py \
  tests/test_invariant_gpu.py tests/test_kernels_gpu.py tests/test_grpc_transport.py tests/test_bench_serve.py > $R/gpu-tests.log 2>&1
echo "gpu tests rc $? at $(( $(date +%s) - start )) s: $(tail -1 $R/gpu-tests.log)"; grep -E "^FAILED|^ERROR" $R/gpu-tests.log | head
tar -C $OUT -czf $OUT/call3.tgz c3
lim=$(left); [ $lim -gt 130 ] && lim=130
[ $lim -gt 60 ] && { PYTHONPATH=/tmp/site:. timeout $lim python3 -m bench.cli ttft --model qwen2.5-7b --transport grpc \
    --prefill-device cuda:0 --decode-device cuda:0 --lengths 4096 --runs 5 --warmup 1 --decode-tokens 4 \
    --log-dir $R/logs-grpc --out $R/ttft-new-grpc > $R/ttft-new-grpc.log 2>&1;
  echo "ttft grpc rc $? at $(( $(date +%s) - start )) s"; tail -12 $R/ttft-new-grpc.log | grep "│\|verif" | cut -c1-220; }
tar -C $OUT -czf $OUT/call3.tgz c3
echo "total $(( $(date +%s) - start )) s"
