"""Preemption (issue #38) in real server processes (CPU, tiny): a pair whose decode worker's pool is a few blocks.

What is claimed (and tested here), on one pair (gRPC data plane; --kv-block-tokens 8, a pool of 24 blocks, 16 rows):
- 16 requests at once, colocated and disaggregated, greedy and seeded, each growing to 6-7 blocks: every one
  completes with the tokens it makes alone (one at a time on the same pair, never preempted), nothing repeated or
  lost, its stream's indices 0, 1, ... with no gap or repeat across a resume, no error; requests were preempted
  (Load.preemptions, kvt_preemptions_total{how="recompute"}), colocated and disaggregated ones alike (each is
  recomputed on the decode worker);
- every block is back in the pool (Load) after that burst, after a request cancelled and one past its deadline
  under the same pressure, and after a peer failure (a held transfer past --peer-timeout-s).
Nothing asserts a duration: waits are bounds that turn a hang into a failure.
"""

from __future__ import annotations

import asyncio
import re
import time
import urllib.request

import grpc
import pytest

from decode_server.client import MODES as WIRE_MODES, generate, sampling_message
from kvtransfer.model.prefill import random_prompt
from proto import kvtransfer_pb2 as pb
from proto import kvtransfer_pb2_grpc as pbg
from support.cancel import cancel_after
from support.servers import colocated_server, free_port, server_pair

PAGE, BLOCKS, ROWS, NEW = 8, 24, 16, 44
TINY_BYTES_PER_TOKEN = 1024  # tiny fp32: 4 layers x K,V x 2 heads x 16 dims x 4 B
POOL = ["--kv-block-tokens", str(PAGE), "--kv-pool-gib", repr(BLOCKS * PAGE * TINY_BYTES_PER_TOKEN / 2**30),
        "--max-batch", str(ROWS)]
MODES = ["colocated", "bulk", "layerwise", "colocated"]
BOUND_S = 120.0


def prompts(vocab: int) -> list[list[int]]:
    return [random_prompt(vocab, 6 + i % 7, seed=200 + i).view(-1).tolist() for i in range(16)]


def seeded(i: int) -> pb.Sampling | None:
    return sampling_message(0.8, 0.95, 0, 9000 + i) if i % 3 == 0 else None


def load(addr: str) -> pb.LoadResponse:
    with grpc.insecure_channel(addr) as ch:
        return pbg.DecodeStub(ch).Load(pb.LoadRequest(), timeout=10)


def settled(addr: str) -> pb.LoadResponse:
    """Load once nothing runs or waits and every block is free or cached (ends are asynchronous), or the last one
    after BOUND_S (the assert that follows then fails)."""
    end = time.monotonic() + BOUND_S
    while True:
        out = load(addr)
        if out.running_requests == out.waiting_requests == 0 and out.free_blocks + out.cached_blocks == BLOCKS:
            return out
        if time.monotonic() > end:
            return out
        time.sleep(0.05)


def preemptions_counted(port: int, how: str = "recompute") -> float:
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
    found = re.search(rf'^kvt_preemptions_total\{{how="{how}"\}} (\S+)$', text, re.M)
    return float(found.group(1)) if found else 0.0


def wait_line(path: str, text: str) -> None:
    end = time.monotonic() + BOUND_S
    while True:
        with open(path) as f:
            if text in f.read():
                return
        assert time.monotonic() < end, f"never logged: {text}"
        time.sleep(0.1)


async def indexed(addr: str, p: list[int], new: int, mode: str, sampling) -> tuple[list[int], list[int]]:
    """One Generate call: its tokens and each message's index (client.generate keeps only the tokens)."""
    async with grpc.aio.insecure_channel(addr) as ch:
        req = pb.GenerateRequest(token_ids=p, max_new_tokens=new, mode=WIRE_MODES[mode], sampling=sampling)
        out = [(m.token_id, m.index) async for m in pbg.DecodeStub(ch).Generate(req, timeout=BOUND_S)]
    return [t for t, _ in out], [i for _, i in out]


async def code_of(coro) -> str:
    try:
        await coro
    except grpc.aio.AioRpcError as e:
        return e.code().name
    return "OK"


@pytest.fixture(scope="module")
def vocab():
    return 512


