"""Continuous batching in the decode server, in real processes on CPU (tiny preset).

Structural checks, never timed asserts: a short request that arrives behind a long one finishes
first (no head-of-line blocking), a full pool with --admission-wait-s set refuses with the flag to
raise (the admission queue itself: test_admission.py), a cancelled or abandoned request gives its
slot back, a client that never reads holds nobody up.
"""

from __future__ import annotations

import asyncio
import math
import re
import time
import urllib.request

import grpc
import pytest

from decode_server.client import generate
from kvtransfer.model.prefill import random_prompt
from proto import kvtransfer_pb2 as pb
from proto import kvtransfer_pb2_grpc as pbg
from support.servers import colocated_server, free_port, server_pair

LONG, SHORT = random_prompt(512, 3000, seed=1)[0].tolist(), [5, 6, 7, 8]


def scrape(port: int, name: str) -> float:
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
    m = re.search(rf"^{name} (\S+)$", text, re.M)
    return float(m.group(1)) if m else float("nan")


async def finish_order(addr: str) -> list[str]:
    """The long request (3,000-token prompt, 300 new tokens), then 0.3 s later the short one: who ends first."""
    done = []

    async def one(name, ids, n, delay):
        await asyncio.sleep(delay)
        await generate(addr, ids, n, "auto", timeout=120)
        done.append(name)
    await asyncio.gather(one("long", LONG, 300, 0), one("short", SHORT, 4, 0.3))
    return done


@pytest.fixture(scope="module")
def colocated(tmp_path_factory):
    """A colocated server with a metrics port and room for LONG, for the tests that only need one serving (each
    start is ~10 s of a CI core): (run, metrics port)."""
    port = free_port()
    with colocated_server(tmp_path_factory.mktemp("colocated"),
                          args=["--max-seq-len", "3400", "--metrics-port", str(port)]) as run:
        yield run, port


@pytest.mark.parametrize("arm", ["colocated", "colocated-mixed", "pair"])
def test_short_request_is_not_stuck_behind_a_long_one(request, tmp_path, arm):
    if arm == "colocated":
        run, _ = request.getfixturevalue("colocated")
        assert asyncio.run(finish_order(run.addr)) == ["short", "long"]
        return
    args = ["--max-seq-len", "3400"] + (["--prefill-chunk", "512", "--mixed-prefill"] if arm.endswith("mixed") else [])
    ctx = server_pair(tmp_path, decode_args=args) if arm == "pair" else colocated_server(tmp_path, args=args)
    with ctx as run:
        assert asyncio.run(finish_order(run.addr)) == ["short", "long"]


async def _refused_beside_a_hog(addr: str, port: int, timeout: float) -> grpc.aio.AioRpcError:
    """A hog takes the only slot; the error of a request sent then (client deadline `timeout`); the hog cancelled."""
    hog = asyncio.create_task(generate(addr, SHORT, 3000, timeout=120))
    while scrape(port, "kvt_kv_pool_slots_used") < 1:
        await asyncio.sleep(0.05)
    with pytest.raises(grpc.aio.AioRpcError) as e:
        await generate(addr, SHORT, 4, timeout=timeout)
    hog.cancel()
    return e.value


def test_full_pool_waits_then_refuses_naming_the_flag(tmp_path):
    port = free_port()
    with colocated_server(tmp_path, args=["--max-batch", "1", "--admission-wait-s", "0.3", "--metrics-port",
                                          str(port)]) as run:
        err = asyncio.run(_refused_beside_a_hog(run.addr, port, timeout=30))
        assert err.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and "--max-batch" in err.details()
        deadline = time.monotonic() + 10
        while scrape(port, "kvt_kv_pool_slots_used") != 0 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert scrape(port, "kvt_kv_pool_slots_used") == 0  # the cancelled hog gave its slot back
        assert len(asyncio.run(generate(run.addr, SHORT, 4, timeout=30))["tokens"]) == 4


def test_client_that_never_reads_holds_nobody_up(tmp_path):
    """One stream opened and never read (3,000 tokens to make), another request meanwhile: it completes."""
    port = free_port()
    with colocated_server(tmp_path, args=["--metrics-port", str(port), "--stream-buffer-tokens", "64"]) as run:
        async def scenario():
            async with grpc.aio.insecure_channel(run.addr) as ch:
                stalled = pbg.DecodeStub(ch).Generate(pb.GenerateRequest(token_ids=SHORT, max_new_tokens=3000),
                                                      timeout=60)
                await stalled.initial_metadata()
                got = await generate(run.addr, SHORT, 8, timeout=30)
                # still open (its tokens sit in flow-control windows), or ended for not reading: never in the way
                ended = stalled.done() and await stalled.code()
                stalled.cancel()
                return got, ended
        got, ended = asyncio.run(scenario())
        assert len(got["tokens"]) == 8 and ended in (False, grpc.StatusCode.RESOURCE_EXHAUSTED)
        deadline = time.monotonic() + 10
        while scrape(port, "kvt_kv_pool_slots_used") != 0 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert scrape(port, "kvt_kv_pool_slots_used") == 0


def test_batch_size_is_reported(colocated):
    """On the module's colocated server: the steps of these six requests (the histogram's growth over them)."""
    run, port = colocated

    def histogram() -> tuple[float, float]:
        steps, rows = scrape(port, "kvt_decode_batch_size_count"), scrape(port, "kvt_decode_batch_size_sum")
        return (0.0, 0.0) if math.isnan(steps) else (steps, rows)  # nan: no step yet

    async def many():
        await asyncio.gather(*[generate(run.addr, SHORT + [i], 40, timeout=60) for i in range(6)])
    steps0, rows0 = histogram()
    asyncio.run(many())
    steps1, rows1 = histogram()
    steps, rows = steps1 - steps0, rows1 - rows0
    assert steps > 0 and rows / steps > 1  # some steps advanced several requests
