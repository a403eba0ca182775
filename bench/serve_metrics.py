"""The decode server's batch size over a serve run, read from its Prometheus endpoint.

Why from the server: how many requests each step advanced is the server's fact, not the client's
guess. Before and after the run we read the step histogram (`kvt_decode_batch_size`: rows per step,
so sum/count is the mean batch of the steps taken); during the run we sample the running gauge
(`kvt_decode_running`) every SAMPLE_S for its distribution over time. The local prefill histogram
(`kvt_prefill_ms`, colocated and recompute prefills) gives the mean prefill time inside the server.
"""

from __future__ import annotations

import asyncio
import re
import time
import urllib.request

import numpy as np

SAMPLE_S = 0.1


def scrape(url: str) -> dict[str, float]:
    """The decode_* series, and the local prefill histogram's sum and count (summed over its mode label)."""
    text = urllib.request.urlopen(url, timeout=5).read().decode()
    out = {m.group(1): float(m.group(2)) for m in re.finditer(r"^(kvt_decode_\w+) (\S+)$", text, re.M)}
    for key in ("sum", "count"):
        out[f"kvt_prefill_ms_{key}"] = sum(float(m.group(1)) for m in re.finditer(
            rf"^kvt_prefill_ms_{key}(?:{{[^}}]*}})? (\S+)$", text, re.M))
    return out


class BatchWatch:
    def __init__(self, url: str):
        self.url, self.before, self.samples = url, scrape(url), []  # samples: (s since start, running)

    async def sample(self, start: float) -> None:
        while True:
            m = await asyncio.to_thread(scrape, self.url)
            self.samples.append((round(time.perf_counter() - start, 3), m.get("kvt_decode_running", 0.0)))
            await asyncio.sleep(SAMPLE_S)

    def report(self) -> dict:
        after = scrape(self.url)
        steps = after.get("kvt_decode_batch_size_count", 0) - self.before.get("kvt_decode_batch_size_count", 0)
        rows = after.get("kvt_decode_batch_size_sum", 0) - self.before.get("kvt_decode_batch_size_sum", 0)
        running = np.asarray([r for _, r in self.samples] or [0.0])
        n_pre = after["kvt_prefill_ms_count"] - self.before["kvt_prefill_ms_count"]
        ms_pre = after["kvt_prefill_ms_sum"] - self.before["kvt_prefill_ms_sum"]
        return {"steps": int(steps), "mean_batch_per_step": rows / steps if steps else None,
                "local_prefills": int(n_pre), "local_prefill_ms_mean": ms_pre / n_pre if n_pre else None,
                "running_p50": float(np.median(running)), "running_max": float(running.max()),
                "timeline": self.samples[:: max(1, len(self.samples) // 200)]}
