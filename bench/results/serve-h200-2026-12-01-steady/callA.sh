#!/bin/bash
# Device call A (nvidia-h200, one GPU): make gpu-test, then the colocated arm of the acceptance sweep with
# 1,024 prompts at concurrency 32 and 64. $OUT from the device tool.
git log -1 --format=%h 2>/dev/null
timeout 250 python3 -m pytest -m gpu -q -p no:cacheprovider > $OUT/gpu-tests.log 2>&1; tail -3 $OUT/gpu-tests.log
python3 -m bench.serve_sweep --model qwen2.5-7b --transport cuda_ipc --arms colocated \
    --decode-args '--prefill-chunk 256 --mixed-prefill' --baseline-decode-args '' \
    --prompts-per-slot 32 --max-prompts 1024 --baseline-concurrency 32 --baseline-prompts 64 \
    --out $OUT/colocated 2>&1 | grep -E '^\{"arm|^\{"ok|Error|error' | cut -c1-900
