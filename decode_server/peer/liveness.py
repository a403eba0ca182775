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


STOPPING = "the prefill worker reports NOT_SERVING (it is stopping, or its data plane failed)"


async def watch_peer(health_stub, metadata, armed: asyncio.Event, service: str = "") -> str:
    """Return once the peer stops serving or the channel breaks; the reason (STOPPING: the peer still answers, so
    what it has in flight may still arrive). Opened before the handshake, it waits for the peer to be up; a
    NOT_SERVING counts only once `armed` is set (our pairing is up): the handshake itself turns the peer
    NOT_SERVING for a moment, which must not end the pairing it starts. `service`: the pair's own health service
    on the prefill worker (rpc.server.pair_service), so another pair's handshake or failure says nothing here."""
    seen_serving = False
    call = health_stub.Watch(health_pb2.HealthCheckRequest(service=service), metadata=metadata, wait_for_ready=True)
    try:
        async for r in call:
            if r.status == SERVING:
                seen_serving = True
            elif seen_serving and armed.is_set():
                return STOPPING
        return "the prefill worker ended the liveness watch"
    except grpc.aio.AioRpcError as e:
        return f"control channel to the prefill worker lost ({e.code().name}: {e.details()})"
    finally:
        call.cancel()


async def until_down(watch: asyncio.Future, data_stopped: asyncio.Future | None) -> str:
    """Wait until the pairing ends (`watch`, a running watch_peer, returns, or the data plane's receive loop
    stopped); returns why."""
    waits = {watch} | ({data_stopped} if data_stopped is not None else set())
    done, _ = await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
    if watch not in done:
        watch.cancel()
        return f"data plane failed: {data_stopped.result()}"
    return watch.result()
