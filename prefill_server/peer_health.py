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

Which watch counts: each carries a token of its own (WATCH_KEY) and the handshake names the one opened for it. After
a link went down and came back, the old watch's stream on the dead connection may close here before or after the new
watch opens: only the named watch, once open, makes its decode worker "seen", so an old stream's late close never
reads as the worker gone (it did once: a pairing abandoned while its decode worker joined it). A decode worker that
names no watch (an older one) is seen at any watch, as before.
"""

from __future__ import annotations

import collections

from grpc_health.v1 import health_pb2
from grpc_health.v1.health import aio as health_aio

from kvtransfer.rpc.server import DECODE_INSTANCE_KEY, MAX_WATCH_TOKEN, WATCH_KEY, pair_service

SERVING, NOT_SERVING = health_pb2.HealthCheckResponse.SERVING, health_pb2.HealthCheckResponse.NOT_SERVING


class PeerHealth(health_aio.HealthServicer):
    """The health service, counting the open Watch streams of each decode instance (its liveness watch)."""

    def __init__(self):
        super().__init__()
        self.open: dict[int, collections.Counter[str]] = {}  # open watches: by instance, by token (none at 0)
        self.named: dict[int, str] = {}  # the watch each instance's latest handshake named
        self.seen: set[int] = set()  # instances whose current watch opened (the named one, or any if none named)

    def watched(self, who: int) -> bool:
        """Whether `who` has a liveness watch open now."""
        return who in self.open

    def left(self, who: int) -> bool:
        """Whether `who` watched and no longer does (its process is gone): not merely "not watching yet"."""
        return who in self.seen and who not in self.open

    def forget(self, who: int) -> None:
        """`who`'s pair was dropped: a later watch of the same instance starts afresh."""
        self.seen.discard(who)
        self.named.pop(who, None)

    def handshake(self, who: int, token: str) -> str:
        """`who` handshakes, naming its liveness watch `token` ("": none, an older decode worker): from now on only
        that watch makes it seen, open already or once it opens; until then it is not "left". Says which, for the
        log."""
        if not token:
            return "no liveness watch named"
        self.named[who] = token
        if self.open.get(who, {}).get(token):
            self.seen.add(who)
            return "its liveness watch open"
        self.seen.discard(who)
        return "its liveness watch not open yet"

    def opened(self, who: int, token: str) -> None:
        self.open.setdefault(who, collections.Counter())[token] += 1
        if self.named.get(who, token) == token:
            self.seen.add(who)

    def closed(self, who: int, token: str) -> None:
        """A watch ended; counts at 0 are dropped (a caller opening watches under ever new ids keeps none)."""
        tokens = self.open[who]
        tokens[token] -= 1
        if tokens[token] <= 0:
            del tokens[token]
            if not tokens:
                del self.open[who]

    async def Watch(self, request, context):
        meta = dict(context.invocation_metadata() or ())
        raw = meta.get(DECODE_INSTANCE_KEY, "")
        who = int(raw, 16) if raw and all(c in "0123456789abcdef" for c in raw) else 0
        token = watch_token(meta)
        self.opened(who, token)
        try:
            await super().Watch(request, context)
        finally:
            self.closed(who, token)

    async def set_pair(self, who: int, up: bool) -> None:
        """The pair of decode instance `who` is up (SERVING) or not, on its own service."""
        await self.set(pair_service(who), SERVING if up else NOT_SERVING)

    async def set_any(self, up: bool) -> None:
        """"" : SERVING while any pair is up."""
        await self.set("", SERVING if up else NOT_SERVING)


def watch_token(metadata: dict) -> str:
    """The liveness watch's token in a call's metadata ("" when none, or one over MAX_WATCH_TOKEN characters)."""
    token = metadata.get(WATCH_KEY, "")
    return token if isinstance(token, str) and len(token) <= MAX_WATCH_TOKEN else ""
