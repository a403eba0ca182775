"""The decode side of the pair: handshake, data plane, liveness watch, and re-pairing after a failure.

Why the decode side leads: it is the front door, so it needs to know at every moment
whether remote prefill can work, and it sees failures first. A pairing is one handshake
plus the data plane built for it. It ends when the liveness watch (a health `Watch` stream
on the prefill worker over the keepalive'd control channel) breaks or reports NOT_SERVING,
or when the receive loop stops. Then every waiting request is failed at once (each goes
to the --on-failure policy), health says NOT_SERVING, and the supervisor handshakes again
until the peer answers, without restarting this process:
- nccl/gloo: the old group is destroyed (an old receive thread still blocked in it ends
  when the peer closes its side) and a fresh one joined under the (instance, epoch) that
  the prefill worker named in its answer; a new receive loop serves it.
- grpc/cuda_ipc: the listener stays; the handshake makes the prefill worker reconnect.
A new instance id in the answer means the prefill worker restarted; it is logged.
"""

from __future__ import annotations

import asyncio
import logging
import secrets
import time

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from kvtransfer.transport import registry
from kvtransfer.transport.registry import Rendezvous
from proto import kvtransfer_pb2 as pb
from proto import kvtransfer_pb2_grpc as pbg

from .handshake import HandshakeRefused, handshake
from .receiver import BufferLedger, ReceiveLoop

log = logging.getLogger("kvtransfer.decode")
SERVING, NOT_SERVING = health_pb2.HealthCheckResponse.SERVING, health_pb2.HealthCheckResponse.NOT_SERVING
DECODE_SERVICE = pb.DESCRIPTOR.services_by_name["Decode"].full_name


