#!/bin/bash
# Issue #26, 2026-12-03, call 4, one H200 (nvidia-h200), carry [".whl"]: what the greedy arm's token choice costs,
# to read the paired decode figures without it: torch argmax over (n, 152,064) bf16 logits as the greedy step runs
# it (eagerly, after the step's graph), device time by CUDA events, p50 of 50 after 10, back to back with a
# 4.5 ms stand-in kernel before each (so the launch overlaps, as after a step); and the whole Sampler call
# (graphed, reading a step-like buffer in place) the same way.
set -u
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 3
export PYTHONPATH=/tmp/site:. NCCL_NVLS_ENABLE=0 PYTHONUNBUFFERED=1
timeout 120 python3 - 2>&1 <<'PY' | tee $OUT/choice.log
import torch
from kvtransfer.engine.sampler import Draws, Sampler, SamplingParams
dev = torch.device("cuda:0"); V = 152064
a = torch.randn(8192, 8192, device=dev, dtype=torch.bfloat16)
def busy():  # ~ a few ms of matmuls: the step before the choice
    for _ in range(12): a @ a
def timed(fn):
    ts = []
    for i in range(60):
        busy(); e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        e0.record(); fn(); e1.record(); e1.synchronize()
        if i >= 10: ts.append(e0.elapsed_time(e1) * 1e3)
    return sorted(ts)[len(ts) // 2]
buf = torch.randn(64, V, device=dev).to(torch.bfloat16)  # a step graph's logits buffer stand-in
s = Sampler(V, torch.bfloat16, dev, [1, 8, 32, 64], True, {b: buf[:b] for b in (1, 8, 32, 64)})
for n in (1, 8, 32, 64):
    x = buf[:n]
    d = Draws([SamplingParams(1.0, 0.9, 0, 7 + j) for j in range(n)], [1000] * n)
    print(f"n {n}: argmax {timed(lambda: x.argmax(-1)):.1f} us, Sampler call (in place) {timed(lambda: s(x, d)):.1f} us", flush=True)
PY
