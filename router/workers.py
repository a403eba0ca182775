"""The decode workers behind the router: one channel per worker, a background poll of each one's Load, and
whether it is healthy.

Why a poll and not a question per request: placement must be a read of what is known, not an RPC on every
request's path; a report at most --load-poll-s old, plus what this router sent the worker since that report
(placement.py), is fresh enough to spread a burst. Why Load is the health probe: its `serving` is the worker's
own "would accept a request now" (not draining, not failed, paired when disaggregated), which a colocated worker
does not publish under the Decode service's health name; a worker without Load (UNIMPLEMENTED) is probed with
grpc health instead. A poll that fails or says not serving marks the worker unhealthy; the next one that
succeeds marks it healthy again.

Why the set can change while it serves (`update`, on SIGHUP with --worker-file): adding a decode worker, or taking
one out for maintenance, should not restart the router and drop every stream through it. A worker added is polled
like the others and takes requests once a poll finds it serving; one removed leaves the set at once, so placement
no longer sees it, and its channel stays open until this router's requests there end (at most `drain_s`).

Why short reconnect backoff: gRPC's default backs off up to two minutes after a refused connection, so a worker
restarted on its address would rejoin only minutes later. At 0.5-1 s, it rejoins within a poll or two of
listening; keepalive pings turn a silent peer into UNAVAILABLE instead of a hang.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from kvtransfer.rpc.security import ClientSecurity
from kvtransfer.rpc.server import grpc_options, keepalive_options
from proto import kvtransfer_pb2 as pb
from proto import kvtransfer_pb2_grpc as pbg
from router.metrics import RouterMetrics

log = logging.getLogger("kvtransfer.router")

INFO_TIMEOUT_S = 5.0


def worker_channel_options(max_message_bytes: int) -> list[tuple[str, int]]:
    return grpc_options(max_message_bytes) + keepalive_options(2000) + [
        ("grpc.initial_reconnect_backoff_ms", 500), ("grpc.min_reconnect_backoff_ms", 500),
        ("grpc.max_reconnect_backoff_ms", 1000)]


@dataclass(eq=False)
class Ticket:
    """One request this router sent a worker, until it ends: what placement charges the worker for it."""
    prompt: int  # tokens
    new: int  # max_new_tokens
    first: bool = False  # its first token came: the worker runs it (until then, it counts it waiting)


@dataclass(eq=False)
class Worker:
    addr: str
    channel: grpc.aio.Channel | None = None
    decode: pbg.DecodeStub | None = None
    health: health_pb2_grpc.HealthStub | None = None
    healthy: bool = False
    why: str = "not polled yet"  # when unhealthy: the last poll's answer
    load: pb.LoadResponse | None = None  # the last report (None: none yet, or the worker has no Load)
    info: pb.InfoResponse | None = None  # asked when the worker (re)joins
    tickets: set[Ticket] = field(default_factory=set)  # this router's requests in flight here
    own_reported: int = 0  # tokens of those, as the last report counts them (see own_as_reported)
    last_chosen: int = 0  # placement's sequence number of the last request sent here (ties go to the oldest)

    @property
    def block(self) -> int:
        """Tokens per prefix-cache block (0: no prefix cache, or not known yet)."""
        return self.info.prefix_block_tokens if self.info is not None else 0

    def reported_tokens(self) -> int:
        """The last report's footprint: tokens of KV held (running contexts and waiting prompts) plus the tokens
        the running requests may still generate."""
        r = self.load
        return 0 if r is None else r.running_tokens + r.waiting_tokens + r.remaining_tokens

    def own_as_reported(self) -> int:
        """This router's requests in flight here, as a report asked for now counts them: a running one (its first
        token came) by prompt + max_new_tokens (context so far + remaining), a waiting one by its prompt."""
        return sum(t.prompt + t.new if t.first else t.prompt for t in self.tickets)

    def own_tokens(self) -> int:
        """This router's requests in flight here, each by the most KV it will hold: prompt + max_new_tokens."""
        return sum(t.prompt + t.new for t in self.tickets)

    def load_tokens(self) -> int:
        """What placement compares: the others' load (the report less this router's own requests in it) plus this
        router's requests in flight now."""
        return max(self.reported_tokens() - self.own_reported, 0) + self.own_tokens()


