"""Multi-turn conversations against the decode server's Generate: the driver of `serve --multi-turn`.

Why conversations: a prefix cache pays off only when a prompt starts with an earlier request's prompt and answer,
which `serve`'s independent random prompts never do; a chat does, since each turn resends the whole conversation
so far plus the user's next message. So conversation c's first prompt is drawn as `serve` draws its prompts (length
uniform in [lo, hi], ids uniform in the vocabulary), and turn k + 1's prompt is turn k's prompt + turn k's answer
exactly as streamed + `user_len` fresh random ids. Each turn is one streamed Generate of exactly `output_len` tokens
(stop_on_eos off), sent as soon as the previous turn ended; at most `concurrency` conversations are in flight. Each
conversation draws from its own generator, seeded (pass seed..., c), so a conversation's ids are the same whatever
order the server answers in, and passes with different seeds share no prefix. A failed turn ends its conversation:
the history a client would resend is not there. Records only; the figures are multiturn_stats.py's.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from dataclasses import dataclass

import grpc
import numpy as np

from bench.measure.serve_doors import stream_record
from proto import kvtransfer_pb2 as pb


@dataclass(frozen=True)
class Load:
    """One pass: `conversations` conversations of `turns` turns each."""
    conversations: int
    turns: int
    first_len: tuple[int, int]      # a first prompt's length: uniform in [lo, hi]
    user_len: int                   # fresh ids after each answer
    output_len: int                 # every turn's answer: max_new_tokens, stop_on_eos off
    vocab_size: int                 # ids uniform in [0, vocab_size)
    seed: tuple[int, ...]           # the pass's; conversation c draws from (*seed, c)
    skip_prefix_cache: bool         # True: the baseline (the server prefills every prompt whole)
    mode: int = pb.MODE_AUTO
    concurrency: int | None = None  # conversations in flight (None: all at once)
    timeout_s: float = 120.0        # one turn
    max_duration_s: float = 600.0   # the pass: after it no turn is sent, and turns in flight end at it


def tier_name(value: int) -> str:
    """Timing.reuse_tier as a short name: none, device, host (a value newer than this bench: tier_<n>)."""
    try:
        return pb.CacheTier.Name(value).removeprefix("CACHE_TIER_").lower()
    except ValueError:
        return f"tier_{value}"


def conversation_rng(load: Load, conv: int) -> np.random.Generator:
    return np.random.default_rng([*load.seed, conv])


def first_prompt(rng: np.random.Generator, load: Load) -> list[int]:
    n = int(rng.integers(load.first_len[0], load.first_len[1] + 1))
    return rng.integers(0, load.vocab_size, n).tolist()


def next_prompt(prompt: list[int], answer: list[int], rng: np.random.Generator, load: Load) -> list[int]:
    """Turn k + 1's prompt: turn k's prompt, its answer as streamed, then the user's next message."""
    return prompt + answer + rng.integers(0, load.vocab_size, load.user_len).tolist()


async def one_turn(stub, ids: list[int], load: Load, timeout: float, metadata) -> dict:
    """One Generate stream: its tokens and their arrival times (s after the request was sent), what the last
    message's Timing says about reuse, or its failure as a status code name (INCOMPLETE: a short stream)."""
    req = pb.GenerateRequest(token_ids=ids, max_new_tokens=load.output_len, mode=load.mode, stop_on_eos=False,
                             skip_prefix_cache=load.skip_prefix_cache)
    out = await stream_record(stub, req, timeout, metadata)
    t = out.pop("timing")
    out.update(reused_tokens=t.reused_tokens if t else 0, reuse_tier=tier_name(t.reuse_tier) if t else "none",
               reload_bytes=t.reload_bytes if t else 0.0)
    return out


async def conversation(send, load: Load, conv: int, deadline: float, step: Callable[[str], None]
                       ) -> tuple[list[dict], int, int]:
    """One conversation's turns, one after another: (records, turns not sent for the time budget, turns dropped
    after a failed one). `send(ids, timeout)` is one turn."""
    rng = conversation_rng(load, conv)
    prompt = first_prompt(rng, load)
    records: list[dict] = []
    for turn in range(1, load.turns + 1):
        left = deadline - time.perf_counter()
        if left <= 0:
            return records, load.turns - turn + 1, 0
        rec = await send(prompt, min(load.timeout_s, left))
        records.append(rec | {"conversation": conv, "turn": turn})
        step(f"turns ({rec['code'] or 'ok'})")
        if rec["code"]:
            return records, 0, load.turns - turn
        prompt = next_prompt(prompt, rec["tokens"], rng, load)
    return records, 0, 0


async def run_pass(stub, load: Load, metadata=None, step: Callable[[str], None] = lambda _: None) -> dict:
    """Every conversation of one pass: their records (turn order within a conversation), the pass's start
    (perf_counter) and duration, and the turns not sent (time budget) or abandoned (after a failure)."""
    limit = asyncio.Semaphore(load.concurrency or load.conversations)
    start = time.perf_counter()
    deadline = start + load.max_duration_s

    async def send(ids: list[int], timeout: float) -> dict:
        return await one_turn(stub, ids, load, timeout, metadata)

    async def limited(conv: int) -> tuple[list[dict], int, int]:
        async with limit:
            return await conversation(send, load, conv, deadline, step)

    outs = await asyncio.gather(*(limited(c) for c in range(load.conversations)))
    return {"records": [r for recs, _, _ in outs for r in recs], "start": start,
            "duration": time.perf_counter() - start, "not_sent": sum(o[1] for o in outs),
            "abandoned": sum(o[2] for o in outs)}


async def server_info(stub, metadata, timeout: float) -> dict:
    """The server's Info (its limits and prefix block), or {"error": "CODE: details"} when it has none."""
    try:
        i = await stub.Info(pb.InfoRequest(), timeout=timeout, metadata=metadata)
    except grpc.aio.AioRpcError as e:
        return {"error": f"{e.code().name}: {e.details() or ''}"}
    return {"model": i.model, "vocab_size": i.vocab_size, "max_seq_len": i.max_seq_len,
            "max_prompt_tokens": i.max_prompt_tokens, "max_new_tokens": i.max_new_tokens,
            "prefix_block_tokens": i.prefix_block_tokens}
