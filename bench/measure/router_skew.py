"""The router's skew workload: a few long generations among many short ones, arriving together, and how evenly
the decode workers' running tokens are spread while they run (issue #28: within +-25% of each other).

Why this shape: round robin places by arrival order alone, so long requests on alternating arrival positions
all land on one worker of two, which then decodes every long context while the other idles once its short
requests are done. A placement that reads load (kvtransfer-router's least_loaded) should split them. The prompts
are all alike in length, so what tells a long request from a short one is its max_new_tokens alone.

Why a 5 ms gap between arrivals: requests started at the same instant on one channel reach the router's handlers
in no fixed order, and round robin's stacking depends on the order; 5 ms apart, they arrive as sent, and the
32 of them still arrive within one default --load-poll-s.

Why 200-token prompts: a long request's running tokens are its prompt plus what it has generated so far, so they
grow at its worker's speed; on shared cores (the router, the client and other tests beside the workers) one
worker may decode a third slower than the other, and that shows as imbalance whatever the placement. A longer
prompt makes that part smaller; 200 + 300 stays under 512 tokens of context, where this CPU's decode step is
cheap.

Two figures per run, from the same samples: `running_tokens` (Load.running_tokens: the KV the running requests
hold now; the issue's figure), and `footprint_tokens` (running_tokens + remaining_tokens: what they hold now plus
what they may still generate, i.e. prompt + max_new_tokens of each running request). The footprint is what
placement decides and nothing else moves: the workers' speeds change only when a request ends, not how much it
counts while it runs; so it is the figure a test can hold to +-25 % on a loaded machine.

Why the median: each sample's imbalance is |a - b| / mean(a, b) of the two workers' figures, over the samples
taken while the run is on (either worker running). Its tail is noise whichever the placement: one worker finishes
its long requests a little before the other, and those last samples read 200 %. The median over the run ignores
a tail shorter than half the run and still reads round robin's stacking (most of the run: one worker decoding,
the other idle). The mean, the 90th percentile and the share of samples within 25 % are reported beside it.
"""

from __future__ import annotations

import asyncio
import random
import statistics
import time

import grpc

from proto import kvtransfer_pb2 as pb
from proto import kvtransfer_pb2_grpc as pbg

WORKER_KEY = "kvt-worker"
LONGS, SHORTS, LONG_NEW, SHORT_NEW, PROMPT = 4, 28, 300, 4, 200
TOLERANCE = 0.25
GAP_S = 0.005  # between two arrivals: the whole burst arrives within 0.2 s, one --load-poll-s, in a known order


def skew_requests(longs: int = LONGS, shorts: int = SHORTS, long_new: int = LONG_NEW, short_new: int = SHORT_NEW,
                  prompt: int = PROMPT, seed: int = 0) -> list[tuple[list[int], int]]:
    """(prompt ids, max_new_tokens) in arrival order: the long ones at positions 0, 2, 4, ..., the rest short."""
    rng = random.Random(seed)
    out = []
    for i in range(longs + shorts):
        long = i % 2 == 0 and i // 2 < longs
        out.append(([rng.randrange(3, 500) for _ in range(prompt)], long_new if long else short_new))
    return out


async def _sample(workers: list[str], every_s: float, done: asyncio.Event
                  ) -> list[tuple[float, list[tuple[int, int]]]]:
    """(monotonic s, [(running_tokens, remaining_tokens) of each worker]) every `every_s` until `done`."""
    channels = [grpc.aio.insecure_channel(a) for a in workers]
    stubs = [pbg.DecodeStub(c) for c in channels]
    out = []
    try:
        while not done.is_set():
            loads = await asyncio.gather(*[s.Load(pb.LoadRequest(), timeout=5) for s in stubs])
            out.append((time.monotonic(), [(int(x.running_tokens), int(x.remaining_tokens)) for x in loads]))
            try:
                await asyncio.wait_for(done.wait(), every_s)
            except asyncio.TimeoutError:
                pass
    finally:
        for c in channels:
            await c.close()
    return out


