"""Measuring for `kvtransfer-bench decode`: timers, memory budget, bandwidth, and the grid's bookkeeping.

Why apart from the bench: the engine cells (bench.runs.decode) and the HF baselines (bench.runs.decode_hf)
are timed, sized and filed the same way. Timers read after a device sync (STYLE 8); a cell's
memory is checked against --mem-fraction before it is allocated, and whatever a cell raises is
filed under `skipped` (an OOM as such, anything else also as a failure) with its memory freed,
so one cell never ends the run.
"""

from __future__ import annotations

import gc
import os
import sys
import traceback
from collections.abc import Callable

import torch

from bench.measure.stats import summarize, timed

HEADROOM = 2 << 30  # activations, graph pools, cuBLAS workspace: kept free beside a cell's cache
Progress = Callable[[str], None]


def time_calls(fn: Callable[[], object], device: torch.device, runs: int, warmup: int,
               reset: Callable[[], object] | None = None) -> dict:
    """p50/p10/p90 ms of `fn` over `runs` after `warmup`; the device synced before every timer read; `reset`
    (untimed) after each call."""
    s = summarize(timed(fn, [device], runs, warmup, after=reset), scale=1e3)
    return dict(p50=s["median"], p10=s["p10"], p90=s["p90"], runs=runs)


def free_memory(device: torch.device) -> None:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def budget(device: torch.device, fraction: float) -> int:
    """Bytes a new allocation may take: --mem-fraction of the device less what is allocated, minus headroom."""
    if device.type == "cuda":
        free, total = torch.cuda.mem_get_info(device)
        return min(int(total * fraction) - torch.cuda.memory_allocated(device), free) - HEADROOM
    return int(os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE") * fraction) - HEADROOM


def is_oom(e: BaseException) -> bool:
    return isinstance(e, torch.cuda.OutOfMemoryError) or "out of memory" in str(e).lower()


def bandwidth_gbps(device: torch.device) -> tuple[float, int]:
    """Device memory bandwidth: (bytes read + written) / time of one large copy, median of 5 after 2."""
    n = (4 << 30) if device.type == "cuda" else (64 << 20)
    src = torch.empty(n, dtype=torch.uint8, device=device).fill_(1)
    dst = torch.empty_like(src)
    s = time_calls(lambda: dst.copy_(src), device, runs=5, warmup=2)
    del src, dst
    free_memory(device)
    return 2 * n / (s["p50"] * 1e-3) / 1e9, n


class Grid:
    """Collects cells, skips and failures; `guard` runs one piece of work and files its exception."""

    def __init__(self, device: torch.device, progress: Progress):
        self.device, self.progress = device, progress
        self.cells: dict[tuple[int, int], dict] = {}
        self.skipped: list[dict] = []
        self.failures: list[str] = []

    def cell(self, b: int, c: int) -> dict:
        return self.cells.setdefault((b, c), {"batch": b, "context": c})

    def skip(self, b: int, c: int, what: str, why: str) -> None:
        self.skipped.append({"batch": b, "context": c, "what": what, "why": why})
        print(f"decode: skip {what} {b}x{c}: {why}", file=sys.stderr, flush=True)

    def guard(self, cells: list[tuple[int, int]], what: str, fn: Callable[[], None]) -> None:
        try:
            fn()
        except Exception as e:  # filed, memory freed, the grid goes on; only a non-OOM error fails the run
            why = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"[:300]
            if not is_oom(e):
                traceback.print_exc()
                self.failures.append(f"{what} {','.join(f'{b}x{c}' for b, c in cells)}: {why}")
            for b, c in cells:
                self.skip(b, c, what, ("out of memory: " if is_oom(e) else "") + why)
        finally:
            free_memory(self.device)
