#!/bin/bash
# Call 1, one GPU, carry [".whl"] (issue #39): the mixed step's two attention kernels at other launches, then the
# best one against the default in the step and in serving, on the same warm card:
#  1. python3 -m bench.probes.chunk_attention --pair-sweep (64 decode rows at 1k beside a 448-row chunk at 512, 28
#     layers in one graph): which kernel takes the side stream, the decode kernel's merge launch, its splits;
#  2. the fastest variant at the default split count becomes arm "best" (runner.SIDE_KERNEL and
#     triton_attention_split.STAGE2_WARPS / STAGE2_HEADS set before the server or the probe starts, bench/results/
#     splits-h100-2026-12-06/patched.py); arm "base" is this tree's defaults;
#  3. the 512-row mixed step's profile, base then best;
#  4. the README serve workload (c64, c128) against a colocated server with default flags, base then best;
#  5. the decode kernel's split counts at 8-256 rows (--split-sweep), with what time is left.
set -u
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 3
export NCCL_NVLS_ENABLE=0 PYTHONUNBUFFERED=1 PYTHONPATH=/tmp/site:.
R=$OUT/call1; mkdir -p $R
exec > >(tee $R/run.log) 2>&1
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv > $R/gpu.txt 2>&1; cat $R/gpu.txt
start=$(date +%s)
at() { echo "$(( $(date +%s) - start )) s"; }
left() { echo $(( 575 - ($(date +%s) - start) )); }
pack() { tar -C $OUT -czf $OUT/call1.tgz call1; }
timeout -k 5 100 python3 -m bench.probes.chunk_attention --pair-sweep --no-chunk-sweep --cases 448@512 \
  > $R/probe-pairs.log 2>&1
echo "pair probe rc $? at $(at)"; grep -E "^(pair|pairs) " $R/probe-pairs.log | cut -c1-220
BEST=$(python3 -c "
import json
rows = [json.loads(l[6:]) for l in open('$R/probe-pairs.log') if l.startswith('pairs ')]
rows = [r for r in rows if r['splits'] == 'default']
b = min(rows, key=lambda r: r['pair_ms']) if rows else {'side': 'chunk', 'stage2': 'default'}
w, h = (4, 1) if b['stage2'] == 'default' else b['stage2']
print(b['side'], w, h)")
echo "best: side kernel, stage-2 warps, heads = $BEST"; echo "$BEST" > $R/best.txt
export KVT_PATCH="$BEST"
pack
for arm in base best; do
  P=""; [ $arm = best ] && P="bench/results/splits-h100-2026-12-06/patched.py"
  timeout -k 5 80 python3 ${P:-"-m"} ${P:+"-m"} bench.probes.profile_mixed --model qwen2.5-7b --mixed 512 --batch 64 \
    --context 1024 > $R/profile-$arm.log 2>&1
  echo "profile $arm rc $? at $(at)"; grep -E "^step" $R/profile-$arm.log | head -1
  grep -E "^    (attn_|silu|norm)" $R/profile-$arm.log
done
pack
serve() {  # $1: arm
  [ $(left) -lt 130 ] && { echo "$1: no time left"; return; }
  P=""; [ $1 = best ] && P="bench/results/splits-h100-2026-12-06/patched.py"
  (exec python3 ${P:-"-m"} ${P:+"-m"} decode_server --colocated --model qwen2.5-7b --listen 127.0.0.1:50051 \
     --metrics-port 9101 > $R/decode-$1.log 2>&1) & DPID=$!
  python3 -c "from bench.measure.launch import wait_serving; wait_serving('127.0.0.1:50051', [], timeout=200)" \
    || { echo "$1: never SERVING"; tail -20 $R/decode-$1.log; }
  echo "$1 serving at $(at)"
  timeout $(left) python3 -m bench.cli serve --addr 127.0.0.1:50051 --model qwen2.5-7b \
    --num-prompts 1 --prompts-per-concurrency 8 --concurrency 64,128 --input-len 1024 --input-len-range 0.5 \
    --output-len 128 --warmup 4 --timeout 300 --max-duration 100 --server-metrics http://127.0.0.1:9101/metrics \
    --out $R/serve-$1 > $R/serve-$1.log 2>&1
  echo "serve $1 rc $? at $(at)"
  python3 -c "
import json; r=json.load(open('$R/serve-$1/result.json'))
for s in r['sweep']:
    b = s.get('server_batch') or {}
    print(s['max_concurrency'], {k: round(s[k], 3) for k in ('output_throughput', 'sustained_output_throughput',
          'median_ttft_ms', 'p99_ttft_ms', 'median_itl_ms', 'p99_itl_ms', 'roofline_output_tok_s', 'of_roofline')},
          {k: b.get(k) for k in ('steps', 'mean_batch_per_step', 'running_p50', 'prompts_queued_p50')})" | cut -c1-600
  kill -TERM $DPID; wait $DPID; sleep 1
  pack
}
serve base
serve best
[ $(left) -gt 40 ] && timeout -k 5 $(( $(left) - 10 )) python3 -m bench.probes.chunk_attention \
  --split-sweep 64@1024,128@1024,32@1024,16@1024,256@1024,8@4096,64@4096,32@8192,1@32768,4@8192 > $R/probe-splits.log 2>&1
echo "split probe rc $? at $(at)"; grep -E "^splits" $R/probe-splits.log | cut -c1-160 | head -90
pack
echo "total $(at)"