def test_a_pool_of_a_few_blocks_serves_16_requests_at_once_and_gives_every_block_back(tmp_path, vocab):
    port = free_port()
    ps = prompts(vocab)
    with server_pair(tmp_path, prefill_args=["--transport", "grpc", "--fail-after-layers", "1", "--fail-stall-s", "10"],
                     decode_args=["--transport", "grpc", *POOL, "--peer-timeout-s", "8", "--metrics-port",
                                  str(port)]) as run:
        addr = run.addr
        # a peer failure first (the prefill worker holds the first transfer past --peer-timeout-s)
        assert asyncio.run(code_of(generate(addr, ps[0], 4, "bulk", timeout=60))) == "UNAVAILABLE"
        assert settled(addr).free_blocks == BLOCKS
        wait_line(run.logs[0], "transfer released")  # prefill.log: the held transfer went on

        alone = [asyncio.run(generate(addr, p, NEW, MODES[i % 4], sampling=seeded(i), timeout=BOUND_S))["tokens"]
                 for i, p in enumerate(ps)]
        assert load(addr).preemptions == 0  # a request alone always fits

        async def burst():
            return await asyncio.gather(*(indexed(addr, p, NEW, MODES[i % 4], seeded(i))
                                          for i, p in enumerate(ps)))
        runs = asyncio.run(burst())
        together = [tokens for tokens, _ in runs]
        assert together == alone  # every token, none repeated or lost, greedy and seeded
        assert [indices for _, indices in runs] == [list(range(NEW))] * len(ps)  # continued across a resume
        after = settled(addr)
        assert after.preemptions > 0 and after.free_blocks == BLOCKS and after.free_slots == ROWS
        assert preemptions_counted(port) == after.preemptions

        async def pressed_cancel_and_deadline():
            others = [asyncio.create_task(generate(addr, p, NEW, MODES[i % 4], timeout=BOUND_S))
                      for i, p in enumerate(ps[2:])]
            end = time.monotonic() + BOUND_S
            while not (await asyncio.to_thread(load, addr)).queued_requests:  # the pool is full: requests wait
                assert time.monotonic() < end
            late = await code_of(generate(addr, ps[0], 150, "colocated", timeout=0.2))
            cancel = await cancel_after(addr, ps[1], NEW * 2)
            done = await asyncio.gather(*others)
            return late, cancel, [r["tokens"] for r in done]
        late, cancel, rest = asyncio.run(pressed_cancel_and_deadline())
        assert late == "DEADLINE_EXCEEDED" and cancel == "CANCELLED"
        assert [len(t) for t in rest] == [NEW] * len(ps[2:])
        final = settled(addr)
        assert final.free_blocks == BLOCKS and final.free_slots == ROWS and final.preemptions >= after.preemptions


HOST_GIB = 16 * 256 * TINY_BYTES_PER_TOKEN / 2**30  # 16 host-tier pages of 256 tokens


def test_with_the_host_tier_preempted_requests_are_swapped_and_make_what_they_make_alone(tmp_path, vocab):
    """A colocated server with the prefix cache and a host tier (on CPU the break-even rule measured at start says
    reload): the same 16 requests at once, then each alone (in that order: the alone runs' cached contexts are
    never what a resumed request reloads); preempted contexts go to the host tier and come back whole, and every
    request makes the tokens it makes alone. Every block is free or cached after. Then 4 prompts over one cached
    opening hold its blocks once (Load.shared_blocks)."""
    port = free_port()
    ps = prompts(vocab)
    with colocated_server(tmp_path, args=[*POOL, "--host-cache-gib", repr(HOST_GIB), "--metrics-port", str(port)],
                          prefix_cache=True) as run:
        addr = run.addr

        async def burst():
            return await asyncio.gather(*(generate(addr, p, NEW, sampling=seeded(i), timeout=BOUND_S)
                                          for i, p in enumerate(ps)))
        together = [r["tokens"] for r in asyncio.run(burst())]
        after = settled(addr)
        assert after.free_blocks + after.cached_blocks == BLOCKS and after.free_slots == ROWS
        assert preemptions_counted(port, "swap") > 0
        assert preemptions_counted(port, "swap") + preemptions_counted(port, "recompute") == after.preemptions
        alone = [asyncio.run(generate(addr, p, NEW, sampling=seeded(i), timeout=BOUND_S))["tokens"]
                 for i, p in enumerate(ps)]
        assert together == alone
        assert load(addr).preemptions == after.preemptions

        # a shared opening: 8 full blocks cached once, then 4 requests over it take them by reference (each adds
        # one block of its own); kept, their contexts still share them: 13 blocks where copies would need 45
        opening = random_prompt(vocab, 64, seed=77).view(-1).tolist()
        asyncio.run(generate(addr, opening + [1], 4, timeout=BOUND_S))

        async def over_the_opening():
            return await asyncio.gather(*(generate(addr, opening + [10 + i] * 3, 4, timeout=BOUND_S)
                                          for i in range(4)))
        reused = [r["timing"].get("reused_tokens") for r in asyncio.run(over_the_opening())]
        assert reused == [64] * 4
        shared = settled(addr)
        assert shared.shared_blocks == 8 and shared.free_blocks + shared.cached_blocks == BLOCKS