class WorkerSet:
    def __init__(self, addrs: tuple[str, ...], security: ClientSecurity, max_message_bytes: int, poll_s: float,
                 timeout_s: float, metrics: RouterMetrics):
        self.workers = [Worker(a) for a in addrs]
        self.security, self.poll_s, self.timeout_s, self.metrics = security, poll_s, timeout_s, metrics
        self._options = worker_channel_options(max_message_bytes)
        self._tasks: dict[str, asyncio.Task] = {}  # each worker's poll, by address
        self._leaving: set[asyncio.Task] = set()  # removed workers' drains (`update`)
        self.on_change: Callable[[], Awaitable[None]] | None = None  # awaited when a worker turns (un)healthy

    def _open(self, w: Worker) -> None:
        w.channel = self.security.channel(w.addr, options=self._options)
        w.decode, w.health = pbg.DecodeStub(w.channel), health_pb2_grpc.HealthStub(w.channel)

    def open(self) -> None:
        """Channels, made on the server's loop (grpc.aio binds a channel to the loop it was made on)."""
        for w in self.workers:
            self._open(w)

    def start(self) -> None:
        self._tasks = {w.addr: asyncio.ensure_future(self._poll_forever(w)) for w in self.workers}

    async def update(self, addrs: tuple[str, ...], drain_s: float) -> tuple[list[str], list[str]]:
        """Make the set `addrs` (started: on the loop): each new worker opened and polled, each one missing taken out
        of the set now and its channel closed once this router's requests there end (at most `drain_s`, then they
        fail as the channel closes). Returns (added, removed) addresses."""
        removed = [w for w in self.workers if w.addr not in addrs]
        added = [a for a in addrs if a not in {w.addr for w in self.workers}]
        for w in removed:
            self.workers.remove(w)
            self._tasks.pop(w.addr).cancel()
            w.healthy, w.why = False, "removed from --worker-file"
            self.metrics.reported(w.addr, False)
            task = asyncio.ensure_future(self._drain(w, drain_s))
            self._leaving.add(task)
            task.add_done_callback(self._leaving.discard)
        for a in added:
            w = Worker(a)
            self._open(w)
            self.workers.append(w)
            self._tasks[a] = asyncio.ensure_future(self._poll_forever(w))
        if (added or removed) and self.on_change is not None:
            await self.on_change()
        return added, [w.addr for w in removed]

    @staticmethod
    async def _drain(w: Worker, drain_s: float) -> None:
        deadline = time.monotonic() + drain_s
        try:
            while w.tickets and time.monotonic() < deadline:
                await asyncio.sleep(0.1)
            if w.tickets:
                log.warning("worker %s removed: closing its channel with %d requests still in flight (%.0f s "
                            "passed)", w.addr, len(w.tickets), drain_s)
        finally:  # also when the router stops first (`close` cancels the drain)
            await w.channel.close()
        log.info("worker %s removed: channel closed", w.addr)

    async def close(self) -> None:
        tasks = [*self._tasks.values(), *self._leaving]
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        for w in self.workers:
            if w.channel is not None:
                await w.channel.close()

    def healthy(self) -> list[Worker]:
        return [w for w in self.workers if w.healthy]

    def describe(self) -> str:
        """Every worker's state in a few words (for a refusal and the log)."""
        return "; ".join(f"{w.addr} {'up' if w.healthy else 'down: ' + w.why}" for w in self.workers)

    async def mark_down(self, w: Worker, why: str) -> None:
        """A call to `w` failed as a dead worker's would: skip it until a poll answers again."""
        await self._set(w, False, why)

    async def _set(self, w: Worker, healthy: bool, why: str = "") -> None:
        changed = healthy != w.healthy
        w.healthy, w.why = healthy, why
        self.metrics.reported(w.addr, healthy, w.load if healthy else None)
        if changed:
            if healthy:
                log.info("worker %s up (%s)", w.addr, _figures(w.load))
            else:
                log.warning("worker %s down: %s", w.addr, why)
            if self.on_change is not None:
                await self.on_change()

    async def _poll_forever(self, w: Worker) -> None:
        while True:
            t0 = time.monotonic()
            try:
                await self.poll(w)
            except asyncio.CancelledError:
                raise
            except Exception as e:  # never let one odd answer end the poll
                log.exception("worker %s: poll failed", w.addr)
                await self._set(w, False, f"poll failed: {type(e).__name__}: {e}")
            await asyncio.sleep(max(self.poll_s - (time.monotonic() - t0), 0.0))

    async def poll(self, w: Worker) -> None:
        """One Load (or health) question. The answer becomes `w`'s report, kept with this router's own requests as
        it counts them (taken when asked: placement subtracts them, and adds what it has in flight now)."""
        md = self.security.metadata()
        own = w.own_as_reported()  # what the answer will count of this router's requests
        try:
            load = await w.decode.Load(pb.LoadRequest(), timeout=self.timeout_s, metadata=md)
        except grpc.aio.AioRpcError as e:
            if e.code() != grpc.StatusCode.UNIMPLEMENTED:
                await self._set(w, False, f"Load: {e.code().name} {e.details()}")
                return
            load = await self._health_as_load(w)
            if load is None:
                return
        if load.serving and (w.info is None or not w.healthy):  # (re)joining: its limits and prefix block
            try:
                w.info = await w.decode.Info(pb.InfoRequest(), timeout=INFO_TIMEOUT_S, metadata=md)
            except grpc.aio.AioRpcError as e:
                if e.code() != grpc.StatusCode.UNIMPLEMENTED:
                    await self._set(w, False, f"Info: {e.code().name} {e.details()}")
                    return
                w.info = pb.InfoResponse()
        w.load, w.own_reported = load, own
        self.metrics.placed(w)
        await self._set(w, load.serving, "" if load.serving else "Load says not serving (draining, failed or "
                        "unpaired)")

    async def _health_as_load(self, w: Worker) -> pb.LoadResponse | None:
        """A worker without Load: grpc health's answer, with no load figures (placement then sees only what this
        router sent it)."""
        try:
            got = await w.health.Check(health_pb2.HealthCheckRequest(), timeout=self.timeout_s)
        except grpc.aio.AioRpcError as e:
            await self._set(w, False, f"health: {e.code().name} {e.details()}")
            return None
        return pb.LoadResponse(serving=got.status == health_pb2.HealthCheckResponse.SERVING)


def _figures(load: pb.LoadResponse | None) -> str:
    if load is None:
        return "no load report"
    return (f"running {load.running_requests} requests / {load.running_tokens} tokens, waiting "
            f"{load.waiting_requests} / {load.waiting_tokens}, {load.free_slots} free slots")
