#!/bin/bash
# Call 4 (#37 TTFT, after the fix: an explicit --max-batch caps the paged pool at --max-batch x the context, as the
# fixed slots did, so the prefill worker beside it on one GPU has its memory): this tree's ttft over cuda_ipc, 1,024
# and 32,760 tokens, as call 3 (whose base arms are the comparison).
set -u
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 3
export NCCL_NVLS_ENABLE=0 PYTHONUNBUFFERED=1
R=$OUT/c4; mkdir -p $R
PYTHONPATH=/tmp/site:. timeout 170 python3 -m bench.cli ttft --model qwen2.5-7b --transport cuda_ipc \
    --prefill-device cuda:0 --decode-device cuda:0 --lengths 1024,32760 --runs 5 --warmup 1 --decode-tokens 4 \
    --log-dir $R/logs --out $R/ttft-new-cuda_ipc > $R/ttft-new-cuda_ipc.log 2>&1
echo "rc $?"; tail -12 $R/ttft-new-cuda_ipc.log | cut -c1-260
