#!/bin/bash
# Issue #37 acceptance (TTFT), call 3, one GPU, carry [".whl"], gpu_base/ = `git archive 02dcfb7` unpacked (the
# fixed-slot tree). Both workers on ONE GPU (cuda:0 -> cuda:0; NCCL refuses two ranks on one GPU):
#   kvtransfer-bench ttft, cuda_ipc at 1,024 and 32,760 tokens, then gRPC at 4,096, this tree (paged, the landing a
#   scatter through the blocks) then the fixed-slot tree, each verified (cache digest, tokens, logits digests equal
#   to colocated) by the bench's deterministic pass; timings median of 5 after 1 warm-up.
set -u
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 3
export NCCL_NVLS_ENABLE=0 PYTHONUNBUFFERED=1
R=$OUT/c3; mkdir -p $R
exec > >(tee $R/run.log) 2>&1
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv > $R/gpu.txt
start=$(date +%s)
ttft() {  # tree dir, tag, transport, lengths
  local dir=$1 tag=$2 tr=$3 lens=$4
  (cd $dir && PYTHONPATH=/tmp/site:. timeout 200 python3 -m bench.cli ttft --model qwen2.5-7b --transport $tr \
    --prefill-device cuda:0 --decode-device cuda:0 --lengths $lens --runs 5 --warmup 1 --decode-tokens 4 \
    --log-dir $R/logs-$tag-$tr --out $R/ttft-$tag-$tr > $R/ttft-$tag-$tr.log 2>&1)
  echo "ttft $tag $tr rc $? at $(( $(date +%s) - start )) s"; tail -25 $R/ttft-$tag-$tr.log | grep -i "overhead\|verif\|equal\||" | cut -c1-200
  tar -C $OUT -czf $OUT/call3.tgz c3
}
ttft . new cuda_ipc 1024,32760
ttft gpu_base base cuda_ipc 1024,32760
ttft . new grpc 4096
ttft gpu_base base grpc 4096
echo "total $(( $(date +%s) - start )) s"
