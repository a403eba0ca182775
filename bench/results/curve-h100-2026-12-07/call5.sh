#!/bin/bash
# Call 5, one GPU, carry [".whl"]: call 4's sweep with each row count's GEMMs in a CUDA graph (call 4's eager loops
# timed the host's launches for qkv and o, ~31-34 us a call), with the SM clock and power logged every 100 ms beside it
# (call 4's `down` at 2,048 rows read 485 us at the sweep's end against 380 in serve's short roofline: clocks?), then
# the roofline's own measure_gemm right after the sweep, on the hot GPU.
set -u
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 3
export NCCL_NVLS_ENABLE=0 PYTHONUNBUFFERED=1 PYTHONPATH=/tmp/site:.
R=/tmp/curve5; mkdir -p $R $OUT
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv > $R/gpu.txt 2>&1; cat $R/gpu.txt
start=$(date +%s)
nvidia-smi --query-gpu=timestamp,clocks.sm,clocks.mem,power.draw,temperature.gpu,clocks_throttle_reasons.active \
  --format=csv -lms 100 > $R/clocks.csv 2>&1 & SMI=$!
timeout -k 5 150 python3 -m bench.probes.gemm_rows --model qwen2.5-7b --rows 16:2048:16 > $R/gemm-rows.log 2>&1
echo "gemm_rows rc $? at $(( $(date +%s) - start )) s"; grep -v "^{" $R/gemm-rows.log | cut -c1-1200
python3 -c "
import json; from bench.measure import roofline; from kvtransfer.model.spec import load_config
m = roofline.measure_gemm(roofline.Dims.of(load_config('qwen2.5-7b')))
print(json.dumps({k: round(v['tflops']) for k, v in m['shapes'].items()}), round(m['layer_tflops']))
" > $R/roofline-after.log 2>&1; echo "roofline after the sweep: $(cat $R/roofline-after.log)"
kill $SMI 2>/dev/null; awk -F', ' 'NR > 1 {print $2}' $R/clocks.csv | sort | uniq -c | sort -rn | head -5
tar -C /tmp -czf $OUT/curve5.tgz curve5
