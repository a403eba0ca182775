#!/bin/bash
# Call 11, one GPU, carry [".whl"], <= 590 s: call 7 reordered to fit one call with step-h100-2026-12-07's call 3.
# (1) the staging GPU test; (2) ../curve-h100-2026-12-07/call6.sh (the 512-row step alone x10, held ~20 s, then serve
# at c64, with SM clock, power and throttle reasons logged, and the server's staging share); (3) the 512-row step's
# profile with the prompt rows' attention on the side stream and on the main stream (`--no-side-stream`): how much of
# the step's ~0.9 ms with no kernel running is the side stream's joins; (4) if >= 200 s are left, call 7's serve
# against a server that switches Python threads every 0.5 ms (sys.setswitchinterval) instead of 5.
set -u
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 3
export NCCL_NVLS_ENABLE=0 PYTHONUNBUFFERED=1 PYTHONPATH=/tmp/site:.
mkdir -p /tmp/call11 $OUT
start=$(date +%s); t() { echo "$1 rc $2 at $(( $(date +%s) - start )) s"; }
git log --oneline -1 > /tmp/call11/tree.txt 2>/dev/null
timeout -k 5 120 python3 -m pytest -q -p no:cacheprovider -rfE tests/test_serve_metrics.py \
  tests/test_engine_gpu.py::test_each_graphed_steps_staging_is_a_part_of_its_device_time > /tmp/call11/pytest.log 2>&1
t pytest $?; tail -3 /tmp/call11/pytest.log
bash bench/results/curve-h100-2026-12-07/call6.sh; t call6 $?
grep -hE "before the graphs' replays|mean step device ms|device busy" /tmp/curve6/serve/report.md \
  /tmp/curve6/serve/c64/report.md 2>/dev/null | head -6
for arm in side one; do
  timeout -k 5 50 python3 -m bench.probes.profile_mixed --model qwen2.5-7b --mixed 512 --batch 64 --context 1024 \
    --attention two $([ $arm = one ] && echo --no-side-stream) > /tmp/call11/profile-$arm.log 2>&1; t "profile $arm" $?
  grep -E "^step|^kernels" /tmp/call11/profile-$arm.log
done
left=$(( 585 - ($(date +%s) - start) ))
if [ $left -ge 200 ]; then
  R=/tmp/call11/switch; mkdir -p $R
  (exec python3 -c "import sys, runpy; sys.setswitchinterval(0.0005); sys.argv[0] = 'decode_server'; \
     runpy.run_module('decode_server', run_name='__main__')" --colocated --model qwen2.5-7b --listen 127.0.0.1:50052 \
     --metrics-port 9102 > $R/decode-server.log 2>&1) & DPID=$!
  python3 -c "from bench.measure.launch import wait_serving; wait_serving('127.0.0.1:50052', [], timeout=120)"
  t "server (switch 0.5 ms)" $?
  timeout -k 10 $(( left - 90 )) python3 -m bench.cli serve --addr 127.0.0.1:50052 --model qwen2.5-7b --num-prompts 1 \
      --prompts-per-concurrency 8 --concurrency 64 --input-len 1024 --input-len-range 0.5 --output-len 128 \
      --warmup 4 --timeout 300 --max-duration 60 --server-metrics http://127.0.0.1:9102/metrics \
      --out $R/serve > $R/serve.log 2>&1; t "serve (switch 0.5 ms)" $?
  kill -TERM $DPID 2>/dev/null; wait $DPID 2>/dev/null
  grep -hE "^\| 64 |before the graphs' replays|mean step device ms|device busy" $R/serve/report.md \
    $R/serve/c64/report.md 2>/dev/null | head -6
else
  echo "switch-interval arm left out: $left s left"
fi
tar -C /tmp -czf $OUT/call11.tgz call11 curve6
