#!/bin/bash
# Call 6 (prepared, not run), one GPU, carry [".whl"], ~200 s: is the served 512-row step's ~14.1 ms (against the
# probe's 13.15) the GPU's clocks under sustained load? With the SM clock, power and throttle reasons logged every
# 100 ms throughout: (1) the 512-row step at the steady mix, 10 timed steps (as call 3); (2) the same step held for
# ~20 s (1,500 steps); (3) the README serve workload at c64 against a default server, as call 14 of
# ../stall-h100-2026-12-07/ (its roofline measured by serve before the load, on a GPU idle since the server's start).
set -u
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 3
export NCCL_NVLS_ENABLE=0 PYTHONUNBUFFERED=1 PYTHONPATH=/tmp/site:.
R=/tmp/curve6; mkdir -p $R $OUT
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv > $R/gpu.txt 2>&1; cat $R/gpu.txt
start=$(date +%s); t() { echo "$1 rc $2 at $(( $(date +%s) - start )) s"; }
nvidia-smi --query-gpu=timestamp,clocks.sm,clocks.mem,power.draw,temperature.gpu,clocks_throttle_reasons.active \
  --format=csv -lms 100 > $R/clocks.csv 2>&1 & SMI=$!
for runs in 10 1500; do
  timeout -k 5 120 python3 -m bench.probes.step_curve --model qwen2.5-7b --sizes 512 --itl-batches 64 --runs $runs \
    --no-roofline > $R/step-512-runs$runs.log 2>&1
  t "step_curve 512 x $runs" $?; grep -E "^\| 512 " $R/step-512-runs$runs.log; date -u +%T.%N >> $R/marks.txt
done
(exec python3 -m decode_server --colocated --model qwen2.5-7b --listen 127.0.0.1:50051 --metrics-port 9101 \
   > $R/decode-server.log 2>&1) & DPID=$!
python3 -c "from bench.measure.launch import wait_serving; wait_serving('127.0.0.1:50051', [], timeout=150)"
t server $?; date -u +%T.%N >> $R/marks.txt
timeout -k 10 100 python3 -m bench.cli serve --addr 127.0.0.1:50051 --model qwen2.5-7b --num-prompts 1 \
    --prompts-per-concurrency 8 --concurrency 64 --input-len 1024 --input-len-range 0.5 --output-len 128 \
    --warmup 4 --timeout 300 --max-duration 60 --server-metrics http://127.0.0.1:9101/metrics \
    --out $R/serve > $R/serve.log 2>&1; t serve $?; date -u +%T.%N >> $R/marks.txt
grep -E "^\| 64 |mean step device ms|without prompt rows" $R/serve/report.md $R/serve/c64/report.md 2>/dev/null | head -6
kill -TERM $DPID 2>/dev/null; wait $DPID 2>/dev/null; kill $SMI 2>/dev/null
awk -F', ' 'NR > 1 {print $2}' $R/clocks.csv | sort | uniq -c | sort -rn | head -6
tar -C /tmp -czf $OUT/curve6.tgz curve6
