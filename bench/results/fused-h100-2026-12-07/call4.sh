#!/bin/bash
# Call 4, one GPU, carry [".whl", "out/gpu_base"] (out/gpu_base: `git archive 02dcfb7 -- . ':!bench/results'`, the
# tree #39 was filed against): #39's second acceptance point, the interference bench's chunked arm (32 streams x 1k
# decoding, then one 32,000-token prompt in 512-row chunks), this tree then 02dcfb7, one call. Each arm tars to $OUT.
set -u
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 3
export NCCL_NVLS_ENABLE=0 PYTHONUNBUFFERED=1
R=/tmp/call4; mkdir -p $R $OUT
start=$(date +%s); t() { echo "$1 rc $2 at $(( $(date +%s) - start )) s"; }
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv > $R/gpu.txt 2>&1; cat $R/gpu.txt
for arm in new base; do
  tree=.; [ $arm = base ] && tree=out/gpu_base
  (cd $tree && PYTHONPATH=/tmp/site:. timeout -k 5 150 python3 -m bench.cli interference --model qwen2.5-7b \
     --device cuda:0 --streams 32 --context 1024 --arrivals 32000 --arms chunked --chunks 512 --gap-s 1 \
     --log-dir $R/intf-logs-$arm --out $R/intf-$arm > $R/intf-$arm.log 2>&1); t "interference $arm" $?
  grep -E "^\| colocated" $R/intf-$arm/report.md | head -4
  tar -C /tmp -czf $OUT/call4.tgz call4
done
