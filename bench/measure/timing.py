"""GPU time of back-to-back calls, measured with CUDA events: the timer the probes and the serve roofline share.

Why apart, in measure/: probe_round and probe_mixed both time this way (probe_round imports probe_mixed), and the
serve run's roofline (measure/roofline.py) times its GEMMs the same way; the timer lives below all of them so the
rooms import only downward.
"""

from __future__ import annotations

import torch

from bench.measure.stats import summarize


def loop_us(fn, calls: int, reps: int = 7) -> float:
    """Median over reps of (GPU time of `calls` back-to-back calls) / calls, in us."""
    fn()
    torch.cuda.synchronize()
    out = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        for _ in range(calls):
            fn()
        b.record()
        torch.cuda.synchronize()
        out.append(a.elapsed_time(b) * 1e3 / calls)
    return summarize(out)["median"]
