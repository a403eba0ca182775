"""Reload or recompute: the break-even rule for a prefix found in the host tier, from speeds measured at start.

Why measured: whether copying a context back beats prefilling it again depends on this machine's link and this
model on this device, by an order of magnitude either way (pinned RAM reloads a Qwen2.5-7B cache tens of times
faster than an H200 recomputes it; pageable RAM or a slow link can lose). So at start the engine times one
copy from the host tier's pinned pages to the device and one prefill, and decides each request by

    reload  iff  tokens x bytes_per_token / reload_bytes_per_s  <  tokens x prefill_s_per_token

(the offload bench's rule: a reload pays when the link moves KV bytes faster than prefill makes them,
bytes_per_token / prefill_s_per_token). The prefill is timed on a short prompt, where attention costs least
per token: a long prefix's recompute is dearer than the rule assumes, so its errors favour recompute.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass

import torch

from kvtransfer.determinism import sync


@dataclass(frozen=True)
class Speeds:
    bytes_per_token: int
    reload_bytes_per_s: float  # host tier -> device, measured
    prefill_s_per_token: float  # this device's prefill, measured

    def reload_s(self, tokens: int) -> float:
        return tokens * self.bytes_per_token / self.reload_bytes_per_s

    def recompute_s(self, tokens: int) -> float:
        return tokens * self.prefill_s_per_token

    def reload_pays(self, tokens: int) -> bool:
        return self.reload_s(tokens) < self.recompute_s(tokens)

    @property
    def break_even_bytes_per_s(self) -> float:
        """The link speed above which a reload beats recompute."""
        return self.bytes_per_token / self.prefill_s_per_token

    def describe(self) -> str:
        return (f"reload {self.reload_bytes_per_s / 1e9:.2f} GB/s vs recompute {self.prefill_s_per_token * 1e6:.1f} "
                f"us/token (break-even link {self.break_even_bytes_per_s / 1e9:.2f} GB/s): a host-tier hit "
                f"{'reloads' if self.reload_pays(1) else 'recomputes'}")


def median_s(fn, device: torch.device, runs: int = 5) -> float:
    """Median wall time of fn() over `runs` runs after one warm-up, synchronized."""
    fn()
    sync(device)
    times = []
    for _ in range(runs):
        t0 = time.perf_counter()
        fn()
        sync(device)
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def measure(tier, prefill_tokens, bytes_per_token: int, probe_tokens: int) -> Speeds:
    """Time a reload of `probe_tokens` tokens' pages from `tier` (HostTier) into a device scratch, and
    `prefill_tokens(probe_tokens)` (a prefill of that many tokens), each the median of 5 after a warm-up."""
    pages = min(tier.pages_for(probe_tokens), tier.pages)
    n = pages * tier.page_tokens
    src = tier.arena[:pages]  # (pages, page_tokens, layers, 2, kv_heads, head_dim), pinned on CUDA
    dst = torch.empty(src.shape, dtype=src.dtype, device=tier.device)
    copy_s = median_s(lambda: dst.copy_(src, non_blocking=True), tier.device)
    prefill_s = median_s(lambda: prefill_tokens(probe_tokens), tier.device, runs=3)
    del dst
    return Speeds(bytes_per_token, n * bytes_per_token / copy_s, prefill_s / probe_tokens)
