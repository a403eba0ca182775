"""The decode side of one pair: handshake, pairing state, and re-pairing after a failure.

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
The data plane (links, receive loops, one request's remote prefill) is dataplane.py; the liveness watch
is liveness.py. A decode worker pairs with every prefill worker it is given (peers.py holds them, picks one per
request and publishes health); each pairing has an instance id of its own, so to a prefill worker every pair is
a peer of its own.
"""

from __future__ import annotations

import asyncio
import logging
import secrets
import time

import grpc
from grpc_health.v1 import health_pb2_grpc

from decode_server.peer.dataplane import DataPlane
from decode_server.peer.handshake import HandshakeRefused, HandshakeTimedOut, handshake
from decode_server.peer.liveness import STOPPING, until_down, watch_peer
from kvtransfer.rpc.server import DECODE_INSTANCE_KEY, WATCH_KEY, pair_service
from proto import kvtransfer_pb2 as pb
from proto import kvtransfer_pb2_grpc as pbg

log = logging.getLogger("kvtransfer.decode")


class DecodePairing:
    def __init__(self, config, loaded, backend, compat: pb.Compat, channel, metadata, metrics, on_change,
                 addr: str, dist_init: str = ""):
        """addr: the prefill worker's control plane; dist_init: its rendezvous (nccl/gloo); on_change(): awaited
        whenever this pairing goes up or down (peers.py publishes health from every pairing)."""
        self.config, self.compat, self.metadata, self.metrics = config, compat, metadata, metrics
        self.on_change, self.addr = on_change, addr
        self.data = DataPlane(config, loaded, backend, metrics, addr, dist_init)
        self.transport = backend.name
        self.channel, self.stub = channel, pbg.PrefillStub(channel)
        self.health_stub = health_pb2_grpc.HealthStub(channel)
        self.instance_id = secrets.randbits(63) | 1
        self.up, self.down_reason, self.down_since = False, "not paired yet", time.monotonic()
        self.prefill_instance = self.epoch = 0
        self.max_prompt_tokens = 0  # the peer's --max-prompt-tokens, from its last handshake (0: not known yet)
        self._task = None
        self._watch: asyncio.Future | None = None  # the liveness watch; opened before each handshake
        self._watch_token = ""  # its token (WATCH_KEY): the handshake names it (prefill_server/peer_health.py)
        self._armed = asyncio.Event()  # set once a pairing is up: the watch's NOT_SERVING counts from then
        self.on_fatal = None  # called if the supervising task dies: the server must stop, not look paired
        self._unreachable_since: float | None = None  # when the peer's rendezvous stopped answering (monotonic)

    def watch_fatal(self, on_fatal) -> None:
        """`on_fatal(what, error)` when the pairing's task or a receive loop dies of a bug."""
        self.on_fatal = self.data.on_fatal = on_fatal

    # --- the pairing's life ---

    async def start(self) -> None:
        """The first pairing, then supervise it. A refusal, or no pairing within --handshake-timeout-s, raises
        HandshakeRefused (the server exits 2, unless another peer paired: peers.py); a join that failed is tried
        again until then."""
        from kvtransfer.transport.rendezvous import RendezvousUnreachable  # torch.distributed: only when paired
        deadline, delay = time.monotonic() + self.config.handshake_timeout_s, 0.5
        while True:
            try:
                await self._pair()
                break
            except HandshakeRefused:
                raise
            except Exception as e:  # a rendezvous that timed out or failed (RuntimeError)
                await self.data.drop_group("the pairing failed")
                if isinstance(e, RendezvousUnreachable):  # the peer answered, so its rendezvous is up: a wrong flag
                    limit = self.config.dist_timeout_s
                    if time.monotonic() + delay > self._unreachable_since + limit:
                        raise HandshakeRefused(f"the prefill worker at {self.addr} answered, but {e} for "
                                               f"--dist-timeout-s {limit:g} s: give this decode worker the "
                                               "--dist-init that prefill worker hosts") from None
                elif time.monotonic() + delay > deadline:
                    raise HandshakeTimedOut(f"could not pair with the prefill worker at {self.addr} "
                                           f"within --handshake-timeout-s {self.config.handshake_timeout_s:g} s: "
                                           f"{e}") from None
                log.warning("pairing failed: %s; trying again", e)
                await asyncio.sleep(delay)
                delay = min(delay * 2, 5.0)
        self.supervise()

    def supervise(self, paired: bool = True) -> None:
        """Keep this pairing up from now on (paired=False: it is not up yet; pair first, retrying until it is)."""
        self._task = asyncio.create_task(self._supervise(paired), name=f"pairing {self.addr}")
        self._task.add_done_callback(self._ended)

    def _ended(self, task: asyncio.Task) -> None:
        """The supervising task never returns; if it ended other than by cancel, pairing is over for good."""
        if task.cancelled() or self.on_fatal is None:
            return
        error = task.exception() or RuntimeError("the pairing task returned")
        self.on_fatal("the pairing task", error)

    async def _supervise(self, paired: bool = True) -> None:
        while True:
            if paired:
                try:
                    reason = await until_down(self._watch, self.data.stopped)
                except Exception as e:  # a bug here must not leave the server believing the pair is up
                    log.exception("liveness watch failed")
                    reason = f"liveness watch failed: {e!r}"
                await self._down(reason, quiesce=reason == STOPPING)
            paired = True
            delay = 0.5
            while True:
                try:
                    await self._pair()
                    break
                except HandshakeRefused as e:
                    self.down_reason = str(e)
                    log.error("re-pairing with %s: %s", self.addr, e)
                except Exception as e:  # a rendezvous that timed out or failed (RuntimeError), a bad address
                    log.warning("re-pairing with %s failed: %s; trying again", self.addr, e)
                    await self.data.drop_group("re-pairing failed")
                await asyncio.sleep(delay)
                delay = min(delay * 2, 5.0)

    async def _pair(self) -> None:
        from kvtransfer.transport.rendezvous import RendezvousUnreachable
        address = self.data.listen()
        self._armed.clear()
        self._open_watch()  # before the handshake: the peer sees us alive
        resp = await handshake(self.stub, self.compat, self.transport, self.config.handshake_timeout_s,
                               self.data.receive_limit(), self._handshake_metadata(), address, self.instance_id,
                               self.addr, quiet=self._unreachable_since is not None)
        if self.prefill_instance and resp.instance_id != self.prefill_instance:
            log.warning("the prefill worker restarted (instance %x -> %x)", self.prefill_instance, resp.instance_id)
        try:
            await self.data.join(resp)
        except RendezvousUnreachable:
            self._unreachable_since = self._unreachable_since or time.monotonic()
            raise
        self._unreachable_since = None
        self._open_watch()  # one that ended meanwhile (sent on the dead peer's connection) says nothing of this one
        self.prefill_instance, self.epoch = resp.instance_id, resp.epoch
        self.max_prompt_tokens = resp.max_prompt_tokens  # 0: not announced (an older prefill worker)
        self.metrics.pairings.inc()
        await self._set_up(True, "")
        self._armed.set()
        log.info("paired with prefill instance %x at %s, epoch %d (%s)", resp.instance_id, self.addr, resp.epoch,
                 self.transport)

    def _open_watch(self) -> None:
        """A liveness watch, unless one is open (it waits for the peer to be up: wait_for_ready)."""
        if self._watch is None or self._watch.done():
            self._watch_token = secrets.token_hex(8)
            self._watch = asyncio.ensure_future(watch_peer(self.health_stub, self._watch_metadata(), self._armed,
                                                           pair_service(self.instance_id)))

    def _handshake_metadata(self):
        """The handshake names the liveness watch open for it (its token): only that one's close says we are gone."""
        return (*(self.metadata or ()), (WATCH_KEY, self._watch_token))

    def _watch_metadata(self):
        return (*(self.metadata or ()), (DECODE_INSTANCE_KEY, f"{self.instance_id:x}"), (WATCH_KEY, self._watch_token))

    async def close(self) -> None:
        """At the stop: no more pairing; a join in progress gives up, the liveness watch ends."""
        self.data.closing = True
        for task in (self._task, self._watch):
            if task is not None:
                task.cancel()

    async def _down(self, reason: str, quiesce: bool = False) -> None:
        """The pairing ended: new requests are refused at once. When the peer still answers (it is stopping),
        what it has in flight is waited for (bounded by --peer-timeout-s); the rest fails now."""
        await self._set_up(False, reason)
        if quiesce and await self.data.quiesce(self.config.peer_timeout_s):
            log.info("prefill peer stopping: its transfers in flight arrived")
        log.warning("prefill peer %s down: %s; failing its waiting requests (--on-failure %s) and pairing again",
                    self.addr, reason, self.config.on_failure)
        await self.data.down(reason)

    def why_down(self) -> str:
        """Why this pair is down, as of now: a peer whose address no longer answers is unreachable, whatever it
        last said (a worker that reported it was stopping and then exited is gone, not stopping)."""
        reason = self.down_reason
        if self.channel.get_state() == grpc.ChannelConnectivity.TRANSIENT_FAILURE:  # a connect attempt failed
            before = "it had reported NOT_SERVING: stopping" if reason == STOPPING else f"before that: {reason}"
            reason = f"the prefill worker is unreachable (its process is gone, or the link is down; {before})"
        return f"{reason} ({time.monotonic() - self.down_since:.1f} s ago)"

    async def _set_up(self, up: bool, reason: str) -> None:
        if not up:
            self.down_reason, self.down_since = reason, time.monotonic()
        self.up = up
        await self.on_change()