async def run_skew(router: str, workers: list[str], requests=None, every_s: float = 0.02, gap_s: float = GAP_S,
                   timeout_s: float = 120.0, in_order: bool = False) -> dict:
    """Send `requests` (default: skew_requests()) through `router`, one every `gap_s`, and sample the workers'
    running tokens until the last one ends. Returns the samples, each request's worker and outcome, and the
    figures. in_order: each request is sent once the one before has its first token (the router's initial
    metadata, sent once it placed it), so the router places them in arrival order however loaded the machine
    (gaps alone do not hold the order on busy cores); the burst then takes one first token per request."""
    requests = requests if requests is not None else skew_requests()
    done = asyncio.Event()
    sampler = asyncio.ensure_future(_sample(workers, every_s, done))
    await asyncio.sleep(every_s * 3)  # a few idle samples first: the run's start is seen
    results = []
    t0 = time.monotonic()
    async with grpc.aio.insecure_channel(router) as channel:
        stub = pbg.DecodeStub(channel)

        started = [asyncio.Event() for _ in requests]  # in_order: request i has its first token

        async def one(i: int, ids: list[int], n: int) -> dict:
            if in_order and i:
                await started[i - 1].wait()
            else:
                await asyncio.sleep(i * gap_s)
            call = stub.Generate(pb.GenerateRequest(token_ids=ids, max_new_tokens=n), timeout=timeout_s)
            try:
                if in_order:
                    try:
                        await call.initial_metadata()
                    finally:
                        started[i].set()
                tokens = [m.token_id async for m in call]
                code = "OK"
            except grpc.aio.AioRpcError as e:
                tokens, code = [], e.code().name
            worker = dict(await call.trailing_metadata() or ()).get(WORKER_KEY, "")
            return {"max_new_tokens": n, "worker": worker, "code": code, "tokens": len(tokens)}

        results = await asyncio.gather(*[one(i, ids, n) for i, (ids, n) in enumerate(requests)])
    seconds = time.monotonic() - t0
    done.set()
    samples = await sampler
    short_new = min((n for _, n in requests), default=0)  # the requests' own short answer, however built
    placed = {w: {"long": sum(1 for r in results if r["worker"] == w and r["max_new_tokens"] > short_new),
                  "short": sum(1 for r in results if r["worker"] == w and r["max_new_tokens"] <= short_new)}
              for w in workers}
    return {"seconds": round(seconds, 2), "requests": len(requests), "codes": sorted({r["code"] for r in results}),
            "placed": placed, "figures": figures(samples), "samples": samples, "results": results}


def figures(samples: list[tuple[float, list[tuple[int, int]]]]) -> dict:
    """Both figures of a run's samples (see the module's docstring)."""
    return {"running_tokens": imbalance([[r for r, _ in s] for _, s in samples]),
            "footprint_tokens": imbalance([[r + left for r, left in s] for _, s in samples])}


async def until_idle(router: str, timeout_s: float = 30.0) -> None:
    """Until the router's Load (its workers' last reports, summed) shows nothing running or waiting: a run starts
    from idle workers, as the router last heard of them (a report from the previous run's tail would skew it)."""
    async with grpc.aio.insecure_channel(router) as channel:
        stub = pbg.DecodeStub(channel)
        deadline = time.monotonic() + timeout_s
        while True:
            load = await stub.Load(pb.LoadRequest(), timeout=5)
            if load.serving and load.running_requests == load.waiting_requests == 0:
                return
            if time.monotonic() > deadline:
                raise TimeoutError(f"the workers behind {router} are still busy after {timeout_s} s: {load}")
            await asyncio.sleep(0.05)


def imbalance(samples: list[list[int]]) -> dict:
    """Per sample with either worker running, |a - b| / mean(a, b) of the two workers' figures; its median, mean,
    90th percentile, the share of samples within TOLERANCE, and each worker's mean figure."""
    on = [s for s in samples if sum(s) > 0]
    if not on:
        return {"samples": 0}
    ratios = sorted(abs(a - b) / ((a + b) / 2) for a, b in on)
    return {"samples": len(on), "median": round(statistics.median(ratios), 3),
            "mean": round(statistics.fmean(ratios), 3), "p90": round(ratios[int(0.9 * (len(ratios) - 1))], 3),
            "within_tolerance": round(sum(r <= TOLERANCE for r in ratios) / len(ratios), 3),
            "mean_tokens": [round(statistics.fmean(s[i] for s in on)) for i in range(2)]}
