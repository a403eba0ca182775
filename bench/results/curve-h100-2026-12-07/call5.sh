#!/bin/bash
# Call 5, one GPU, carry [".whl"]: call 4's sweep with each row count's GEMMs in a CUDA graph (call 4's eager loops
# timed the host's launches for qkv and o, ~31-34 us a call).
set -u
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 3
export NCCL_NVLS_ENABLE=0 PYTHONUNBUFFERED=1 PYTHONPATH=/tmp/site:.
R=/tmp/curve5; mkdir -p $R $OUT
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv > $R/gpu.txt 2>&1; cat $R/gpu.txt
start=$(date +%s)
timeout -k 5 150 python3 -m bench.probes.gemm_rows --model qwen2.5-7b --rows 16:2048:16 > $R/gemm-rows.log 2>&1
echo "gemm_rows rc $? at $(( $(date +%s) - start )) s"; grep -v "^{" $R/gemm-rows.log | cut -c1-1200
tar -C /tmp -czf $OUT/curve5.tgz curve5
