"""Decode gRPC service: `Generate`, the front door.

Why this flow: the request id is chosen here and registered with the receive loop
*before* the prefill worker is asked, so the frame can never arrive unexpected; the first
token streams as soon as the prefill worker names it, and decoding starts once the whole
cache is on this device. When the peer or the data plane fails the request, --on-failure
decides: `fail` ends it with UNAVAILABLE saying what failed and what to do, `recompute`
prefills here instead (the colocated path: same tokens). Every request ends in a status
before its deadline.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

import grpc

from kvtransfer.metrics import Metrics
from kvtransfer.modes import REQUEST_MODES, Mode
from kvtransfer.security import server_credentials
from kvtransfer.serving import InflightLimit, build_server
from kvtransfer.streaming import cache_digest, cache_layers
from proto import kvtransfer_pb2 as pb
from proto import kvtransfer_pb2_grpc as pbg

from .config import DecodeConfig
from .engine import DecodeEngine
from .pairing import DecodePairing
from .remote import PeerFailure, RequestError, remote_prefill

log = logging.getLogger("kvtransfer.decode")

KNOWN_MODES = {m.proto for m in REQUEST_MODES}


@dataclass
class Prefilled:
    cache: object
    first: int
    digest: str
    timing: pb.Timing
    t_first: float  # perf_counter: first token known
    t_ready: float  # whole cache on this device
    release: Callable[[], None] = lambda: None  # let go of the receive buffers once the request is over


class DecodeService(pbg.DecodeServicer):
    def __init__(self, config: DecodeConfig, engine: DecodeEngine, gpu, pairing: DecodePairing | None = None,
                 metrics: Metrics | None = None, prefill_metadata=None):
        self.config, self.engine, self.gpu, self.pairing = config, engine, gpu, pairing
        self.vocab = engine.m.model.config.vocab_size
        self.ids = itertools.count(1)  # 0 is the warm-up frame
        self.admit = InflightLimit(config.max_inflight)
        self.prefill_metadata = prefill_metadata  # the prefill worker's token, when it asks for one
        self.metrics = metrics or Metrics("decode")
        self.metrics.inflight.set_function(lambda: self.admit.count)
        if pairing is not None:
            m = self.metrics
            m.buffer_bytes.set_function(lambda: pairing.ledger.bytes)
            m.expected.set_function(lambda: pairing.loop.pending() if pairing.loop else 0)
            m.receivers.set_function(pairing.receivers)
            m.receive_loops.set_function(pairing.receive_loops)

    async def _abort(self, context, code: grpc.StatusCode, message: str):
        self.metrics.finished(code.name)
        await context.abort(code, message)

    async def _validate(self, request, context) -> None:
        n, c, new = len(request.token_ids), self.config, request.max_new_tokens
        context_len = self.engine.m.model.config.max_position_embeddings
        problem = code = None
        if n == 0:
            problem = "empty prompt: send at least one token id"
        elif n > c.max_prompt_tokens:
            problem = f"prompt has {n} tokens; this server accepts at most {c.max_prompt_tokens} (--max-prompt-tokens)"
        elif n >= context_len:
            problem = (f"prompt has {n} tokens; the model's context is {context_len} tokens, "
                       "and at least one must be left to generate")
        elif not 1 <= new <= c.max_new_tokens:
            problem = f"max_new_tokens is {new}; use 1..{c.max_new_tokens} (--max-new-tokens)"
        elif n + new > context_len:
            problem = (f"prompt ({n}) + max_new_tokens ({new}) exceeds the model's context of {context_len} tokens; "
                       f"ask for at most {context_len - n} new tokens")
        elif (bad := next((t for t in request.token_ids if not 0 <= t < self.vocab), None)) is not None:
            problem = f"token id {bad} outside the vocabulary [0, {self.vocab})"
        elif request.mode not in KNOWN_MODES:
            problem = f"unknown mode {request.mode}; use AUTO, LAYERWISE, BULK or COLOCATED"
        elif request.mode != pb.MODE_COLOCATED and not c.colocated:
            if self.pairing is None:
                problem, code = "no prefill peer configured", grpc.StatusCode.FAILED_PRECONDITION
            elif (size := self.engine.m.geometry.cache_bytes(n)) > c.max_receive_bytes:
                problem, code = (f"a {n}-token cache is {size} bytes, over this server's --max-receive-bytes "
                                 f"{c.max_receive_bytes}; send a shorter prompt"), grpc.StatusCode.RESOURCE_EXHAUSTED
        if problem is not None:
            await self._abort(context, code or grpc.StatusCode.INVALID_ARGUMENT, problem)

    async def Generate(self, request, context):
        await self._validate(request, context)
        if not self.admit.try_enter():
            await self._abort(context, grpc.StatusCode.RESOURCE_EXHAUSTED, self.admit.refusal())
        try:
            remaining = context.time_remaining()
            limit = self.config.request_timeout_s
            budget = limit if remaining is None else min(remaining, limit)
            deadline = time.perf_counter() + budget
            async for msg in self._generate(request, context, deadline):
                yield msg
            self.metrics.finished("OK")
        finally:
            self.admit.leave()

    async def _prefill(self, request, context, rid: int, deadline: float):
        """The cache and first token, remotely unless colocated; the --on-failure policy when the peer fails."""
        loop, want = asyncio.get_running_loop(), request.return_logits_digest
        timing = pb.Timing()
        if not (self.config.colocated or request.mode == pb.MODE_COLOCATED):
            try:
                r = await remote_prefill(self.pairing, request, rid, deadline, self.prefill_metadata)
            except RequestError as e:
                await self._abort(context, e.code, e.message)
            except PeerFailure as f:
                self.metrics.failures.labels(f.cause).inc()
                if self.config.on_failure != "recompute":
                    log.warning("request %d: %s", rid, f.message)
                    await self._abort(context, f.code, f"{f.message}. Retry later; or start the decode server with "
                                      "--on-failure recompute to prefill here when the peer fails")
                if time.perf_counter() >= deadline:
                    await self._abort(context, grpc.StatusCode.DEADLINE_EXCEEDED,
                                      f"{f.message}; no time was left to recompute before the deadline")
                log.warning("request %d: %s; recomputing the prefill here (--on-failure recompute)", rid, f.message)
                timing.mode = Mode.RECOMPUTE.proto
            else:
                timing.prefill_ms, timing.mode = r.response.prefill_ms, r.response.mode
                timing.transfer_bytes = nbytes = self.engine.m.geometry.cache_bytes(len(request.token_ids))
                self.metrics.moved(nbytes, r.t_ready - r.t_sent, Mode.from_proto(r.response.mode))
                try:
                    cache = await loop.run_in_executor(self.gpu, self.engine.assemble, r.layers)
                except BaseException:
                    r.release()
                    raise
                return Prefilled(cache, r.response.first_token, r.response.first_logits_digest, timing, r.t_first,
                                 r.t_ready, r.release)
        cache, first, digest, timing.prefill_ms = await loop.run_in_executor(
            self.gpu, self.engine.local_prefill, list(request.token_ids), want)
        timing.mode = timing.mode or Mode.COLOCATED.proto
        self.metrics.prefill_ms.labels(Mode.from_proto(timing.mode)).observe(timing.prefill_ms)
        t = time.perf_counter()
        return Prefilled(cache, first, digest, timing, t, t)

    async def _generate(self, request, context, deadline: float):
        t_in, rid = time.perf_counter(), next(self.ids)
        p = await self._prefill(request, context, rid, deadline)
        try:
            async for msg in self._decode(request, context, deadline, rid, t_in, p):
                yield msg
        finally:
            p.release()

    async def _decode(self, request, context, deadline: float, rid: int, t_in: float, p: Prefilled):
        loop = asyncio.get_running_loop()
        n, want, cache, first, digest, timing = (len(request.token_ids), request.return_logits_digest, p.cache,
                                                 p.first, p.digest, p.timing)
        cache_dig = (await loop.run_in_executor(self.gpu, cache_digest, cache_layers(cache))
                     if request.return_cache_digest else "")
        timing.first_token_ms = (p.t_first - t_in) * 1e3
        timing.cache_ready_ms = (p.t_ready - t_in) * 1e3
        mode = Mode.from_proto(timing.mode)
        self.metrics.ttft_ms.labels(mode).observe(timing.cache_ready_ms)
        log.info("request %d: %d tokens, %s, cache ready %.1f ms", rid, n, mode, timing.cache_ready_ms)
        steps = request.max_new_tokens - 1
        if steps == 0:
            timing.total_ms = timing.second_token_ms = (time.perf_counter() - t_in) * 1e3
            yield pb.GenerateResponse(token_id=first, index=0, logits_digest=digest, timing=timing,
                                      cache_digest=cache_dig)
            return
        yield pb.GenerateResponse(token_id=first, index=0, logits_digest=digest, cache_digest=cache_dig)
        queue: asyncio.Queue = asyncio.Queue()
        cancelled = threading.Event()

        def emit(i, tok, dig, t):
            loop.call_soon_threadsafe(queue.put_nowait, (i, tok, dig, t))

        job = loop.run_in_executor(self.gpu, self.engine.decode, cache, first, steps, n, want, emit, cancelled)
        try:
            for _ in range(steps):
                left = deadline - time.perf_counter()
                i, tok, dig, t = await asyncio.wait_for(queue.get(), max(left, 0.001))
                if i == 1:
                    timing.second_token_ms = (t - t_in) * 1e3
                if i == steps:
                    timing.total_ms = (time.perf_counter() - t_in) * 1e3
                    yield pb.GenerateResponse(token_id=tok, index=i, logits_digest=dig, timing=timing)
                else:
                    yield pb.GenerateResponse(token_id=tok, index=i, logits_digest=dig)
            await job
        except asyncio.TimeoutError:
            cancelled.set()
            log.warning("request %d: decoding did not finish before the deadline", rid)
            await self._abort(context, grpc.StatusCode.DEADLINE_EXCEEDED, "decoding did not finish before the deadline")
        finally:
            cancelled.set()
            if not job.done():
                job.add_done_callback(lambda f: f.exception())  # Cancelled is expected; don't warn


async def create_server(config: DecodeConfig, service: DecodeService, address: str | None = None,
                        token: str = "") -> tuple[grpc.aio.Server, int]:
    """Build (not start) the server; returns it and the bound port (tests bind port 0)."""
    server, port, service.health = build_server(
        pb.DESCRIPTOR.services_by_name["Decode"], service, address or config.listen, config.max_message_bytes,
        token, server_credentials(config.tls_cert, config.tls_key, config.tls_ca))
    return server, port
