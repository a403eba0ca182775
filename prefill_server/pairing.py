"""The prefill side of its pairs: answer handshakes, (re)build each decode peer's data plane, say which are up.

Why the decode side leads: it is the front door and sees every failure first (a request that fails, a control
channel that drops), so it decides when to pair again and simply handshakes; this side never has to detect the
peer's death. A prefill worker serves several decode workers (xPyD): one pair per decode instance (its handshake's
instance id), each with its own link, and every accepted handshake is a new pairing of that pair with a new epoch,
which supersedes its old one (never another pair's):
- nccl/gloo: the answer names (instance id, epoch) at once; then, on the device thread (so no transfer of the old
  group is in progress), the pair's old group is dropped; a fresh one is joined under that prefix on a thread of the
  join's own while the decode side joins too (a join whose decode worker died holds only that thread), then one
  warm-up back on the device thread (group_join.py).
- grpc/cuda_ipc: the device thread connects to the data address the decode side announced (closing the pair's old
  link) and warms it up before the answer goes back.
Each request names the decode instance that asked (PrefillRequest.decode_instance), and its cache goes to that
pair's link. A request that comes while its pair's process-group pairing is in progress (the decode side counts the
pair up once its own join returns, and sends at once) waits for that pairing to end (`request`). At most
--max-pending-pairings joins are in progress at once: a new decode worker's handshake beyond is refused.

Health, per pair (published through peer_health.py, which also says who still watches): a pair is up from its
pairing's warm-up until a transfer breaks its process group (peer gone, gloo timeout: the group is closed for good),
which ends that pair until its next handshake. A pair whose decode worker is gone (no liveness watch open here: a
health Watch carrying its instance id, opened before its handshake) is dropped at the next handshake. A stopping
worker refuses handshakes (UNAVAILABLE: the decode side waits and retries), gives up a join in progress, and closes
every data plane; nothing it runs outlives the stop.
"""

from __future__ import annotations

import asyncio
import logging
import secrets

import grpc

from kvtransfer.transport import Cause, TransferError
from kvtransfer.transport.errors import TlsRefused
from kvtransfer.transport.registry import Rendezvous
from prefill_server.group_join import GroupJoin
from prefill_server.pair import Pair, needs_place
from prefill_server.peer_health import PeerHealth, watch_token
from proto import kvtransfer_pb2 as pb

log = logging.getLogger("kvtransfer.prefill")


