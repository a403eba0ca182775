#!/bin/bash
# Call 10, one GPU, carry [".whl"], ~400-560 s: the whole GPU suite (`make gpu-test`'s selection) on the current
# tree, whose device code changed since the last suite that passed (3f5bc05, stall-h100-2026-12-07 call 15): the
# event before each graph replay (graphs.Step._replay), the delivery move (queued.hand_out), the attention kernels'
# shared tile step in kernels/triton_softmax.py and the RMSNorms in kernels/norms.py. Run it before call7.sh.
set -u
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 3
export NCCL_NVLS_ENABLE=0 PYTHONUNBUFFERED=1 PYTHONPATH=/tmp/site:.
mkdir -p $OUT
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv > $OUT/gpu.txt 2>&1; cat $OUT/gpu.txt
git log --oneline -1 2>/dev/null > $OUT/tree.txt
timeout -k 10 560 python3 -m pytest -m gpu -q -p no:cacheprovider -rfE --durations=10 > $OUT/gpu-tests.log 2>&1
echo "pytest rc $?"; tail -25 $OUT/gpu-tests.log
