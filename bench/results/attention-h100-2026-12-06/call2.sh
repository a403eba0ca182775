#!/bin/bash
# Call 2, one GPU, carry [".whl"] (issue #39), this tree = call 1's + the rows a decode bucket leaves carrying
# prompt tokens (mixed.lay_out), the chunk kernel at 3 stages, the prompts-queued gauge:
# 1. the GPU kernel and engine tests (the graphs' layout with those rows);
# 2. the README serve workload at c64 and c128: this tree, then gpu_base/ (git archive 5146311);
# 3. the interference bench's chunked arm (32 streams x 1k, then a 32,000-token prompt, --prefill-chunk 512): this
#    tree, then gpu_base/.
set -u
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 3
export NCCL_NVLS_ENABLE=0 PYTHONUNBUFFERED=1 PYTHONPATH=/tmp/site:.
R=$OUT/call2; mkdir -p $R
exec > >(tee $R/run.log) 2>&1
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv > $R/gpu.txt; cat $R/gpu.txt
start=$(date +%s)
at() { echo "$(( $(date +%s) - start )) s"; }
pack() { tar -C $OUT -czf $OUT/call2.tgz call2; }
timeout 150 python3 -m pytest -m gpu -q -p no:cacheprovider tests/test_kernels_gpu.py tests/test_engine_gpu.py \
  > $R/gpu-tests.log 2>&1; echo "gpu tests rc $? at $(at)"; tail -5 $R/gpu-tests.log
serve() {  # $1: arm name, $2: tree
  [ $(( 585 - ($(date +%s) - start) )) -lt 110 ] && { echo "$1: no time left"; return; }
  (cd $2 && exec python3 -m decode_server --colocated --model qwen2.5-7b --listen 127.0.0.1:50051 \
     --metrics-port 9101 > $R/decode-$1.log 2>&1) & DPID=$!
  python3 -c "from bench.measure.launch import wait_serving; wait_serving('127.0.0.1:50051', [], timeout=200)" \
    || { echo "$1: never SERVING"; tail -20 $R/decode-$1.log; }
  echo "$1 serving at $(at)"
  timeout $(( 585 - ($(date +%s) - start) )) python3 -m bench.cli serve --addr 127.0.0.1:50051 --model qwen2.5-7b \
    --num-prompts 1 --prompts-per-concurrency 8 --concurrency 64,128 --input-len 1024 --input-len-range 0.5 \
    --output-len 128 --warmup 4 --timeout 300 --max-duration 100 --server-metrics http://127.0.0.1:9101/metrics \
    --out $R/serve-$1 > $R/serve-$1.log 2>&1
  echo "serve $1 rc $? at $(at)"
  python3 -c "
import json; r=json.load(open('$R/serve-$1/result.json'))
for s in r['sweep']:
    b = s.get('server_batch') or {}
    print(s['max_concurrency'], {k: round(s[k], 3) for k in ('output_throughput', 'sustained_output_throughput',
          'median_ttft_ms', 'p99_ttft_ms', 'median_itl_ms', 'p99_itl_ms', 'roofline_output_tok_s', 'of_roofline')},
          {k: b.get(k) for k in ('steps', 'mean_batch_per_step', 'mixed_steps_by_rows', 'running_p50',
                                 'prompts_queued_p50', 'prompts_queued_none_share')})" | cut -c1-700
  kill -TERM $DPID; wait $DPID; sleep 1
  pack
}
serve new .
serve base gpu_base
for arm in new base; do
  [ $(( 585 - ($(date +%s) - start) )) -lt 75 ] && { echo "interference $arm: no time left"; continue; }
  tree=.; [ $arm = base ] && tree=gpu_base
  (cd $tree && timeout $(( 585 - ($(date +%s) - start) )) python3 -m bench.cli interference --model qwen2.5-7b \
     --device cuda:0 --streams 32 --context 1024 --arrivals 32000 --arms chunked --chunks 512 --gap-s 1 \
     --log-dir $R/intf-logs-$arm --out $R/intf-$arm > $R/intf-$arm.log 2>&1); echo "interference $arm rc $? at $(at)"
  grep -E "^\| colocated" $R/intf-$arm/report.md | head -4
  pack
done
echo "total $(at)"
