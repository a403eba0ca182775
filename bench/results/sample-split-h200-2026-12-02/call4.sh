#!/bin/bash
# Issue #26, call 4: where the split draw's time goes at 64 rows: each launch's device time (torch.profiler, CUDA
# activity, 30 calls after 10) at vocab 152,064 bf16, temperature 1, top_p 0.9, rows N(0, s^2) (s = 1 flat, the
# preset's; s = 10 peaked), for 1, 8, 32 and 64 rows; and the Sampler's whole captured call beside it.
set -u
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 3
export PYTHONPATH=/tmp/site:. NCCL_NVLS_ENABLE=0 PYTHONUNBUFFERED=1
timeout 300 python3 - > $OUT/launches.log 2>&1 <<'PY'
import torch
from torch.profiler import ProfilerActivity, profile
from kvtransfer.kernels.triton_sample import programs_for, sample_triton
dev = torch.device("cuda:0"); V = 152064
for n in (1, 8, 32, 64):
    for s in (1.0, 10.0):
        g = torch.Generator(device=dev).manual_seed(n)
        x = (torch.randn(n, V, device=dev, generator=g) * s).to(torch.bfloat16)
        t = torch.ones(n, device=dev); p = torch.full((n,), 0.9, device=dev)
        k = torch.zeros(n, dtype=torch.long, device=dev); seed = torch.arange(n, device=dev)
        pos = torch.full((n,), 1000, device=dev)
        for _ in range(10): sample_triton(x, t, p, k, seed, pos)
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(30): sample_triton(x, t, p, k, seed, pos)
            torch.cuda.synchronize()
        rows = [(e.key, e.device_time_total / e.count if e.count else 0.0) for e in prof.key_averages()
                if "kernel" in e.key]
        total = sum(us for _, us in rows)
        print(f"n {n} s {s:g} P {programs_for(n, dev)}: " + ", ".join(f"{name.split('_kernel')[0].lstrip('_')} {us:.1f}"
              for name, us in rows) + f" | sum {total:.1f} us", flush=True)
PY
cat $OUT/launches.log | tail -20
