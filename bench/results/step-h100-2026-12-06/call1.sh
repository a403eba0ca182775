#!/bin/bash
# Call 1, one GPU, carry [".whl"]: the decode kernel's launch sweep (the attention probe's --decode-sweep, alone and
# beside the chunk kernel), then the whole GPU suite on this tree (make gpu-test). ~9.5 min.
set -u
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 3
export NCCL_NVLS_ENABLE=0 PYTHONUNBUFFERED=1 PYTHONPATH=/tmp/site:.
R=$OUT/call1; mkdir -p $R
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv > $R/gpu.txt 2>&1; cat $R/gpu.txt
start=$(date +%s)
timeout -k 5 140 python3 -m bench.probes.chunk_attention --decode-sweep --no-chunk-sweep --cases 448@512 \
  > $R/probe-attention.log 2>&1
echo "probe rc $? at $(( $(date +%s) - start )) s"; grep -E "^(pair|decode)" $R/probe-attention.log | cut -c1-300
tar -C $OUT -czf $OUT/call1.tgz call1
left=$(( 575 - ($(date +%s) - start) ))
timeout -k 5 $left python3 -m pytest -m gpu -q -p no:cacheprovider --durations=15 tests/ > $R/gpu-tests.log 2>&1
echo "gpu tests rc $? at $(( $(date +%s) - start )) s"; tail -25 $R/gpu-tests.log
tar -C $OUT -czf $OUT/call1.tgz call1
