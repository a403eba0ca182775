"""The decode side's data plane: the receiving link, its receive loops, and one request's remote prefill.

Why apart from the pairing: the pairing decides *when* there is a peer (handshake, liveness, re-pairing);
this owns *how* caches arrive from it. One per prefill peer (a decode worker pairs with several). nccl/gloo: a
fresh process group of the pair's own (rendezvous.join_pair) and receive loop per pairing, old loops retired
(their threads end when the peer closes the old group); grpc/cuda_ipc: one listener whose loop lives across
pairings (the handshake makes the prefill worker reconnect), rebuilt only when it broke.
Every receive buffer is counted in `ledger` from a frame's header until its request lets go of it.
"""

from __future__ import annotations

import asyncio
import logging
import time

import grpc

from decode_server.peer.receiver import BufferLedger, ReceiveLoop
from decode_server.peer.remote import PEER_CODES, PeerFailure, Remote, RequestError
from kvtransfer.transport import TransferError, registry
from kvtransfer.transport.registry import Rendezvous
from kvtransfer.transport.status import transfer_status
from proto import kvtransfer_pb2 as pb

log = logging.getLogger("kvtransfer.decode")
S = grpc.StatusCode
QUIESCE_POLL_S = 0.05  # a stopping peer: how often to look whether its transfers in flight arrived
REPORT_FRESH_S = 1.0  # a peer's queue report counts this long (an idle peer sends none: a stale one would stick)


