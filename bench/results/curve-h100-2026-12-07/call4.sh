#!/bin/bash
# Call 4, one GPU, carry [".whl"]: cuBLAS's time for Qwen2.5-7B's layer GEMMs at every row count 16..2,048 (step 16):
# which row counts get a kernel slower than a larger count's (call 2: gate_up at 448 rows, 347 TFLOP/s).
set -u
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 3
export NCCL_NVLS_ENABLE=0 PYTHONUNBUFFERED=1 PYTHONPATH=/tmp/site:.
R=/tmp/curve4; mkdir -p $R $OUT
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv > $R/gpu.txt 2>&1; cat $R/gpu.txt
start=$(date +%s)
timeout -k 5 200 python3 -m bench.probes.gemm_rows --model qwen2.5-7b --rows 16:2048:16 > $R/gemm-rows.log 2>&1
echo "gemm_rows rc $? at $(( $(date +%s) - start )) s"; grep -v "^{" $R/gemm-rows.log | cut -c1-1500
tar -C /tmp -czf $OUT/curve4.tgz curve4
