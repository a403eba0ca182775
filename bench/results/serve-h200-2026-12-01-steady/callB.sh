#!/bin/bash
# Device call B (nvidia-h200, one GPU): the pair arm of the acceptance sweep (cuda_ipc, two processes on cuda:0),
# then the mixed-step probe (kernel timings after the shared online-softmax step), then colocated c=32 with
# --mixed-max-rows 512. $OUT from the device tool.
python3 -m bench.serve_sweep --model qwen2.5-7b --transport cuda_ipc --arms pair \
    --decode-args '--prefill-chunk 256 --mixed-prefill' --baseline-decode-args '' \
    --prompts-per-slot 32 --max-prompts 1024 --baseline-concurrency 32 --baseline-prompts 64 \
    --out $OUT/pair 2>&1 | grep -E '^\{"arm|^\{"ok|Error|error' | cut -c1-600
timeout 150 python3 -m bench.probe_round --only mixed --out $OUT/probe-mixed.json 2>&1 | grep -E "^mixed|Error|error" | head -5
python3 -m bench.serve_sweep --model qwen2.5-7b --transport cuda_ipc --arms colocated --concurrency 32 \
    --decode-args '--prefill-chunk 256 --mixed-prefill --mixed-max-rows 512' --baseline-concurrency '' \
    --prompts-per-slot 32 --max-prompts 1024 --out $OUT/m512 2>&1 | grep -E '^\{"arm|Error|error' | cut -c1-600
