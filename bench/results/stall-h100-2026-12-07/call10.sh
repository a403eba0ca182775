#!/bin/bash
# Call 10, one GPU, carry [".whl"]: the interference chunked arm on the tree with the odd-sized chunk first
# (engine.prefill_job; every later chunk is --prefill-chunk rows), traced as call 8; then the engine's GPU tests.
set -u
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 3
export NCCL_NVLS_ENABLE=0 PYTHONUNBUFFERED=1
R=/tmp/call10; mkdir -p $R $OUT
start=$(date +%s); t() { echo "$1 rc $2 at $(( $(date +%s) - start )) s"; }
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv > $R/gpu.txt 2>&1; cat $R/gpu.txt
KVT_TRACE=$R/trace-oddfirst.jsonl PYTHONPATH=$PWD/bench/probes/sched_trace:/tmp/site:. timeout -k 5 110 \
  python3 -m bench.cli interference --model qwen2.5-7b --device cuda:0 --streams 32 --context 1024 --arrivals 32000 \
  --arms chunked --chunks 512 --gap-s 1 --log-dir $R/intf-logs-oddfirst --out $R/intf-oddfirst > $R/intf-oddfirst.log 2>&1
t "interference odd-first" $?
grep -E "^\| colocated" $R/intf-oddfirst/report.md | head -4
PYTHONPATH=. python3 -m bench.probes.sched_trace.report $R/trace-oddfirst.jsonl > $R/trace-oddfirst.txt 2>&1; tail -2 $R/trace-oddfirst.txt
tar -C /tmp -czf $OUT/call10.tgz call10
PYTHONPATH=/tmp/site:. timeout -k 5 60 python3 -m pytest -m gpu -q -p no:cacheprovider -rfE tests/test_engine_gpu.py \
  > $R/gpu-tests-engine.log 2>&1; t "engine GPU tests" $?
tail -3 $R/gpu-tests-engine.log; tar -C /tmp -czf $OUT/call10.tgz call10
