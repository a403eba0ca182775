"""Where a decode step's GPU time goes: torch.profiler over CUDA-graph replays, kernels grouped by name.

Why: the decode bench gives the step against its floor; this says which kernels fill the gap (GEMMs
short of bandwidth, small kernels' fixed cost, attention). Prints one JSON line:

    python -m bench.probes.profile_step --model qwen2.5-7b --batch 1 --context 1024

With --mixed ROWS the step carries prompt-chunk rows beside the --batch decode rows, as --mixed-prefill builds it,
and the kernels are grouped by what they do (profile_mixed.py, which takes the rest of the arguments):

    python -m bench.probes.profile_step --model qwen2.5-7b --mixed 512 --batch 64 --context 1024
"""

from __future__ import annotations

import argparse
import json
from collections import defaultdict

import torch
from torch.profiler import ProfilerActivity, profile

from bench.probes import profile_mixed
from kvtransfer.engine.graphs import Step
from kvtransfer.engine.pool import KVPool
from kvtransfer.engine.runner import StepRunner
from kvtransfer.geometry import CacheGeometry
from kvtransfer.model.spec import ModelSpec, load_model


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="qwen2.5-7b")
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--context", type=int, default=1024)
    p.add_argument("--replays", type=int, default=20)
    p.add_argument("--top", type=int, default=15)
    p.add_argument("--mixed", type=int, default=0, help="a mixed step of this many rows (profile_mixed.py)")
    a, rest = p.parse_known_args(argv)
    if a.mixed:
        profile_mixed.main(argv)
        return
    if rest:
        p.error(f"unrecognized arguments: {' '.join(rest)} (only with --mixed)")
    model = load_model(ModelSpec(a.model, "bfloat16", 0), "cuda")
    pool = KVPool(CacheGeometry.from_config(model.config, torch.bfloat16), torch.device("cuda"), a.batch, a.context + 8)
    pool.kv.normal_()
    step = Step(StepRunner(model, pool), a.batch, cuda_graphs=True)
    tok = torch.zeros(a.batch, dtype=torch.long, device="cuda")
    pos = torch.full((a.batch,), a.context - 1, dtype=torch.long, device="cuda")
    slots = torch.arange(a.batch, device="cuda")
    for _ in range(5):
        step(tok, pos, slots)
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(a.replays):
            step(tok, pos, slots)
        torch.cuda.synchronize()
    per = defaultdict(lambda: [0.0, 0])
    for e in prof.events():
        if e.device_type == torch.autograd.DeviceType.CUDA:
            per[e.name][0] += e.device_time_total if hasattr(e, "device_time_total") else e.cuda_time_total
            per[e.name][1] += 1
    total = sum(t for t, _ in per.values())
    rows = sorted(per.items(), key=lambda kv: -kv[1][0])[:a.top]
    print(json.dumps({"bench": "profile_step", "model": a.model, "batch": a.batch, "context": a.context,
                      "gpu_us_per_step": total / a.replays,
                      "kernels": [{"name": n[:90], "us_per_step": t / a.replays, "calls_per_step": c / a.replays,
                                   "share": t / total} for n, (t, c) in rows]}))


if __name__ == "__main__":
    main()
