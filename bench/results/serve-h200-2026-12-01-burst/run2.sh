#!/bin/bash
# Device call 2: graphed step sizes up to --mixed-max-rows at concurrency 32, colocated. $OUT from the device tool.
run() {  # run NAME PROMPTS_PER_SLOT DECODE_ARGS
  python3 -m bench.serve_sweep --model qwen2.5-7b --transport cuda_ipc --arms colocated --concurrency 32 \
    --baseline-concurrency '' --decode-args "$3" --prompts-per-slot $2 --out $OUT/$1 2>&1 \
    | grep -E '^\{"arm|Error|error' | tail -3
}
M="--prefill-chunk 256 --mixed-prefill"
run m1024-pps4 4 "$M --mixed-max-rows 1024"
run m512-pps4 4 "$M --mixed-max-rows 512"
run m1024-pps8 8 "$M --mixed-max-rows 1024"
