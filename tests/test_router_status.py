"""The router passes a worker's own status through (issue #36, item 4), in real processes on CPU: colocated `tiny`
decode workers with room for one request (`--max-inflight 1`), each kept full by a long request sent to it
directly, and routers over them.

Why this matters: a full worker answers RESOURCE_EXHAUSTED, which a caller (and the OpenAI front, as HTTP 429)
backs off on; turned into UNAVAILABLE (HTTP 503) it reads as "the service is down". The router retries a
RESOURCE_EXHAUSTED once on another worker (its retry rule); with no other worker, or when the other is full too,
the caller gets the worker's status and words, naming the worker(s).
"""

from __future__ import annotations

import asyncio

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from bench.measure.launch import free_port, stop, wait_serving
from proto import kvtransfer_pb2 as pb
from proto import kvtransfer_pb2_grpc as pbg
from support.faultkit import Half

S = grpc.StatusCode
KEY = "kvt-worker"
START_S = 120.0
HOLD_TOKENS = 4000  # the held request's length: it still runs while the test's calls are refused


def start_worker(log_dir) -> tuple[Half, str]:
    addr = f"127.0.0.1:{free_port()}"
    h = Half("decode_server", ["--colocated", "--model", "tiny", "--dtype", "float32", "--no-prefix-cache",
                               "--max-inflight", "1", "--listen", addr], str(log_dir))
    h.start()
    return h, addr


def start_router(log_dir, workers: list[str]) -> tuple[Half, str]:
    addr = f"127.0.0.1:{free_port()}"
    h = Half("router", ["--listen", addr, "--load-poll-s", "0.1", *[a for w in workers for a in ("--worker", w)]],
             str(log_dir))
    h.start()
    return h, addr


async def refused(addr: str) -> tuple[grpc.StatusCode, str, str | None]:
    """One request through `addr`: (status, details, the kvt-worker trailing metadata)."""
    async with grpc.aio.insecure_channel(addr) as ch:
        call = pbg.DecodeStub(ch).Generate(pb.GenerateRequest(token_ids=[5, 6, 7], max_new_tokens=4), timeout=30)
        try:
            async for _ in call:
                pass
            return S.OK, "", None
        except grpc.aio.AioRpcError as e:
            return e.code(), e.details(), dict(await call.trailing_metadata() or ()).get(KEY)


def test_a_full_worker_stays_resource_exhausted_through_the_router(tmp_path):
    (wa, a), (wb, b) = start_worker(tmp_path), start_worker(tmp_path)
    (r1, one), (r2, both) = start_router(tmp_path, [a]), start_router(tmp_path, [a, b])
    everyone = [wa, wb, r1, r2]
    try:
        for h, addr in ((wa, a), (wb, b), (r1, one), (r2, both)):
            wait_serving(addr, [h.proc], START_S)

        async def scenario():
            async with grpc.aio.insecure_channel(a) as cha, grpc.aio.insecure_channel(b) as chb:
                holds = [pbg.DecodeStub(ch).Generate(pb.GenerateRequest(token_ids=[1, 2, 3],
                                                                        max_new_tokens=HOLD_TOKENS), timeout=120)
                         for ch in (cha, chb)]
                for h in holds:
                    await h.read()  # its first token: the worker's one admission is taken
                direct = await refused(a)
                through_one, through_both = await refused(one), await refused(both)
                for h in holds:
                    h.cancel()
            for _ in range(300):  # the cancelled holds leave the worker: then a request goes through
                after = await refused(one)
                if after[0] != S.RESOURCE_EXHAUSTED:
                    break
                await asyncio.sleep(0.1)
            return direct, through_one, through_both, after

        direct, through_one, through_both, after = asyncio.run(scenario())
        assert direct[0] == S.RESOURCE_EXHAUSTED and "--max-inflight" in direct[1], direct
        # one worker, nothing to retry on: the worker's status and words, naming it
        assert through_one[0] == S.RESOURCE_EXHAUSTED, through_one
        assert f"decode worker {a}" in through_one[1] and "--max-inflight" in through_one[1], through_one
        assert through_one[2] == a
        # two workers, both full: retried once, then the retry's status, naming both
        assert through_both[0] == S.RESOURCE_EXHAUSTED, through_both
        assert a in through_both[1] and b in through_both[1] and "--max-inflight" in through_both[1], through_both
        # a full worker is not a down one: the router still serves, and the next request goes through
        with grpc.insecure_channel(one) as ch:
            status = health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=5).status
        assert status == health_pb2.HealthCheckResponse.SERVING
        assert after[0] == S.OK, after
    except Exception as e:
        raise AssertionError(f"{e}\n" + "\n".join(h.log_text()[-2000:] for h in everyone)) from e
    finally:
        stop([h.proc for h in everyone])
