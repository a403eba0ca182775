#!/bin/bash
# Call 12, one GPU, carry [".whl"], ~300 s (limit 470): what failed starts left room for (the session of 2026-12-07 from
# 23:33 UTC: 734 s of device time left after seven refusals). (1) The GPU tests of the device code changed since the
# last whole suite (3f5bc05): the kernels (kernels/triton_softmax.py and norms.py split out) and the engine (the
# event before each graph replay, the delivery move, the staging split and its test): tests/test_kernels_gpu.py and
# tests/test_engine_gpu.py. (2) call9.sh: serve at c64 (the README workload, default flags) with the served steps'
# device ms, their staging share and the SM clock logged.
set -u
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 3
export NCCL_NVLS_ENABLE=0 PYTHONUNBUFFERED=1 PYTHONPATH=/tmp/site:.
mkdir -p $OUT
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv > $OUT/gpu.txt 2>&1; cat $OUT/gpu.txt
start=$(date +%s)
timeout -k 10 200 python3 -m pytest -m gpu -q -p no:cacheprovider -rfE --durations=5 tests/test_kernels_gpu.py \
  tests/test_engine_gpu.py > $OUT/gpu-tests.log 2>&1
echo "gpu tests rc $? at $(( $(date +%s) - start )) s"; tail -4 $OUT/gpu-tests.log
bash bench/results/served-step-2026-12-07/call9.sh
