#!/bin/bash
# Call 3, one GPU, carry [".whl"]: the new split rule (choose_num_splits at 2 programs an SM) on this tree: the
# 512-row mixed step's profile, then the GPU kernel and engine tests, in the ~250 s of device time left.
set -u
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 3
export NCCL_NVLS_ENABLE=0 PYTHONUNBUFFERED=1 PYTHONPATH=/tmp/site:.
R=$OUT/call3; mkdir -p $R
start=$(date +%s)
timeout -k 5 60 python3 -m bench.probes.profile_mixed --model qwen2.5-7b --mixed 512 --batch 64 --context 1024 \
  > $R/profile-mixed.log 2>&1
echo "profile rc $? at $(( $(date +%s) - start )) s"; grep -E "^step|^    (attn_|gate_up|down)" $R/profile-mixed.log
timeout -k 5 $(( 165 - ($(date +%s) - start) )) python3 -m pytest -m gpu -q -p no:cacheprovider \
  tests/test_kernels_gpu.py tests/test_engine_gpu.py > $R/gpu-tests.log 2>&1
echo "gpu tests rc $? at $(( $(date +%s) - start )) s"; tail -4 $R/gpu-tests.log
