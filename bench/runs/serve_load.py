"""One `serve` load against one server: its prompts, the schedule that sends them, and the result of the run.

Why apart from the command (bench/runs/serve.py, which parses the flags and runs one load, or a sweep of them, with
the roofline beside it): this is the part every run shares, the sweep's and the single run's, and the multi-turn
run's config (serve_config.py) is checked before any of it. The prompts are random token ids (uniform in the
server's vocabulary, lengths uniform in input_len x [1 - r, 1 + r], a share of long ones, an optional shared
opening); the schedule is the warm-up, then every prompt at most `concurrency` in flight and/or as Poisson arrivals,
within one wall-clock budget; the result carries vLLM's keys (serve_figures.py).
"""

from __future__ import annotations

import asyncio
import math
import time
from collections import Counter
from dataclasses import asdict

import numpy as np

from bench.common import Step
from bench.measure import pool_report, serve_figures
from bench.measure.serve_doors import grpc_door, http_door
from bench.measure.serve_figures import by_length, summary, sustained, ttft_and_itl
from bench.measure.serve_metrics import BatchWatch
from bench.runs.serve_config import ServeConfig

METRICS = ("ttft", "tpot", "itl", "e2el")
PERCENTILES = serve_figures.PERCENTILES  # the pNN keys of every metric


def make_prompts(cfg: ServeConfig) -> list[list[int]]:
    rng = np.random.default_rng(cfg.seed)
    lo, hi = cfg.short_lengths()
    lens = rng.integers(lo, hi + 1, cfg.num_prompts)
    if cfg.long_share > 0:  # its own stream: without long prompts the prompts stay those of earlier runs
        pick = np.random.default_rng([cfg.seed, 1])
        long_ = pick.random(cfg.num_prompts) < cfg.long_share
        lens[long_] = pick.integers(cfg.long_len[0], cfg.long_len[1] + 1, int(long_.sum()))
    prompts = [rng.integers(0, cfg.vocab_size, int(n)).tolist() for n in lens]
    if cfg.shared_prefix:  # its own stream: the prompts after the opening stay those of a run without it
        opening = np.random.default_rng([cfg.seed, 2]).integers(0, cfg.vocab_size, cfg.shared_prefix).tolist()
        prompts = [opening + p for p in prompts]
    return prompts


def client_ends(cfg: ServeConfig, n: int) -> list[int | None]:
    """With --stop-after LO,HI: after how many tokens each prompt's client ends its request (uniform in [LO, HI],
    its own stream of the seed); else None each (the request runs to --output-len)."""
    if cfg.stop_after is None:
        return [None] * n
    lo, hi = cfg.stop_after
    return np.random.default_rng([cfg.seed, 3]).integers(lo, hi + 1, n).tolist()


async def _run(cfg: ServeConfig, prompts: list[list[int]], step: Step, metadata, watch=None
               ) -> tuple[list[dict], float, list]:
    async with (http_door if cfg.api else grpc_door)(cfg, metadata) as send:
        for i in range(cfg.warmup):
            w = await send(prompts[0], cfg.timeout_s)
            step(f"warm-up {i + 1}")
            if w["code"]:
                return [], 0.0, [f"warm-up request failed: {w['code']}: {w['error']}"]
        if watch is not None:  # the server's figures count from here: the warm-up's steps are no part of the run
            await asyncio.to_thread(watch.restart)
        rng = np.random.default_rng(cfg.seed + 1)
        gaps = rng.exponential(1 / cfg.request_rate, len(prompts)) if math.isfinite(cfg.request_rate) else None
        limit = asyncio.Semaphore(cfg.concurrency or len(prompts))
        start = time.perf_counter()
        deadline = start + cfg.max_duration_s

        async def limited(ids: list[int], end: int | None) -> dict | None:
            async with limit:
                left = deadline - time.perf_counter()
                if left <= 0:
                    return None  # the run's budget is spent: not sent
                res = await (send(ids, min(cfg.timeout_s, left)) if end is None else
                             send(ids, min(cfg.timeout_s, left), stop_after=end))
                step(f"requests ({res['code'] or 'ok'})")
                return res

        tasks = []
        sampler = asyncio.create_task(watch.sample(start)) if watch else None
        for i, (ids, end) in enumerate(zip(prompts, client_ends(cfg, len(prompts)))):
            if gaps is not None and i:
                await asyncio.sleep(gaps[i])
            if time.perf_counter() >= deadline:
                break  # the rest are not sent
            tasks.append(asyncio.create_task(limited(ids, end)))
        results = await asyncio.gather(*tasks)
        if sampler is not None:
            sampler.cancel()
        return results, time.perf_counter() - start, []


