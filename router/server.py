"""The router's Decode servicer: Generate placed on one worker and its stream passed through; Info from a worker;
Load summed over the healthy ones.

Why the request is forwarded unchanged: the workers validate it (and say what to fix); the router adds nothing a
worker would have to trust. Only the deadline is carried over (what is left of the caller's, capped by
--request-timeout-s, less a margin so the status arrives before the caller gives up); the caller's metadata is
not (a worker's token is the router's own, --worker-auth-token).

Why retry only before the first token: until then the caller has seen nothing, so another worker can serve the
request as if it were the first (a failed worker's UNAVAILABLE: gone, refusing connections, shutting down; its
RESOURCE_EXHAUSTED: full). With no other worker to retry on, or a retry that fails too, the caller gets the
worker's own status (a full worker's RESOURCE_EXHAUSTED, which callers back off on, stays that). After a token, a
retry would repeat tokens the caller already has; the request ends with the worker's status, its message naming
the worker. Bad input (INVALID_ARGUMENT) is the caller's to fix: it comes back unchanged. Every response names its
worker: initial metadata `kvt-worker` before the first message, and the same key in the trailing metadata (errors
included).
"""

from __future__ import annotations

import asyncio
import logging
from contextlib import aclosing

import grpc

from kvtransfer.rpc.lifecycle import SHUTTING_DOWN, RunningRequests, request_budget
from kvtransfer.rpc.security import ClientSecurity
from proto import kvtransfer_pb2 as pb
from proto import kvtransfer_pb2_grpc as pbg
from router.metrics import LOAD_FIELDS, RouterMetrics
from router.placement import Placement
from router.workers import Worker, WorkerSet

log = logging.getLogger("kvtransfer.router")

WORKER_KEY = "kvt-worker"  # metadata naming the worker that served (or failed) a request
RETRYABLE = (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.RESOURCE_EXHAUSTED)
PASS_THROUGH = (grpc.StatusCode.INVALID_ARGUMENT,)  # the caller's own mistake: the worker's words, unchanged
ATTEMPTS = 2  # the first worker, and one retry elsewhere


