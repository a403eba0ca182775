"""cuBLAS's time for the model's GEMMs at every row count: where a step or a prompt of M rows gets a slow kernel.

Why: bench/results/curve-h100-2026-12-07 found 448- and 576-row mixed steps slower than 512- and 640-row ones, the
gate_up GEMM at (448, 37,888, 3,584) running 347 TFLOP/s against 748 at 512 rows: cuBLAS's heuristic picks its kernel
by shape, and some row counts get a poor one. A step's rows come from a ladder (graphs.step_sizes), but a prompt
prefilled whole has its own length as M. This times F.linear (bf16, the engine's fused shapes: bench/measure/
roofline.Dims) at each --rows, median of --reps replays of a CUDA graph of --calls, and lists the row counts whose
GEMM takes longer than at a larger row count (`slower_than_larger`): there, padding the rows up would be faster.
The same weights run every call, so qkv's and o's (26-33 MB) stay in L2 and their small-row times read low. CUDA
only.

    python -m bench.probes.gemm_rows --model qwen2.5-7b --rows 16:2048:16
"""

from __future__ import annotations

import argparse
import json

from bench.measure import roofline
from kvtransfer.model.spec import load_config


def parse_rows(text: str) -> list[int]:
    """"a:b:s" (a to b inclusive, step s) or "m,n,..." -> sorted distinct row counts (>= 1)."""
    if ":" in text:
        a, b, s = (int(x) for x in text.split(":"))
        if s < 1:
            raise ValueError(f"step {s} < 1")
        rows = range(a, b + 1, s)
    else:
        rows = (int(x) for x in text.split(","))
    out = sorted(set(rows))
    if not out or out[0] < 1:
        raise ValueError(f"row counts must be >= 1 (got {text!r})")
    return out


def slower_than_larger(times: dict[int, float], margin: float = 0.05) -> list[dict]:
    """Row counts m whose time exceeds, by more than `margin`, the time at some larger count n (the smallest such
    time): [{"rows": m, "us": t(m), "pad_to": n, "pad_us": t(n)}], ascending m."""
    rows = sorted(times)
    out, best, best_at = [], float("inf"), None
    for m in reversed(rows):  # best: the fastest time at a count above m
        if best_at is not None and times[m] > best * (1 + margin):
            out.append({"rows": m, "us": times[m], "pad_to": best_at, "pad_us": best})
        if times[m] < best:
            best, best_at = times[m], m
    return sorted(out, key=lambda r: r["rows"])


def time_rows(linear, x, w, calls: int, reps: int, loop_us, graph=None, capture=None) -> float:
    """linear(x, w)'s median us: `calls` of them captured in one CUDA graph, replayed (eager launches would time the
    host: ~30 us a call on the device machine, longer than a small GEMM); 3 eager calls first (cuBLAS picks and
    loads its kernel). graph / capture: torch.cuda.CUDAGraph and torch.cuda.graph (None), or a test's stand-ins."""
    import torch

    graph = graph or torch.cuda.CUDAGraph
    capture = capture or torch.cuda.graph
    for _ in range(3):
        linear(x, w)
    if x.is_cuda:
        torch.cuda.synchronize()
    g = graph()
    with capture(g):
        for _ in range(calls):
            linear(x, w)
    return loop_us(g.replay, 1, reps) / calls


def sweep(dims: roofline.Dims, rows: list[int], calls: int, reps: int, device: str = "cuda",
          qkv_bias: bool = False) -> dict:
    """Each layer GEMM's {"n", "k", "us", "tflops", "slower_than_larger"} by row count. qkv_bias: qkv with a bias, as
    the engine runs it for models with one (Qwen2: cuBLAS then picks among its bias kernels)."""
    import torch
    import torch.nn.functional as F

    from bench.measure.timing import loop_us

    dev = torch.device(device)
    out = {}
    for name, (n, k) in dims.shapes().items():
        if name not in roofline.LAYER_SHAPES:
            continue
        w = torch.randn(n, k, device=dev, dtype=torch.bfloat16)
        bias = torch.randn(n, device=dev, dtype=torch.bfloat16) if name == "qkv" and qkv_bias else None
        x_all = torch.randn(max(rows), k, device=dev, dtype=torch.bfloat16)
        linear = (lambda x, w, bias=bias: F.linear(x, w, bias))
        times = {m: time_rows(linear, x_all[:m], w, calls, reps, loop_us) for m in rows}
        out[name] = {"n": n, "k": k, "us": times,
                     "tflops": {m: 2 * m * n * k / (us * 1e-6) / 1e12 for m, us in times.items()},
                     "slower_than_larger": slower_than_larger(times)}
    torch.cuda.empty_cache()
    return out


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="qwen2.5-7b")
    p.add_argument("--device", default="cuda")
    p.add_argument("--rows", default="16:2048:16", help="row counts: a:b:step, or comma-separated")
    p.add_argument("--calls", type=int, default=10, help="GEMMs per CUDA graph")
    p.add_argument("--reps", type=int, default=5, help="timed replays per row count (median)")
    a = p.parse_args(argv)
    try:
        rows = parse_rows(a.rows)
    except ValueError as e:
        p.error(f"--rows: {e}")
    import torch

    if not a.device.startswith("cuda") or not torch.cuda.is_available():
        p.error(f"cuBLAS's row counts are timed on a CUDA device only (got --device {a.device})")
    config = load_config(a.model)
    bias = bool(getattr(config, "attention_bias", config.model_type == "qwen2"))  # Qwen2's q, k, v carry one
    r = {"bench": "gemm_rows", "model": a.model, "device": torch.cuda.get_device_name(torch.device(a.device)),
         "calls": a.calls, "reps": a.reps, "qkv_bias": bias,
         "shapes": sweep(roofline.Dims.of(config), rows, a.calls, a.reps, a.device, bias)}
    for name, s in r["shapes"].items():
        bad = s["slower_than_larger"]
        print(f"{name} ({s['n']} x {s['k']}): {len(bad)} of {len(rows)} row counts slower than a larger one"
              + (": " + ", ".join(f"{b['rows']} ({b['us']:.0f} us; {b['pad_to']}: {b['pad_us']:.0f})"
                                  for b in bad) if bad else ""))
    print(json.dumps(r))
    return r


if __name__ == "__main__":
    main()