class DataPlane:
    def __init__(self, config, loaded, backend, metrics=None, addr: str = "", dist_init: str = ""):
        """addr: the prefill peer's control plane (for messages); dist_init: its rendezvous (nccl/gloo)."""
        self.config, self.m, self.backend, self.addr, self.dist_init = config, loaded, backend, addr, dist_init
        self.group = None  # nccl/gloo: the current pairing's process group
        self.inflight_tokens = 0  # prompt tokens of this worker's requests on the peer now
        self.reported_queue, self.reported_at = 0, 0.0  # the peer's queued prompt tokens (every decode worker's)
        # in its last answer, and when (monotonic)
        self.transport = backend.name
        self.options = registry.options_from(config, backend.name)
        self.addressed = backend.rendezvous is Rendezvous.ADDRESS
        self.ledger = BufferLedger()
        self.link = self.loop = None
        self.stopped: asyncio.Future | None = None  # resolves (with the loop's error) when the current loop stops
        self.old_loops: list[ReceiveLoop] = []  # retired, their threads possibly still blocked
        self.on_fatal = None  # given to each receive loop: called if one dies of a bug (the server stops)
        self.closing = False  # the server is stopping: a join in progress gives up

    # --- one pairing's data plane ---

    def listen(self) -> str:
        """Address transports: (re)open the listener unless its loop is healthy; the address to announce."""
        if not self.addressed:
            return ""
        if self.loop is None or self.loop.error is not None:
            if self.link is not None:
                self.link.close()
            self.link = self._new_link()
            log.info("data plane (%s) listening at %s", self.transport, self.link.address)
            self._start_loop(self.link, "kv-receive")
        return self.link.address

    async def join(self, resp) -> None:
        """Process-group transports: join the group the prefill worker named (instance, epoch); a loop serves it."""
        if self.addressed:
            return
        from kvtransfer.transport.rendezvous import join_pair, open_store, pairing_prefix, store_address
        c = self.config
        store = await asyncio.to_thread(open_store, self.dist_init, 1, c.dist_timeout_s)  # RendezvousUnreachable
        log.info("joining process group epoch %d as rank 1 (%s, %s)", resp.epoch, self.transport, self.dist_init)
        self.group = await asyncio.to_thread(join_pair, 1, store, pairing_prefix(resp.instance_id, resp.epoch),
                                             self.m.device, c.dist_timeout_s, c.dist_op_timeout_s,
                                             lambda: self.closing, store_address(self.dist_init)[0])
        self._start_loop(self._new_link(self.group), f"kv-receive-{resp.epoch}")

    async def down(self, reason: str) -> None:
        """The pairing ended: fail every waiting request now (process groups: leave the group too)."""
        if not self.addressed:
            await self.drop_group(reason)
        elif self.loop is not None:
            self.loop.fail_pending(f"prefill peer down: {reason}")

    async def drop_group(self, reason: str) -> None:
        from kvtransfer.transport.rendezvous import leave_pair
        if self.loop is not None:
            self.loop.retire(f"prefill peer down: {reason}")
            self.old_loops.append(self.loop)
            self.loop, self.stopped = None, None
        self.old_loops = [lp for lp in self.old_loops if lp.alive()]
        group, self.group = self.group, None
        await asyncio.to_thread(leave_pair, group)

    def _new_link(self, group=None):
        c, g = self.config, self.m.geometry
        # no valid frame is larger than a --max-prompt-tokens cache (cuda_ipc: the size of one receive slot)
        max_bytes = self.receive_limit()
        kw = {"group": group} if group is not None else {}
        return registry.receiver_link(self.transport, self.m.device, self.options, address=c.data_listen,
                                      max_bytes=max_bytes, max_layers=g.num_layers, **kw)

    def _start_loop(self, link, name: str) -> None:
        aloop = asyncio.get_running_loop()
        stopped = aloop.create_future()

        def on_stop():
            aloop.call_soon_threadsafe(lambda: stopped.done() or stopped.set_result(loop.error))
        loop = ReceiveLoop(link, self.m.geometry, self.m.device, self.config.request_timeout_s, self.ledger, name)
        loop.on_stop, loop.on_fatal = on_stop, self.on_fatal
        self.loop, self.stopped = loop, stopped
        loop.start()

    # --- one request ---

    async def remote_prefill(self, stub, request, rid: int, deadline: float, metadata, destination, lease,
                             sampling: pb.Sampling | None = None, instance: int = 0) -> Remote:
        """Prefill `request` on the peer as request `rid`, its cache landing in `destination` (per layer (k, v)
        views of the request's pool slot, held by `lease` while a frame lands); raises PeerFailure or
        RequestError. Bounded by --peer-timeout-s as well as the deadline, so a stalled peer leaves time to
        recompute. `sampling` (its seed set) chooses the first token there; None: greedy. `instance`: this side's
        pairing instance (the peer sends the cache to its data plane)."""
        c, loop, n = self.config, self.loop, len(request.token_ids)
        if loop is None:
            raise PeerFailure("peer_down", S.UNAVAILABLE, "the data plane is being rebuilt; retry")
        peer_deadline = min(deadline, time.perf_counter() + c.peer_timeout_s)
        by_peer = peer_deadline < deadline  # which bound a timeout hits: the peer's, or the request's own
        exp = loop.expect(rid, n, destination, lease)
        arrived = False
        self.inflight_tokens += n
        try:
            t_sent = time.perf_counter()
            resp = await stub.Prefill(
                pb.PrefillRequest(request_id=rid, token_ids=request.token_ids, mode=request.mode,
                                  return_logits_digest=request.return_logits_digest, sampling=sampling,
                                  decode_instance=instance),
                timeout=max(peer_deadline - t_sent, 0.001), metadata=metadata)
            t_first = time.perf_counter()
            self.reported_queue, self.reported_at = resp.queued_tokens, time.monotonic()
            await asyncio.wait_for(asyncio.wrap_future(exp.future), max(peer_deadline - t_first, 0.001))
            arrived = True
        except grpc.aio.AioRpcError as e:
            code = e.code()
            if code == S.DEADLINE_EXCEEDED and by_peer:
                raise PeerFailure("peer_timeout", S.UNAVAILABLE, f"the prefill worker did not answer within "
                                  f"--peer-timeout-s {c.peer_timeout_s:g} s") from None
            if code in PEER_CODES:
                raise PeerFailure("peer_error", code, f"the prefill worker at {self.addr} failed the request "
                                  f"({code.name}: {e.details()})") from None
            raise RequestError(code, f"prefill worker: {e.details()}") from None
        except TransferError as e:
            raise PeerFailure(f"transfer_{e.cause}", transfer_status(e), f"cache transfer: {e}") from None
        except asyncio.TimeoutError:
            if by_peer:
                raise PeerFailure("peer_timeout", S.UNAVAILABLE, "the cache did not arrive from the prefill worker "
                                  f"within --peer-timeout-s {c.peer_timeout_s:g} s") from None
            raise RequestError(S.DEADLINE_EXCEEDED, "the cache did not arrive before the deadline") from None
        finally:
            self.inflight_tokens -= n
            if not arrived:  # failed, timed out or cancelled: a late frame is drained and dropped
                loop.forget(rid)
                loop.release(exp)
        return Remote(resp, t_sent, t_first, max(exp.t_ready, t_first), lambda: loop.release(exp))

    # --- what the metrics read ---

    def _loops(self) -> list[ReceiveLoop]:
        return [*self.old_loops, *([self.loop] if self.loop else [])]

    def receive_loops(self) -> int:
        return sum(lp.alive() for lp in self._loops())

    def receivers(self) -> int:
        """Data-plane receivers holding buffers: the gRPC listener's, or the one each process-group loop is in."""
        if self.addressed:
            return self.link.inflight() if self.link is not None else 0
        return sum(lp.receiving() for lp in self._loops())

    def pending(self) -> int:
        return self.loop.pending() if self.loop else 0

    def load(self) -> int:
        """Prompt tokens ahead of a new request on the peer, as this worker knows them: its own in flight there,
        plus what the peer last said was queued (other decode workers' too) while that is recent."""
        fresh = time.monotonic() - self.reported_at < REPORT_FRESH_S
        return self.inflight_tokens + (self.reported_queue if fresh else 0)

    def receive_limit(self) -> int:
        """The largest frame accepted (announced at the handshake, so the peer refuses what would not fit)."""
        c, g = self.config, self.m.geometry
        return min(c.max_receive_bytes, g.cache_bytes(c.max_prompt_tokens))

    async def quiesce(self, timeout_s: float) -> bool:
        """Wait (at most `timeout_s`) until no request waits for a frame, or the receive loop stopped; True when
        nothing was left waiting."""
        deadline = time.monotonic() + timeout_s
        while self.pending() and not (self.stopped is not None and self.stopped.done()):
            if time.monotonic() >= deadline:
                return False
            await asyncio.sleep(QUIESCE_POLL_S)
        return not self.pending()
