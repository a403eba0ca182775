"""Decode gRPC service: `Generate`, the front door, with `Info` and `Load`; and the server that serves it.

Why this file: it decides whether a request may start (the server failed, is draining, the request breaks a
limit, --max-inflight is reached) and how every request ends when the server does (fail_all, end_for_shutdown);
what happens to a request once it may start is request_path.py. Every request ends in a status: one the gate
refuses at once, one the shutdown's grace outlives UNAVAILABLE, one under a dead thread INTERNAL.
"""

from __future__ import annotations

import asyncio
from contextlib import aclosing

import grpc

from decode_server.admission import AdmissionQueue
from decode_server.config import DecodeConfig
from decode_server.peer.peers import PrefillPeers
from decode_server.reports import info_response, load_response, watch_gauges
from decode_server.request_path import RequestPath, abort
from decode_server.validate import request_problem
from kvtransfer.engine.engine import DecodeEngine
from kvtransfer.engine.scheduler import EngineFailed
from kvtransfer.engine.sequence import EndCause
from kvtransfer.rpc.lifecycle import SHUTTING_DOWN, RunningRequests, end_by_cancel
from kvtransfer.rpc.limits import ConcurrencyLimit
from kvtransfer.rpc.metrics import Metrics
from kvtransfer.rpc.security import server_credentials
from kvtransfer.rpc.server import build_server
from proto import kvtransfer_pb2 as pb
from proto import kvtransfer_pb2_grpc as pbg

SHUTDOWN_MESSAGE = f"{SHUTTING_DOWN}: --shutdown-grace-s passed before this request finished; retry elsewhere"


class DecodeService(pbg.DecodeServicer):
    def __init__(self, config: DecodeConfig, engine: DecodeEngine, peers: PrefillPeers | None = None,
                 metrics: Metrics | None = None, prefill_metadata=None):
        self.config, self.engine, self.peers = config, engine, peers
        self.vocab = engine.m.model.config.vocab_size
        self.admit = ConcurrencyLimit(config.max_inflight or None)  # an explicit cap only; the queue bounds waiting
        self.admission = AdmissionQueue(engine.pool, config.max_waiting, config.admission_wait_s)
        self.metrics = metrics or Metrics("decode")
        self.running = RunningRequests(self.metrics)
        self.path = RequestPath(config, engine, peers, self.admission, self.metrics, prefill_metadata)
        self.failed = ""  # set by fail_all: a thread the server depends on died; every request ends INTERNAL
        watch_gauges(self.metrics, engine, peers, lambda: self.admit.count, lambda: self.admission.waiting)

    async def _validate(self, request, context) -> None:
        refusal = request_problem(request, self.config, self.engine, self.vocab, self.peers)
        if refusal is not None:
            await abort(context, *refusal)

    async def Info(self, request, context):
        """The served model's name and the limits a request must keep (clients ask once)."""
        return info_response(self.engine, self.config, self.vocab)

    async def Load(self, request, context):
        """Running and waiting requests and tokens, and the pool's free slots (a router places requests by it)."""
        serving = not (self.failed or self.running.draining) and (
            self.peers is None or self.peers.up or self.config.on_failure == "recompute")
        return load_response(self.running.requests, self.engine, serving, self.admission.waiting,
                             self.path.preemptions)

    async def Generate(self, request, context):
        with self.running.request(context) as r:  # counts the request's one outcome when it ends
            try:
                if self.failed:
                    await abort(context, grpc.StatusCode.INTERNAL, self.failed)
                if self.running.draining:
                    await abort(context, grpc.StatusCode.UNAVAILABLE, f"{SHUTTING_DOWN}; retry elsewhere")
                await self._validate(request, context)
                if not self.admit.try_enter():
                    await abort(context, grpc.StatusCode.RESOURCE_EXHAUSTED, self.admit.refusal())
                r.prompt_tokens = len(request.token_ids)
                try:
                    async with aclosing(self.path.responses(request, context, r)) as msgs:
                        async for msg in msgs:
                            r.at_yield = True
                            yield msg
                            r.at_yield = False
                            if r.ending:
                                await abort(context, *self._ending(r))
                finally:
                    self.admit.leave()
            except EngineFailed as e:  # the scheduler thread died under this request
                await abort(context, grpc.StatusCode.INTERNAL, str(e))
            except asyncio.CancelledError:
                if r.ending:  # the shutdown's grace is over (or the server failed): a status, not a silent cancel
                    await abort(context, *self._ending(r))
                raise

    @staticmethod
    def _ending(r) -> tuple[grpc.StatusCode, str]:
        return (r.end_code, r.end_message) if r.end_code is not None else (grpc.StatusCode.UNAVAILABLE,
                                                                             SHUTDOWN_MESSAGE)

    def fail_all(self, cause: str) -> None:
        """A thread the server depends on died (`cause`): new requests are refused, and every waiting or in-flight
        one ends INTERNAL saying so (one at a `yield` when its client reads on; the others now)."""
        self.failed = message = f"this server failed and is exiting: {cause}; retry on another replica"
        self.running.draining = True
        for r in list(self.running.requests):
            r.ending, r.end_code, r.end_message = True, grpc.StatusCode.INTERNAL, message
            if r.seq is not None:
                r.seq.stop(message, EndCause.ENGINE_FAILED)
            end_by_cancel(r)

    def end_for_shutdown(self, r) -> None:
        """The grace is over: a decoding request's sequence ends UNAVAILABLE at the next step; others are cancelled."""
        if r.end_code is not None:  # already ended by fail_all
            return
        if r.seq is not None:
            r.seq.stop(SHUTDOWN_MESSAGE, EndCause.SHUTDOWN)
        else:
            end_by_cancel(r)


async def create_server(config: DecodeConfig, service: DecodeService, address: str | None = None,
                        token: str = "", health=None) -> tuple[grpc.aio.Server, int]:
    """Build (not start) the server; returns it and the bound port (tests bind port 0). `health`: the health
    servicer to serve (the pairing's, built before the server); a new one when None."""
    server, port, service.health = build_server(
        pb.DESCRIPTOR.services_by_name["Decode"], service, address or config.listen, config.max_message_bytes,
        token, server_credentials(config.tls_cert, config.tls_key, config.tls_ca), health)
    return server, port
