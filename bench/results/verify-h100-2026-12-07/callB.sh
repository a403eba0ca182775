#!/bin/bash
# Call B, one GPU, carry [".whl"]: the fused mixed attention (kvtransfer/kernels/triton_mixed_attention.py) on a GPU:
# the 512-row step's profile three ways at 64 decode rows (fused, the two kernels on the side stream, the two on one
# stream) and two ways at 128, then the kernel, engine and defaults GPU tests (the servers at default flags).
set -u
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 3
export NCCL_NVLS_ENABLE=0 PYTHONUNBUFFERED=1 PYTHONPATH=/tmp/site:.
R=/tmp/callB; mkdir -p $R $OUT
start=$(date +%s); t() { echo "$1 rc $2 at $(( $(date +%s) - start )) s"; }
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv > $R/gpu.txt 2>&1; cat $R/gpu.txt
for arm in fused side one; do
  timeout -k 5 50 python3 -m bench.probes.profile_mixed --model qwen2.5-7b --mixed 512 --batch 64 --context 1024 \
    $([ $arm = fused ] && echo --attention fused || echo --attention two) $([ $arm = one ] && echo --no-side-stream) \
    > $R/profile-$arm.log 2>&1; t "profile $arm" $?
  grep -E "^step|^kernels|^    attn" $R/profile-$arm.log; grep -oE '"attention": "[a-z]+"' $R/profile-$arm.log
done
timeout -k 5 50 python3 -m bench.probes.profile_mixed --model qwen2.5-7b --mixed 512 --batch 128 --context 1024 \
  > $R/profile-fused-128.log 2>&1; t "profile fused 128" $?; grep -E "^step|^kernels" $R/profile-fused-128.log
timeout -k 5 50 python3 -m bench.probes.profile_mixed --model qwen2.5-7b --mixed 512 --batch 128 --context 1024 \
  --attention two > $R/profile-side-128.log 2>&1; t "profile side 128" $?; grep -E "^step|^kernels" $R/profile-side-128.log
timeout -k 5 200 python3 -m pytest -m gpu -q -p no:cacheprovider -rfE tests/test_kernels_gpu.py tests/test_engine_gpu.py \
  > $R/gpu-tests-1.log 2>&1; t "gpu tests kernels+engine" $?; tail -3 $R/gpu-tests-1.log
timeout -k 5 120 python3 -m pytest -m gpu -q -p no:cacheprovider -rfE tests/test_defaults_gpu.py \
  > $R/gpu-tests-2.log 2>&1; t "gpu tests defaults" $?; tail -3 $R/gpu-tests-2.log
tar -C /tmp -czf $OUT/callB.tgz callB
