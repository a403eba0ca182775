#!/bin/bash
# Call 3, one GPU, carry [".whl"] (issue #39): the budget curve. The README serve workload (1,024 +-50% in, 128 out)
# at c64 and c128 (512 and 1,024 prompts) against a colocated qwen2.5-7b server whose mixed steps are at most
# --prefill-chunk 256, 512 (the default) or 1024 rows, with serve's roofline (the GEMM rate measured in this run).
set -u
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 3
export NCCL_NVLS_ENABLE=0 PYTHONUNBUFFERED=1 PYTHONPATH=/tmp/site:.
R=$OUT/call3; mkdir -p $R
exec > >(tee $R/run.log) 2>&1
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv > $R/gpu.txt; cat $R/gpu.txt
start=$(date +%s)
at() { echo "$(( $(date +%s) - start )) s"; }
for chunk in 512 1024 256; do
  [ $(( 590 - ($(date +%s) - start) )) -lt 150 ] && { echo "chunk $chunk: no time left"; continue; }
  (exec python3 -m decode_server --colocated --model qwen2.5-7b --listen 127.0.0.1:50051 --metrics-port 9101 \
     --mixed-prefill --prefill-chunk $chunk > $R/decode-$chunk.log 2>&1) & DPID=$!
  python3 -c "from bench.measure.launch import wait_serving; wait_serving('127.0.0.1:50051', [], timeout=200)" \
    || { echo "$chunk: never SERVING"; tail -20 $R/decode-$chunk.log; }
  echo "chunk $chunk serving at $(at): $(grep -o 'engine defaults.*' $R/decode-$chunk.log | head -1 | cut -c1-200)"
  timeout $(( 585 - ($(date +%s) - start) )) python3 -m bench.cli serve --addr 127.0.0.1:50051 --model qwen2.5-7b \
    --num-prompts 1 --prompts-per-concurrency 8 --concurrency 64,128 --input-len 1024 --input-len-range 0.5 \
    --output-len 128 --warmup 4 --timeout 300 --max-duration 100 --server-metrics http://127.0.0.1:9101/metrics \
    --out $R/serve-$chunk > $R/serve-$chunk.log 2>&1
  echo "serve chunk $chunk rc $? at $(at)"
  python3 -c "
import json; r=json.load(open('$R/serve-$chunk/result.json'))
for s in r['summary']: print({k: (round(v, 3) if isinstance(v, float) else v) for k, v in s.items()})" | cut -c1-500
  kill -TERM $DPID; wait $DPID; sleep 1
  tar -C $OUT -czf $OUT/call3.tgz call3
done
echo "total $(at)"
