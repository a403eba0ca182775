#!/bin/bash
# Call A, one GPU, carry [".whl"]: the GPU suite's transport/tier/sampler/serve half on this tree (with the test the
# last stop's call cut: the transport contract's silent peer over grpc on cuda), the 512-row step's profile with and
# without the side stream, and the layer GEMMs' rate at step sizes 384..1,024 rows (gemm_rows.py). ~520 s of timeouts.
set -u
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 3
export NCCL_NVLS_ENABLE=0 PYTHONUNBUFFERED=1 PYTHONPATH=/tmp/site:.
R=/tmp/callA; mkdir -p $R $OUT
start=$(date +%s); t() { echo "$1 rc $2 at $(( $(date +%s) - start )) s"; }
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv > $R/gpu.txt 2>&1; cat $R/gpu.txt
for arm in side one; do
  timeout -k 5 50 python3 -m bench.probes.profile_mixed --model qwen2.5-7b --mixed 512 --batch 64 --context 1024 \
    $([ $arm = one ] && echo --no-side-stream) > $R/profile-$arm.log 2>&1; t "profile $arm" $?
  grep -E "^step|^kernels" $R/profile-$arm.log
done
timeout -k 5 60 python3 bench/results/verify-h100-2026-12-07/gemm_rows.py > $R/gemm-rows.jsonl 2> $R/gemm-rows.err
t "gemm rows" $?; cut -c1-400 $R/gemm-rows.jsonl | grep -oE '"rows": [0-9]+|"layer_tflops": [0-9.]+|"us_per_row_28_layers": [0-9.]+' | paste - - - 
timeout -k 10 330 python3 -m pytest -m gpu -q -p no:cacheprovider -rfE --durations=15 tests/test_transport_contract.py \
  tests/test_prefix_cache_gpu.py tests/test_tiers.py tests/test_cuda_ipc.py tests/test_grpc_transport.py tests/test_gpu.py \
  tests/test_sampler.py tests/test_bench_serve.py > $R/gpu-tests.log 2>&1; t "gpu tests (half B)" $?
tail -3 $R/gpu-tests.log
tar -C /tmp -czf $OUT/callA.tgz callA
