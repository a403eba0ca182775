#!/bin/bash
# Call 9, one GPU, carry [".whl"]. Call 8's trace put the 32k prompt's stall in its chunks' forwards: each holds the
# serving thread about as long as the device runs it (~40 ms for 512 tokens at any context), the last (256 tokens)
# 117 ms. This call: bench/probes/chunked_prefill.py (the engine's chunk loop alone, cold then warm, SDPA's default
# from 16k keys vs never cuDNN; torch.profiler on the last chunk and one at ~20k keys); the interference chunked arm
# with the no-cuDNN variant (KVT_CHUNK_NO_CUDNN, traced); the 26 GPU tests call 8's 443 s limit left unrun.
set -u
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 3
export NCCL_NVLS_ENABLE=0 PYTHONUNBUFFERED=1
R=/tmp/call9; mkdir -p $R $OUT
start=$(date +%s); t() { echo "$1 rc $2 at $(( $(date +%s) - start )) s"; }
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv > $R/gpu.txt 2>&1; cat $R/gpu.txt
PYTHONPATH=/tmp/site:. timeout -k 5 170 python3 -m bench.probes.chunked_prefill --profile --out $R/chunked > $R/chunked.log 2>&1
t "chunked_prefill probe" $?; grep -v "per chunk" $R/chunked.log | tail -6
tar -C /tmp -czf $OUT/call9.tgz call9
KVT_CHUNK_NO_CUDNN=1 KVT_TRACE=$R/trace-nocudnn.jsonl PYTHONPATH=$PWD/bench/probes/sched_trace:/tmp/site:. timeout -k 5 130 \
  python3 -m bench.cli interference --model qwen2.5-7b --device cuda:0 --streams 32 --context 1024 --arrivals 32000 \
  --arms chunked --chunks 512 --gap-s 1 --log-dir $R/intf-logs-nocudnn --out $R/intf-nocudnn > $R/intf-nocudnn.log 2>&1
t "interference no-cudnn" $?
grep -E "^\| colocated" $R/intf-nocudnn/report.md | head -4
PYTHONPATH=. python3 -m bench.probes.sched_trace.report $R/trace-nocudnn.jsonl > $R/trace-nocudnn.txt 2>&1; tail -2 $R/trace-nocudnn.txt
tar -C /tmp -czf $OUT/call9.tgz call9
left=$(( 570 - ($(date +%s) - start) ))
PYTHONPATH=/tmp/site:. timeout -k 5 $left python3 -m pytest -q -p no:cacheprovider -rfE --durations=10 \
  $(cat bench/results/stall-h100-2026-12-07/rest-of-suite.txt) > $R/gpu-tests-rest.log 2>&1
t "the rest of the GPU suite (limit $left s)" $?
tail -15 $R/gpu-tests-rest.log; tar -C /tmp -czf $OUT/call9.tgz call9
