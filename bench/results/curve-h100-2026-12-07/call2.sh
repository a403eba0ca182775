#!/bin/bash
# Call 2, one GPU, carry [".whl"]: call 1's curve again with the GEMM rate measured after the steps (warm GPU; call 1
# measured it first, 698 TFLOP/s against 765 in serve runs), the same sizes plus 480 and 576; then the 448-row step
# (17.4 ms in call 1, slower than 512 rows) profiled beside the 512-row one (`profile_mixed`, 49 / 56 decode rows).
set -u
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 3
export NCCL_NVLS_ENABLE=0 PYTHONUNBUFFERED=1 PYTHONPATH=/tmp/site:.
R=/tmp/curve2; mkdir -p $R $OUT
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv > $R/gpu.txt 2>&1; cat $R/gpu.txt
start=$(date +%s); t() { echo "$1 rc $2 at $(( $(date +%s) - start )) s"; }
timeout -k 5 300 python3 -m bench.probes.step_curve --model qwen2.5-7b \
  --sizes 256,384,448,480,512,576,640,768,1024 --runs 10 > $R/step-curve.log 2>&1
t step_curve $?; grep -v "^{" $R/step-curve.log | tail -14
tar -C /tmp -czf $OUT/curve2.tgz curve2
for m in 448:49 512:56; do
  timeout -k 5 120 python3 -m bench.probes.profile_mixed --model qwen2.5-7b --mixed ${m%:*} --batch ${m#*:} \
    --context 1024 --prompt-start 320 --prompt-len 1024 > $R/profile-mixed-${m%:*}.log 2>&1
  t "profile_mixed ${m}" $?; grep -E "^(step|kernels run|  gemm|  attention|    (gate_up|down|qkv|o|attn_chunk|attn_decode) |lm_head rows)" $R/profile-mixed-${m%:*}.log | cut -c1-400
done
tar -C /tmp -czf $OUT/curve2.tgz curve2
