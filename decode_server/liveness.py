"""Is the prefill worker still there? A health `Watch` on its control channel, or the data plane stopping.

Why a Watch and not polling: the control channel is keepalive'd (--peer-keepalive-s), so a peer that dies
or a link that goes down ends the stream within about that time, and the worker's own NOT_SERVING (its data
plane failed) arrives as an event. Whichever comes first ends the pairing; the answer says why.
"""

from __future__ import annotations

import asyncio

import grpc
from grpc_health.v1 import health_pb2

SERVING = health_pb2.HealthCheckResponse.SERVING


async def watch_peer(health_stub, metadata) -> str:
    """Return once the peer stops serving or the channel breaks; the reason."""
    seen_serving = False
    call = health_stub.Watch(health_pb2.HealthCheckRequest(), metadata=metadata)
    try:
        async for r in call:
            if r.status == SERVING:
                seen_serving = True
            elif seen_serving:
                return "the prefill worker reports NOT_SERVING (its data plane failed)"
        return "the prefill worker ended the liveness watch"
    except grpc.aio.AioRpcError as e:
        return f"control channel to the prefill worker lost ({e.code().name}: {e.details()})"
    finally:
        call.cancel()


async def until_down(health_stub, metadata, data_stopped: asyncio.Future | None) -> str:
    """Wait until the pairing ends (peer gone, or the data plane's receive loop stopped); returns why."""
    watch = asyncio.ensure_future(watch_peer(health_stub, metadata))
    waits = {watch} | ({data_stopped} if data_stopped is not None else set())
    done, _ = await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
    if watch not in done:
        watch.cancel()
        return f"data plane failed: {data_stopped.result()}"
    return watch.result()
