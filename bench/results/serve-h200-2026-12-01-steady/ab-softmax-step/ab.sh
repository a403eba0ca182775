#!/bin/bash
# A/B: the mixed-step probe with the kernels before (ab_old: kvtransfer at 18d59cb) and after the shared softmax step
R=$(pwd)
for i in 1 2 3; do
  for t in new old; do
    if [ $t = old ]; then P=/tmp/site:$R/ab_old:$R; else P=/tmp/site:$R; fi
    (cd /tmp && PYTHONPATH=$P python3 -c "import kvtransfer.kernels.triton_attention as t; print('$t', hasattr(t, 'online_softmax_step'), t.__file__)" &&
     PYTHONPATH=$P timeout 100 python3 -m bench.probe_round --only mixed --out $OUT/probe-$t-$i.json > /dev/null 2>&1)
    python3 -c "
import json,sys; m=json.load(open('$OUT/probe-$t-$i.json'))['mixed']
print('$t', round(m['plain_step_ms'],3), [round(g['ms'],3) for g in m['graphed']], [(round(a['decode_kernel_us'],1), round(a['chunk_kernel_us'],1), round(a['flash_causal_us'],1)) for a in m['attention_per_layer']])"
  done
done
