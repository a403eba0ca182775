#!/bin/bash
# Issue #26, call 2: the split draw's launch shape, captured as the Sampler captures it (one CUDA graph, replay
# timed with CUDA events, p50 of 40 after 5), at vocab 152,064 bf16, temperature 1, top_p 0.9, over programs per
# row P, warps and the round pass's block; rows N(0, s^2), s = 1 (flat: the preset's) and 10 (peaked).
# The one-program kernel (triton_sample.py) captured the same way beside it.
set -u
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 3
export PYTHONPATH=/tmp/site:. NCCL_NVLS_ENABLE=0 PYTHONUNBUFFERED=1
timeout 400 python3 - > $OUT/shape.log 2>&1 <<'PY'
import statistics, torch
from kvtransfer.kernels.triton_sample import sample_triton
from kvtransfer.kernels.triton_sample_split import programs_for, sample_triton_split
dev = torch.device("cuda:0"); V = 152064
def replay_us(fn):
    s = torch.cuda.Stream(); s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(2): fn()
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g): out = fn()
    for _ in range(5): g.replay()
    ts = []
    for _ in range(40):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record(); g.replay(); b.record(); b.synchronize(); ts.append(a.elapsed_time(b) * 1e3)
    return statistics.median(ts), out
for n in (1, 8, 32, 64):
    for s in (1.0, 10.0):
        gen = torch.Generator(device=dev).manual_seed(n)
        x = (torch.randn(n, V, device=dev, generator=gen) * s).to(torch.bfloat16)
        t = torch.ones(n, device=dev); p = torch.full((n,), 0.9, device=dev)
        k = torch.zeros(n, dtype=torch.long, device=dev); seed = torch.arange(n, device=dev); pos = torch.full((n,), 1000, device=dev)
        old, ref = replay_us(lambda: sample_triton(x, t, p, k, seed, pos))
        line = [f"n {n} s {s:g}: one-program {old:.0f}"]
        best = None
        for P in sorted({1, 2, 4, programs_for(n, dev), programs_for(n, dev, 4), programs_for(n, dev, 8), 16, 32}):
            for w in (4, 8):
                for blk in (256, 512):
                    us, tok = replay_us(lambda: sample_triton_split(x, t, p, k, seed, pos, programs_per_row=P,
                                                                    num_warps=w, block=blk))
                    line.append(f"P{P} w{w} b{blk} {us:.0f}")
                    if best is None or us < best[0]: best = (us, P, w, blk)
        print(" | ".join(line)); print(f"  best n {n} s {s:g}: {best[0]:.0f} us at P {best[1]} warps {best[2]} block {best[3]} (default P {programs_for(n, dev)})", flush=True)
PY
cat $OUT/shape.log | grep -v "^n " ; grep -c "^n " $OUT/shape.log
