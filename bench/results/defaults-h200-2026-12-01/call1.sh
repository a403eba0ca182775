#!/bin/bash
# Device call 1 (nvidia-h200): make gpu-test (the defaults-only starts included), then the colocated arms:
# defaults (only --listen) and the tuned flags of the README's serve sweep, same workload, same call.
set -u
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
export PYTHONPATH=/tmp/site:. NCCL_NVLS_ENABLE=0 PYTHONUNBUFFERED=1
mkdir -p $OUT/r
timeout 260 python3 -m pytest -m gpu -q -p no:cacheprovider > $OUT/r/gpu-tests.log 2>&1; tail -3 $OUT/r/gpu-tests.log
A=bench/results/defaults-h200-2026-12-01/serve_arm.sh
bash $A colocated-defaults colocated ""
bash $A colocated-tuned colocated "--dtype bfloat16 --max-batch 64 --max-seq-len 2048 --prefill-chunk 256 --mixed-prefill"
tar -C $OUT -czf $OUT/call1.tgz r && rm -rf $OUT/r
