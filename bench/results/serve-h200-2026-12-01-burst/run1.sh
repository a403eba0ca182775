#!/bin/bash
# Device call 1: burst steps at concurrency 32, colocated (nvidia-h200, one GPU). $OUT from the device tool.
S="python3 -m bench.serve_sweep --model qwen2.5-7b --transport cuda_ipc --arms colocated --concurrency 32 --baseline-concurrency ''"
M="--prefill-chunk 256 --mixed-prefill"
$S --decode-args "$M --burst-rows 2048" --prompts-per-slot 4 --out $OUT/b2048-pps4 2>&1 | grep -E '^\{"arm|failures|Error|error' | tail -3
$S --decode-args "$M" --prompts-per-slot 4 --out $OUT/g256-pps4 2>&1 | grep -E '^\{"arm|failures|Error|error' | tail -3
$S --concurrency '' --baseline-concurrency 32 --baseline-prompts 64 --baseline-decode-args '' --out $OUT/baseline 2>&1 | grep -E '^\{"arm|failures|Error|error' | tail -3
$S --decode-args "$M --burst-rows 1024" --prompts-per-slot 4 --out $OUT/b1024-pps4 2>&1 | grep -E '^\{"arm|failures|Error|error' | tail -3
$S --decode-args "$M --burst-rows 2048" --prompts-per-slot 8 --out $OUT/b2048-pps8 2>&1 | grep -E '^\{"arm|failures|Error|error' | tail -3
