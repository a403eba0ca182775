"""What the decode server's KV pool did over a `serve` run: its size, the load against it, preemptions, sharing.

Why: preemption (docs/paging.md, issue #38) runs only when the requests in flight need more blocks than the pool
holds, and blocks are shared only when prompts start with one cached opening (docs/prefix-cache.md). A load sized
by hand to a server's pool stops pressing it as soon as the pool's flags change, so `--memory-pressure F` asks the
server its pool (Info: kv_blocks x kv_block_tokens) and sizes the concurrency to F times it; `--shared-prefix N`
opens every prompt with one N-token opening. Either way the run reports, from the server's Load before and after:
the preemptions it made, the blocks shared at the end, and from the requests' Timing the prompt tokens reused.
"""

from __future__ import annotations

import dataclasses
import math
import time

import grpc
import numpy as np

from proto import kvtransfer_pb2 as pb
from proto import kvtransfer_pb2_grpc as pbg


def _stub_call(addr: str, method: str, request, metadata):
    with grpc.insecure_channel(addr) as ch:
        return getattr(pbg.DecodeStub(ch), method)(request, timeout=10, metadata=metadata)


def info(addr: str, metadata=None) -> pb.InfoResponse:
    return _stub_call(addr, "Info", pb.InfoRequest(), metadata)


def load(addr: str, metadata=None) -> pb.LoadResponse:
    return _stub_call(addr, "Load", pb.LoadRequest(), metadata)


def settled(addr: str, rows: int, metadata=None, timeout_s: float = 10.0, poll_s: float = 0.05) -> pb.LoadResponse:
    """The server's Load once no request holds anything: none running or waiting, and all `rows` rows unleased
    (cached rows count as free). Or, after `timeout_s`, the last Load read.

    Why wait: a stream the client ends (`--stop-after`) is over for the client at once, but the server gives its row
    and blocks back on its next pass, after the step in flight that holds them; a Load read right after the run
    could still count them as held (CI run 61: 8 of 24 blocks)."""
    deadline = time.monotonic() + timeout_s
    while True:
        now = load(addr, metadata)
        if (now.free_slots >= rows and not now.running_requests and not now.waiting_requests) \
                or time.monotonic() >= deadline:
            return now
        time.sleep(poll_s)


def pool_tokens(about: pb.InfoResponse) -> int:
    """The positions the whole pool holds (the slot layout: its slots of --max-seq-len)."""
    return about.kv_blocks * about.kv_block_tokens


def pressed(cfg, prompts: list[list[int]], about: pb.InfoResponse):
    """`cfg` with its concurrency sized so that the requests in flight need `cfg.memory_pressure` times the pool's
    positions at their end (each its prompt and --output-len), at most every prompt; a --concurrency given stays."""
    if cfg.concurrency is not None:
        return cfg
    need = float(np.mean([len(p) for p in prompts])) + cfg.output_len
    return dataclasses.replace(cfg, concurrency=min(len(prompts), max(1, math.ceil(
        cfg.memory_pressure * pool_tokens(about) / need))))


def report(cfg, prompts: list[list[int]], about: pb.InfoResponse, before: pb.LoadResponse,
           after: pb.LoadResponse, done: list[dict]) -> dict:
    """The result's `pool` record: the pool, the load over it, preemptions over the run, blocks shared at its end,
    and the prompt tokens the requests reused (their Timing; the gRPC door only)."""
    in_flight = cfg.concurrency or len(prompts)
    need = (float(np.mean([len(p) for p in prompts])) + cfg.output_len) * min(in_flight, len(prompts))
    reused = [r["timing"].reused_tokens for r in done if r.get("timing") is not None]
    return {"blocks": about.kv_blocks, "block_tokens": about.kv_block_tokens, "tokens": pool_tokens(about),
            "rows": about.max_batch, "concurrency": cfg.concurrency, "load_over_pool": need / pool_tokens(about),
            "preemptions": after.preemptions - before.preemptions, "shared_blocks_after": after.shared_blocks,
            "cached_blocks_after": after.cached_blocks, "free_blocks_after": after.free_blocks,
            "shared_prefix": cfg.shared_prefix, "reused_tokens_mean": float(np.mean(reused)) if reused else None,
            "requests_reusing": sum(1 for n in reused if n > 0)}
