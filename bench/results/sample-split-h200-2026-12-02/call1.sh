#!/bin/bash
# Issue #26, the split draw (kvtransfer/kernels/triton_sample_split.py) wired in as the step's draw, one H200
# (nvidia-h200), from the repo root, carry [".whl"]:
# 1. the gpu tests of the sampler, the engine and the prefix cache (the split draw == the torch reference at vocab
#    152,064, alone == in a batch, captured == eager, a graphed engine step with sampling rows == eager);
# 2. the draw alone (CUDA events, p50 of 50 after 10), bf16 rows N(0, s^2) at vocab 152,064, temperature 1,
#    top_p 0.9: the one-program-a-row kernel (triton_sample.py) beside the split one, and the Sampler's whole call;
# 3. the decode step, greedy vs every row sampling (temperature 1, top_p 0.9), alternating, two rounds each.
set -u
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 3
export PYTHONPATH=/tmp/site:. NCCL_NVLS_ENABLE=0 PYTHONUNBUFFERED=1
R=$OUT/r1; mkdir -p $R
start=$(date +%s)
timeout 200 python3 -m pytest -m gpu -q -p no:cacheprovider -rfEs tests/test_sampler.py tests/test_engine_gpu.py \
  tests/test_prefix_cache_gpu.py -s > $R/gpu-tests.log 2>&1
echo "gpu tests rc $? ($(( $(date +%s) - start )) s): $(tail -1 $R/gpu-tests.log)"
timeout 90 python3 - > $R/draw.log 2>&1 <<'PY'
import statistics, torch
from kvtransfer.engine.sampler import Draws, Sampler, SamplingParams
from kvtransfer.kernels.triton_sample import sample_triton
from kvtransfer.kernels.triton_sample_split import programs_for, sample_triton_split
dev = torch.device("cuda:0")
V = 152064
sampler = Sampler(V, torch.bfloat16, dev, [1, 8, 32, 64], True)
def timed(fn, runs=50, warm=10):
    for _ in range(warm): fn()
    ts = []
    for _ in range(runs):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record(); fn(); b.record(); b.synchronize(); ts.append(a.elapsed_time(b) * 1e3)
    return statistics.median(ts)
for s in (1.0, 3.0, 10.0):
    for n in (1, 8, 32, 64):
        g = torch.Generator(device=dev).manual_seed(n)
        x = (torch.randn(n, V, device=dev, generator=g) * s).to(torch.bfloat16)
        t = torch.ones(n, device=dev); p = torch.full((n,), 0.9, device=dev)
        k = torch.zeros(n, dtype=torch.long, device=dev); seed = torch.arange(n, device=dev); pos = torch.full((n,), 1000, device=dev)
        old = timed(lambda: sample_triton(x, t, p, k, seed, pos))
        new = timed(lambda: sample_triton_split(x, t, p, k, seed, pos))
        arg = timed(lambda: x.argmax(-1))
        same = int((sample_triton(x, t, p, k, seed, pos) == sample_triton_split(x, t, p, k, seed, pos)).sum())
        draws = Draws([SamplingParams(1.0, 0.9, 0, j) for j in range(n)], [1000] * n)
        whole = timed(lambda: sampler(x, draws))
        print(f"s {s:g} batch {n}: one-program kernel {old:.1f} us, split kernel {new:.1f} us (P {programs_for(n, dev)}), "
              f"argmax {arg:.1f} us, Sampler call {whole:.1f} us; same token {same} of {n}")
PY
tail -12 $R/draw.log
for round in 1 2; do
  for arm in greedy sampling; do
    flags=$([ $arm = sampling ] && echo "--temperature 1 --top-p 0.9" || echo "")
    t0=$(date +%s)
    timeout 110 python3 -m bench.cli decode --model qwen2.5-7b --batches 1,8,32,64 --contexts 1024,4096 \
      --hf none $flags --out $R/decode-$arm-$round > $R/decode-$arm-$round.log 2>&1
    echo "$arm-$round rc $? ($(( $(date +%s) - t0 )) s)"
    tar -C $OUT -czf $OUT/call1.tgz r1
  done
done
python3 bench/results/openai-h200-2026-12-02/summarize_decode.py $R > $R/summary.md
cat $R/summary.md
tar -C $OUT -czf $OUT/call1.tgz r1 && rm -rf $R
