"""Decode gRPC service: `Generate`, the front door.

Why this flow: the request id is chosen here and registered with the receive loop
*before* the prefill worker is asked, so the frame can never arrive unexpected; the first
token streams as soon as the prefill worker names it, and decoding starts once the whole
cache is on this device. Every request ends in a status before its deadline.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import threading
import time

import grpc

from kvtransfer.security import server_credentials
from kvtransfer.serving import InflightLimit, build_server, transfer_status
from kvtransfer.streaming import cache_digest, cache_layers
from kvtransfer.transport import TransferError
from proto import kvtransfer_pb2 as pb
from proto import kvtransfer_pb2_grpc as pbg

from .config import DecodeConfig
from .engine import DecodeEngine
from .receiver import ReceiveLoop

log = logging.getLogger("kvtransfer.decode")

KNOWN_MODES = {pb.MODE_AUTO, pb.MODE_LAYERWISE, pb.MODE_BULK, pb.MODE_COLOCATED}


class DecodeService(pbg.DecodeServicer):
    def __init__(self, config: DecodeConfig, engine: DecodeEngine, gpu, receiver: ReceiveLoop | None = None,
                 prefill_stub: pbg.PrefillStub | None = None, prefill_metadata=None):
        self.config, self.engine, self.gpu = config, engine, gpu
        self.receiver, self.prefill_stub = receiver, prefill_stub
        self.vocab = engine.m.model.config.vocab_size
        self.ids = itertools.count(1)  # 0 is the warm-up frame
        self.admit = InflightLimit(config.max_inflight)
        self.prefill_metadata = prefill_metadata  # the prefill worker's token, when it asks for one

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
            if self.receiver is None:
                problem, code = "no prefill peer configured", grpc.StatusCode.FAILED_PRECONDITION
            elif (size := self.engine.m.geometry.cache_bytes(n)) > c.max_receive_bytes:
                problem, code = (f"a {n}-token cache is {size} bytes, over this server's --max-receive-bytes "
                                 f"{c.max_receive_bytes}; send a shorter prompt"), grpc.StatusCode.RESOURCE_EXHAUSTED
        if problem is not None:
            await context.abort(code or grpc.StatusCode.INVALID_ARGUMENT, problem)

    async def Generate(self, request, context):
        await self._validate(request, context)
        if not self.admit.try_enter():
            await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, self.admit.refusal())
        try:
            remaining = context.time_remaining()
            budget = self.config.request_timeout_s if remaining is None else min(remaining, self.config.request_timeout_s)
            deadline = time.perf_counter() + budget
            async for msg in self._generate(request, context, deadline):
                yield msg
        finally:
            self.admit.leave()

    async def _generate(self, request, context, deadline: float):
        t_in = time.perf_counter()
        loop = asyncio.get_running_loop()
        n, want = len(request.token_ids), request.return_logits_digest
        timing = pb.Timing()
        if self.config.colocated or request.mode == pb.MODE_COLOCATED:
            cache, first, digest, prefill_ms = await loop.run_in_executor(
                self.gpu, self.engine.local_prefill, list(request.token_ids), want)
            timing.prefill_ms, timing.mode = prefill_ms, "colocated"
            t_first = t_ready = time.perf_counter()
        else:
            rid = next(self.ids)
            exp = self.receiver.expect(rid, n)
            arrived = False
            try:
                resp = await self.prefill_stub.Prefill(
                    pb.PrefillRequest(request_id=rid, token_ids=request.token_ids, mode=request.mode,
                                      return_logits_digest=want), timeout=max(deadline - time.perf_counter(), 0.001),
                    metadata=self.prefill_metadata)
                t_first = time.perf_counter()
                layers = await asyncio.wait_for(asyncio.wrap_future(exp.future),
                                                max(deadline - time.perf_counter(), 0.001))
                arrived = True
            except grpc.aio.AioRpcError as e:
                await context.abort(e.code(), f"prefill worker: {e.details()}")
            except TransferError as e:
                await context.abort(transfer_status(e), f"cache transfer: {e}")
            except asyncio.TimeoutError:
                await context.abort(grpc.StatusCode.DEADLINE_EXCEEDED, "the cache did not arrive before the deadline")
            finally:
                if not arrived:  # failed, timed out or cancelled: a late frame is drained and dropped
                    self.receiver.forget(rid)
            t_ready = max(exp.t_ready, t_first)
            first, digest = resp.first_token, resp.first_logits_digest
            timing.prefill_ms, timing.mode = resp.prefill_ms, resp.mode
            timing.transfer_bytes = self.engine.m.geometry.cache_bytes(n)
            cache = await loop.run_in_executor(self.gpu, self.engine.assemble, layers)
        cache_dig = (await loop.run_in_executor(self.gpu, cache_digest, cache_layers(cache))
                     if request.return_cache_digest else "")
        timing.first_token_ms = (t_first - t_in) * 1e3
        timing.cache_ready_ms = (t_ready - t_in) * 1e3
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
            await context.abort(grpc.StatusCode.DEADLINE_EXCEEDED, "decoding did not finish before the deadline")
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
