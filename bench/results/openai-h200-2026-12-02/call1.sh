#!/bin/bash
# Device call 1 of issue #26 (nvidia-h200, one GPU), from the repo root, carry [".whl"]:
# 1. the sampler's gpu tests (the captured sampling graph == eager; a graphed engine step with sampling rows ==
#    an eager one) and the engine/graph gpu tests the sampling wiring touched;
# 2. the decode step, greedy against sampling at temperature 1, top_p 0.9 (every row sampling, seeded), alternating
#    greedy, sampling, greedy, sampling, the same cells: `kvtransfer-bench decode` (CUDA graphs, p50 of 20 after 3).
set -u
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
export PYTHONPATH=/tmp/site:. NCCL_NVLS_ENABLE=0 PYTHONUNBUFFERED=1
mkdir -p $OUT/r1
timeout 200 python3 -m pytest -m gpu -q -p no:cacheprovider -rfEs tests/test_sampler.py tests/test_engine_gpu.py \
  > $OUT/r1/gpu-tests.log 2>&1
echo "gpu tests rc $?: $(tail -1 $OUT/r1/gpu-tests.log)"
for round in 1 2; do
  for arm in greedy sampling; do
    flags=$([ $arm = sampling ] && echo "--temperature 1 --top-p 0.9" || echo "")
    timeout 150 python3 -m bench.cli decode --model qwen2.5-7b --batches 1,8,32,64 --contexts 1024,4096 \
      --hf none $flags --out $OUT/r1/decode-$arm-$round > $OUT/r1/decode-$arm-$round.log 2>&1
    echo "$arm-$round rc $?: $(grep 'engine ' $OUT/r1/decode-$arm-$round.log | sed 's/decode: engine //' | tr '\n' ' ')"
    tar -C $OUT -czf $OUT/call1.tgz r1
  done
done
rm -rf $OUT/r1
