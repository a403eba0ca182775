#!/bin/bash
# Issue #26, 2026-12-03, call 2, one H200 (nvidia-h200), carry [".whl"], the final tree (splits_for at 4 x SMs):
# 1. the decode step, sampling (temperature 1, top_p 0.9) with greedy (argmax) timed alternately in the same
#    process, two processes;
# 2. the draw's launches at the default P and Q (torch.profiler, 30 calls after 10);
# 3. every gpu test (make gpu-test), with the time left.
set -u
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 3
export PYTHONPATH=/tmp/site:. NCCL_NVLS_ENABLE=0 PYTHONUNBUFFERED=1
R=$OUT/r2; mkdir -p $R
start=$(date +%s)
for round in 1 2; do
  t0=$(date +%s)
  timeout 120 python3 -m bench.cli decode --model qwen2.5-7b --batches 1,8,32,64 --contexts 1024,4096 --hf none \
    --temperature 1 --top-p 0.9 --out $R/decode-paired-$round > $R/decode-paired-$round.log 2>&1
  echo "paired-$round rc $? ($(( $(date +%s) - t0 )) s)"
  grep "decode: engine" $R/decode-paired-$round.log
  tar -C $OUT -czf $OUT/call2.tgz r2
done
timeout 60 python3 - > $R/launches.log 2>&1 <<'PY'
import torch
from torch.profiler import ProfilerActivity, profile
from kvtransfer.kernels.triton_sample import programs_for, sample_triton
dev = torch.device("cuda:0"); V = 152064
for n in (1, 8, 32, 64):
    for s in (1.0, 10.0):
        g = torch.Generator(device=dev).manual_seed(n)
        a = ((torch.randn(n, V, device=dev, generator=g) * s).to(torch.bfloat16), torch.ones(n, device=dev),
             torch.full((n,), 0.9, device=dev), torch.zeros(n, dtype=torch.long, device=dev), torch.arange(n, device=dev),
             torch.full((n,), 1000, device=dev))
        for _ in range(10): sample_triton(*a)
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(30): sample_triton(*a)
            torch.cuda.synchronize()
        ks = [(e.key, e.device_time_total / 30) for e in prof.key_averages() if "kernel" in e.key]
        print(f"n {n} s {s:g} P {programs_for(n, dev)}: " + ", ".join(f"{k.split('_kernel')[0].lstrip('_')} {us:.1f}"
              for k, us in ks) + f" | sum {sum(us for _, us in ks):.1f} us per call (round: both launches)", flush=True)
PY
echo "launches rc $? ($(( $(date +%s) - start )) s)"; grep "^n " $R/launches.log
tar -C $OUT -czf $OUT/call2.tgz r2
left=$(( 570 - ($(date +%s) - start) ))
echo "gpu tests get $left s"
timeout $left python3 -m pytest -m gpu -q -p no:cacheprovider -rfEs --durations=15 tests > $R/gpu-tests.log 2>&1
echo "gpu tests rc $? ($(( $(date +%s) - start )) s)"; tail -25 $R/gpu-tests.log
tar -C $OUT -czf $OUT/call2.tgz r2 && rm -rf $R
