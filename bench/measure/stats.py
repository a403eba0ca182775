"""Timing and summary statistics, one way for every bench (and the tests that time things).

Why one module: STYLE 8 asks every bench to synchronize before each timer read, warm up,
and report medians and spread; five benches did it with five private copies whose
percentiles disagreed. Percentiles here are numpy's linear interpolation, std is the
population std (numpy's and vLLM's), so every figure of the same name means the same.
Each bench keeps its own result keys and builds them from these figures.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Sequence

import numpy as np


def summarize(samples: Iterable[float], scale: float = 1.0, percentiles: Sequence[float] = (10, 90)) -> dict:
    """n, mean, median, std, min, max and p<N> for each of `percentiles`, of samples * scale (e.g. 1e3 for
    seconds -> ms); every figure but n is None when there are no samples."""
    a = np.asarray(list(samples), dtype=float) * scale
    keys = ["mean", "median", "std", "min", "max", *(f"p{p:g}" for p in percentiles)]
    if not a.size:
        return {"n": 0} | dict.fromkeys(keys)
    figures = [a.mean(), np.median(a), a.std(), a.min(), a.max(), *np.percentile(a, list(percentiles))]
    return {"n": int(a.size)} | {k: float(v) for k, v in zip(keys, figures)}


def median(samples: Iterable[float]) -> float | None:
    return summarize(samples, percentiles=())["median"]


def percentile(samples: Iterable[float], p: float) -> float | None:
    """Linear-interpolated percentile (numpy's default), None for no data."""
    return summarize(samples, percentiles=(p,))[f"p{p:g}"]


def spread_ms(samples: Iterable[float], scale: float = 1e3) -> dict:
    """The `median [min-max]` figures of the bench tables: median_ms, min_ms, max_ms (samples in seconds
    unless `scale` says otherwise)."""
    s = summarize(samples, scale, percentiles=())
    return {"median_ms": s["median"], "min_ms": s["min"], "max_ms": s["max"]}


def clock(fn: Callable[[], object], devices: Sequence = ()) -> tuple[float, object]:
    """Seconds of one call of `fn` and its result, every device in `devices` synced before each timer read."""
    if devices:
        from kvtransfer.determinism import sync  # torch only when a device is timed
    for d in devices:
        sync(d)
    t0 = time.perf_counter()
    out = fn()
    for d in devices:
        sync(d)
    return time.perf_counter() - t0, out


def timed(fn: Callable[[], object], devices: Sequence = (), runs: int = 5, warmup: int = 1,
          before: Callable[[], object] | None = None, after: Callable[[], object] | None = None) -> list[float]:
    """Seconds of `runs` calls of `fn` after `warmup` untimed ones (see `clock`); `before` and `after` run
    untimed around every call."""
    secs = []
    for i in range(warmup + runs):
        if before is not None:
            before()
        t, _ = clock(fn, devices)
        if after is not None:
            after()
        if i >= warmup:
            secs.append(t)
    return secs
