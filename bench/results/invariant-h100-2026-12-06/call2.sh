#!/bin/bash
# Call 2, one GPU, carry [".whl"] (issue #40), runner.INVARIANT_ON_CUDA turned on in this copy only:
# 1. tests/test_batch_invariant_servers_gpu.py (call 1's run refused --prefill-chunk 32 at --max-batch 64);
# 2. the decode step with and without --batch-invariant (kvtransfer-bench decode, 1/64 rows x 1k/8k, same call).
set -u
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 3
export NCCL_NVLS_ENABLE=0 PYTHONUNBUFFERED=1 PYTHONPATH=/tmp/site:.
R=$OUT/call2; mkdir -p $R
exec > >(tee $R/run.log) 2>&1
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv > $R/gpu.txt; cat $R/gpu.txt
start=$(date +%s)
at() { echo "$(( $(date +%s) - start )) s"; }
sed -i 's/^INVARIANT_ON_CUDA = False/INVARIANT_ON_CUDA = True/' kvtransfer/engine/runner.py
timeout 150 python3 -m pytest -m gpu -q -p no:cacheprovider tests/test_batch_invariant_servers_gpu.py > $R/test-servers.log 2>&1
echo "servers test rc $?: $(tail -1 $R/test-servers.log)"; at
grep -E "^E  " $R/test-servers.log | head -10 | cut -c1-300
for m in default invariant; do
  timeout 90 python3 -m bench.cli decode --batches 1,64 --contexts 1024,8192 --hf none --runs 20 --warmup 3 \
    $([ $m = invariant ] && echo --batch-invariant) --out $R/decode-$m > $R/decode-$m.log 2>&1
  echo "decode $m rc $? at $(at)"; grep "decode: engine" $R/decode-$m.log
done
tar -C $OUT -czf $OUT/call2.tgz call2; echo "total $(at)"
# 3. #37: TTFT over gRPC at 4,096 tokens, both workers on this one GPU: this tree (write_layer's slice copy for
#    consecutive blocks, 1d54469), then the fixed-slot tree (gpu_base/ = git archive 02dcfb7) in the same call;
#    the landing probe on cuda first.
timeout 40 python3 -m bench.probes.grpc_landing --device cuda > $R/probe-landing.log 2>&1; echo "probe rc $?"; tail -8 $R/probe-landing.log
TTFT=(-m bench.cli ttft --model qwen2.5-7b --transport grpc --prefill-device cuda:0 --decode-device cuda:0
      --lengths 4096 --runs 5 --warmup 1 --decode-tokens 4)
timeout 140 python3 "${TTFT[@]}" --log-dir $R/logs-grpc --out $R/ttft-grpc > $R/ttft-grpc.log 2>&1
echo "ttft grpc rc $? at $(at)"; tail -14 $R/ttft-grpc.log | grep "│\|verif" | cut -c1-220
tar -C $OUT -czf $OUT/call2.tgz call2
[ $(( 590 - ($(date +%s) - start) )) -gt 100 ] && (cd gpu_base && PYTHONPATH=/tmp/site:. timeout $(( 585 - ($(date +%s) - start) )) python3 "${TTFT[@]}" --log-dir $R/logs-grpc-base --out $R/ttft-grpc-base > $R/ttft-grpc-base.log 2>&1
 echo "ttft grpc base rc $? at $(at)"; tail -14 $R/ttft-grpc-base.log | grep "│\|verif" | cut -c1-220)
tar -C $OUT -czf $OUT/call2.tgz call2; echo "total $(at)"
