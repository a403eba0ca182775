#!/bin/bash
# Issue #37 step 1-2 (the kernels through a block table; the engine reads its pool through the table), one GPU,
# carry [".whl", "gpu_base"] where gpu_base/ is `git archive 02dcfb7` (the fixed-slot tree) unpacked:
# 1. the kernels' and engine's gpu tests on this tree;
# 2. decode_attention through a block table at pages 16-256 beside the slot layout (python -m bench.probes.kernels
#    --only paging), outputs checked equal;
# 3. kvtransfer-bench decode, this tree and the fixed-slot tree alternately (A B A B), same machine.
set -u
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 3
export NCCL_NVLS_ENABLE=0 PYTHONUNBUFFERED=1
R=$OUT/c1; mkdir -p $R
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv > $R/gpu.txt
start=$(date +%s)
PYTHONPATH=/tmp/site:. timeout 200 python3 -m pytest -m gpu -q -p no:cacheprovider -rfEs tests/test_kernels_gpu.py tests/test_engine_gpu.py > $R/gpu-tests.log 2>&1
echo "gpu tests rc $? ($(( $(date +%s) - start )) s)"; tail -3 $R/gpu-tests.log
PYTHONPATH=/tmp/site:. timeout 150 python3 -m bench.probes.kernels --only paging > $R/paging.json 2> $R/paging.log
echo "paging rc $? ($(( $(date +%s) - start )) s)"; tail -c 1500 $R/paging.json
tar -C $OUT -czf $OUT/call1.tgz c1
for round in 1 2; do
  for tree in new base; do
    dir=.; [ $tree = base ] && dir=gpu_base
    t0=$(date +%s)
    (cd $dir && PYTHONPATH=/tmp/site:. timeout 110 python3 -m bench.cli decode --model qwen2.5-7b --batches 1,64 \
      --contexts 1024,8192 --hf none --out $R/decode-$tree-$round > $R/decode-$tree-$round.log 2>&1)
    echo "decode $tree $round rc $? ($(( $(date +%s) - t0 )) s)"; grep "decode: engine" $R/decode-$tree-$round.log | head -8
    tar -C $OUT -czf $OUT/call1.tgz c1
  done
done
echo "total $(( $(date +%s) - start )) s"
