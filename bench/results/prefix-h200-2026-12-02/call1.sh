#!/bin/bash
# Device call 1 of #27 (nvidia-h200), from the repo root, carry [".whl"]: the prefix cache's gpu tests; then the
# multi-turn acceptance (mt_arm.sh) in two arms on the one GPU: colocated with default flags, and the pair
# (two processes, cuda_ipc) whose decode worker has a pool too small to keep every conversation (16 slots for 64
# conversations at concurrency 32) and a 16 GiB pinned host tier.
set -u
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 3
export PYTHONPATH=/tmp/site:. NCCL_NVLS_ENABLE=0 PYTHONUNBUFFERED=1
mkdir -p $OUT/r
A=bench/results/prefix-h200-2026-12-02/mt_arm.sh
timeout 100 python3 -m pytest -m gpu -q -p no:cacheprovider -rfEs tests/test_prefix_cache_gpu.py > $OUT/r/gpu-tests.log 2>&1
echo "gpu tests rc $?: $(tail -1 $OUT/r/gpu-tests.log)"
bash $A colocated colocated ""
tar -C $OUT -czf $OUT/call1.tgz r
bash $A pair-host pair "--transport cuda_ipc --gpu-memory-utilization 0.65 --max-batch 16 --host-cache-gib 16" "--transport cuda_ipc"
tar -C $OUT -czf $OUT/call1.tgz r && rm -rf $OUT/r