def run_serve(cfg: ServeConfig, step: Step = lambda _: None, metadata=None) -> dict:
    """`metadata`: call metadata such as the bearer token (kept out of the result)."""
    prompts = make_prompts(cfg)
    about = before = None
    if not cfg.api and (cfg.memory_pressure or cfg.shared_prefix or cfg.stop_after):  # the pool's record (the gRPC door's server)
        about, before = pool_report.info(cfg.addr, metadata), pool_report.load(cfg.addr, metadata)
        if cfg.memory_pressure:
            cfg = pool_report.pressed(cfg, prompts, about)
    watch = BatchWatch(cfg.server_metrics) if cfg.server_metrics else None
    try:
        import uvloop
        runner = asyncio.Runner(loop_factory=uvloop.new_event_loop)
    except ImportError:
        runner = asyncio.Runner()
    with runner:
        results, duration, failures = runner.run(_run(cfg, prompts, step, metadata, watch))
    result = serve_result(cfg, prompts, results, duration, failures, watch)
    if about is not None:
        done = [r for r in results if r is not None and r["code"] is None]
        after = pool_report.settled(cfg.addr, about.max_batch, metadata)  # every ended request's row given back
        result["pool"] = pool_report.report(cfg, prompts, about, before, after, done)
    return result


def config_record(cfg: ServeConfig) -> dict:
    """The config as the result records it (an infinite request rate as "inf": result.json holds no inf)."""
    return asdict(cfg) | {"request_rate": cfg.request_rate if math.isfinite(cfg.request_rate) else "inf"}


def serve_result(cfg: ServeConfig, prompts: list[list[int]], results: list, duration: float, failures: list[str],
                 watch=None) -> dict:
    """The run's result from its request records (none: a run that stopped before any, its `failures` say why)."""
    sent = [r for r in results if r is not None]
    done = [r for r in sent if r["code"] is None]
    codes = Counter(r["code"] for r in sent if r["code"])
    t_in = sum(r["input_len"] for r in done)
    t_out = sum(len(r["times"]) for r in done)
    ttft, itl = ttft_and_itl(done)
    e2el = [r["times"][-1] for r in done]
    tpot = [(r["times"][-1] - r["times"][0]) / (len(r["times"]) - 1) for r in done if len(r["times"]) > 1]
    not_sent = len(prompts) - len(sent) if results else 0
    if codes:
        failures.append(f"{sum(codes.values())} requests failed: {dict(codes)}")
    if not_sent:
        failures.append(f"{not_sent} requests not sent: the {cfg.max_duration_s:g} s budget ran out")
    config = config_record(cfg)
    rate = config["request_rate"]
    result = {"kind": "serve", "ok": not failures, "failures": failures, "config": config,
              "num_prompts": cfg.num_prompts, "request_rate": rate, "max_concurrency": cfg.concurrency,
              "duration": duration, "completed": len(done), "failed": sum(codes.values()),
              "failed_by_code": dict(codes), "not_sent": not_sent,
              "total_input_tokens": t_in, "total_output_tokens": t_out,
              "request_throughput": len(done) / duration if duration else None,
              "output_throughput": t_out / duration if duration else None,
              "total_token_throughput": (t_in + t_out) / duration if duration else None,
              "modes_ran": dict(Counter(r["mode"] for r in done)),
              "errors": sorted({f"{r['code']}: {r['error']}" for r in sent if r["code"]})[:10],
              "input_lens": [r["input_len"] for r in done], "output_lens": [len(r["times"]) for r in done]}
    for name, xs in zip(METRICS, (ttft, tpot, itl, e2el)):
        result |= summary(xs, name)
    result |= sustained(sent, cfg.concurrency if not math.isfinite(cfg.request_rate) else 0)
    if cfg.long_share > 0:
        result["by_length"] = by_length(done, cfg.long_len[0])
    if watch is not None:
        result["server_batch"] = watch.report()
    return result


def total_steps(cfg: ServeConfig) -> int:
    return cfg.warmup + cfg.num_prompts

