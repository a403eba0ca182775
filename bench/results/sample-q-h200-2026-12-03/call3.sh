#!/bin/bash
# Issue #26, 2026-12-03, call 3, one H200 (nvidia-h200), carry [".whl"]: after triton_sample.py was cut into three
# files (no kernel changed): the sampler's and the engine's gpu tests, and one paired decode run.
set -u
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 3
export PYTHONPATH=/tmp/site:. NCCL_NVLS_ENABLE=0 PYTHONUNBUFFERED=1
R=$OUT/r3; mkdir -p $R
start=$(date +%s)
timeout 200 python3 -m pytest -m gpu -q -p no:cacheprovider -rfEs tests/test_sampler.py tests/test_engine_gpu.py -s > $R/gpu-tests.log 2>&1
echo "gpu tests rc $? ($(( $(date +%s) - start )) s): $(tail -1 $R/gpu-tests.log)"
timeout 120 python3 -m bench.cli decode --model qwen2.5-7b --batches 1,8,32,64 --contexts 1024,4096 --hf none \
  --temperature 1 --top-p 0.9 --out $R/decode-paired-1 > $R/decode-paired-1.log 2>&1
echo "paired-1 rc $? ($(( $(date +%s) - start )) s)"
grep "decode: engine" $R/decode-paired-1.log
tar -C $OUT -czf $OUT/call3.tgz r3 && rm -rf $R
