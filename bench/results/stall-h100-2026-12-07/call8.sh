#!/bin/bash
# Call 8, one GPU, carry [".whl", "out/gpu_base"] (out/gpu_base: `git archive 02dcfb7 -- . ':!bench/results'`).
# Call 7 found the 32k prompt's stall at 141 ms on this tree against 95 on 02dcfb7. This call traces the decode
# server's scheduler passes in the interference bench's chunked arm (bench/probes/sched_trace: a sitecustomize,
# KVT_TRACE), on this tree then on 02dcfb7, then runs the whole GPU suite (call 7's 120 s limit cut it short).
set -u
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 3
export NCCL_NVLS_ENABLE=0 PYTHONUNBUFFERED=1
R=/tmp/call8; mkdir -p $R $OUT
start=$(date +%s); t() { echo "$1 rc $2 at $(( $(date +%s) - start )) s"; }
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv > $R/gpu.txt 2>&1; cat $R/gpu.txt
TRACE_SITE=$PWD/bench/probes/sched_trace
for arm in new base; do
  tree=.; [ $arm = base ] && tree=out/gpu_base
  (cd $tree && KVT_TRACE=$R/trace-$arm.jsonl PYTHONPATH=$TRACE_SITE:/tmp/site:. timeout -k 5 150 python3 -m bench.cli \
     interference --model qwen2.5-7b --device cuda:0 --streams 32 --context 1024 --arrivals 32000 --arms chunked \
     --chunks 512 --gap-s 1 --log-dir $R/intf-logs-$arm --out $R/intf-$arm > $R/intf-$arm.log 2>&1); t "interference $arm" $?
  grep -E "^\| colocated" $R/intf-$arm/report.md | head -4
  PYTHONPATH=. python3 -m bench.probes.sched_trace.report $R/trace-$arm.jsonl > $R/trace-$arm.txt 2>&1
  tail -3 $R/trace-$arm.txt
  tar -C /tmp -czf $OUT/call8.tgz call8
done
export PYTHONPATH=/tmp/site:.
left=$(( 560 - ($(date +%s) - start) ))
timeout -k 5 $left python3 -m pytest -m gpu -q -p no:cacheprovider -rfE --durations=20 > $R/gpu-tests.log 2>&1
t "gpu suite (limit $left s)" $?
tail -25 $R/gpu-tests.log; tar -C /tmp -czf $OUT/call8.tgz call8
