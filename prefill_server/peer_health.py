"""The prefill worker's health service: which decode workers still watch it, and what it tells them.

Why apart from the pairing (pairing.py): this is the gRPC surface that each decode worker's liveness watch
talks to (decode_server/peer/liveness.py), built with the server before any pair exists, and it knows
nothing of pairs, epochs, links or the device thread. The pairing asks it one thing (is that decode worker
still watching?) and tells it one thing (is that pair up?); what a pair is and when it goes up or down
stays in the pairing.

Health, per pair: the service `pair_service(decode instance)` is SERVING while that pair is up, and each
decode worker watches its own (so one pair's handshake or failure never ends another's); "" is SERVING
while any pair is up. A decode worker's liveness watch is a health Watch carrying its instance id
(DECODE_INSTANCE_KEY), opened before its handshake; one that watched and no longer does is gone.
"""

from __future__ import annotations

import collections

from grpc_health.v1 import health_pb2
from grpc_health.v1.health import aio as health_aio

from kvtransfer.rpc.server import DECODE_INSTANCE_KEY, pair_service

SERVING, NOT_SERVING = health_pb2.HealthCheckResponse.SERVING, health_pb2.HealthCheckResponse.NOT_SERVING


class PeerHealth(health_aio.HealthServicer):
    """The health service, counting the open Watch streams of each decode instance (its liveness watch)."""

    def __init__(self):
        super().__init__()
        self.watching: collections.Counter[int] = collections.Counter()
        self.seen: set[int] = set()  # every instance that opened a watch

    def watched(self, who: int) -> bool:
        """Whether `who` has a liveness watch open now."""
        return self.watching[who] > 0

    def left(self, who: int) -> bool:
        """Whether `who` watched and no longer does (its process is gone): not merely "not watching yet"."""
        return who in self.seen and self.watching[who] <= 0

    def forget(self, who: int) -> None:
        """`who`'s pair was dropped: a later watch of the same instance starts afresh."""
        self.seen.discard(who)

    async def Watch(self, request, context):
        raw = dict(context.invocation_metadata() or ()).get(DECODE_INSTANCE_KEY, "")
        who = int(raw, 16) if raw and all(c in "0123456789abcdef" for c in raw) else 0
        self.watching[who] += 1
        self.seen.add(who)
        try:
            await super().Watch(request, context)
        finally:
            self.watching[who] -= 1

    async def set_pair(self, who: int, up: bool) -> None:
        """The pair of decode instance `who` is up (SERVING) or not, on its own service."""
        await self.set(pair_service(who), SERVING if up else NOT_SERVING)

    async def set_any(self, up: bool) -> None:
        """"" : SERVING while any pair is up."""
        await self.set("", SERVING if up else NOT_SERVING)
