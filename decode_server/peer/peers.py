"""The decode worker's prefill peers: one pairing per prefill worker, one chosen per request, health from all.

Why a file of its own: a decode worker pairs with every prefill worker it is given (--prefill-addr
HOST:PORT,HOST:PORT: xPyD), and the front door asks one question per remote request, "which prefill worker
takes this one?". The answer: among the peers that are up, the one with the fewest prompt tokens ahead of it
(DataPlane.load: this worker's own in flight there, plus the queue the peer reported in its last answer, which
counts other decode workers' requests too); ties go round-robin, so idle peers share the work. A peer that is
down is skipped; with none up the request is refused at once, naming why, so that the --on-failure policy (fail,
or recompute here) decides without waiting on a dead link; a request whose peer fails is tried once more on
another peer that is up before that policy applies (`remote_prefill`). Each pairing re-pairs on its own (pairing.py), so a
restarted prefill worker rejoins without restarting this one.

Health: "" is SERVING while any peer is up; the Decode service stays SERVING under --on-failure recompute (it
still answers). At start the server waits for the first pairing; the others pair in the background. A refused
handshake (another model or layout: a configuration error) ends the start with the reason.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import time

import grpc
from grpc_health.v1 import health_pb2

from decode_server.peer.handshake import HandshakeRefused, HandshakeTimedOut
from decode_server.peer.pairing import DecodePairing
from decode_server.peer.remote import PeerFailure
from proto import kvtransfer_pb2 as pb

log = logging.getLogger("kvtransfer.decode")
SERVING, NOT_SERVING = health_pb2.HealthCheckResponse.SERVING, health_pb2.HealthCheckResponse.NOT_SERVING
DECODE_SERVICE = pb.DESCRIPTOR.services_by_name["Decode"].full_name


class PrefillPeers:
    def __init__(self, config, health, metrics):
        self.config, self.health, self.metrics = config, health, metrics
        self.pairings: list[DecodePairing] = []
        self._turn = itertools.count()
        self.transport = ""

    def add(self, pairing: DecodePairing) -> None:
        self.pairings.append(pairing)
        self.transport = pairing.transport

    @property
    def up(self) -> bool:
        return any(p.up for p in self.pairings)

    def watch_fatal(self, on_fatal) -> None:
        for p in self.pairings:
            p.watch_fatal(on_fatal)

    async def start(self) -> None:
        """Until the first pairing is up (then the rest pair in the background); raises HandshakeRefused when a
        peer refuses, or (HandshakeTimedOut) when none paired within --handshake-timeout-s."""
        async def attempt(p: DecodePairing) -> HandshakeRefused | None:
            try:
                await p.start()
            except HandshakeRefused as e:  # a SystemExit: kept as a value, never raised inside a task
                return e
            return None

        tasks = {asyncio.create_task(attempt(p), name=f"first pairing {p.addr}"): p for p in self.pairings}
        first_error: HandshakeRefused | None = None
        timed_out: list[DecodePairing] = []
        pending = set(tasks)
        while pending:
            done, pending = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
            for t in done:
                error = t.result()
                if error is None:
                    for rest in pending:  # the first is up: the rest keep trying on their own
                        rest.add_done_callback(lambda t, p=tasks[rest]: self._late(t, p))
                    for p in timed_out:  # and those that gave up before it
                        log.error("prefill peer %s did not pair at start; it keeps trying", p.addr)
                        p.supervise(paired=False)
                    return
                if not isinstance(error, HandshakeTimedOut):  # refused: a configuration error, the start ends
                    for rest in pending:
                        rest.cancel()
                    raise error
                first_error = first_error or error
                timed_out.append(tasks[t])
        raise first_error

    def _late(self, task: asyncio.Task, pairing: DecodePairing) -> None:
        """A peer that did not pair by the time the first did: it keeps trying (a refusal is logged)."""
        if task.cancelled():
            return
        error = task.result()
        if error is not None:
            log.error("prefill peer %s did not pair at start: %s; it keeps trying", pairing.addr, error)
            pairing.supervise(paired=False)

    def prompt_limit(self) -> tuple[int, str]:
        """(the smallest --max-prompt-tokens the prefill workers announced, the address of one with it); (0, "")
        before any announced one. A disaggregated prompt over it is refused whether or not this worker's prefix
        cache would let it prefill the prompt here: the same prompt must not be served or refused by what the cache
        happens to hold."""
        known = [(p.max_prompt_tokens, p.addr) for p in self.pairings if p.max_prompt_tokens]
        return min(known) if known else (0, "")

    def other_up(self, exclude: list[DecodePairing]) -> bool:
        return any(p.up and p not in exclude for p in self.pairings)

    def choose(self, exclude: list[DecodePairing] = ()) -> DecodePairing:
        """The peer that prefills the next request: the least loaded that is up and not in `exclude` (PeerFailure
        when none is)."""
        up = [p for p in self.pairings if p.up and p not in exclude]
        if not up:
            why = "; ".join(f"{p.addr}: {p.why_down()}" for p in self.pairings)
            raise PeerFailure("peer_down", grpc.StatusCode.UNAVAILABLE,
                              f"no prefill worker is available ({why})")
        start = next(self._turn) % len(up)
        up = up[start:] + up[:start]  # ties: round-robin
        return min(up, key=lambda p: p.data.load())

    async def remote_prefill(self, request, rid: int, deadline: float, metadata, lease, wire, destination):
        """`request` prefilled on the least loaded peer that is up, its cache landing in `destination` (the slot's
        per-layer views, held by `lease`); a peer failure is tried once more on another peer that is up, then
        raised (PeerFailure: the caller's --on-failure policy). Returns dataplane.Remote."""
        tried: list[DecodePairing] = []
        while True:
            peer = self.choose(exclude=tried)
            try:
                return await peer.data.remote_prefill(peer.stub, request, rid, deadline, metadata, destination,
                                                      lease, wire, peer.instance_id)
            except PeerFailure as f:
                tried.append(peer)
                if len(tried) > 1 or not self.other_up(tried) or time.perf_counter() >= deadline:
                    raise
                self.metrics.failures.labels(f.cause).inc()
                log.warning("request %d: %s; trying another prefill worker", rid, f.message)

    async def close(self) -> None:
        for p in self.pairings:
            await p.close()

    async def publish(self) -> None:
        """"" follows the peers (SERVING while any is up); the Decode service stays SERVING under --on-failure
        recompute (it still answers)."""
        n = sum(p.up for p in self.pairings)
        self.metrics.peer_up.set(n)
        await self.health.set("", SERVING if n else NOT_SERVING)
        await self.health.set(DECODE_SERVICE, SERVING if n or self.config.on_failure == "recompute"
                              else NOT_SERVING)

    # --- what the metrics read: summed over the peers ---

    def buffer_bytes(self) -> int:
        return sum(p.data.ledger.bytes for p in self.pairings)

    def pending(self) -> int:
        return sum(p.data.pending() for p in self.pairings)

    def receivers(self) -> int:
        return sum(p.data.receivers() for p in self.pairings)

    def receive_loops(self) -> int:
        return sum(p.data.receive_loops() for p in self.pairings)
