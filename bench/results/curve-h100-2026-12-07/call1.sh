#!/bin/bash
# Call 1, one GPU, carry [".whl"]: the mixed step's time against its size at the README serve workload's steady mix
# (1,024 in, 128 out: 127 decode rows for every 1,024 prompt rows), with the GEMM rate and the decode-only steps at 64
# and 128 rows measured in the same process: `python3 -m bench.probes.step_curve` (issue #39; docs/architecture.md,
# "What bounds serving against the compute roofline").
set -u
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 3
export NCCL_NVLS_ENABLE=0 PYTHONUNBUFFERED=1 PYTHONPATH=/tmp/site:.
R=/tmp/curve1; mkdir -p $R $OUT
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv > $R/gpu.txt 2>&1; cat $R/gpu.txt
start=$(date +%s)
timeout -k 5 420 python3 -m bench.probes.step_curve --model qwen2.5-7b --sizes 256,384,448,512,640,768,1024 \
  --runs 10 > $R/step-curve.log 2>&1
echo "step_curve rc $? at $(( $(date +%s) - start )) s"; grep -v "^{" $R/step-curve.log | tail -14
tar -C /tmp -czf $OUT/curve1.tgz curve1
