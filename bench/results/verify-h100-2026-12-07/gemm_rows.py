"""The engine's layer GEMMs (Qwen2.5-7B shapes, bf16, F.linear as the engine calls it) at each step size:
which row counts fill the card's waves (#39: is 512 rows a bad point for qkv and o?). One JSON line per rows.
Timed as bench/measure/roofline.py times its rate (warm-up, median of loop_us over REPS loops)."""
import json
import sys

import torch
import torch.nn.functional as F

from bench.measure.roofline import Dims, LAYER_SHAPES
from bench.measure.timing import loop_us

dims = Dims(hidden=3584, heads=28, kv_heads=4, head_dim=128, intermediate=18944, layers=28, vocab=152064)
rows_list = [int(r) for r in sys.argv[1].split(",")] if len(sys.argv) > 1 else list(range(384, 1025, 32))
weights = {n: torch.randn(o, i, device="cuda", dtype=torch.bfloat16) for n, (o, i) in dims.shapes().items()
           if n in LAYER_SHAPES}
for rows in rows_list:
    out = {"rows": rows}
    total_us = 0.0
    for name, w in weights.items():
        x = torch.randn(rows, w.shape[1], device="cuda", dtype=torch.bfloat16)
        for _ in range(3):
            F.linear(x, w)
        us = loop_us(lambda: F.linear(x, w), 10, 7)
        out[name] = {"us": round(us, 2), "tflops": round(2 * rows * w.shape[0] * w.shape[1] / (us * 1e-6) / 1e12, 1)}
        total_us += us
    flops = 2 * rows * sum(w.shape[0] * w.shape[1] for w in weights.values())
    out["layer_us"] = round(total_us, 2)
    out["layer_tflops"] = round(flops / (total_us * 1e-6) / 1e12, 1)
    out["us_per_row_28_layers"] = round(28 * total_us / rows, 3)
    print(json.dumps(out), flush=True)
