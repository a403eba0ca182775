#!/bin/bash
# Issue #26, call 5: the split draw's round-2 bar (cap: a bracket holding more values than this after round 1 gets
# a second pass over the row) and P, captured as the Sampler captures it (replay p50 of 40 after 5), vocab 152,064
# bf16, temperature 1, top_p 0.9, rows N(0, s^2) (s = 1 flat: the preset's; s = 10 peaked).
set -u
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 3
export PYTHONPATH=/tmp/site:. NCCL_NVLS_ENABLE=0 PYTHONUNBUFFERED=1
timeout 300 python3 - > $OUT/cap.log 2>&1 <<'PY'
import statistics, torch
from kvtransfer.kernels.triton_sample import programs_for, sample_triton
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
    return statistics.median(ts), out.clone()
for n in (1, 8, 32, 64):
    for s in (1.0, 10.0):
        gen = torch.Generator(device=dev).manual_seed(n)
        x = (torch.randn(n, V, device=dev, generator=gen) * s).to(torch.bfloat16)
        t = torch.ones(n, device=dev); p = torch.full((n,), 0.9, device=dev)
        k = torch.zeros(n, dtype=torch.long, device=dev); seed = torch.arange(n, device=dev); pos = torch.full((n,), 1000, device=dev)
        base = programs_for(n, dev)
        line, ref = [], None
        for P in sorted({base, max(1, base // 2), min(32, base * 2)}):
            for cap in (4096, 16384, 65536, 1 << 20):
                us, tok = replay_us(lambda: sample_triton(x, t, p, k, seed, pos, programs_per_row=P, cap=cap))
                ref = tok if ref is None else ref
                line.append(f"P{P} cap{cap} {us:.0f}{'' if torch.equal(tok, ref) else ' (TOKENS DIFFER)'}")
        print(f"n {n} s {s:g}: " + " | ".join(line), flush=True)
PY
cat $OUT/cap.log | tail -10
