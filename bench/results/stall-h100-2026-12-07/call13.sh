#!/bin/bash
# Call 13, one GPU, carry [".whl", "out/gpu_base", "out/gpu_head"] (out/gpu_base: `git archive 02dcfb7 -- .
# ':!bench/results'`; out/gpu_head: `git archive a884fa4 -- . ':!bench/results'` with this tree's
# tests/test_kernels_gpu.py and tests/test_compile_keys.py: the tree before the fix). Call 11's run 1 stalled 247 ms
# on the 32k prompt's first chunk: rope+store compiled for the block's length (a constexpr). This call: the GPU test
# that counts compiled kernels, on this tree and on a884fa4 (it must fail there); then the interference chunked arm
# with an empty Triton cache each (cold, as call 11's run 1): this tree, then 02dcfb7; then the chunk loop profiled
# (bench/probes/chunked_prefill.py). Prepared 2026-12-07; ran the next session on 3f5bc05 (COMMAND.md), 196 s.
set -u
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 3
export NCCL_NVLS_ENABLE=0 PYTHONUNBUFFERED=1
R=/tmp/call13; mkdir -p $R $OUT
start=$(date +%s); t() { echo "$1 rc $2 at $(( $(date +%s) - start )) s"; }
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv > $R/gpu.txt 2>&1; cat $R/gpu.txt
for arm in new head; do
  tree=.; [ $arm = head ] && tree=out/gpu_head
  (cd $tree && TRITON_CACHE_DIR=$(mktemp -d) PYTHONPATH=/tmp/site:. timeout -k 5 60 python3 -m pytest -m gpu -q \
     -p no:cacheprovider -rfE tests/test_kernels_gpu.py -k "compiles_nothing or rope_store" \
     > $R/gpu-tests-$arm.log 2>&1); t "gpu tests $arm" $?; tail -2 $R/gpu-tests-$arm.log
done
tar -C /tmp -czf $OUT/call13.tgz call13
for arm in new base; do
  tree=.; [ $arm = base ] && tree=out/gpu_base
  (cd $tree && TRITON_CACHE_DIR=$(mktemp -d) PYTHONPATH=/tmp/site:. timeout -k 5 100 python3 -m bench.cli interference \
     --model qwen2.5-7b --device cuda:0 --streams 32 --context 1024 --arrivals 32000 --arms chunked --chunks 512 \
     --gap-s 1 --log-dir $R/intf-logs-$arm --out $R/intf-$arm > $R/intf-$arm.log 2>&1)
  t "interference $arm (empty Triton cache)" $?
  grep -E "^\| colocated" $R/intf-$arm/report.md | head -4
  tar -C /tmp -czf $OUT/call13.tgz call13
done
# The chunk loop alone, profiled cold and warm (fused and hf): where the host spends a fused chunk's ~35 ms.
PYTHONPATH=/tmp/site:. timeout -k 5 150 python3 -m bench.probes.chunked_prefill --profile --out $R/chunked \
  > $R/chunked.log 2>&1; t "chunk loop probe, profiled" $?; grep -E "^(fused|hf)" $R/chunked.log
tar -C /tmp -czf $OUT/call13.tgz call13
