#!/bin/bash
# Call 4 (same warm machine as call 3), one GPU, carry [".whl"]: the servers' GPU tests on this tree, in ~190 s.
set -u
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 3
export NCCL_NVLS_ENABLE=0 PYTHONUNBUFFERED=1 PYTHONPATH=/tmp/site:.
R=$OUT/call4; mkdir -p $R
timeout 190 python3 -m pytest -m gpu -q -p no:cacheprovider --durations=8 tests/test_batch_invariant_gpu.py \
  tests/test_batch_invariant_servers_gpu.py tests/test_defaults_gpu.py > $R/gpu-tests.log 2>&1
echo "rc $?"; tail -14 $R/gpu-tests.log
