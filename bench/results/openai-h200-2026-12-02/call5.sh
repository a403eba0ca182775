#!/bin/bash
# Device call 5 of issue #26 (nvidia-h200), from the repo root, carry [".whl"]: the draw over many programs per row (S segments, a fixed sequence of launches).
# 1. the Triton draw alone (CUDA events, p50 of 50 after 10) at vocab 152,064, bf16, batch 1/8/64, on rows drawn
#    N(0, s^2) for s = 1, 3, 10 (s small: a flat row, the nucleus most of the vocabulary, as the random-weight
#    preset's; s large: a peaked one), temperature 1, top_p 0.9; and the Sampler's whole call (copy-in + replay);
# 2. the decode step, greedy vs sampling (temperature 1, top_p 0.9), context 1k, alternating, with the params
#    now copied from pinned memory.
set -u
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
export PYTHONPATH=/tmp/site:. NCCL_NVLS_ENABLE=0 PYTHONUNBUFFERED=1
mkdir -p $OUT/r5
timeout 120 python3 -m pytest -m gpu -q -p no:cacheprovider -rfEs tests/test_sampler.py -s > $OUT/r5/gpu-tests.log 2>&1
echo "gpu tests rc $?: $(tail -1 $OUT/r5/gpu-tests.log)"
timeout 120 python3 - > $OUT/r5/draw.log 2>&1 <<'PY'
import statistics, torch
from kvtransfer.engine.sampler import Draws, Sampler, SamplingParams, sample
from kvtransfer.kernels.triton_sample import sample_triton
dev = torch.device("cuda:0")
V = 152064
sampler = Sampler(V, torch.bfloat16, dev, [1, 8, 64], True)
def timed(fn, runs=50, warm=10):
    for _ in range(warm): fn()
    ts = []
    for _ in range(runs):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record(); fn(); b.record(); b.synchronize(); ts.append(a.elapsed_time(b) * 1e3)
    return statistics.median(ts)
for s in (1.0, 3.0, 10.0):
    for n in (1, 8, 64):
        x = (torch.randn(n, V, device=dev) * s).to(torch.bfloat16)
        t = torch.ones(n, device=dev); p = torch.full((n,), 0.9, device=dev)
        k = torch.zeros(n, dtype=torch.long, device=dev); seed = torch.arange(n, device=dev); pos = torch.full((n,), 1000, device=dev)
        kern = timed(lambda: sample_triton(x, t, p, k, seed, pos))
        draws = Draws([SamplingParams(1.0, 0.9, 0, j) for j in range(n)], [1000] * n)
        whole = timed(lambda: sampler(x, draws))
        w = torch.softmax(x.float(), -1).sort(-1, descending=True).values.cumsum(-1)
        kept = int((w[0] < 0.9).sum()) + 1
        print(f"s {s:g} batch {n}: kernel {kern:.1f} us, Sampler call {whole:.1f} us; row 0 nucleus {kept} of {V}")
PY
cat $OUT/r5/draw.log | tail -12
for round in 1 2; do
  for arm in greedy sampling; do
    flags=$([ $arm = sampling ] && echo "--temperature 1 --top-p 0.9" || echo "")
    timeout 120 python3 -m bench.cli decode --model qwen2.5-7b --batches 1,8,32,64 --contexts 1024 \
      --hf none $flags --out $OUT/r5/decode-$arm-$round > $OUT/r5/decode-$arm-$round.log 2>&1
    echo "$arm-$round rc $?"
  done
done
python3 bench/results/openai-h200-2026-12-02/summarize_decode.py $OUT/r5
tar -C $OUT -czf $OUT/call5.tgz r5 && rm -rf $OUT/r5
