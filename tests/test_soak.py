"""Bounded soak: 64 concurrent clients holding multi-turn conversations of mixed lengths against a tiny pair on
CPU, with the prefix cache on and a small host tier, so that turns reuse cached prefixes (claimed, copied and
reloaded from the host) while other requests evict them.

Checks: no request lost (every one ends OK with the tokens of the same prompt prefilled from scratch, the
colocated reference's; a RESOURCE_EXHAUSTED refusal would be counted apart, and none is expected at 64 clients
under the default --max-inflight 64), both servers' resident memory flat within 5% between the first and the
last part of the run, after a warm-up, and the pool and host tier within their sizes, every slot given back.
The parts are counted in requests done, not in seconds: memory grows with the work (caches filling up), and a
busy machine does less of it in the same time (so a warm-up in seconds could end before the caches are full).
The decode worker runs all device work on one thread, so throughput is a few tens of requests per second here.
Length: 25 s by default; `KVT_SOAK_SECONDS=600 pytest tests/test_soak.py` for a long one
(read here only).
"""

from __future__ import annotations

import asyncio
import os
import threading
import time

import grpc

from kvtransfer.model.prefill import random_prompt
from proto import kvtransfer_pb2 as pb
from proto import kvtransfer_pb2_grpc as pbg
from support.enginekit import engine_generate
from support.faultkit import Pair, assert_no_leaks, value

CLIENTS = 64
LENGTHS = [1, 6, 17, 33, 64, 130, 257, 450]
TURNS, USER = 3, 20  # each conversation: its first prompt, then twice the history + the answer + USER new tokens
HOST_GIB = 0.002  # 2 MiB of host tier: 2,048 tiny tokens (8 pages), full within the warm-up
MODES = [pb.MODE_AUTO, pb.MODE_LAYERWISE, pb.MODE_BULK, pb.MODE_COLOCATED]


