#!/bin/bash
# Call 11 (prepared for the next session, not run), one GPU, carry [".whl", "out/gpu_base"] (out/gpu_base:
# `git archive 02dcfb7 -- . ':!bench/results'`): #39's second point with every later chunk padded to the chunk
# (engine.pad_chunk) and run on the fused ops into one block (fused_prefill.chunk_cache): the interference chunked
# arm, traced, this tree then 02dcfb7, twice each (the stall swings by ~20 ms run to run); the chunk loop alone, fused
# against the HF forward (bench/probes/chunked_prefill.py); then the engine GPU tests. ~450 s with the start.
set -u
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 3
export NCCL_NVLS_ENABLE=0 PYTHONUNBUFFERED=1
R=/tmp/call11; mkdir -p $R $OUT
TRACE_SITE=$PWD/bench/probes/sched_trace
start=$(date +%s); t() { echo "$1 rc $2 at $(( $(date +%s) - start )) s"; }
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv > $R/gpu.txt 2>&1; cat $R/gpu.txt
for run in 1 2; do for arm in new base; do
  tree=.; [ $arm = base ] && tree=out/gpu_base
  (cd $tree && KVT_TRACE=$R/trace-$arm-$run.jsonl PYTHONPATH=$TRACE_SITE:/tmp/site:. timeout -k 5 110 python3 -m bench.cli \
     interference --model qwen2.5-7b --device cuda:0 --streams 32 --context 1024 --arrivals 32000 --arms chunked \
     --chunks 512 --gap-s 1 --log-dir $R/intf-logs-$arm-$run --out $R/intf-$arm-$run > $R/intf-$arm-$run.log 2>&1)
  t "interference $arm $run" $?
  grep -E "^\| colocated" $R/intf-$arm-$run/report.md | head -4
  PYTHONPATH=. python3 -m bench.probes.sched_trace.report $R/trace-$arm-$run.jsonl > $R/trace-$arm-$run.txt 2>&1
  tail -2 $R/trace-$arm-$run.txt; gzip -f $R/trace-$arm-$run.jsonl
  tar -C /tmp -czf $OUT/call11.tgz call11
done; done
PYTHONPATH=/tmp/site:. timeout -k 5 120 python3 -m bench.probes.chunked_prefill --out $R/chunked > $R/chunked.log 2>&1
t "chunk loop probe" $?; grep -E "^(fused|hf)" $R/chunked.log; tar -C /tmp -czf $OUT/call11.tgz call11
PYTHONPATH=/tmp/site:. timeout -k 5 120 python3 -m pytest -m gpu -q -p no:cacheprovider -rfE tests/test_engine_gpu.py \
  > $R/gpu-tests-engine.log 2>&1; t "engine GPU tests" $?
tail -3 $R/gpu-tests-engine.log; tar -C /tmp -czf $OUT/call11.tgz call11
