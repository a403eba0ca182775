#!/bin/bash
# Device call 2 of #27 (nvidia-h200), from the repo root, carry [".whl"]: the multi-turn acceptance (mt_arm.sh) for
# the pair (two processes on the one GPU, cuda_ipc) with its default pool (call 1's pair had a pool of 16 slots).
set -u
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 3
export PYTHONPATH=/tmp/site:. NCCL_NVLS_ENABLE=0 PYTHONUNBUFFERED=1
mkdir -p $OUT/r
bash bench/results/prefix-h200-2026-12-02/mt_arm.sh pair pair "--transport cuda_ipc --gpu-memory-utilization 0.65" \
  "--transport cuda_ipc"
tar -C $OUT -czf $OUT/call2.tgz r && rm -rf $OUT/r
