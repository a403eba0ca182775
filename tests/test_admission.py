"""Admission (issue #37), in real processes on CPU: colocated `tiny` decode servers whose KV pool is full.

What is claimed (and tested here): requests that wait for KV memory are served in arrival order, also under
clients that send back to back (the server's admission log, arrival numbers in admission order); a burst of far
more requests than rows is all served (no refusal at a fixed count, no wait cap by default); a full queue
(--max-waiting) refuses at once with RESOURCE_EXHAUSTED naming the flag; a waiter whose deadline passes ends
DEADLINE_EXCEEDED saying it waited for KV memory, and one whose client cancels leaves the queue, and in both cases
the one behind it is served; Load.queued_requests, Info.max_waiting and kvt_waiting_requests say what waits.
The slots are held by long requests ("hogs") that the test cancels; a waiter is sent once Load shows the one
before it waiting, so arrival order is the order sent. Nothing asserts a duration: the waits below are bounds
that turn a hang into a failure.
"""

from __future__ import annotations

import asyncio
import re
import urllib.request

import grpc
import pytest

from decode_server.client import generate
from kvtransfer.model.prefill import random_prompt
from proto import kvtransfer_pb2 as pb
from proto import kvtransfer_pb2_grpc as pbg
from support.servers import colocated_server, free_port

S = grpc.StatusCode
SHORT = [5, 6, 7, 8]
HOG_TOKENS = 3000  # a hog's length: it still runs when the test cancels it
BOUND_S = 60.0  # how long a condition may take to hold before the test fails (a hang, not a slow machine)
ADMITTED = re.compile(r"admission: arrival (\d+) admitted (at once|after waiting)")


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    """Two rows, the default queue, the admission log on: (run, metrics port)."""
    port = free_port()
    with colocated_server(tmp_path_factory.mktemp("admission"), args=[
            "--max-batch", "2", "--log-level", "DEBUG", "--metrics-port", str(port)]) as run:
        yield run, port


async def load(addr: str) -> pb.LoadResponse:
    async with grpc.aio.insecure_channel(addr) as ch:
        return await pbg.DecodeStub(ch).Load(pb.LoadRequest(), timeout=10)


async def until_load(addr: str, cond) -> pb.LoadResponse:
    """Poll Load until `cond(load)` holds (at most BOUND_S: then the test fails)."""
    loop = asyncio.get_running_loop()
    end = loop.time() + BOUND_S
    while not cond(got := await load(addr)):
        assert loop.time() < end, f"Load never reached the state waited for: {got}"
        await asyncio.sleep(0.02)
    return got


def waiting_gauge(port: int) -> float:
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
    return float(re.search(r"^kvt_waiting_requests (\S+)$", text, re.M).group(1))


async def outcome(addr: str, n: int, timeout: float = 120, first: list | None = None, name=None) -> S:
    """One request's final status; `name` goes into `first` when its first token comes."""
    async with grpc.aio.insecure_channel(addr) as ch:
        call = pbg.DecodeStub(ch).Generate(pb.GenerateRequest(token_ids=SHORT, max_new_tokens=n), timeout=timeout)
        try:
            async for _ in call:
                if first is not None and name not in first:
                    first.append(name)
        except grpc.aio.AioRpcError as e:
            return e.code(), e.details()
        return S.OK, ""


async def fill(addr: str, rows: int) -> list[asyncio.Task]:
    """`rows` hogs, each holding a slot (the pool full once Load says so)."""
    hogs = [asyncio.create_task(outcome(addr, HOG_TOKENS)) for _ in range(rows)]
    await until_load(addr, lambda x: x.free_slots == 0 and x.running_requests == rows)
    return hogs


async def send_in_order(addr: str, calls) -> list[asyncio.Task]:
    """Each call started once the ones before it are queued (Load.queued_requests), so the queue holds them in this
    order."""
    tasks = []
    for call in calls:
        tasks.append(asyncio.create_task(call))
        await until_load(addr, lambda x, n=len(tasks): x.queued_requests == n)
    return tasks


def test_waiters_are_served_in_arrival_order(server):
    """Both rows held; six waiters queued one after another; one hog ends, so one row serves them one at a time:
    their first tokens come in the order they arrived."""
    run, _ = server

    async def scenario():
        hogs = await fill(run.addr, 2)
        first = []
        waiters = await send_in_order(run.addr, [outcome(run.addr, 4, first=first, name=i) for i in range(6)])
        hogs[0].cancel()
        codes = await asyncio.gather(*waiters)
        hogs[1].cancel()
        await until_load(run.addr, lambda x: x.running_requests == 0 and x.queued_requests == 0)
        return first, codes
    first, codes = asyncio.run(scenario())
    assert all(c == S.OK for c, _ in codes), codes
    assert first == [0, 1, 2, 3, 4, 5]


