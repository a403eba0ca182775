#!/bin/bash
# Device call 4: the acceptance sweep on the committed tree (nvidia-h200, one GPU). $OUT from the device tool.
git log -1 --format=%h 2>/dev/null
python3 -m bench.serve_sweep --model qwen2.5-7b --transport cuda_ipc \
    --decode-args '--prefill-chunk 256 --mixed-prefill' --baseline-decode-args '' \
    --prompts-per-slot 8 --baseline-concurrency 32 --baseline-prompts 64 --out $OUT/serve 2>&1 \
    | grep -E '^\{"arm|^\{"ok|Error|error' | cut -c1-600
# then, if time is left: 32k TTFT with SDPA's own backend from 16k tokens (CUDNN_MIN_TOKENS), not measured last stop
timeout 170 python3 -m bench.cli ttft --model qwen2.5-7b --dtype bfloat16 --transport cuda_ipc \
    --prefill-device cuda:0 --decode-device cuda:0 --lengths 32760 --runs 5 --warmup 1 --out $OUT/ttft 2>&1 | tail -4
