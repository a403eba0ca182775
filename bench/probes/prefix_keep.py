"""The prefix cache's host work for one long prompt: acquire (its block keys, then the slot under the pool's lock) and
the release that caches the row (keep, under the pool's lock), on CPU with no model.

Why: a trace of the serving thread (bench/results/stall-h100-2026-12-07) showed a 32k prompt's `keep` taking 7.6 ms
on an H100 machine's host; the pool's lock is held meanwhile, and the scheduler thread takes that lock to grow rows,
so the step launched after it waits too. Each run takes a new prompt (a miss, and a keep of the whole prompt, as
request_path sets it: its own array of the same ids); medians of --runs after two warm-ups. The last line is JSON.

    python -m bench.probes.prefix_keep --tokens 32000
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import numpy as np
import torch

from kvtransfer.engine.pool import KVPool
from kvtransfer.engine.prefix_cache import PrefixCache
from kvtransfer.geometry import CacheGeometry


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tokens", type=int, default=32000)
    p.add_argument("--runs", type=int, default=9)
    a = p.parse_args()
    geo = CacheGeometry(num_layers=2, kv_heads=2, head_dim=4, dtype=torch.float32)  # the KV's size plays no part
    cache = PrefixCache(KVPool(geo, torch.device("cpu"), 4, a.tokens + 128, 64, 0))
    rng = np.random.default_rng(0)
    acquire, keep = [], []
    for i in range(a.runs + 2):
        tokens = rng.integers(3, 150000, a.tokens).astype(np.int64)
        t0 = time.perf_counter()
        lease = cache.acquire(tokens, True, None, a.tokens + 16)
        t1 = time.perf_counter()
        lease.keep = np.asarray(tokens.tolist(), dtype=np.int64)
        t2 = time.perf_counter()
        lease.release()
        t3 = time.perf_counter()
        if i >= 2:
            acquire.append((t1 - t0) * 1e3)
            keep.append((t3 - t2) * 1e3)
    out = {"tokens": a.tokens, "runs": a.runs, "acquire_ms": statistics.median(acquire),
           "keep_ms": statistics.median(keep), "device": "cpu"}
    print(f"{a.tokens} tokens: acquire {out['acquire_ms']:.2f} ms, release (keep) {out['keep_ms']:.2f} ms "
          f"(CPU, medians of {a.runs})")
    print(json.dumps(out))


if __name__ == "__main__":
    main()