def test_back_to_back_clients_are_admitted_in_arrival_order(server):
    """8 clients, each sending its next request once the last ends, 12 each on 2 rows: every request is served,
    most wait, and the server admits them in the order they arrived (its log: arrival numbers, admission order)."""
    run, _ = server
    with open(run.logs[0]) as f:
        f.seek(0, 2)
        start = f.tell()
    prompts = [random_prompt(512, 16, seed=s)[0].tolist() for s in range(96)]

    async def client(c: int) -> list:
        return [(await generate(run.addr, prompts[c * 12 + i], 8, timeout=120))["tokens"] for i in range(12)]

    async def scenario():
        return await asyncio.gather(*(client(c) for c in range(8)))
    served = asyncio.run(scenario())
    assert [len(t) for c in served for t in c] == [8] * 96
    with open(run.logs[0]) as f:
        f.seek(start)
        admitted = ADMITTED.findall(f.read())
    arrivals = [int(a) for a, _ in admitted]
    assert len(arrivals) == 96
    assert arrivals == sorted(arrivals), f"admitted out of arrival order: {arrivals}"
    assert sum(how == "after waiting" for _, how in admitted) >= 24, admitted  # the pool was full most of the time


def test_a_burst_far_over_the_rows_is_all_served(server):
    """96 requests at once on 2 rows (more than the old --max-inflight 64): every one ends OK."""
    run, _ = server

    async def scenario():
        return await asyncio.gather(*(outcome(run.addr, 4) for _ in range(96)))
    codes = asyncio.run(scenario())
    assert [c for c, _ in codes] == [S.OK] * 96, [c for c in codes if c[0] != S.OK][:3]


def test_a_waiter_whose_deadline_passes_leaves_and_the_queue_moves_on(server):
    """Rows held; a waiter with a 4 s deadline, one behind it with 30 s: the first ends DEADLINE_EXCEEDED saying it
    waited for KV memory, the queue is down to one, and once a row frees the second is served."""
    run, _ = server

    async def scenario():
        hogs = await fill(run.addr, 2)
        short, behind = await send_in_order(run.addr, [outcome(run.addr, 4, timeout=4),
                                                       outcome(run.addr, 4, timeout=30)])
        ended = await short
        after = await until_load(run.addr, lambda x: x.queued_requests <= 1)
        hogs[0].cancel()
        served = await behind
        hogs[1].cancel()
        return ended, after.queued_requests, served
    ended, queued_after, served = asyncio.run(scenario())
    assert ended[0] == S.DEADLINE_EXCEEDED and "waited for KV memory" in ended[1], ended
    assert queued_after == 1 and served == (S.OK, ""), (queued_after, served)


def test_a_cancelled_waiter_leaves_the_queue(server):
    """Rows held, two waiters; the first one's client cancels: Load and kvt_waiting_requests drop to one, and the
    other is served once a row frees."""
    run, port = server

    async def scenario():
        hogs = await fill(run.addr, 2)
        gone, behind = await send_in_order(run.addr, [outcome(run.addr, 4), outcome(run.addr, 4)])
        assert waiting_gauge(port) == 2
        gone.cancel()
        await until_load(run.addr, lambda x: x.queued_requests == 1)
        gauge = waiting_gauge(port)
        hogs[0].cancel()
        served = await behind
        hogs[1].cancel()
        await until_load(run.addr, lambda x: x.queued_requests == 0 and x.running_requests == 0)
        return gauge, served
    gauge, served = asyncio.run(scenario())
    assert gauge == 1 and served == (S.OK, ""), (gauge, served)


def test_a_full_queue_refuses_at_once_naming_the_flag(tmp_path):
    """--max-batch 1 --max-waiting 2: the row held and two waiting, a third request is refused RESOURCE_EXHAUSTED
    naming --max-waiting (not queued: it ends while the row is still held); the two are served after, and the
    server serves on."""
    with colocated_server(tmp_path, args=["--max-batch", "1", "--max-waiting", "2"]) as run:
        async def scenario():
            async with grpc.aio.insecure_channel(run.addr) as ch:
                info = await pbg.DecodeStub(ch).Info(pb.InfoRequest(), timeout=10)
            hogs = await fill(run.addr, 1)
            waiters = await send_in_order(run.addr, [outcome(run.addr, 4), outcome(run.addr, 4)])
            refused = await outcome(run.addr, 4)
            still = await load(run.addr)
            hogs[0].cancel()
            served = await asyncio.gather(*waiters)
            return info.max_waiting, refused, still, served, await outcome(run.addr, 4)
        max_waiting, refused, still, served, after = asyncio.run(scenario())
    assert max_waiting == 2
    assert refused[0] == S.RESOURCE_EXHAUSTED and "--max-waiting 2" in refused[1], refused
    assert still.running_requests == 1 and still.queued_requests == 2, still
    assert served == [(S.OK, ""), (S.OK, "")] and after == (S.OK, "")
