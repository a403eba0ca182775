#!/bin/bash
# Two-GPU call 3 of 3 (issue #14 item 3): serve, the pair on two GPUs (prefill cuda:0, decode cuda:1, nccl)
# against colocated on one (cuda:1), concurrency 8/32/48, input 1024 +-50% with 5% of the prompts 16k-32k,
# output 128, each arm against its --max-batch 1 baseline. ~8 min. Preamble and $OUT as in two-gpu-1-smoke.sh.
# result.json is rewritten after every run, so a cut-short sweep keeps what it finished. --max-batch 48: a KV
# pool of 49 slots x 32,768 tokens x 57,344 B is 86 GiB beside 14 GiB of weights (64 slots would be 114 GiB).
# Long prompts end at 32,640 so that with 128 output tokens they fit Qwen2.5-7B's 32,768 context.
set -u
source "$(dirname "$0")/need_gpus.sh" 2
export NCCL_DEBUG=${NCCL_DEBUG:-WARN} NCCL_NVLS_ENABLE=0
mkdir -p "$OUT"
timeout -k 40 440 python3 -m bench.runs.serve_sweep --model qwen2.5-7b --device cuda:1 --prefill-device cuda:0 \
    --transport nccl --arms pair,colocated --concurrency 8,32,48 --max-batch 48 --max-seq-len 32768 \
    --long-share 0.05 --long-len-range 16384,32640 --decode-args '--prefill-chunk 256 --mixed-prefill' \
    --baseline-decode-args '' --baseline-concurrency 32 --baseline-prompts 32 \
    --prompts-per-slot 8 --max-prompts 384 --out "$OUT/serve" 2>&1 | tee "$OUT/serve.log" \
    | grep -E '^\{"(arm|ok)"|Error|error' | cut -c1-900
echo "serve rc=${PIPESTATUS[0]}"
