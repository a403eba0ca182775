"""cuda_ipc, decode side: the receive pool, the handshake, and one request's receiver.

Why the cache is a view into its slot: the decode worker uses the received K/V in place
(docs/architecture.md, "No copies of the received cache on the decode side"), so the slot stays held
until the cache's tensors are gone. Each request's block is a fresh tensor over the slot;
every K/V handed out is a view of it, and a finalizer on it sends RELEASE when the last
view dies (or `release()` is called; at once on abort, timeout or a sender's abort).
Releasing records the slot's release event on the current stream first, so the sender's
next copy into the slot waits, on the GPU, for the reads queued before the release.
Tensors built with `set_()` on the slot's storage do not hold the slot: don't.
"""

from __future__ import annotations

import contextlib
import os
import threading
import time
import weakref

from kvtransfer.transport import base
from kvtransfer.transport.base import KVReceiver, TransferError, TransferHeader, TransferState
from kvtransfer.transport.cuda_ipc.channel import Channel, accept, check_hello, expect, listen
from kvtransfer.transport.cuda_ipc.device import EVENT_HANDLE_BYTES, CudaOps, slot_view
from kvtransfer.transport.cuda_ipc.messages import (
    MAGIC,
    ROLE_RECEIVER,
    ROLE_SENDER,
    TRAILER_OK,
    VERSION,
    Events,
    Header,
    Hello,
    Landed,
    Pool,
    Ready,
    Release,
    Slot,
    Trailer,
)
from kvtransfer.transport.cuda_ipc.pool import HeldSlots, check_fits
from kvtransfer.transport.frames import make_header
from kvtransfer.transport.landing import Placement, destination_for

_POLL_S = 20e-6


