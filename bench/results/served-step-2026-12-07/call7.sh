#!/bin/bash
# Call 7, one GPU, carry [".whl"], ~400 s: (1) the new GPU test of the staging split (the served step's device time
# before its graph's replay: input copies, and the device waiting on a host that fell behind); (2) call 6 of
# ../curve-h100-2026-12-07/ (the 512-row step alone x10, held ~20 s, then serve at c64 with the server's step times
# and now its staging share, SM clock and power logged throughout); (3) the same serve against a server whose Python
# switches threads every 0.5 ms instead of 5 (sys.setswitchinterval): does the scheduler thread wait on the GIL?
# (Call 5 there, the cuBLAS row sweep, was left out: failed machine starts left too little device time.)
set -u
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 3
export NCCL_NVLS_ENABLE=0 PYTHONUNBUFFERED=1 PYTHONPATH=/tmp/site:.
mkdir -p /tmp/call7 $OUT
timeout -k 5 240 python3 -m pytest -q -p no:cacheprovider tests/test_serve_metrics.py \
  tests/test_engine_gpu.py::test_each_graphed_steps_staging_is_a_part_of_its_device_time > $OUT/pytest.log 2>&1; echo "pytest rc $?"; tail -3 $OUT/pytest.log
bash bench/results/curve-h100-2026-12-07/call6.sh
grep -E "before the graphs' replays|mean step device ms|device busy" /tmp/curve6/serve/report.md /tmp/curve6/serve/c64/report.md 2>/dev/null | head -6
R=/tmp/call7/switch; mkdir -p $R
(exec python3 -c "import sys, runpy; sys.setswitchinterval(0.0005); sys.argv[0] = 'decode_server'; \
   runpy.run_module('decode_server', run_name='__main__')" --colocated --model qwen2.5-7b --listen 127.0.0.1:50052 \
   --metrics-port 9102 > $R/decode-server.log 2>&1) & DPID=$!
python3 -c "from bench.measure.launch import wait_serving; wait_serving('127.0.0.1:50052', [], timeout=150)"
echo "server (switch 0.5 ms) rc $?"
timeout -k 10 100 python3 -m bench.cli serve --addr 127.0.0.1:50052 --model qwen2.5-7b --num-prompts 1 \
    --prompts-per-concurrency 8 --concurrency 64 --input-len 1024 --input-len-range 0.5 --output-len 128 \
    --warmup 4 --timeout 300 --max-duration 60 --server-metrics http://127.0.0.1:9102/metrics \
    --out $R/serve > $R/serve.log 2>&1; echo "serve (switch 0.5 ms) rc $?"
kill -TERM $DPID 2>/dev/null; wait $DPID 2>/dev/null
tar -C /tmp -czf $OUT/call7-switch.tgz call7
grep -E "^\| 64 |before the graphs' replays|mean step device ms|device busy" $R/serve/report.md $R/serve/c64/report.md 2>/dev/null | head -6
