#!/bin/bash
# Device call 3: prompt rows attend through the chunk kernel. Probe, two serve runs at c=32 colocated, GPU tests.
python3 -m bench.probe_round --only mixed --out $OUT/probe-mixed-chunk-kernel.json 2>&1 | grep -E "^mixed|^attention|Error|error" | head -20
run() {  # run NAME PROMPTS_PER_SLOT DECODE_ARGS
  python3 -m bench.serve_sweep --model qwen2.5-7b --transport cuda_ipc --arms colocated --concurrency 32 \
    --baseline-concurrency '' --decode-args "$3" --prompts-per-slot $2 --out $OUT/$1 2>&1 \
    | grep -E '^\{"arm|Error|error' | tail -3
}
M="--prefill-chunk 256 --mixed-prefill"
run ck-g256-pps4 4 "$M"
run ck-m512-pps4 4 "$M --mixed-max-rows 512"
timeout 230 python3 -m pytest -m gpu -q -p no:cacheprovider > $OUT/gpu-tests.log 2>&1; tail -5 $OUT/gpu-tests.log