class ReceiverLink(base.ReceiverLink):
    """Decode side of one connection: owns `slots` receive slots of `slot_bytes` each on `device`
    and listens at `address` (unix:/path or tcp://127.0.0.1:PORT; `.address` is the bound one).
    accept(destinations=None): the cache is a view into its slot (zero copy); with a provider each
    layer is copied device-locally from the slot into the destination and the slot goes back at finish."""

    survives_failed_request = False
    abort_reaches_sender = True  # an early release tells the sender its receiver gave up

    def __init__(self, device, address: str, slot_bytes: int, slots: int = 2, max_layers: int = 128, ops=None):
        if min(slot_bytes, slots, max_layers) < 1:
            raise ValueError(f"slot_bytes, slots, max_layers must be >= 1 (got {slot_bytes}, {slots}, {max_layers})")
        self.ops = ops if ops is not None else CudaOps(device)
        self.device, self.slot_bytes, self.max_layers = self.ops.device, slot_bytes, max_layers
        self.storages = [self.ops.alloc(slot_bytes) for _ in range(slots)]  # (slot_bytes,) uint8 each
        self.release_events = [self.ops.new_event() for _ in range(slots)]  # (event, handle), recorded here
        self.held = HeldSlots(slots)
        self.layer_events: list[list] = []  # [slot][layer]: the sender's events, waited on here
        self.chan: Channel | None = None
        self.error: TransferError | None = None
        self._listener, self.address = listen(address)
        self._pump_lock = threading.Lock()
        self._pending: Header | None = None  # a header read while finishing the previous request
        self._current = None  # weakref to the open receiver

    def _connect(self, deadline: float | None) -> None:
        chan = Channel(accept(self._listener, deadline))
        self._listener.close()  # one sender per link; a new sender needs a new link (and pool)
        if self.address.startswith("unix:"):
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self.address[len("unix:"):])
        try:
            hello = expect(chan, Hello, deadline, "hello")
            check_hello(hello, ROLE_SENDER)
            sender_dev = self.ops.peer_index(hello.device_uuid)
            chan.send(Hello(MAGIC, VERSION, ROLE_RECEIVER, os.getpid(), self.ops.uuid()))
            chan.send(Pool(len(self.storages), self.slot_bytes, self.max_layers))
            for s, storage in enumerate(self.storages):
                chan.send(Slot(slot=s, release_event=self.release_events[s][1], **self.ops.share(storage)))
            for s in range(len(self.storages)):
                m = expect(chan, Events, deadline, f"slot {s} events")
                if m.slot != s or len(m.handles) != self.max_layers * EVENT_HANDLE_BYTES:
                    raise TransferError("protocol", f"events for slot {m.slot} ({len(m.handles)} bytes) where "
                                        f"{self.max_layers} handles for slot {s} were due")
                hs = m.handles
                self.layer_events.append([self.ops.open_event(hs[i:i + EVENT_HANDLE_BYTES], sender_dev)
                                          for i in range(0, len(hs), EVENT_HANDLE_BYTES)])
            chan.send(Ready())
        except BaseException as e:  # a CUDA error opening a handle included: the link is unusable
            self.error = e if isinstance(e, TransferError) else TransferError("peer", f"handshake failed: {e}")
            chan.close()
            raise
        self.chan = chan

    def accept(self, timeout=None, destinations=None) -> "IpcReceiver":
        deadline = None if timeout is None else time.monotonic() + timeout
        if self.error is not None:
            raise TransferError("peer", f"link is broken: {self.error}")
        if self.chan is None:
            self._connect(deadline)
        current = self._current() if self._current is not None else None
        if current is not None and current.status() not in (TransferState.SUCCESS, TransferState.FAILED):
            raise TransferError("protocol", "previous transfer still open on this link (finish or abort it first)")
        with self._pump_lock:
            m, self._pending = self._pending, None
            while not isinstance(m, Header):
                if m is not None and not isinstance(m, (Landed, Trailer)):
                    raise TransferError("protocol", f"unexpected {type(m).__name__} message before a header")
                m = self.recv(deadline)  # Landed/Trailer here: the rest of a request this side gave up on
                if m is None:
                    raise TransferError("timeout", f"no transfer arrived within {timeout} s")
        try:
            h = make_header(m.request_id, m.seq_len, m.num_layers, m.kv_heads, m.head_dim, m.dtype_code, m.batch,
                            max_bytes=1 << 62)  # this backend's limits (slot size, events) are check_fits'

            check_fits(h, self.slot_bytes, self.max_layers)
            self.held.hold(m.slot, m.request_id)
        except TransferError:
            if 0 <= m.slot < len(self.storages) and m.slot not in self.held.held():
                self.send(Release(m.request_id, m.slot, True))  # keep the sender's pool in step
            raise
        dest, error = (None, None) if destinations is None else destination_for(h, self.device, destinations)
        r = IpcReceiver(self, h, m.slot, dest, error)
        self._current = weakref.ref(r)
        return r

    def recv(self, deadline: float | None):
        try:
            return self.chan.recv(deadline)
        except TransferError as e:
            self.error = self.error or e
            raise

    def send(self, m) -> None:
        try:
            self.chan.send(m)
        except TransferError as e:
            self.error = self.error or e  # the sender sees the closed channel; nothing more to tell it

    def release(self, slot: int, request_id: int, early: bool) -> None:
        """Hand `slot` back to the sender (any thread; idempotent per request)."""
        if not self.held.free(slot, request_id):
            return
        self.ops.record(self.release_events[slot][0])  # the next copy into the slot waits for reads queued so far
        if self.chan is not None and self.error is None:
            self.send(Release(request_id, slot, early))

    def close(self) -> None:
        if self.chan is not None:
            self.chan.close()
            return
        self._listener.close()
        if self.address.startswith("unix:"):
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self.address[len("unix:"):])


