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
"""

from __future__ import annotations

import asyncio
import logging
import secrets

import grpc

from kvtransfer.transport import Cause, TransferError
from kvtransfer.transport.registry import Rendezvous
from proto import kvtransfer_pb2 as pb

log = logging.getLogger("kvtransfer.prefill")


class PrefillPairing:
    def __init__(self, config, worker, backend, connect, gpu, metrics, store=None):
        self.config, self.worker, self.backend, self.connect = config, worker, backend, connect
        self.transport = backend.name
        self.process_group = backend.rendezvous is Rendezvous.PROCESS_GROUP
        self.gpu, self.metrics, self.store = gpu, metrics, store  # store: process-group rendezvous (rendezvous.py)
        self.instance_id = secrets.randbits(63) | 1
        self.epoch = 0
        self.health = None  # the server's health servicer, set once the server is built
        self.loop: asyncio.AbstractEventLoop | None = None

    async def handshake(self, request, context) -> pb.HandshakeResponse:
        """A compatible decode peer asks to pair: start a new pairing (epoch + 1) that supersedes the old one."""
        self.loop = asyncio.get_running_loop()
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
        from kvtransfer.transport.rendezvous import join_pair, leave_pair, pairing_prefix
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
                      self.config.dist_timeout_s, self.config.dist_op_timeout_s)
            self.worker.link = self.connect()
            self.worker.warmup(self.config.warmup_tokens)
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
