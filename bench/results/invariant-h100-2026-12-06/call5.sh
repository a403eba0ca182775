#!/bin/bash
# Call 5, one GPU, carry [".whl"]:
# 1. #40: `kvtransfer-bench invariance` with every request greedy (--seeded 0): 512 prompts of the README serve
#    workload, twice in two orders at c64, on a colocated qwen2.5-7b --batch-invariant server (default flags else);
# 2. #37: the gRPC landing probe on cuda (its device naming fixed after call 2);
# 3. #39: where a mixed step's GPU time goes: 64 decode rows at 1k + 448 prompt rows in a 512-row graphed step.
set -u
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 3
export NCCL_NVLS_ENABLE=0 PYTHONUNBUFFERED=1 PYTHONPATH=/tmp/site:.
R=$OUT/call5; mkdir -p $R
exec > >(tee $R/run.log) 2>&1
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv > $R/gpu.txt; cat $R/gpu.txt
start=$(date +%s)
at() { echo "$(( $(date +%s) - start )) s"; }
(exec python3 -m decode_server --colocated --model qwen2.5-7b --listen 127.0.0.1:50051 --batch-invariant \
   > $R/decode-invariant.log 2>&1) & DPID=$!
python3 -c "from bench.measure.launch import wait_serving; wait_serving('127.0.0.1:50051', [], timeout=200)" \
  || { echo "never SERVING"; tail -20 $R/decode-invariant.log; }
echo "serving at $(at): $(grep -o 'engine defaults.*' $R/decode-invariant.log | head -1 | cut -c1-220)"
timeout 170 python3 -m bench.cli invariance --addr 127.0.0.1:50051 --model qwen2.5-7b --num-prompts 512 \
  --concurrency 64 --seeded 0 --out $R/invariance-greedy > $R/invariance-greedy.log 2>&1
echo "invariance rc $? at $(at)"; grep "│" $R/invariance-greedy.log | cut -c1-200
kill -TERM $DPID; wait $DPID
tar -C $OUT -czf $OUT/call5.tgz call5
timeout 40 python3 -m bench.probes.grpc_landing --device cuda > $R/probe-landing.log 2>&1; echo "probe rc $?"; tail -30 $R/probe-landing.log | tr -d ' \n' | cut -c1-900; echo
tar -C $OUT -czf $OUT/call5.tgz call5
left=$(( 320 - ($(date +%s) - start) )); [ $left -gt 120 ] && left=120
[ $left -gt 30 ] && { timeout $left python3 -m bench.probes.profile_step --model qwen2.5-7b --mixed 512 --batch 64 \
  --context 1024 > $R/profile-mixed-512.log 2>&1; echo "profile rc $? at $(at)"; tail -40 $R/profile-mixed-512.log | cut -c1-250; }
tar -C $OUT -czf $OUT/call5.tgz call5; echo "total $(at)"
