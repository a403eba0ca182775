#!/bin/bash
# Call 1, one GPU, carry [".whl"]: the mixed step's two attention kernels at other launches (--pair-sweep), the
# decode kernel's split counts at 8-256 rows (the attention probe's
# --split-sweep, to re-tune choose_num_splits), then the whole GPU suite on this tree (make gpu-test). ~9.5 min.
set -u
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 3
export NCCL_NVLS_ENABLE=0 PYTHONUNBUFFERED=1 PYTHONPATH=/tmp/site:.
R=$OUT/call1; mkdir -p $R
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv > $R/gpu.txt 2>&1; cat $R/gpu.txt
git log -1 --format=%h > $R/tree.txt 2>/dev/null
start=$(date +%s)
timeout -k 5 90 python3 -m bench.probes.chunk_attention --pair-sweep --no-chunk-sweep --cases 448@512 \
  > $R/probe-pairs.log 2>&1
echo "pair probe rc $? at $(( $(date +%s) - start )) s"; grep -E "^(pair|pairs) " $R/probe-pairs.log | cut -c1-200
timeout -k 5 150 python3 -m bench.probes.chunk_attention \
  --split-sweep 8@4096,16@1024,32@1024,64@1024,128@1024,256@1024,64@4096,32@8192,1@32768,4@8192 > $R/probe-splits.log 2>&1
echo "split probe rc $? at $(( $(date +%s) - start )) s"; grep -E "^splits" $R/probe-splits.log | cut -c1-200 | head -90
tar -C $OUT -czf $OUT/call1.tgz call1
left=$(( 570 - ($(date +%s) - start) ))
timeout -k 5 $left python3 -m pytest -m gpu -q -p no:cacheprovider --durations=15 tests/ > $R/gpu-tests.log 2>&1
echo "gpu tests rc $? at $(( $(date +%s) - start )) s"; tail -25 $R/gpu-tests.log
tar -C $OUT -czf $OUT/call1.tgz call1
