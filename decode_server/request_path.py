"""One admitted request's path: its KV lease, its prefill, its tokens streamed back, a preemption's resume.

Why apart from the servicer (server.py): the servicer decides whether a request may start and how the server
ends (failed, draining, the concurrency cap); this file is what happens to one request once it may. The request
id is chosen here and registered with the receive loop *before* the prefill worker is asked, so the frame can
never arrive unexpected; the first token streams as soon as the prefill worker names it, and decoding starts once
the whole cache is on this device. When the peer or the data plane fails the request, --on-failure decides:
`fail` ends it with UNAVAILABLE saying what failed and what to do, `recompute` prefills here instead (the
colocated path: same tokens). Every request ends in a status before its deadline.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import time
from contextlib import aclosing
from dataclasses import dataclass

import grpc
import numpy as np

from decode_server.admission import AdmissionQueue
from decode_server.config import DecodeConfig
from decode_server.landing import pool_destination
from decode_server.peer.peers import PrefillPeers
from decode_server.peer.remote import PeerFailure, RequestError
from decode_server.reuse import count_reuse, resume_taker, slot_taker
from decode_server.streams import Mailbox, TokenStream, slot_ready
from kvtransfer.engine.engine import DecodeEngine
from kvtransfer.engine.sampler import SamplingParams, sampling_params
from kvtransfer.engine.sequence import EndCause, Ended, Sequence
from kvtransfer.rpc.lifecycle import request_budget
from kvtransfer.rpc.metrics import Metrics
from kvtransfer.rpc.modes import Mode
from proto import kvtransfer_pb2 as pb

log = logging.getLogger("kvtransfer.decode")

END_STATUS = {EndCause.REQUEST_ENDED: grpc.StatusCode.CANCELLED, EndCause.SLOW_READER: grpc.StatusCode.RESOURCE_EXHAUSTED,
              EndCause.STEP_FAILED: grpc.StatusCode.INTERNAL, EndCause.SHUTDOWN: grpc.StatusCode.UNAVAILABLE,
              EndCause.ENGINE_FAILED: grpc.StatusCode.INTERNAL}


@dataclass
class Prefilled:
    first: int
    digest: str
    timing: pb.Timing
    t_first: float  # perf_counter: first token known
    t_ready: float  # whole cache in the request's pool slot


async def abort(context, code: grpc.StatusCode, message: str):
    """End the call with `code`: a status, or a cancel where gRPC already ended it (the servicer's gate uses it too)."""
    left = context.time_remaining()  # grpc.aio's done() is only "status sent"; a passed deadline shows here
    if context.done() or context.cancelled() or (left is not None and left <= 0):
        raise asyncio.CancelledError(message)  # gRPC already ended the call: a status now fails in core
    await context.abort(code, message)  # counted once, by RunningRequests.request


class RequestPath:
    """The path every admitted request of one server takes; holds what they share: the request ids, the loop's
    Mailbox and the preemption count."""

    def __init__(self, config: DecodeConfig, engine: DecodeEngine, peers: PrefillPeers | None,
                 admission: AdmissionQueue, metrics: Metrics, prefill_metadata=None):
        self.config, self.engine, self.peers, self.admission, self.metrics = config, engine, peers, admission, metrics
        self.prefill_metadata = prefill_metadata  # the prefill worker's token, when it asks for one
        self.ids = itertools.count(1)  # 0 is the warm-up frame
        self._mailbox: Mailbox | None = None  # tokens from the scheduler thread to this server's loop, one wake a burst
        self.preemptions = 0  # running requests preempted since start (Load.preemptions)

    def _box(self) -> Mailbox:
        """The Mailbox of the running loop: made on first use (the servicer is built before its loop may run)."""
        loop, box = asyncio.get_running_loop(), self._mailbox
        if box is None or box.loop is not loop:
            box = self._mailbox = Mailbox(loop)
        return box

    async def responses(self, request, context, r):
        """The request's messages, from its lease in the admission queue (arrival order) to its last token; `r`:
        its record in RunningRequests (its sequence, for a shutdown or fail_all to stop)."""
        deadline = time.perf_counter() + request_budget(context.time_remaining(), self.config.request_timeout_s)
        try:
            lease = await self.admission.acquire(deadline, self._take(request))  # in arrival order
        except RequestError as e:
            await abort(context, e.code, e.message)
        held = [lease]  # the request's lease (a preempted request's is replaced by the one it is readmitted with)
        try:
            await slot_ready(lease)  # copies into or out of the slot (the prefix cache's) are done
            async with aclosing(self._generate(request, context, deadline, held, r)) as tokens:
                async for msg in tokens:
                    yield msg
        finally:
            for le in held:
                le.release()

    def _take(self, request):
        return slot_taker(self.engine.cache, self.config, request, self.metrics, self.engine.pool)

    async def _prefill(self, request, context, rid: int, deadline: float, lease,
                       sampling: SamplingParams | None) -> Prefilled:
        """The cache into the request's slot and the first token (chosen by `sampling`, the same on both sides),
        remotely unless colocated; the --on-failure policy when the peer fails."""
        want = request.return_logits_digest
        timing = pb.Timing()
        reuse = lease.reuse
        if reuse is not None:  # a cached prefix is in the slot: prefill the rest here
            count_reuse(reuse, timing, self.metrics)
            log.debug("request %d: %d of %d prompt tokens from the prefix cache (%s, %s)", rid, reuse.length,
                      len(request.token_ids), reuse.tier, reuse.how)
        elif not (self.config.colocated or request.mode == pb.MODE_COLOCATED):
            try:
                wire = None if sampling is None else pb.Sampling(temperature=sampling.temperature,
                                                                 top_p=sampling.top_p, top_k=sampling.top_k,
                                                                 seed=sampling.seed)
                r = await self.peers.remote_prefill(request, rid, deadline, self.prefill_metadata, lease, wire,
                                                    pool_destination(self.engine.pool, lease.slot,
                                                                     len(request.token_ids)))
            except RequestError as e:
                await abort(context, e.code, e.message)
            except PeerFailure as f:
                self.metrics.failures.labels(f.cause).inc()
                if self.config.on_failure != "recompute":
                    log.warning("request %d: %s", rid, f.message)
                    await abort(context, f.code, f"{f.message}. Retry later; or start the decode server with "
                                      "--on-failure recompute to prefill here when the peer fails")
                if time.perf_counter() >= deadline:
                    await abort(context, grpc.StatusCode.DEADLINE_EXCEEDED,
                                      f"{f.message}; no time was left to recompute before the deadline")
                log.warning("request %d: %s; recomputing the prefill here (--on-failure recompute)", rid, f.message)
                timing.mode = Mode.RECOMPUTE.proto
            else:
                r.release()  # the cache is in the slot now: the receive side holds nothing for it
                timing.prefill_ms, timing.mode = r.response.prefill_ms, r.response.mode
                timing.transfer_bytes = nbytes = self.engine.m.geometry.cache_bytes(len(request.token_ids))
                self.metrics.moved(nbytes, r.t_ready - r.t_sent, Mode.from_proto(r.response.mode))
                return Prefilled(r.response.first_token, r.response.first_logits_digest, timing, r.t_first, r.t_ready)
        job = self.engine.prefill(list(request.token_ids), lease, want, sampling, reuse.length if reuse else 0)
        local = await self._within(context, job, deadline, "the prefill did not finish before the deadline")
        timing.prefill_ms = local.prefill_ms
        timing.mode = timing.mode or Mode.COLOCATED.proto
        self.metrics.prefill_ms.labels(Mode.from_proto(timing.mode)).observe(timing.prefill_ms)
        t = time.perf_counter()
        return Prefilled(local.first, local.digest, timing, t, t)

    async def _within(self, context, future, deadline: float, late: str):
        """Await a scheduler future before the deadline (DEADLINE_EXCEEDED after; the job is cancelled if queued)."""
        try:
            return await asyncio.wait_for(asyncio.wrap_future(future), max(deadline - time.perf_counter(), 0.001))
        except asyncio.TimeoutError:
            future.cancel()
            await abort(context, grpc.StatusCode.DEADLINE_EXCEEDED, late)

    async def _resume(self, request, context, deadline: float, rid: int, tokens: list[int], left: int):
        """A preempted request back in: readmitted ahead of every new arrival, and its context (`tokens` but the
        last, whose KV the next step makes) put back in the new lease's row: prefilled here, after any prefix the
        cache held. Returns the lease; `left`: tokens still to make."""
        take = resume_taker(self.engine.cache, request, tokens, left, self.metrics, self.engine.pool)
        try:
            lease = await self.admission.acquire(deadline, take, resumed=rid)
        except RequestError as e:
            await abort(context, e.code, e.message)
        try:
            await slot_ready(lease)
            n, reused = len(tokens) - 1, lease.reuse.length if lease.reuse is not None else 0
            if lease.reuse is not None and lease.reuse.tier == "host":  # swapped back in (or another's context)
                self.metrics.reload_bytes.inc(lease.reuse.bytes)
            if reused < n:  # its first token is the one already made: dropped
                job = self.engine.prefill(tokens[:n], lease, False, None, reused)
                await self._within(context, job, deadline, "the preempted request's context was not prefilled "
                                   "again before the deadline")
            log.debug("request %d resumed at %d tokens (%d reused, %d prefilled)", rid, n, reused, n - reused)
        except BaseException:
            lease.release()
            raise
        return lease

    def _swaps(self, request) -> bool:
        """Whether a preempted row of this request may be swapped to the host tier (preempt.py): there is one, and
        the request does not skip the prefix cache (its resume reloads through it)."""
        cache = self.engine.cache
        return cache is not None and cache.host is not None and not request.skip_prefix_cache

    async def _generate(self, request, context, deadline: float, held: list, r):
        lease = held[0]
        t_in, rid = time.perf_counter(), next(self.ids)
        n, want = len(request.token_ids), request.return_logits_digest
        sm = request.sampling  # absent or temperature 0: None (greedy); a seed drawn here when the request has none
        sampling = sampling_params(sm.temperature, sm.top_p if sm.HasField("top_p") else None, sm.top_k,
                                   sm.seed if sm.HasField("seed") else None)
        # the tokens that end the request early (each is sent, as its last)
        stops = frozenset(request.stop_token_ids) | (self.engine.eos if request.stop_on_eos else frozenset())
        p = await self._prefill(request, context, rid, deadline, lease, sampling)
        prompt = np.asarray(request.token_ids, dtype=np.int64)
        lease.keep = prompt  # the prompt's KV is whole in the slot: cached when the request lets it go
        timing = p.timing
        cache_dig = (await self._within(context, self.engine.digest(lease.slot, n), deadline,
                                        "the cache digest did not finish before the deadline")
                     if request.return_cache_digest else "")
        timing.first_token_ms = (p.t_first - t_in) * 1e3
        timing.cache_ready_ms = (p.t_ready - t_in) * 1e3
        mode = Mode.from_proto(timing.mode)
        self.metrics.ttft_ms.labels(mode).observe(timing.cache_ready_ms)
        log.info("request %d: %d tokens, %s, cache ready %.1f ms", rid, n, mode, timing.cache_ready_ms)
        steps = request.max_new_tokens - 1
        if steps == 0 or p.first in stops:
            timing.total_ms = timing.second_token_ms = (time.perf_counter() - t_in) * 1e3
            yield pb.GenerateResponse(token_id=p.first, index=0, logits_digest=p.digest, timing=timing,
                                      cache_digest=cache_dig, finish_reason=finish_reason(p.first, stops))
            return
        yield pb.GenerateResponse(token_id=p.first, index=0, logits_digest=p.digest, cache_digest=cache_dig)
        stream = TokenStream(self._box(), self.config.stream_buffer_tokens)
        lease.hold()  # the sequence's own hold: the scheduler lets go when it drops or finishes it (or preempts it:
        # then this request is readmitted and continues from the tokens it made, `_resume`)
        swaps = self._swaps(request)  # the sequence keeps its tokens: a preempted row may go to the host tier
        seq = stream.seq = Sequence(rid, lease, n, p.first, steps, stream.sink, want, stops, sampling=sampling,
                                    tokens=[*request.token_ids, p.first] if swaps else None)
        r.seq = seq
        self.engine.scheduler.add(seq)
        made = [p.first]  # the tokens delivered: a delivered token's predecessor has its KV in the slot
        try:
            while True:
                item = await stream.next(deadline)
                if isinstance(item, Ended) and item.cause is EndCause.PREEMPTED:  # not the client's business
                    self.preemptions += 1
                    self.metrics.preemptions.labels(item.reason).inc()
                    r.seq = None  # waiting again (Load; a shutdown cancels it)
                    held.pop().release()
                    tokens = prompt.tolist() + made
                    left = request.max_new_tokens - len(made)
                    lease = await self._resume(request, context, deadline, rid, tokens, left)
                    held.append(lease)
                    lease.hold()  # the sequence's own hold, as the first one had
                    seq = stream.seq = Sequence(rid, lease, len(tokens) - 1, made[-1], left, stream.sink, want,
                                                stops, index=len(made) - 1, sampling=sampling,
                                                tokens=tokens if swaps else None)
                    r.seq = seq
                    self.engine.scheduler.add(seq)
                    continue
                if isinstance(item, Ended):
                    await abort(context, END_STATUS[item.cause], item.reason)
                made.append(item.token_id)
                if item.index == 1:
                    timing.second_token_ms = (item.t - t_in) * 1e3
                if item.last:
                    timing.total_ms = (time.perf_counter() - t_in) * 1e3
                    yield pb.GenerateResponse(token_id=item.token_id, index=item.index,
                                              logits_digest=item.logits_digest, timing=timing,
                                              finish_reason=finish_reason(item.token_id, stops))
                    return
                yield pb.GenerateResponse(token_id=item.token_id, index=item.index, logits_digest=item.logits_digest)
        except asyncio.TimeoutError:
            log.warning("request %d: decoding did not finish before the deadline", rid)
            await abort(context, grpc.StatusCode.DEADLINE_EXCEEDED, "decoding did not finish before the deadline")
        finally:
            seq.stop("the request ended (client gone, deadline or error)")  # no-op once it finished
            if held:
                held[-1].keep = np.concatenate([prompt, np.asarray(made[:-1], dtype=np.int64)])



def finish_reason(last: int, stops: frozenset[int]) -> int:
    """Why the last message is the last: a stop token (stop_token_ids, or EOS with stop_on_eos), else the length."""
    return pb.FINISH_REASON_STOP if last in stops else pb.FINISH_REASON_LENGTH
