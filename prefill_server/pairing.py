"""The prefill side of the pair: answer handshakes, (re)build the data plane, say whether it is up.

Why the decode side leads: it is the front door and sees every failure first (a request
that fails, a control channel that drops), so it decides when to pair again and simply
handshakes; this side never has to detect the peer's death. Every accepted handshake is a
new pairing with a new epoch, which supersedes the old one:
- nccl/gloo: the answer names (instance id, epoch) at once; then, on the device thread
  (so no transfer of the old group is in progress), the old group is destroyed and a fresh
  one joined under that prefix while the decode side joins too, then one warm-up transfer.
- grpc/cuda_ipc: the device thread connects to the data address the decode side
  announced (closing the old link) and warms it up before the answer goes back.
Health is SERVING only while a pairing is up: a transfer that breaks a process group
(peer gone, gloo timeout: the group is closed for good) ends the pairing until the next
handshake, and the decode side, watching this health, sees it.

One decode worker at a time (until xPyD): a handshake from another decode instance is refused
FAILED_PRECONDITION, naming the paired one, while that one is alive: while its liveness watch (a
health Watch carrying its instance id, opened before its handshake) is open here. A decode worker
that dies closes its watch, so a restarted one pairs at once; a handshake that nobody follows up
(no watch) leaves nothing that blocks the next.
A stopping worker refuses handshakes (UNAVAILABLE: the decode side waits and retries), gives up a
join in progress, and closes its data plane; nothing it runs outlives the stop.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import secrets

import grpc
from grpc_health.v1.health import aio as health_aio

from kvtransfer.rpc.server import DECODE_INSTANCE_KEY
from kvtransfer.transport import Cause, TransferError
from kvtransfer.transport.registry import Rendezvous
from proto import kvtransfer_pb2 as pb

log = logging.getLogger("kvtransfer.prefill")


class PeerHealth(health_aio.HealthServicer):
    """The health service, counting the open Watch streams of each decode instance (its liveness watch)."""

    def __init__(self):
        super().__init__()
        self.watching: collections.Counter[int] = collections.Counter()

    async def Watch(self, request, context):
        raw = dict(context.invocation_metadata() or ()).get(DECODE_INSTANCE_KEY, "")
        who = int(raw, 16) if raw and all(c in "0123456789abcdef" for c in raw) else 0
        self.watching[who] += 1
        try:
            await super().Watch(request, context)
        finally:
            self.watching[who] -= 1


class PrefillPairing:
    def __init__(self, config, worker, backend, connect, gpu, metrics, store=None):
        self.config, self.worker, self.backend, self.connect = config, worker, backend, connect
        self.transport = backend.name
        self.process_group = backend.rendezvous is Rendezvous.PROCESS_GROUP
        self.gpu, self.metrics, self.store = gpu, metrics, store  # store: process-group rendezvous (rendezvous.py)
        self.instance_id = secrets.randbits(63) | 1
        self.epoch = 0
        self.health: PeerHealth | None = None  # the server's health servicer, set once the server is built
        self.loop: asyncio.AbstractEventLoop | None = None
        self.peer = 0  # the paired decode instance
        self.stopping = False

    def peer_alive(self) -> bool:
        return bool(self.peer) and self.health is not None and self.health.watching[self.peer] > 0

    async def handshake(self, request, context) -> pb.HandshakeResponse:
        """A compatible decode peer asks to pair: start a new pairing (epoch + 1) that supersedes the old one."""
        self.loop = asyncio.get_running_loop()
        if self.stopping:
            await context.abort(grpc.StatusCode.UNAVAILABLE, "the prefill worker is shutting down; pair with it "
                                "once it is back, or with another one")
        if request.instance_id != self.peer and self.peer_alive():
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION,
                                f"this prefill worker is paired with decode instance {self.peer:x}, which is alive; "
                                "one decode worker per prefill worker: point this decode server's --prefill-addr at "
                                "another prefill worker, or stop the other decode server")
        self.peer = request.instance_id
        self.epoch += 1
        epoch = self.epoch
        log.info("handshake from decode instance %x: pairing epoch %d (%s)", request.instance_id, epoch,
                 self.transport)
        await self._set_up(False)
        resp = pb.HandshakeResponse(instance_id=self.instance_id, epoch=epoch)
        if self.process_group:
            self.loop.run_in_executor(self.gpu, self._rejoin, epoch).add_done_callback(_log_failure)
            return resp
        try:
            await self.loop.run_in_executor(self.gpu, self._reconnect, request.data_address, epoch)
        except (TransferError, ValueError, OSError) as e:
            await context.abort(grpc.StatusCode.UNAVAILABLE,
                                f"cannot reach the data plane at {request.data_address}: {e}")
        return resp

    # --- device thread ---

    def _rejoin(self, epoch: int) -> None:
        from kvtransfer.transport.rendezvous import PairingAbandoned, join_pair, leave_pair, pairing_prefix
        if epoch != self.epoch:
            log.info("pairing epoch %d superseded by %d before it started", epoch, self.epoch)
            return
        old, self.worker.link = self.worker.link, None
        if old is not None:
            old.close()
        leave_pair(self.worker.m.device)
        log.info("joining process group epoch %d as rank 0 (%s)", epoch, self.transport)
        try:
            join_pair(0, self.store, pairing_prefix(self.instance_id, epoch), self.worker.m.device,
                      self.config.dist_timeout_s, self.config.dist_op_timeout_s,
                      abandoned=lambda: epoch != self.epoch or self.stopping)
            self.worker.link = self.connect()
            self.worker.warmup(self.config.warmup_tokens)
        except PairingAbandoned:
            log.info("pairing epoch %d abandoned before the decode peer joined (%s)", epoch,
                     "stopping" if self.stopping else f"superseded by epoch {self.epoch}")
            self.worker.link = None
            leave_pair(self.worker.m.device)
            return
        except (TransferError, RuntimeError) as e:  # torch.distributed reports a failed rendezvous as RuntimeError
            log.error("pairing epoch %d failed: %s; waiting for the decode peer to handshake again", epoch, e)
            self.worker.link = None
            leave_pair(self.worker.m.device)
            return
        self._paired(epoch)

    def _reconnect(self, address: str, epoch: int) -> None:
        """(Re)connect the data plane to a decode peer that (re)started, then warm it up."""
        if epoch != self.epoch:  # a newer handshake (the decode side retried) will connect
            log.info("pairing epoch %d superseded by %d before it started", epoch, self.epoch)
            return
        old, self.worker.link = self.worker.link, None
        if old is not None:
            old.close()
        self.worker.link = self.connect(address)
        log.info("data plane (%s) connected to %s", self.transport, address)
        self.worker.warmup(self.config.warmup_tokens)
        self._paired(epoch)

    def close(self) -> None:
        """On the device thread, at the stop: the data plane closed, the group left (its peer hears at once)."""
        from kvtransfer.transport.rendezvous import leave_pair
        old, self.worker.link = self.worker.link, None
        if old is not None:
            old.close()
        if self.process_group:
            leave_pair(self.worker.m.device)

    def _paired(self, epoch: int) -> None:
        log.info("paired with the decode peer (epoch %d)", epoch)
        self.metrics.pairings.inc()
        self._from_thread(self._set_up(True))

    def run_request(self, *args):
        """worker.run on the device thread; a transfer that broke the process group ends the pairing."""
        link = self.worker.link
        try:
            return self.worker.run(*args)
        except TransferError as e:
            if (self.process_group and e.cause in (Cause.PEER, Cause.TIMEOUT) and self.worker.link is link
                    and not type(link).survives_failed_request):
                from kvtransfer.transport.rendezvous import leave_pair
                log.warning("data plane lost (%s); unpaired until the decode peer handshakes again", e)
                self.worker.link = None
                leave_pair(self.worker.m.device)  # closes our end: a peer still blocked in the group wakes up
                self._from_thread(self._set_up(False))
            raise

    # --- health ---

    def _from_thread(self, coro) -> None:
        if self.loop is None:
            coro.close()
            return
        asyncio.run_coroutine_threadsafe(coro, self.loop)

    async def _set_up(self, up: bool) -> None:
        from grpc_health.v1 import health_pb2
        self.metrics.peer_up.set(1 if up else 0)
        if self.health is not None:
            s = health_pb2.HealthCheckResponse
            await self.health.set("", s.SERVING if up else s.NOT_SERVING)


def _log_failure(job) -> None:
    if not job.cancelled() and job.exception() is not None:
        log.error("pairing failed: %r", job.exception())
