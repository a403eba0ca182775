#!/bin/bash
# Call 9, one GPU, carry [".whl"], ~170 s: call 8 cut again to the device time failed starts left. The README serve
# workload at c64 against a default server: the served steps' device ms by size and the share of it before the
# graphs' replays (input copies, waits on the host), with the SM clock, power and throttle reasons logged every
# 100 ms; then, in what time is left, the GPU test of the staging split.
set -u
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 3
export NCCL_NVLS_ENABLE=0 PYTHONUNBUFFERED=1 PYTHONPATH=/tmp/site:.
R=/tmp/call9; mkdir -p $R $OUT
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv > $R/gpu.txt 2>&1; cat $R/gpu.txt
start=$(date +%s); t() { echo "$1 rc $2 at $(( $(date +%s) - start )) s"; }
nvidia-smi --query-gpu=timestamp,clocks.sm,clocks.mem,power.draw,temperature.gpu,clocks_throttle_reasons.active \
  --format=csv -lms 100 > $R/clocks.csv 2>&1 & SMI=$!
(exec python3 -m decode_server --colocated --model qwen2.5-7b --listen 127.0.0.1:50051 --metrics-port 9101 \
   > $R/decode-server.log 2>&1) & DPID=$!
python3 -c "from bench.measure.launch import wait_serving; wait_serving('127.0.0.1:50051', [], timeout=120)"
t server $?; date -u +%T.%N >> $R/marks.txt
timeout -k 10 90 python3 -m bench.cli serve --addr 127.0.0.1:50051 --model qwen2.5-7b --num-prompts 1 \
    --prompts-per-concurrency 8 --concurrency 64 --input-len 1024 --input-len-range 0.5 --output-len 128 \
    --warmup 4 --timeout 300 --max-duration 50 --server-metrics http://127.0.0.1:9101/metrics \
    --out $R/serve > $R/serve.log 2>&1; t serve $?; date -u +%T.%N >> $R/marks.txt
kill -TERM $DPID 2>/dev/null; wait $DPID 2>/dev/null; kill $SMI 2>/dev/null
grep -E "^\| 64 |before the graphs' replays|mean step device ms|device busy|steps with prompt" $R/serve/report.md \
  $R/serve/c64/report.md 2>/dev/null | head -8
awk -F', ' 'NR > 1 {print $2}' $R/clocks.csv | sort | uniq -c | sort -rn | head -6
tar -C /tmp -czf $OUT/call9.tgz call9
timeout -k 5 60 python3 -m pytest -q -p no:cacheprovider \
  tests/test_engine_gpu.py::test_each_graphed_steps_staging_is_a_part_of_its_device_time > $OUT/pytest.log 2>&1
t pytest $?; tail -3 $OUT/pytest.log
