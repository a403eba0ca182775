#!/bin/bash
# Call 3, one GPU, carry [".whl"]: the curve as a default server runs its steps: pool rows of 32,768 positions (the
# model's context, --max-seq-len's default), so the decode kernel's grid holds 32 splits a row and the mixed step runs
# the two attention kernels on the side stream (calls 1-2 had 1,024-position rows: the fused launch). Then the same
# pool with the fused launch forced (--attention fused), to price the two against each other at every size.
set -u
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 3
export NCCL_NVLS_ENABLE=0 PYTHONUNBUFFERED=1 PYTHONPATH=/tmp/site:.
R=/tmp/curve3; mkdir -p $R $OUT
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv > $R/gpu.txt 2>&1; cat $R/gpu.txt
start=$(date +%s); t() { echo "$1 rc $2 at $(( $(date +%s) - start )) s"; }
for arm in served fused; do
  extra=""; [ $arm = fused ] && extra="--attention fused"
  timeout -k 5 200 python3 -m bench.probes.step_curve --model qwen2.5-7b --sizes 256,384,512,640,768,1024 \
    --runs 10 $extra > $R/step-curve-$arm.log 2>&1
  t "step_curve $arm" $?; grep -v "^{" $R/step-curve-$arm.log | tail -9
  tar -C /tmp -czf $OUT/curve3.tgz curve3
done
