#!/bin/bash
# Call 2, one GPU, carry [".whl"]: the whole GPU suite on this tree (the split rule at 2 programs an SM, the named
# liveness watch).
set -u
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 3
export NCCL_NVLS_ENABLE=0 PYTHONUNBUFFERED=1 PYTHONPATH=/tmp/site:.
mkdir -p $OUT
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv > $OUT/gpu.txt 2>&1; cat $OUT/gpu.txt
start=$(date +%s)
timeout -k 10 560 python3 -m pytest -m gpu -q -p no:cacheprovider -rfE tests/ > $OUT/gpu-tests.log 2>&1
echo "gpu tests rc $? at $(( $(date +%s) - start )) s"; tail -6 $OUT/gpu-tests.log