class DecodePairing:
    def __init__(self, config, loaded, backend, compat: pb.Compat, channel, metadata, metrics):
        self.config, self.m, self.backend, self.compat = config, loaded, backend, compat
        self.transport = backend.name
        self.options = registry.options_from(config, backend.name)
        self.addressed = backend.rendezvous is Rendezvous.ADDRESS
        self.stub = pbg.PrefillStub(channel)
        self.health_stub = health_pb2_grpc.HealthStub(channel)
        self.metadata, self.metrics = metadata, metrics
        self.instance_id = secrets.randbits(63) | 1
        self.ledger = BufferLedger()
        self.link = self.loop = None
        self._stopped: asyncio.Future | None = None
        self.old_loops: list[ReceiveLoop] = []  # retired, their threads possibly still blocked
        self.up, self.down_reason, self.down_since = False, "not paired yet", time.monotonic()
        self.prefill_instance = self.epoch = 0
        self.health = None
        self._task = None

    # --- the pairing's life ---

    async def start(self) -> None:
        """The first pairing (raises HandshakeRefused: the server exits), then supervise it."""
        await self._pair()
        self._task = asyncio.create_task(self._supervise(), name="pairing")

    async def _supervise(self) -> None:
        while True:
            try:
                reason = await self._watch()
            except Exception as e:  # a bug here must not leave the server believing the pair is up
                log.exception("liveness watch failed")
                reason = f"liveness watch failed: {e!r}"
            await self._down(reason)
            delay = 0.5
            while True:
                try:
                    await self._pair()
                    break
                except HandshakeRefused as e:
                    self.down_reason = str(e)
                    log.error("re-pairing: %s", e)
                except Exception as e:  # a rendezvous that timed out or failed (RuntimeError), a bad address
                    log.warning("re-pairing failed: %s; trying again", e)
                    await self._drop_group("re-pairing failed")
                await asyncio.sleep(delay)
                delay = min(delay * 2, 5.0)

    async def _pair(self) -> None:
        if self.addressed and (self.loop is None or self.loop.error is not None):
            if self.link is not None:
                self.link.close()
            self.link = self._new_link()
            log.info("data plane (%s) listening at %s", self.transport, self.link.address)
            self._start_loop(self.link, "kv-receive")
        resp = await handshake(self.stub, self.compat, self.transport, self.config.handshake_timeout_s,
                               self.config.max_receive_bytes, self.metadata,
                               self.link.address if self.addressed else "",
                               self.instance_id, self.config.prefill_addr)
        if self.prefill_instance and resp.instance_id != self.prefill_instance:
            log.warning("the prefill worker restarted (instance %x -> %x)", self.prefill_instance, resp.instance_id)
        if not self.addressed:
            await self._join(resp)
        self.prefill_instance, self.epoch = resp.instance_id, resp.epoch
        self.metrics.pairings.inc()
        await self._set_up(True, "")
        log.info("paired with prefill instance %x, epoch %d (%s)", resp.instance_id, resp.epoch, self.transport)

    async def _join(self, resp) -> None:
        from kvtransfer.transport.rendezvous import join_pair, open_store, pairing_prefix
        c = self.config
        log.info("joining process group epoch %d as rank 1 (%s)", resp.epoch, self.transport)
        store = await asyncio.to_thread(open_store, c.dist_init, 1, c.dist_timeout_s)
        await asyncio.to_thread(join_pair, 1, store, pairing_prefix(resp.instance_id, resp.epoch), self.m.device,
                                c.dist_timeout_s, c.dist_op_timeout_s)
        self._start_loop(self._new_link(), f"kv-receive-{resp.epoch}")

    def _new_link(self):
        c, g = self.config, self.m.geometry
        # no valid frame is larger than a --max-prompt-tokens cache (cuda_ipc: the size of one receive slot)
        max_bytes = min(c.max_receive_bytes, g.cache_bytes(c.max_prompt_tokens))
        return registry.receiver_link(self.transport, self.m.device, self.options, address=c.data_listen,
                                      max_bytes=max_bytes, max_layers=g.num_layers)

    def _start_loop(self, link, name: str) -> None:
        aloop = asyncio.get_running_loop()
        stopped = aloop.create_future()

        def on_stop():
            aloop.call_soon_threadsafe(lambda: stopped.done() or stopped.set_result(loop.error))
        loop = ReceiveLoop(link, self.m.geometry, self.m.device, self.config.request_timeout_s, self.ledger, name)
        loop.on_stop = on_stop
        self.loop, self._stopped = loop, stopped
        loop.start()

    async def _watch(self) -> str:
        """Wait until the pairing ends; returns why."""
        watch = asyncio.ensure_future(self._watch_health())
        waits = {watch} | ({self._stopped} if self._stopped is not None else set())
        done, _ = await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
        if watch not in done:
            watch.cancel()
            return f"data plane failed: {self._stopped.result()}"
        return watch.result()

    async def _watch_health(self) -> str:
        seen_serving = False
        call = self.health_stub.Watch(health_pb2.HealthCheckRequest(), metadata=self.metadata)
        try:
            async for r in call:
                if r.status == SERVING:
                    seen_serving = True
                elif seen_serving:
                    return "the prefill worker reports NOT_SERVING (its data plane failed)"
            return "the prefill worker ended the liveness watch"
        except grpc.aio.AioRpcError as e:
            return f"control channel to the prefill worker lost ({e.code().name}: {e.details()})"
        finally:
            call.cancel()

    async def _down(self, reason: str) -> None:
        await self._set_up(False, reason)
        log.warning("prefill peer down: %s; failing waiting requests (--on-failure %s) and pairing again", reason,
                    self.config.on_failure)
        if not self.addressed:
            await self._drop_group(reason)
        elif self.loop is not None:
            self.loop.fail_pending(f"prefill peer down: {reason}")

    async def _drop_group(self, reason: str) -> None:
        from kvtransfer.transport.rendezvous import leave_pair
        if self.loop is not None:
            self.loop.retire(f"prefill peer down: {reason}")
            self.old_loops.append(self.loop)
            self.loop, self._stopped = None, None
        self.old_loops = [lp for lp in self.old_loops if lp.alive()]
        await asyncio.to_thread(leave_pair, self.m.device)

    # --- what the front door asks ---

    def _loops(self) -> list[ReceiveLoop]:
        return [*self.old_loops, *([self.loop] if self.loop else [])]

    def receive_loops(self) -> int:
        return sum(lp.alive() for lp in self._loops())

    def receivers(self) -> int:
        """Data-plane receivers holding buffers: the gRPC listener's, or the one each process-group loop is in."""
        if self.addressed:
            return self.link.inflight() if self.link is not None else 0
        return sum(lp.receiving() for lp in self._loops())

    def why_down(self) -> str:
        return f"{self.down_reason} ({time.monotonic() - self.down_since:.1f} s ago)"

    async def publish(self, health) -> None:
        """The server's health servicer is built: report the pairing's state on it from now on."""
        self.health = health
        await self._publish()

    async def _set_up(self, up: bool, reason: str) -> None:
        if not up:
            self.down_reason, self.down_since = reason, time.monotonic()
        self.up = up
        self.metrics.peer_up.set(1 if up else 0)
        await self._publish()

    async def _publish(self) -> None:
        """"" follows the peer; the Decode service stays SERVING under --on-failure recompute (it still answers)."""
        if self.health is not None:
            await self.health.set("", SERVING if self.up else NOT_SERVING)
            await self.health.set(DECODE_SERVICE, SERVING if self.up or self.config.on_failure == "recompute"
                                  else NOT_SERVING)
