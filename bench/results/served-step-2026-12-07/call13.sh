#!/bin/bash
# Call 13, one GPU, carry [".whl"], ~100 s (limit 150): the layer GEMMs held back to back (bench/probes/gemm_sustained.py)
# at the roofline's 2,048 rows for 30 s, then at the served step's 512 rows for 20 s, with the SM clock, power and
# clock-event reasons logged every 100 ms: is serve's roofline (a few hundred ms of GEMMs on an idle GPU) a rate a
# sustained load keeps? Call 12 saw the SM clock at ~1,530 MHz through serve (software power cap) against 1,980.
set -u
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 3
export NCCL_NVLS_ENABLE=0 PYTHONUNBUFFERED=1 PYTHONPATH=/tmp/site:.
mkdir -p $OUT
nvidia-smi --query-gpu=name,memory.total,driver_version,power.limit --format=csv > $OUT/gpu.txt 2>&1; cat $OUT/gpu.txt
nvidia-smi --query-gpu=timestamp,clocks.sm,clocks.mem,power.draw,temperature.gpu,clocks_throttle_reasons.active \
  --format=csv -lms 100 > $OUT/clocks.csv 2>&1 & SMI=$!
for rows in 2048 512; do
  timeout -k 5 65 python3 -m bench.probes.gemm_sustained --model qwen2.5-7b --rows $rows \
    --hold-s $([ $rows = 2048 ] && echo 30 || echo 20) > $OUT/sustained-$rows.log 2>&1
  echo "rows $rows rc $?"; grep -v "^{" $OUT/sustained-$rows.log | head -3
done
kill $SMI 2>/dev/null
awk -F', ' 'NR > 1 {print $2, $6}' $OUT/clocks.csv | sort | uniq -c | sort -rn | head -6
