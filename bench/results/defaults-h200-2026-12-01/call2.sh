#!/bin/bash
# Device call 2 (nvidia-h200): the defaults-only GPU starts (tests/test_defaults_gpu.py), then the pair on the one GPU (two processes, cuda_ipc): defaults (the decode side's share of
# the GPU, --gpu-memory-utilization 0.65, is the one flag two servers on one GPU need) and the tuned flags.
set -u
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
export PYTHONPATH=/tmp/site:. NCCL_NVLS_ENABLE=0 PYTHONUNBUFFERED=1
mkdir -p $OUT/r
timeout 200 python3 -m pytest -m gpu -q -p no:cacheprovider -rf tests/test_defaults_gpu.py > $OUT/r/gpu-defaults.log 2>&1
tail -5 $OUT/r/gpu-defaults.log
A=bench/results/defaults-h200-2026-12-01/serve_arm.sh
bash $A pair-defaults pair "--transport cuda_ipc --gpu-memory-utilization 0.65" "--transport cuda_ipc"
bash $A pair-tuned pair "--transport cuda_ipc --dtype bfloat16 --max-batch 64 --max-seq-len 2048 --prefill-chunk 256 --mixed-prefill" "--transport cuda_ipc --dtype bfloat16"
tar -C $OUT -czf $OUT/call2.tgz r && rm -rf $OUT/r
