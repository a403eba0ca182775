"""The model's layer GEMMs held for seconds: the rate a sustained compute-bound load gets, beside the burst rate that
serve's roofline measures.

Why: serve's roofline (bench/measure/roofline.measure_gemm) times 7 x 10 calls of each GEMM, a few hundred ms on a GPU
idle since the server started. bench/results/served-step-2026-12-07 (call 12) logged the SM clock through serve at c64
on an H100: it fell under load, with the software power cap as the reason. So the rate serve's steps get may sit
below the rate its roofline is measured at. This replays the layer mix (qkv, o,
gate_up, down at --rows rows, each once: one token's mix, as the roofline's layer rate) in a CUDA graph for --hold-s
seconds and reports the rate in each --window-s window: the first window (the burst), the median of the second half
(sustained), and measure_gemm's rate before and after the hold. CUDA only.

    python -m bench.probes.gemm_sustained --model qwen2.5-7b --hold-s 30
"""

from __future__ import annotations

import argparse
import json
import statistics

from bench.measure import roofline
from kvtransfer.model.spec import load_config


def summarize(rates: list[float]) -> dict:
    """Per-window TFLOP/s, in order -> the burst (first window), the sustained rate (median of the second half's
    windows) and sustained / burst."""
    if not rates:
        raise ValueError("no window was timed")
    tail = rates[len(rates) // 2:]
    sustained = statistics.median(tail)
    return {"burst_tflops": rates[0], "sustained_tflops": sustained, "sustained_over_burst": sustained / rates[0],
            "min_tflops": min(rates), "windows": len(rates)}


def sm_clock_and_power(device) -> tuple[float | None, float | None]:
    """The SM clock (MHz) and power (W) now, where torch can read them (it needs pynvml); else None, None."""
    import torch

    try:
        return float(torch.cuda.clock_rate(device)), float(torch.cuda.power_draw(device)) / 1000
    except Exception:  # noqa: BLE001 - no pynvml on the machine: the shell's nvidia-smi log has them
        return None, None


def hold(dims: roofline.Dims, rows: int, hold_s: float, window_s: float, device: str = "cuda") -> list[dict]:
    """The layer mix replayed back to back for hold_s seconds: [{"tflops", "ms", "sm_mhz", "watts"}] per window."""
    import torch
    import torch.nn.functional as F

    dev = torch.device(device)
    mats = [(torch.randn(rows, k, device=dev, dtype=torch.bfloat16), torch.randn(n, k, device=dev,
                                                                                 dtype=torch.bfloat16))
            for name, (n, k) in dims.shapes().items() if name in roofline.LAYER_SHAPES]
    flops = sum(2 * rows * w.shape[0] * w.shape[1] for _, w in mats)  # one replay of the mix
    for x, w in mats:  # cuBLAS picks and loads its kernels outside the capture
        F.linear(x, w)
    torch.cuda.synchronize(dev)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for x, w in mats:
            F.linear(x, w)
    begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    begin.record()
    for _ in range(10):
        graph.replay()
    end.record()
    end.synchronize()
    per_window = max(1, round(window_s * 1e3 / (begin.elapsed_time(end) / 10)))
    out = []
    for _ in range(max(2, round(hold_s / window_s))):
        begin.record()
        for _ in range(per_window):
            graph.replay()
        end.record()
        end.synchronize()
        ms = begin.elapsed_time(end)
        mhz, watts = sm_clock_and_power(dev)
        out.append({"tflops": flops * per_window / (ms * 1e-3) / 1e12, "ms": ms, "sm_mhz": mhz, "watts": watts})
    del graph, mats
    torch.cuda.empty_cache()
    return out


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="qwen2.5-7b")
    p.add_argument("--device", default="cuda")
    p.add_argument("--rows", type=int, default=roofline.ROWS, help="the GEMMs' rows (the roofline's)")
    p.add_argument("--hold-s", type=float, default=30.0, help="seconds of GEMMs back to back")
    p.add_argument("--window-s", type=float, default=1.0, help="seconds a timed window")
    a = p.parse_args(argv)
    if a.hold_s <= 0 or a.window_s <= 0 or a.window_s > a.hold_s:
        p.error("--hold-s and --window-s must be > 0, with --window-s <= --hold-s")
    import torch

    if not a.device.startswith("cuda") or not torch.cuda.is_available():
        p.error(f"the GEMM rate is held on a CUDA device only (got --device {a.device})")
    dims = roofline.Dims.of(load_config(a.model))
    before = roofline.measure_gemm(dims, a.device)["layer_tflops"]
    windows = hold(dims, a.rows, a.hold_s, a.window_s, a.device)
    after = roofline.measure_gemm(dims, a.device)["layer_tflops"]
    r = {"bench": "gemm_sustained", "model": a.model, "device": torch.cuda.get_device_name(torch.device(a.device)),
         "rows": a.rows, "hold_s": a.hold_s, "window_s": a.window_s, "roofline_before_tflops": before,
         "roofline_after_tflops": after, **summarize([w["tflops"] for w in windows]), "per_window": windows}
    print(f"layer mix at {a.rows} rows on {r['device']}: roofline before {before:.0f} TFLOP/s; held {a.hold_s:.0f} s: "
          f"first window {r['burst_tflops']:.0f}, second half's median {r['sustained_tflops']:.0f} "
          f"({r['sustained_over_burst']:.1%}), lowest {r['min_tflops']:.0f}; roofline after {after:.0f}")
    for i, w in enumerate(windows):
        print(f"  window {i}: {w['tflops']:.0f} TFLOP/s, SM {w['sm_mhz'] or '-'} MHz, {w['watts'] or '-'} W")
    print(json.dumps(r))
    return r


if __name__ == "__main__":
    main()
