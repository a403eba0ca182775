"""A server whose engine died says so: health NOT_SERVING at once, every request INTERNAL, a non-zero exit.

Why real processes: what a supervisor (systemd, Kubernetes) sees is the process's health answer and its exit
code; the fault is the typed option --fail-scheduler-after-steps, which kills the decode scheduler thread.
"""

from __future__ import annotations

import asyncio
import time

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from decode_server.client import generate
from kvtransfer.rpc.lifecycle import EXIT_FATAL
from support.servers import colocated_server

PROMPT = [5, 6, 7, 8]
DECODE = "kvtransfer.v1.Decode"  # the Decode service's health entry (decode_server.peer.peers.DECODE_SERVICE)
NOT_SERVING_S = 10.0  # health turns NOT_SERVING within this of the first failure (at once, but probes may be slow)


async def _health(addr: str, service: str = "") -> int:
    async with grpc.aio.insecure_channel(addr) as ch:
        try:
            return (await health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(service=service),
                                                               timeout=1)).status
        except grpc.aio.AioRpcError:
            return -1  # the server is gone: not serving either


def test_a_dead_scheduler_fails_every_request_and_the_process(tmp_path):
    """The scheduler dies after 400 steps with one request decoding and one waiting for the only slot: both end
    INTERNAL naming the cause, health turns NOT_SERVING (the server says so at once; the bound, NOT_SERVING_S, is
    generous: a busy machine delays the probes, and a server that never says so stays SERVING for good), the
    traceback is logged once, and the process exits EXIT_FATAL."""
    args = ["--fail-scheduler-after-steps", "400", "--max-batch", "1", "--admission-wait-s", "60"]
    with colocated_server(tmp_path, args=args) as run:
        async def scenario():
            # colocated, the Decode service's own entry serves too (docs/faults.md: it was NOT_FOUND, pairs only)
            assert await _health(run.addr, DECODE) == health_pb2.HealthCheckResponse.SERVING
            running = asyncio.create_task(generate(run.addr, PROMPT, 2000, timeout=60))
            await asyncio.sleep(0.05)
            waiting = asyncio.create_task(generate(run.addr, PROMPT, 8, timeout=60))
            errors = []
            for task in (running, waiting):
                try:
                    await task
                except grpc.aio.AioRpcError as e:
                    errors.append(e)
                if len(errors) == 1:
                    t_failed = time.monotonic()
                    while health_pb2.HealthCheckResponse.SERVING in {await _health(run.addr, n) for n in ("", DECODE)}:
                        assert time.monotonic() - t_failed < NOT_SERVING_S, \
                            f"still SERVING {NOT_SERVING_S} s after the engine died"
                        await asyncio.sleep(0.02)
            return errors
        errors = asyncio.run(scenario())
        assert [e.code() for e in errors] == [grpc.StatusCode.INTERNAL] * 2, [e.details() for e in errors]
        assert all("scheduler thread died" in e.details() for e in errors), [e.details() for e in errors]
        proc = run.procs[0]
        assert proc.wait(timeout=30) == EXIT_FATAL
    log = open(run.logs[0]).read()
    assert log.count("Traceback") == 1 and "InjectedFault" in log, log[-3000:]
