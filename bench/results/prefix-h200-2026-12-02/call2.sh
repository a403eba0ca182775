#!/bin/bash
# Device call 2 of #27 (nvidia-h200), from the repo root, carry [".whl"]: the multi-turn acceptance (mt_arm.sh) in two
# more arms: the pair (two processes on the one GPU, cuda_ipc) with its default pool, and colocated with a pool too
# small to keep every conversation (16 slots for 64 conversations at concurrency 32), a 16 GiB pinned host tier and
# room to wait for a slot (--admission-wait-s 120: call 1's pair with the default 10 s refused some requests).
set -u
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 3
export PYTHONPATH=/tmp/site:. NCCL_NVLS_ENABLE=0 PYTHONUNBUFFERED=1
mkdir -p $OUT/r
A=bench/results/prefix-h200-2026-12-02/mt_arm.sh
bash $A pair pair "--transport cuda_ipc --gpu-memory-utilization 0.65" "--transport cuda_ipc"
tar -C $OUT -czf $OUT/call2.tgz r
bash $A colocated-host colocated "--max-batch 16 --host-cache-gib 16 --admission-wait-s 120"
tar -C $OUT -czf $OUT/call2.tgz r && rm -rf $OUT/r
