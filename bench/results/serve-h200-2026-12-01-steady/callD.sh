#!/bin/bash
# Device call D (nvidia-h200, one GPU): make gpu-test on the shared layer loop (ea718b7+), then the mixed-step
# probe, to compare step times with calls B and C. $OUT from the device tool.
timeout 250 python3 -m pytest -m gpu -q -p no:cacheprovider > $OUT/gpu-tests.log 2>&1; tail -3 $OUT/gpu-tests.log
timeout 120 python3 -m bench.probe_round --only mixed --out $OUT/probe-mixed-layer-loop.json > /dev/null 2>&1
python3 -c "
import json; m=json.load(open('$OUT/probe-mixed-layer-loop.json'))['mixed']
print(round(m['plain_step_ms'],3), [round(g['ms'],3) for g in m['graphed']], [(round(a['decode_kernel_us'],1), round(a['chunk_kernel_us'],1)) for a in m['attention_per_layer']])"
