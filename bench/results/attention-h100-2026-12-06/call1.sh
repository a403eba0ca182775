#!/bin/bash
# Call 1, one GPU, carry [".whl"] (issue #39): the mixed step's attention.
# 1. bench.probes.chunk_attention: the chunk kernel's tiling sweep and the two attention kernels side by side;
# 2. the GPU kernel and engine tests on this tree (the chunk kernel's new loop, the shared output, the side stream);
# 3. bench.probes.profile_mixed, 64 decode rows at 1k + 448 prompt rows, with and without the side stream;
# 4. the README serve workload at c64 and c128 on this tree, then on gpu_base/ (git archive 5146311, before it).
set -u
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 3
export NCCL_NVLS_ENABLE=0 PYTHONUNBUFFERED=1 PYTHONPATH=/tmp/site:.
R=$OUT/call1; mkdir -p $R
exec > >(tee $R/run.log) 2>&1
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv > $R/gpu.txt; cat $R/gpu.txt
start=$(date +%s)
at() { echo "$(( $(date +%s) - start )) s"; }
pack() { tar -C $OUT -czf $OUT/call1.tgz call1; }
timeout 120 python3 -m bench.probes.chunk_attention > $R/probe-attention.log 2>&1; echo "probe rc $? at $(at)"
grep -E "^(chunk|pair)" $R/probe-attention.log | cut -c1-260
timeout 150 python3 -m pytest -m gpu -q -p no:cacheprovider tests/test_kernels_gpu.py tests/test_engine_gpu.py \
  > $R/gpu-tests.log 2>&1; echo "gpu tests rc $? at $(at)"; tail -5 $R/gpu-tests.log
pack
for side in "" "--no-side-stream"; do
  timeout 100 python3 -m bench.probes.profile_mixed --model qwen2.5-7b --mixed 512 --batch 64 --context 1024 $side \
    > $R/profile-mixed${side:+-no-side}.log 2>&1; echo "profile $side rc $? at $(at)"
  grep -E "^(step|  [a-z])" $R/profile-mixed${side:+-no-side}.log | head -20
done
pack
serve() {  # $1: arm name, $2: tree
  [ $(( 585 - ($(date +%s) - start) )) -lt 130 ] && { echo "$1: no time left"; return; }
  (cd $2 && exec python3 -m decode_server --colocated --model qwen2.5-7b --listen 127.0.0.1:50051 \
     --metrics-port 9101 > $R/decode-$1.log 2>&1) & DPID=$!
  python3 -c "from bench.measure.launch import wait_serving; wait_serving('127.0.0.1:50051', [], timeout=200)" \
    || { echo "$1: never SERVING"; tail -20 $R/decode-$1.log; }
  echo "$1 serving at $(at): $(grep -o 'engine defaults.*' $R/decode-$1.log | head -1 | cut -c1-200)"
  timeout $(( 585 - ($(date +%s) - start) )) python3 -m bench.cli serve --addr 127.0.0.1:50051 --model qwen2.5-7b \
    --num-prompts 1 --prompts-per-concurrency 8 --concurrency 64,128 --input-len 1024 --input-len-range 0.5 \
    --output-len 128 --warmup 4 --timeout 300 --max-duration 100 --server-metrics http://127.0.0.1:9101/metrics \
    --out $R/serve-$1 > $R/serve-$1.log 2>&1
  echo "serve $1 rc $? at $(at)"
  python3 -c "
import json; r=json.load(open('$R/serve-$1/result.json'))
for s in r['summary']: print({k: (round(v, 3) if isinstance(v, float) else v) for k, v in s.items()})" | cut -c1-600
  kill -TERM $DPID; wait $DPID; sleep 1
  pack
}
serve new .
serve base gpu_base
echo "total $(at)"
