#!/bin/bash
# Issue #28 on one H200 (nvidia-h200), from the repo root, carry [".whl"]: a SMOKE test, labelled as such: 2 prefill
# + 2 decode workers of qwen2.5-7b over cuda_ipc as four processes on the one GPU (deploy/launch_xpyd.py), the router
# in front; 64 clients x 2 requests (256-1024-token prompts, 64 new tokens); every process's metrics summed
# (smoke.py). Also the sampler's gpu tests (the split draw after its rename to triton_sample.py).
set -u
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 3
export PYTHONPATH=/tmp/site:. NCCL_NVLS_ENABLE=0 PYTHONUNBUFFERED=1
R=$OUT/r; mkdir -p $R/logs
D=bench/results/xpyd-smoke-1xh200-2026-12-02
timeout 150 python3 -m pytest -m gpu -q -p no:cacheprovider tests/test_sampler.py > $R/gpu-tests.log 2>&1
echo "sampler gpu tests rc $?: $(tail -1 $R/gpu-tests.log)"
python3 -m deploy.launch_xpyd --prefill 2 --decode 2 --model qwen2.5-7b --transport cuda_ipc \
  --device-prefill cuda:0 --device-decode cuda:0 --metrics-base-port 9100 --router-listen 127.0.0.1:50050 \
  --log-dir $R/logs --start-timeout-s 360 --prefill-args "--max-prompt-tokens 4096" \
  --decode-args "--max-prompt-tokens 4096 --max-batch 32 --max-seq-len 4352 --no-prefix-cache" > $R/launcher.log 2>&1 &
lp=$!
t0=$(date +%s)
until grep -q "^ready" $R/launcher.log || ! kill -0 $lp 2>/dev/null || [ $(( $(date +%s) - t0 )) -gt 380 ]; do sleep 2; done
echo "launcher: $(( $(date +%s) - t0 )) s: $(grep -c serving $R/launcher.log) serving; $(tail -1 $R/launcher.log)"
timeout 200 python3 $D/smoke.py 127.0.0.1:50050 9100 $R/smoke.json > $R/smoke.log 2>&1
echo "smoke rc $?: $(tail -c 1500 $R/smoke.log)"
nvidia-smi --query-gpu=memory.used,memory.total --format=csv > $R/nvidia-smi.txt 2>&1
kill -TERM $lp; wait $lp; echo "launcher exited $?"
tail -8 $R/launcher.log
tar -C $OUT -czf $OUT/call1.tgz r && rm -rf $R
