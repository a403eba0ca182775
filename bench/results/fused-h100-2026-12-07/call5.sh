#!/bin/bash
# Call 5, one GPU, carry [".whl"]: the decode kernel with one long row among short ones (long_row.py: the rule as
# it is, the old count, the per-split cap at 1k/2k/4k), then the kernels' GPU tests on this tree.
set -u
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 3
export NCCL_NVLS_ENABLE=0 PYTHONUNBUFFERED=1 PYTHONPATH=/tmp/site:.
R=/tmp/call5; mkdir -p $R $OUT
start=$(date +%s); t() { echo "$1 rc $2 at $(( $(date +%s) - start )) s"; }
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv > $R/gpu.txt 2>&1; cat $R/gpu.txt
timeout -k 5 100 python3 bench/results/fused-h100-2026-12-07/long_row.py > $R/long-row.log 2>&1; t "long row" $?
grep -o '"case.*' $R/long-row.log | cut -c1-200; tail -3 $R/long-row.log | grep -v '^{'
tar -C /tmp -czf $OUT/call5.tgz call5
timeout -k 5 120 python3 -m pytest -m gpu -q -p no:cacheprovider -rfE tests/test_kernels_gpu.py \
  > $R/gpu-tests-kernels.log 2>&1; t "gpu tests (kernels)" $?; tail -3 $R/gpu-tests-kernels.log
tar -C /tmp -czf $OUT/call5.tgz call5
