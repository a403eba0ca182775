#!/bin/bash
# Call 2, one GPU, carry [".whl"]: the fused mixed attention's launch swept (mixed_sweep.py: the grid's order,
# warps, stages at 64 and 128 decode rows); the 512-row step's profile at 64 and 128 decode rows on this tree; then
# the GPU tests call 1 leaves (the defaults, the invariant GEMM, the batch-invariant mode and servers) in what time
# is left. Each stage tars to $OUT.
set -u
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 3
export NCCL_NVLS_ENABLE=0 PYTHONUNBUFFERED=1 PYTHONPATH=/tmp/site:.
R=/tmp/call2; mkdir -p $R $OUT
start=$(date +%s); t() { echo "$1 rc $2 at $(( $(date +%s) - start )) s"; }
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv > $R/gpu.txt 2>&1; cat $R/gpu.txt
timeout -k 5 150 python3 bench/results/fused-h100-2026-12-07/mixed_sweep.py > $R/mixed-sweep.log 2>&1
t "fused launch sweep" $?; grep -o '"decode_rows.*' $R/mixed-sweep.log
tar -C /tmp -czf $OUT/call2.tgz call2
for b in 64 128; do
  timeout -k 5 45 python3 -m bench.probes.profile_mixed --model qwen2.5-7b --mixed 512 --batch $b --context 1024 \
    > $R/profile-$b.log 2>&1; t "profile $b" $?
  grep -E "^step|^kernels|^    attn" $R/profile-$b.log
done
tar -C /tmp -czf $OUT/call2.tgz call2
left=$(( ${CAP:-575} - $(date +%s) + start )); [ $left -ge 20 ] || { echo "no time left for the tests"; exit 0; }
timeout -k 5 $left python3 -m pytest -m gpu -q -p no:cacheprovider -rfE tests/test_invariant_gpu.py \
  tests/test_batch_invariant_gpu.py tests/test_batch_invariant_servers_gpu.py tests/test_defaults_gpu.py \
  > $R/gpu-tests.log 2>&1; t "gpu tests (invariant, defaults; ${left} s)" $?; tail -3 $R/gpu-tests.log
tar -C /tmp -czf $OUT/call2.tgz call2
