#!/bin/bash
# Call 1, one GPU, carry [".whl"]: the whole GPU suite on this tree (make gpu-test), then the decode kernel's
# launch sweep (the attention probe's --decode-sweep). ~9 min.
set -u
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 3
export NCCL_NVLS_ENABLE=0 PYTHONUNBUFFERED=1 PYTHONPATH=/tmp/site:.
R=$OUT/call1; mkdir -p $R
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv > $R/gpu.txt 2>&1
git log -1 --format=%H > $R/tree.txt 2>/dev/null || true
timeout -k 10 450 python3 -m pytest -m gpu -q -p no:cacheprovider --durations=15 tests/ > $R/gpu-tests.log 2>&1
echo "gpu tests rc $?"; tail -25 $R/gpu-tests.log
timeout -k 10 120 python3 -m bench.probes.chunk_attention --decode-sweep --cases 448@512 > $R/probe-attention.log 2>&1
echo "probe rc $?"; grep -E "^(pair|decode)" $R/probe-attention.log | cut -c1-240 | head -30
tar -C $OUT -czf $OUT/call1.tgz call1