class PrefillPairing(GroupJoin):
    def __init__(self, config, worker, backend, connect, gpu, metrics, store=None):
        """connect(address="", group=None) builds a sender link: to `address` (grpc/cuda_ipc) or in `group`."""
        self.config, self.worker, self.backend, self.connect = config, worker, backend, connect
        self.transport = backend.name
        self.process_group = backend.rendezvous is Rendezvous.PROCESS_GROUP
        self.gpu, self.metrics, self.store = gpu, metrics, store  # store: process-group rendezvous (rendezvous.py)
        self.instance_id = secrets.randbits(63) | 1
        self.epoch = 0  # one count over every pair: a pairing's prefix (instance, epoch) is never reused
        self.health: PeerHealth | None = None  # the server's health servicer, set once the server is built
        self.loop: asyncio.AbstractEventLoop | None = None
        self.pairs: dict[int, Pair] = {}  # by decode instance
        self.stopping = False

    def alive(self, instance: int) -> bool:
        return self.health is not None and self.health.watched(instance)

    def up_count(self) -> int:
        return sum(p.up for p in self.pairs.values())

    def pending(self) -> int:  # pairings whose process group is being joined: a thread each
        return sum(p.pending() for p in self.pairs.values())

    async def handshake(self, request, context) -> pb.HandshakeResponse:
        """A compatible decode peer asks to pair: a new pairing of its pair (epoch + 1) that supersedes the old."""
        self.loop = asyncio.get_running_loop()
        if self.stopping:
            await context.abort(grpc.StatusCode.UNAVAILABLE, "the prefill worker is shutting down; pair with it "
                                "once it is back, or with another one")
        who = request.instance_id
        if not who:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "the handshake names no decode instance_id")
        cap = self.config.max_pending_pairings
        if self.process_group and needs_place(self.pairs.get(who)) and self.pending() >= cap:
            await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, f"{self.pending()} pairings are being joined "
                                "here (--max-pending-pairings); retry once one ends (--dist-timeout-s at most)")
        watch = "" if self.health is None else self.health.handshake(  # the liveness watch it goes by, before any await
            who, watch_token(dict(context.invocation_metadata() or ())))
        pair = self.pairs.setdefault(who, Pair(who))
        self.epoch += 1
        pair.epoch = epoch = self.epoch
        if self.process_group:  # its place taken before any await: until the join ends (_set_up, pair.settle)
            pair.settled.clear()
        gone = [p for i, p in self.pairs.items() if i != who and not self.alive(i)]
        log.info("handshake from decode instance %x: pairing epoch %d (%s; %d other pairs, %d gone; %s)", who, epoch,
                 self.transport, len(self.pairs) - 1 - len(gone), len(gone), watch)
        try:
            await self._set_up(pair, False)
        except asyncio.CancelledError:  # the caller went before its join was started: nothing else settles it
            pair.settle(epoch)
            raise
        resp = pb.HandshakeResponse(instance_id=self.instance_id, epoch=epoch)
        if self.process_group:
            self.loop.run_in_executor(self.gpu, self._rejoin, pair, epoch, gone).add_done_callback(
                self._on_failure(pair, epoch))
            return resp
        try:
            await self.loop.run_in_executor(self.gpu, self._reconnect, pair, request.data_address, epoch, gone)
        except (TransferError, ValueError, OSError) as e:
            log.warning("pairing epoch %d: cannot reach the data plane at %s: %s", epoch, request.data_address, e)
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION if isinstance(e, TlsRefused) else
                                grpc.StatusCode.UNAVAILABLE,  # TLS will not heal by retrying: the decode side stops
                                f"cannot reach the data plane at {request.data_address}: {e}")
        return resp

    # --- device thread ---

    def _drop(self, pair: Pair) -> None:
        """Close a pair's link and group (device thread)."""
        from kvtransfer.transport.rendezvous import leave_pair
        link, group, pair.link, pair.group = pair.link, pair.group, None, None
        if link is not None:
            link.close()
        leave_pair(group)

    def _forget(self, gone: list[Pair]) -> None:
        """Pairs whose decode worker is gone (no liveness watch): their links closed, their entries dropped."""
        for p in gone:
            if self.pairs.get(p.instance) is p and not self.alive(p.instance):
                log.info("decode instance %x is gone: its pair dropped", p.instance)
                self._drop(p)
                del self.pairs[p.instance]
                if self.health is not None:
                    self.health.forget(p.instance)
                self._from_thread(self._publish_any())

    def _reconnect(self, pair: Pair, address: str, epoch: int, gone: list[Pair]) -> None:
        """(Re)connect a pair's data plane to a decode peer that (re)started, then warm it up."""
        self._forget(gone)
        if epoch != pair.epoch:  # a newer handshake (the decode side retried) will connect
            log.info("pairing epoch %d superseded by %d before it started", epoch, pair.epoch)
            return
        self._drop(pair)
        pair.link = self.connect(address)
        log.info("data plane (%s) connected to %s", self.transport, address)
        self.worker.warmup(self.config.warmup_tokens, pair.link)
        self._paired(pair, epoch)

    def close(self) -> None:
        """On the device thread, at the stop: every data plane closed, every group left (the peers hear at once)."""
        for pair in list(self.pairs.values()):
            self._drop(pair)

    def _paired(self, pair: Pair, epoch: int) -> None:
        log.info("paired with decode instance %x (epoch %d)", pair.instance, epoch)
        self.metrics.pairings.inc()
        self._from_thread(self._set_up(pair, True))

    async def request(self, decode_instance: int, *args):
        """run_request on the device thread, once the asking decode worker's pairing in progress, if any, has ended
        (paired, failed or given up; at most --dist-timeout-s): the decode side counts the pair up as soon as its own
        join returns, and a request it sends at once could reach the device thread before this side's join thread
        handed it the group (UNAVAILABLE "no data plane paired here" for a request sent once it was SERVING)."""
        pair = self.pairs.get(decode_instance)
        if pair is not None and not pair.settled.is_set():
            try:
                await asyncio.wait_for(pair.settled.wait(), self.config.dist_timeout_s)
            except asyncio.TimeoutError:
                pass  # run_request says what is missing
        return await asyncio.get_running_loop().run_in_executor(self.gpu, self.run_request, decode_instance, *args)

    def run_request(self, decode_instance: int, *args):
        """worker.run over the asking decode worker's link, on the device thread; a transfer that broke its process
        group ends that pair."""
        pair = self.pairs.get(decode_instance)
        if pair is None and not decode_instance and len(self.pairs) == 1:
            pair = next(iter(self.pairs.values()))  # an older decode worker names no instance
        if pair is None or pair.link is None:
            raise TransferError("peer", f"decode instance {decode_instance:x} has no data plane paired here (the "
                                "decode server handshakes at start and again after a failure)")
        link = pair.link
        try:
            return self.worker.run(link, *args)
        except TransferError as e:
            if (self.process_group and e.cause in (Cause.PEER, Cause.TIMEOUT) and pair.link is link
                    and not type(link).survives_failed_request):
                log.warning("data plane lost (decode instance %x: %s); unpaired until it handshakes again",
                            pair.instance, e)
                self._drop(pair)  # closes our end: a peer still blocked in the group wakes up
                self._from_thread(self._set_up(pair, False))
            raise

    # --- health ---

    def _from_thread(self, coro) -> None:
        if self.loop is None:
            coro.close()
            return
        asyncio.run_coroutine_threadsafe(coro, self.loop)

    async def _set_up(self, pair: Pair, up: bool) -> None:
        pair.up = up
        if up:
            pair.was_up = True
            pair.settled.set()
        if self.health is not None:
            await self.health.set_pair(pair.instance, up)
        await self._publish_any()

    async def _settle(self, pair: Pair, epoch: int) -> None:
        pair.settle(epoch)

    def _on_failure(self, pair: Pair, epoch: int):
        """A done-callback (any thread) for the device thread's part of a pairing: if it raised, logged, and the
        pairing settled (else nothing would, and its place under --max-pending-pairings stayed taken)."""
        def done(job) -> None:
            _log_failure(job)
            if job.cancelled() or job.exception() is not None:
                self._from_thread(self._settle(pair, epoch))
        return done

    async def _publish_any(self) -> None:
        """"" and the peer_up gauge: SERVING while any pair is up (the gauge counts them)."""
        n = self.up_count()
        self.metrics.peer_up.set(n)
        if self.health is not None:
            await self.health.set_any(bool(n))


def _log_failure(job) -> None:
    if not job.cancelled() and job.exception() is not None:
        log.error("pairing failed: %r", job.exception())
