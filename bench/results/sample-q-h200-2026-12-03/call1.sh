#!/bin/bash
# Issue #26, 2026-12-03, call 1, one H200 (nvidia-h200), carry [".whl"]:
# 1. the sampler's gpu tests (the draw against the reference at vocab 152,064; captured == eager; the step's draw
#    reading the step graph's logits in place);
# 2. the draw's launches (torch.profiler, 30 calls after 10) at 1, 8, 32, 64 rows, flat (s = 1) and peaked (s = 10)
#    rows at vocab 152,064 bf16, temperature 1, top_p 0.9; the captured draw over Q (the programs per segment of the
#    rounds and the compaction), with the tokens compared across Q;
# 3. the decode step, sampling (temperature 1, top_p 0.9) with greedy (argmax) timed alternately in the same
#    process: two processes.
set -u
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 3
export PYTHONPATH=/tmp/site:. NCCL_NVLS_ENABLE=0 PYTHONUNBUFFERED=1
R=$OUT/r1; mkdir -p $R
start=$(date +%s)
timeout 200 python3 -m pytest -m gpu -q -p no:cacheprovider -rfEs tests/test_sampler.py -s > $R/gpu-tests.log 2>&1
echo "gpu tests rc $? ($(( $(date +%s) - start )) s): $(tail -1 $R/gpu-tests.log)"
timeout 150 python3 - > $R/launches.log 2>&1 <<'PY'
import torch
from torch.profiler import ProfilerActivity, profile
from kvtransfer.kernels.triton_sample import programs_for, sample_triton
dev = torch.device("cuda:0"); V = 152064
def rows(n, s):
    g = torch.Generator(device=dev).manual_seed(n)
    x = (torch.randn(n, V, device=dev, generator=g) * s).to(torch.bfloat16)
    return (x, torch.ones(n, device=dev), torch.full((n,), 0.9, device=dev), torch.zeros(n, dtype=torch.long, device=dev),
            torch.arange(n, device=dev), torch.full((n,), 1000, device=dev))
for n in (1, 8, 32, 64):
    for s in (1.0, 10.0):
        a = rows(n, s)
        for _ in range(10): sample_triton(*a)
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(30): sample_triton(*a)
            torch.cuda.synchronize()
        ks = [(e.key, e.device_time_total / e.count if e.count else 0.0) for e in prof.key_averages() if "kernel" in e.key]
        print(f"n {n} s {s:g} P {programs_for(n, dev)}: " + ", ".join(f"{k.split('_kernel')[0].lstrip('_')} {us:.1f}"
              for k, us in ks) + f" | sum {sum(us for _, us in ks):.1f} us", flush=True)
print("captured draw, replay p50 of 40 (us), over Q")
for n in (1, 8, 32, 64):
    for s in (1.0, 10.0):
        a = rows(n, s); toks = {}
        for q in (None, 1, 2, 4, 8, 16):
            side = torch.cuda.Stream(); side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                sample_triton(*a, splits=q)
            torch.cuda.current_stream().wait_stream(side)
            g = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g):
                out = sample_triton(*a, splits=q)
            ts = []
            for _ in range(50):
                e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                e0.record(); g.replay(); e1.record(); e1.synchronize(); ts.append(e0.elapsed_time(e1) * 1e3)
            ts = sorted(ts[10:]); toks[q] = out.clone()
            print(f"n {n} s {s:g} Q {q if q else 'default'}: {ts[len(ts) // 2]:.1f} us", flush=True)
        print(f"n {n} s {s:g}: tokens equal across Q: {all(torch.equal(t, toks[None]) for t in toks.values())}", flush=True)
PY
echo "launches rc $? ($(( $(date +%s) - start )) s)"; tail -30 $R/launches.log
for round in 1 2; do
  t0=$(date +%s)
  timeout 150 python3 -m bench.cli decode --model qwen2.5-7b --batches 1,8,32,64 --contexts 1024,4096 --hf none \
    --temperature 1 --top-p 0.9 --out $R/decode-paired-$round > $R/decode-paired-$round.log 2>&1
  echo "paired-$round rc $? ($(( $(date +%s) - t0 )) s)"
  grep "decode: engine" $R/decode-paired-$round.log
  tar -C $OUT -czf $OUT/call1.tgz r1
done
tar -C $OUT -czf $OUT/call1.tgz r1 && rm -rf $R
