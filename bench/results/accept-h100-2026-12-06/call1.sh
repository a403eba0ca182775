#!/bin/bash
# Call 1, one GPU, carry [".whl"], gpu_base/ = `git archive 02dcfb7` unpacked (the fixed-slot tree):
# 1. make gpu-test on this tree (every gpu-marked test: paging, preemption, the landing, the invariant GEMM);
# 2. #37 TTFT acceptance: kvtransfer-bench ttft, cuda_ipc 1,024 and 32,760 tokens, then gRPC 4,096, this tree
#    (paged; the landing by whole blocks, b21e822) then the fixed-slot tree, in this one call. Both workers on ONE
#    GPU (cuda:0 -> cuda:0; NCCL refuses two ranks on one GPU). Each verified (cache digest, tokens, logits digests
#    equal to colocated) by the bench's deterministic pass; timings median of 5 after 1 warm-up.
set -u
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 3
export NCCL_NVLS_ENABLE=0 PYTHONUNBUFFERED=1
R=$OUT/c1; mkdir -p $R
exec > >(tee $R/run.log) 2>&1
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv > $R/gpu.txt
start=$(date +%s)
PYTHONPATH=/tmp/site:. timeout 170 python3 -m pytest -m gpu -q -p no:cacheprovider > $R/gpu-tests.log 2>&1
echo "gpu tests rc $? at $(( $(date +%s) - start )) s: $(tail -1 $R/gpu-tests.log)"; grep -E "^FAILED|^ERROR" $R/gpu-tests.log | head
tar -C $OUT -czf $OUT/call1.tgz c1
ttft() {  # tree dir, tag, transport, lengths, limit s
  local dir=$1 tag=$2 tr=$3 lens=$4 lim=$5
  (cd $dir && PYTHONPATH=/tmp/site:. timeout $lim python3 -m bench.cli ttft --model qwen2.5-7b --transport $tr \
    --prefill-device cuda:0 --decode-device cuda:0 --lengths $lens --runs 5 --warmup 1 --decode-tokens 4 \
    --log-dir $R/logs-$tag-$tr --out $R/ttft-$tag-$tr > $R/ttft-$tag-$tr.log 2>&1)
  echo "ttft $tag $tr rc $? at $(( $(date +%s) - start )) s"; tail -25 $R/ttft-$tag-$tr.log | grep -i "overhead\|verif\|equal\||" | cut -c1-200
  tar -C $OUT -czf $OUT/call1.tgz c1
}
ttft . new cuda_ipc 1024,32760 150
ttft gpu_base base cuda_ipc 1024,32760 150
ttft . new grpc 4096 120
left=$(( 575 - ($(date +%s) - start) ))
[ $left -gt 100 ] && ttft gpu_base base grpc 4096 $left || echo "base grpc not run: $left s left"
echo "total $(( $(date +%s) - start )) s"