class RouterService(pbg.DecodeServicer):
    def __init__(self, workers: WorkerSet, placement: Placement, metrics: RouterMetrics, security: ClientSecurity,
                 request_timeout_s: float):
        self.workers, self.placement, self.metrics = workers, placement, metrics
        self.security, self.request_timeout_s = security, request_timeout_s
        self.running = RunningRequests(metrics)
        self.health = None  # set by __main__ once the server is built

    @staticmethod
    async def _abort(context, code: grpc.StatusCode, message: str, worker: Worker | None = None):
        left = context.time_remaining()
        if context.done() or context.cancelled() or (left is not None and left <= 0):
            raise asyncio.CancelledError(message)  # gRPC already ended the call: a status now fails in core
        await context.abort(code, message, trailing_metadata=((WORKER_KEY, worker.addr),) if worker else ())

    async def Info(self, request, context):
        """The first healthy worker's Info (the workers serve one model; the router adds no limits of its own)."""
        for w in self.workers.healthy():
            if w.info is not None:
                return w.info
        await self._abort(context, grpc.StatusCode.UNAVAILABLE, self._none_healthy())

    async def Load(self, request, context):
        """The healthy workers' last reports, summed; `serving` while any worker is healthy."""
        out = pb.LoadResponse()
        for w in self.workers.healthy():
            if w.load is not None:
                for f in LOAD_FIELDS:
                    setattr(out, f, getattr(out, f) + getattr(w.load, f))
            out.serving = True
        out.serving = out.serving and not self.running.draining
        return out

    def _none_healthy(self) -> str:
        return f"no healthy decode worker behind this router ({self.workers.describe()}); retry later"

    async def Generate(self, request, context):
        with self.running.request(context) as r:  # counts the caller's request once, by its final status
            self.metrics.inflight.inc()
            try:
                if self.running.draining:
                    await self._abort(context, grpc.StatusCode.UNAVAILABLE, f"router {SHUTTING_DOWN}; retry elsewhere")
                async with aclosing(self._generate(request, context)) as msgs:  # closed now, the worker's call too
                    async for msg in msgs:
                        r.at_yield = True
                        yield msg
                        r.at_yield = False
                        if r.ending:
                            await self._abort(context, grpc.StatusCode.UNAVAILABLE,
                                              f"router {SHUTTING_DOWN}: --shutdown-grace-s passed; retry elsewhere")
            finally:
                self.metrics.inflight.dec()

    async def _failed(self, w: Worker, e: grpc.aio.AioRpcError) -> None:
        """Count a worker's error; an UNAVAILABLE one (gone, refusing, shutting down) takes the worker out of
        placement until a poll finds it serving again."""
        self.metrics.failed.labels(w.addr, e.code().name).inc()
        if e.code() == grpc.StatusCode.UNAVAILABLE:
            await self.workers.mark_down(w, f"Generate: UNAVAILABLE {e.details()}")

    async def _generate(self, request: pb.GenerateRequest, context):
        """One attempt per worker tried (at most ATTEMPTS), streaming the one that sends a first token."""
        tried: list[Worker] = []
        earlier = ""  # what the first worker said, when this is the retry
        earlier_code = grpc.StatusCode.UNAVAILABLE
        while True:
            choice = self.placement.choose(request, exclude=tried)
            if choice is None:  # none at all, or none to retry on: then the first worker's own status
                why = self._none_healthy() if not tried else f"{earlier} (no other healthy worker to retry on)"
                await self._abort(context, earlier_code, why, tried[-1] if tried else None)
            if tried:
                self.metrics.retried.labels(tried[-1].addr).inc()
                log.info("retrying a request that failed on %s before its first token on %s: %s", tried[-1].addr,
                         choice.worker.addr, earlier)
            w = choice.worker
            tried.append(w)
            self.metrics.routed.labels(w.addr, choice.reason).inc()
            budget = request_budget(context.time_remaining(), self.request_timeout_s)
            call, made = None, []
            try:
                if budget <= 0:
                    await self._abort(context, grpc.StatusCode.DEADLINE_EXCEEDED, "the deadline passed before a "
                                      "worker could be asked", w)
                call = w.decode.Generate(request, timeout=budget, metadata=self.security.metadata())
                try:
                    msg = await call.read()
                except grpc.aio.AioRpcError as e:
                    await self._failed(w, e)
                    if e.code() in RETRYABLE and len(tried) < ATTEMPTS:
                        earlier, earlier_code = f"decode worker {w.addr}: {e.code().name} {e.details()}", e.code()
                        continue
                    message = e.details() if e.code() in PASS_THROUGH else f"decode worker {w.addr}: {e.details()}"
                    if earlier:
                        message += f" (the retry after {earlier})"
                    await self._abort(context, e.code(), message, w)
                if msg is grpc.aio.EOF:  # a worker always streams at least one token before OK
                    self.metrics.failed.labels(w.addr, "INTERNAL").inc()
                    await self._abort(context, grpc.StatusCode.INTERNAL,
                                      f"decode worker {w.addr} ended the stream without a token", w)
                self.placement.started(choice)
                await context.send_initial_metadata(((WORKER_KEY, w.addr),))
                while msg is not grpc.aio.EOF:
                    made.append(msg.token_id)
                    yield msg
                    try:
                        msg = await call.read()
                    except grpc.aio.AioRpcError as e:
                        await self._failed(w, e)
                        await self._abort(context, e.code(), f"decode worker {w.addr} failed after {len(made)} "
                                          f"tokens: {e.details()}", w)
                context.set_trailing_metadata(((WORKER_KEY, w.addr),))
                self.placement.served(w, [*request.token_ids, *made[:-1]])
                return
            finally:
                self.placement.release(choice)
                if call is not None and not call.done():
                    call.cancel()  # the caller went, or the router ended it: the worker stops decoding it