class IpcReceiver(KVReceiver):
    def __init__(self, link: ReceiverLink, header: TransferHeader, slot: int, dest=None, error=None):
        self.link, self.header, self.slot = link, header, slot
        self.block = slot_view(link.storages[slot], header)  # (layers, 2, batch, kv_heads, seq, head_dim)
        # a provider's destination: copied from the slot per layer; None: the slot views are the cache
        self._placement = None if dest is None else Placement(header, link.device, dest, staging=self.block)
        self._views = [(self.block[i, 0], self.block[i, 1]) for i in range(header.num_layers)]
        self._lease = weakref.finalize(self.block, link.release, slot, header.request_id, False)
        self._lease.atexit = False
        self._events = link.layer_events[slot]
        self._landed = [False] * header.num_layers
        self._trailer: Trailer | None = None
        self._error: TransferError | None = None
        self._state = TransferState.TRANSFERRING
        if error is not None:
            self._fail(error)

    def _pump(self, until, deadline: float | None) -> bool:
        """Read this request's control messages until `until()`; False when the deadline passes first."""
        rid, link = self.header.request_id, self.link
        with link._pump_lock:
            while not until():
                m = link.recv(deadline)
                if m is None:
                    return False
                if isinstance(m, Landed) and m.request_id == rid:
                    if not 0 <= m.layer < self.header.num_layers:
                        raise TransferError("protocol", f"request {rid}: layer {m.layer} landed; it has "
                                            f"{self.header.num_layers}")
                    self._landed[m.layer] = True
                elif isinstance(m, Trailer) and m.request_id == rid:
                    self._trailer = m
                elif isinstance(m, Header):
                    link._pending = m
                    raise TransferError("protocol", f"request {m.request_id} began before request {rid} ended")
                elif not isinstance(m, (Landed, Trailer)):  # those two: an earlier, abandoned request's
                    raise TransferError("protocol", f"unexpected {type(m).__name__} message during a transfer")
        return True

    def _wait(self, until, deadline: float | None, what: str) -> None:
        if self._error is not None:
            raise TransferError(self._error.cause, f"request {self.header.request_id} already failed: {self._error}")
        try:
            arrived = self._pump(until, deadline)
        except TransferError as e:
            raise self._fail(e) from None
        if not arrived:
            raise self._fail(TransferError("timeout", f"request {self.header.request_id}: {what} within the timeout "
                                           f"({sum(self._landed)} of {self.header.num_layers} layers landed)"))

    def _trailer_error(self) -> TransferError:
        t, rid = self._trailer, self.header.request_id
        if t.code != TRAILER_OK:
            return TransferError("aborted", f"sender aborted request {rid}: {t.reason.decode(errors='replace')}")
        return TransferError("protocol", f"request {rid}: trailer OK with layers missing "
                             f"({sum(self._landed)} of {self.header.num_layers} landed)")

    def wait_for_layer(self, layer_idx, timeout=None):
        if not 0 <= layer_idx < self.header.num_layers:
            raise TransferError("protocol", f"layer {layer_idx} outside 0..{self.header.num_layers - 1}")
        deadline = None if timeout is None else time.monotonic() + timeout
        if not self._landed[layer_idx]:
            self._wait(lambda: self._landed[layer_idx] or self._trailer is not None, deadline,
                       f"layer {layer_idx} did not land")
            if not self._landed[layer_idx]:
                raise self._fail(self._trailer_error())
        elif self._error is not None:
            raise TransferError(self._error.cause, f"request {self.header.request_id} failed: {self._error}")
        self.link.ops.wait(self._events[layer_idx])  # the current stream waits on the GPU, the host does not
        return self._out(layer_idx)

    def _out(self, i: int):
        if self._placement is None:
            return self._views[i]
        return self._placement.layer(i)  # one device-local copy, on the current stream

    def finish(self, timeout=None):
        n = self.header.num_layers
        if self._state != TransferState.SUCCESS:
            deadline = None if timeout is None else time.monotonic() + timeout
            self._wait(lambda: self._trailer is not None, deadline, "no trailer arrived")
            if self._trailer.code != TRAILER_OK or not all(self._landed):
                raise self._fail(self._trailer_error())
            while not self.link.ops.done(self._events[n - 1]):  # copies run in order on one stream
                if deadline is not None and time.monotonic() > deadline:
                    raise self._fail(TransferError("timeout", f"request {self.header.request_id}: copies did "
                                                   f"not complete within {timeout} s"))
                time.sleep(_POLL_S)
            self.link.ops.wait(self._events[n - 1])
            out = [self._out(i) for i in range(n)]
            self._state = TransferState.SUCCESS
            if self._placement is not None:
                self.release()  # the copies are queued; the release event orders the slot's next use after them
            return out
        return [self._out(i) for i in range(n)]

    def _fail(self, err: TransferError) -> TransferError:
        if self._error is None:
            self._error, self._state = err, TransferState.FAILED
            if self._lease.detach() is not None:
                self.link.release(self.slot, self.header.request_id, True)
        return err

    def release(self) -> None:
        """Give the slot back now rather than when the last view dies; the views must not be used after."""
        if self._lease.detach() is not None:
            self.link.release(self.slot, self.header.request_id, self._state != TransferState.SUCCESS)

    def abort(self, reason):
        if self._state != TransferState.SUCCESS:
            self._fail(TransferError("aborted", f"receiver aborted: {reason}"))

    def status(self):
        return self._state
