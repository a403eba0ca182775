#!/bin/bash
# Issue #26, call 3: the split draw with the launch shape call 2 chose (programs_for: P a power of two at or
# below 4 x SMs / n up to 32 rows, 2 x SMs / n past; 4 warps), one H200 (nvidia-h200), carry [".whl"]:
# 1. the sampler's gpu tests;
# 2. the decode step, greedy vs every row sampling (temperature 1, top_p 0.9), alternating, two rounds each.
set -u
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 3
export PYTHONPATH=/tmp/site:. NCCL_NVLS_ENABLE=0 PYTHONUNBUFFERED=1
R=$OUT/r3; mkdir -p $R
start=$(date +%s)
timeout 200 python3 -m pytest -m gpu -q -p no:cacheprovider -rfEs tests/test_sampler.py -s > $R/gpu-tests.log 2>&1
echo "gpu tests rc $? ($(( $(date +%s) - start )) s): $(tail -1 $R/gpu-tests.log)"
for round in 1 2; do
  for arm in greedy sampling; do
    flags=$([ $arm = sampling ] && echo "--temperature 1 --top-p 0.9" || echo "")
    t0=$(date +%s)
    timeout 110 python3 -m bench.cli decode --model qwen2.5-7b --batches 1,8,32,64 --contexts 1024,4096 \
      --hf none $flags --out $R/decode-$arm-$round > $R/decode-$arm-$round.log 2>&1
    echo "$arm-$round rc $? ($(( $(date +%s) - t0 )) s)"
    tar -C $OUT -czf $OUT/call3.tgz r3
  done
done
python3 bench/results/openai-h200-2026-12-02/summarize_decode.py $R > $R/summary.md
cat $R/summary.md
tar -C $OUT -czf $OUT/call3.tgz r3 && rm -rf $R
