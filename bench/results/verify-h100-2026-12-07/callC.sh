#!/bin/bash
# Call C, one GPU, carry [".whl"]: call B cut to the ~250 s of device time the session had left: the fused kernel's
# GPU tests, then the 512-row step's profile with the fused kernel and with the two kernels (side stream), at 64 and
# at 128 decode rows over 1k.
set -u
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 3
export NCCL_NVLS_ENABLE=0 PYTHONUNBUFFERED=1 PYTHONPATH=/tmp/site:.
R=/tmp/callC; mkdir -p $R $OUT
start=$(date +%s); t() { echo "$1 rc $2 at $(( $(date +%s) - start )) s"; }
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv > $R/gpu.txt 2>&1; cat $R/gpu.txt
timeout -k 5 50 python3 -m pytest -m gpu -q -p no:cacheprovider -rfE tests/test_kernels_gpu.py -k "mixed_attention" \
  > $R/gpu-tests-kernels.log 2>&1; t "gpu tests (the fused kernel's)" $?; tail -2 $R/gpu-tests-kernels.log
for batch in 64 128; do
  for arm in fused two; do
    timeout -k 5 40 python3 -m bench.probes.profile_mixed --model qwen2.5-7b --mixed 512 --batch $batch --context 1024 \
      --attention $arm > $R/profile-$arm-$batch.log 2>&1; t "profile $arm $batch" $?
    grep -E "^step|^kernels|^    attn" $R/profile-$arm-$batch.log
    tar -C /tmp -czf $OUT/callC.tgz callC
  done
done
