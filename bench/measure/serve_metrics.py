"""The decode server's batch size over a serve run, read from its Prometheus endpoint.

Why from the server: how many requests each step advanced is the server's fact, not the client's
guess. Before and after the run we read the step histogram (`kvt_decode_batch_size`: rows per step,
so sum/count is the mean batch of the steps taken); during the run we sample the running gauge
(`kvt_decode_running`) every SAMPLE_S for its distribution over time. The local prefill histogram
(`kvt_prefill_ms`, colocated and recompute prefills) gives the mean prefill time inside the server.
The steps' device time (`kvt_decode_device_seconds`, CUDA events) over the wall time between the two
reads says how busy the scheduler kept the GPU: what is left is host time or an empty queue.
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
    return parse(urllib.request.urlopen(url, timeout=5).read().decode())


def parse(text: str) -> dict[str, float]:
    """`scrape` of a /metrics text already read."""
    out = {m.group(1): float(m.group(2)) for m in re.finditer(r"^(kvt_(?:decode|kv_pool)_\w+) (\S+)$", text, re.M)}
    for m in re.finditer(r'^kvt_decode_mixed_steps_total{rows="(\d+)"} (\S+)$', text, re.M):
        out[f"kvt_decode_mixed_steps_total:{m.group(1)}"] = float(m.group(2))
    for m in re.finditer(r'^kvt_decode_step_device_seconds_total{rows="(\w+)"} (\S+)$', text, re.M):
        out[f"kvt_decode_step_device_seconds_total:{m.group(1)}"] = float(m.group(2))
    for key in ("sum", "count"):
        out[f"kvt_prefill_ms_{key}"] = sum(float(m.group(1)) for m in re.finditer(
            rf"^kvt_prefill_ms_{key}(?:{{[^}}]*}})? (\S+)$", text, re.M))
    return out


def mixed_steps(after: dict[str, float], before: dict[str, float]) -> dict[str, float]:
    """Steps that carried prompt rows during the run, by step size in rows."""
    key = "kvt_decode_mixed_steps_total:"
    return {k[len(key):]: v - before.get(k, 0.0) for k, v in after.items() if k.startswith(key)}


def step_ms(after: dict[str, float], before: dict[str, float]) -> dict[str, float]:
    """The run's mean step device time (ms) by kind: each mixed step size in rows, and "decode" (steps without
    prompt rows); kinds with no steps or no device time (CPU: no CUDA events) left out."""
    counts = mixed_steps(after, before)
    counts["decode"] = after.get("kvt_decode_decode_only_steps_total", 0.0) - before.get(
        "kvt_decode_decode_only_steps_total", 0.0)
    key, out = "kvt_decode_step_device_seconds_total:", {}
    for kind, n in counts.items():
        seconds = after.get(key + kind, 0.0) - before.get(key + kind, 0.0)
        if n > 0 and seconds > 0:
            out[kind] = seconds / n * 1e3
    return out


class BatchWatch:
    def __init__(self, url: str):
        self.url, self.before, self.samples = url, scrape(url), []  # samples: (s since start, running)
        self.pool: list[tuple[float, float]] = []  # (shared blocks, free blocks) at each sample
        self.queued: list[float] = []  # prompts waiting to ride in steps at each sample (--mixed-prefill)
        self.t0 = time.perf_counter()

    def restart(self) -> None:
        """Count from now: the server's series as they stand and an empty timeline (after the warm-up requests,
        whose steps, batch-of-one ones, are no part of the run)."""
        self.before, self.t0 = scrape(self.url), time.perf_counter()
        self.samples, self.pool, self.queued = [], [], []

    async def sample(self, start: float) -> None:
        while True:
            m = await asyncio.to_thread(scrape, self.url)
            self.samples.append((round(time.perf_counter() - start, 3), m.get("kvt_decode_running", 0.0)))
            if "kvt_decode_prompts_queued" in m:
                self.queued.append(m["kvt_decode_prompts_queued"])
            if "kvt_kv_pool_free_blocks" in m:  # the paged pool's gauges
                self.pool.append((m.get("kvt_kv_pool_shared_blocks", 0.0), m["kvt_kv_pool_free_blocks"]))
            await asyncio.sleep(SAMPLE_S)

    def report(self) -> dict:
        after = scrape(self.url)
        wall = time.perf_counter() - self.t0

        def delta(name: str) -> float:
            return after.get(name, 0.0) - self.before.get(name, 0.0)
        steps = after.get("kvt_decode_batch_size_count", 0) - self.before.get("kvt_decode_batch_size_count", 0)
        rows = after.get("kvt_decode_batch_size_sum", 0) - self.before.get("kvt_decode_batch_size_sum", 0)
        running = np.asarray([r for _, r in self.samples] or [0.0])
        busy = delta("kvt_decode_device_seconds_total")
        n_pre = after["kvt_prefill_ms_count"] - self.before["kvt_prefill_ms_count"]
        ms_pre = after["kvt_prefill_ms_sum"] - self.before["kvt_prefill_ms_sum"]
        return {"steps": int(steps), "mean_batch_per_step": rows / steps if steps else None,
                "local_prefills": int(n_pre), "local_prefill_ms_mean": ms_pre / n_pre if n_pre else None,
                "prompt_rows_in_steps": int(delta("kvt_decode_prompt_rows_total")),
                "mixed_steps_by_rows": {k: int(v) for k, v in sorted(
                    mixed_steps(after, self.before).items(), key=lambda kv: int(kv[0])) if v},
                "device_busy": busy / wall if busy > 0 and wall > 0 else None,  # None on CPU (no CUDA events)
                # of the device time, the share before the steps' graph replays: input copies, and the device
                # waiting on a host that fell behind (so a step's device ms is the GPU's own only when this is small)
                "staging_share": (delta("kvt_decode_step_staging_seconds_total") / busy if busy > 0 else None),
                "decode_only_steps": int(delta("kvt_decode_decode_only_steps_total")),
                # the served steps' mean device ms, by kind: what bench/probes/step_curve.py prices alone
                "step_ms_by_rows": step_ms(after, self.before),
                "running_p50": float(np.median(running)), "running_max": float(running.max()),
                # how often no prompt waited for a step's rows (then a step decodes only): sampled
                "prompts_queued_p50": float(np.median(self.queued)) if self.queued else None,
                "prompts_queued_none_share": (sum(q == 0 for q in self.queued) / len(self.queued)
                                              if self.queued else None),
                "shared_blocks_max": max((s for s, _ in self.pool), default=None),
                "free_blocks_min": min((f for _, f in self.pool), default=None),
                "timeline": self.samples[:: max(1, len(self.samples) // 200)]}