def rss_kib(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmRSS:"))


class RssSampler(threading.Thread):
    def __init__(self, pids: dict[str, int], progress, every: float = 0.25):
        """progress(): the requests done so far (read at each sample)."""
        super().__init__(daemon=True)
        self.pids, self.progress, self.every, self.samples = pids, progress, every, []  # (requests done, {name: kib})
        self.done = threading.Event()
        self.start()

    def run(self) -> None:
        while not self.done.wait(self.every):
            self.samples.append((self.progress(), {k: rss_kib(p) for k, p in self.pids.items()}))

    def mean(self, name: str, lo: float, hi: float) -> float:
        """The mean RSS of the samples taken while the requests done were in [lo, hi) of all the run's."""
        total = self.progress()
        xs = [s[name] for n, s in self.samples if lo * total <= n < hi * total]
        assert xs, f"no RSS samples while [{lo:.0%}, {hi:.0%}) of the {total} requests were done"
        return sum(xs) / len(xs)


async def clients(addr: str, pool: list, seconds: float, stats: dict) -> dict:
    stop = time.monotonic() + seconds
    async with grpc.aio.insecure_channel(addr) as channel:
        stub = pbg.DecodeStub(channel)

        async def one_client(c: int) -> None:
            i = c
            while time.monotonic() < stop:
                ids, n, mode, want = pool[i % len(pool)]
                i += CLIENTS
                t0 = time.monotonic()
                if i % 7 == 0:  # every 7th request: the client cancels after its first token
                    call = stub.Generate(pb.GenerateRequest(token_ids=ids, max_new_tokens=200, mode=mode), timeout=60)
                    async for _ in call:
                        break
                    call.cancel()
                    stats["cancelled"] += 1
                    continue
                try:
                    got = [m.token_id async for m in stub.Generate(
                        pb.GenerateRequest(token_ids=ids, max_new_tokens=n, mode=mode), timeout=60)]
                except grpc.aio.AioRpcError as e:
                    if e.code() == grpc.StatusCode.RESOURCE_EXHAUSTED:
                        stats["exhausted"] += 1
                    else:
                        stats["lost"].append(f"{len(ids)} tokens: {e.code().name} {e.details()}")
                    continue
                if got != want:
                    stats["lost"].append(f"{len(ids)} tokens: wrong tokens {got} != {want}")
                else:
                    stats["ok"] += 1
                    stats["latency_ms"].append((time.monotonic() - t0) * 1e3)
        await asyncio.gather(*[one_client(c) for c in range(CLIENTS)])
    return stats


def test_soak(tmp_path, tiny_fp32, record_property):
    seconds = float(os.environ.get("KVT_SOAK_SECONDS", "25"))
    pool = []
    for k, n in enumerate(LENGTHS * 2):
        ids = random_prompt(512, n, seed=1000 + k).view(-1).tolist()
        new = 2 + k % 5
        for turn in range(TURNS):  # a client sends a conversation's turns in order (its requests run in order)
            tokens = engine_generate(tiny_fp32, ids, new)[0]
            pool.append((ids, new, MODES[(k + turn) % len(MODES)], tokens))
            ids = ids + tokens + random_prompt(512, USER, seed=2000 + 10 * k + turn).view(-1).tolist()
    # a cancelled call's handler may outlive it by a moment: room for that, so no refusal is expected
    with Pair(tmp_path, "gloo", prefix_cache=True,
              decode_args=["--max-batch", str(CLIENTS), "--max-inflight", str(2 * CLIENTS),
                           "--host-cache-gib", str(HOST_GIB)]) as pair:
        pair.start()
        stats = {"ok": 0, "exhausted": 0, "cancelled": 0, "lost": [], "latency_ms": []}
        rss = RssSampler({"prefill": pair.prefill.proc.pid, "decode": pair.decode.proc.pid},
                         lambda: stats["ok"] + stats["cancelled"] + stats["exhausted"] + len(stats["lost"]))
        asyncio.run(clients(pair.addr, pool, seconds, stats))
        rss.done.set()
        rss.join()
        assert not stats["lost"], f"{len(stats['lost'])} lost, e.g. {stats['lost'][:3]}\n{pair.log_text()}"
        assert stats["exhausted"] == 0
        flat = {}  # the requests [30%, 50%) against the last 20%, after a warm-up of the first 30%
        for name in ("prefill", "decode"):
            first, last = rss.mean(name, 0.3, 0.5), rss.mean(name, 0.8, 1.01)
            flat[name] = round(last / first - 1, 4)
            assert abs(last / first - 1) <= 0.05, f"{name} RSS {first:.0f} -> {last:.0f} KiB"
        lat = sorted(stats["latency_ms"])
        d = pair.metrics("decode")
        assert value(d, "kvt_requests_total", outcome="OK") == stats["ok"] and stats["cancelled"] > 0
        assert_no_leaks(pair)  # includes every KV pool slot given back
        d = pair.metrics("decode")
        hits = {t: value(d, "kvt_prefix_hits_total", tier=t) for t in ("device", "host")}
        assert hits["device"] > 0 and hits["host"] > 0, hits  # both tiers served turns
        assert 0 < value(d, "kvt_prefix_cached_slots") <= CLIENTS
        assert 0 < value(d, "kvt_prefix_host_bytes") <= HOST_GIB * 2**30
        figures = {"seconds": seconds, "clients": CLIENTS, "ok": stats["ok"], "cancelled": stats["cancelled"], "rps": round(stats["ok"] / seconds, 1),
                   "p50_ms": round(lat[len(lat) // 2], 1), "p99_ms": round(lat[int(len(lat) * 0.99)], 1),
                   "rss_change": flat, "prefix_hits": hits, "rss_mib": {k: round(v / 1024) for k, v in rss.samples[-1][1].items()}}
        record_property("soak", figures)
        print(f"SOAK {figures}")
