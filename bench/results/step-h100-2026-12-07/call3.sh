#!/bin/bash
# Call 3, one GPU, carry [".whl"]: the GPU test call 2's limit cut (the transport contract's silent peer over grpc on cuda),
# then the step's two attention kernels serial vs on the side stream under the split rule at 2 programs an SM
# (the 512-row step's profile both ways).
set -u
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 3
export NCCL_NVLS_ENABLE=0 PYTHONUNBUFFERED=1 PYTHONPATH=/tmp/site:.
R=/tmp/call3; mkdir -p $R $OUT
start=$(date +%s); t() { echo "$1 rc $2 at $(( $(date +%s) - start )) s"; }
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv > $R/gpu.txt 2>&1; cat $R/gpu.txt
timeout -k 5 80 python3 -m pytest -m gpu -q -p no:cacheprovider -rfE tests/test_transport_contract.py -k "grpc_cuda and silent_peer" \
  > $R/gpu-tests-contract.log 2>&1; t "contract gpu tests" $?; tail -2 $R/gpu-tests-contract.log
for arm in side one; do
  timeout -k 5 45 python3 -m bench.probes.profile_mixed --model qwen2.5-7b --mixed 512 --batch 64 --context 1024 \
    $([ $arm = one ] && echo --no-side-stream) > $R/profile-$arm.log 2>&1; t "profile $arm" $?
  grep -E "^step|^kernels" $R/profile-$arm.log
done
tar -C /tmp -czf $OUT/call3.tgz call3
