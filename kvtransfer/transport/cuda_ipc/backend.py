"""cuda_ipc backend: one box; the prefill GPU's copy engine writes straight into decode-GPU memory.

Why: on NVLink the link is not the cost; NCCL kernels take SMs from prefill and per-layer
host work slows a launch-bound prefill (docs/architecture.md, "Layer-wise vs bulk on NVLink").
A peer copy (cudaMemcpyAsync within one GPU or between two) runs on copy engines and uses no
SMs. The decode side owns a pool of receive slots and shares each once per connection as a
CUDA IPC memory handle; the
prefill side maps them once and creates one interprocess event per (slot, layer), whose
handles go the other way once. Per layer the sender records, waits, launches one copy
into the slot on a side stream, records the layer's event and writes a 17-byte "landed"
message; the receiver makes its stream wait on that event (no host sync). The control
channel (ipc_channel.py) carries typed struct frames only; the slot bookkeeping
(ipc_pool.py) keeps a slot out of use while a copy into it may still be issued or the
decode side holds its cache; the CUDA calls are in ipc_device.py; the decode side is in
ipc_receiver.py. A received cache is a view into its slot: the slot goes back when
`release()` is called or the cache's tensors are all dropped, at once on abort or timeout.
Both processes must see both GPUs (CUDA_VISIBLE_DEVICES naming both, in any order).
"""

from __future__ import annotations

import logging
import os
import threading
import time

import torch

from kvtransfer.geometry import DTYPE_CODES
from kvtransfer.transport import base
from kvtransfer.transport.base import KVSender, TransferError, TransferHeader, TransferState
from kvtransfer.transport.frames import check_layer
from kvtransfer.transport.layout import kv_pair_view
from kvtransfer.transport.options import IpcOptions
from kvtransfer.transport.cuda_ipc.channel import Channel, check_hello, connect, expect
from kvtransfer.transport.cuda_ipc.messages import (MAGIC, ROLE_RECEIVER, ROLE_SENDER, TRAILER_ABORTED, TRAILER_OK, VERSION, Events, Header,
                           Hello, Pool, Ready, Release, Slot, Trailer, encode, encode_landed)
from kvtransfer.transport.cuda_ipc.device import CudaOps, LocalOps, slot_view
from kvtransfer.transport.cuda_ipc.pool import SlotPool, check_fits
from kvtransfer.transport.cuda_ipc.receiver import IpcReceiver, ReceiverLink

__all__ = ["IpcReceiver", "IpcSender", "LocalOps", "ReceiverLink", "SenderLink", "receiver_link", "sender_link"]

log = logging.getLogger("kvtransfer.transport.cuda_ipc.backend")
_POLL_S = 20e-6  # host polling interval while finish() waits for the last layer's event


def _with_scheme(address: str) -> str:
    """HOST:PORT means tcp://HOST:PORT (as --data-listen writes it); unix:/path and tcp:// stay as they are."""
    return address if address.startswith(("unix:", "tcp://")) else f"tcp://{address}"


def sender_link(device, options: IpcOptions, address: str, connect_timeout_s: float = 60.0) -> "SenderLink":
    return SenderLink(device, _with_scheme(address), connect_timeout=connect_timeout_s,
                      slot_timeout=options.slot_timeout_s,
                      ops=LocalOps(device) if options.local_ops else None)


def receiver_link(device, options: IpcOptions, address: str, max_bytes: int, max_layers: int,
                  slot_bytes: int | None = None) -> ReceiverLink:
    """slot_bytes: one slot's size (the largest cache it takes), at most max_bytes."""
    return ReceiverLink(device, _with_scheme(address or "127.0.0.1:0"), slot_bytes=min(slot_bytes or max_bytes, max_bytes),
                        slots=options.slots, max_layers=max_layers, ops=LocalOps(device) if options.local_ops else None)


class SenderLink(base.SenderLink):
    """Prefill side of one connection: maps the receiver's slots once, then one request at a time."""

    survives_failed_request = False  # conservative: a broken control channel ends the link
    abort_reaches_sender = True

    def __init__(self, device, address: str, connect_timeout: float = 60.0, slot_timeout: float = 30.0, ops=None):
        self.ops = ops if ops is not None else CudaOps(device)
        self.device, self.slot_timeout = self.ops.device, slot_timeout
        self.error: TransferError | None = None
        self._closing = False
        self._current: IpcSender | None = None
        deadline = time.monotonic() + connect_timeout
        self.chan = Channel(connect(address, deadline))
        try:
            self._handshake(deadline)
        except BaseException:
            self.chan.close()
            raise
        self.pool = SlotPool(len(self.slots))
        self._reader = threading.Thread(target=self._read_releases, name="cuda-ipc-releases", daemon=True)
        self._reader.start()

    def _handshake(self, deadline: float) -> None:
        ops, chan = self.ops, self.chan
        chan.send(Hello(MAGIC, VERSION, ROLE_SENDER, os.getpid(), ops.uuid()))
        hello = expect(chan, Hello, deadline, "hello")
        check_hello(hello, ROLE_RECEIVER)
        owner = ops.peer_index(hello.device_uuid)
        pool = expect(chan, Pool, deadline, "pool description")
        if min(pool.slots, pool.slot_bytes, pool.max_layers) < 1:
            raise TransferError("protocol", f"receiver offers an empty pool: {pool}")
        self.slot_bytes, self.max_layers = pool.slot_bytes, pool.max_layers
        self.slots, self.release_events, self.layer_events = [], [], []
        for s in range(pool.slots):
            m = expect(chan, Slot, deadline, f"slot {s} handle")
            if m.slot != s or m.size < pool.slot_bytes:
                raise TransferError("protocol", f"slot message {m.slot} ({m.size} bytes) where slot {s} was due")
            self.slots.append(ops.open(m, owner))
            self.release_events.append(ops.open_event(m.release_event, owner))
        for s in range(pool.slots):  # one event per (slot, layer), created once, recorded by this side
            made = [ops.new_event() for _ in range(pool.max_layers)]
            self.layer_events.append([ev for ev, _ in made])
            chan.send(Events(s, b"".join(handle for _, handle in made)))
        expect(chan, Ready, deadline, "ready")

    def _read_releases(self) -> None:
        try:
            while True:
                m = self.chan.recv(None)
                if not isinstance(m, Release):
                    raise TransferError("protocol", f"unexpected {type(m).__name__} message from the receiver")
                self.pool.released(m.slot, m.request_id, m.early)
        except TransferError as e:
            if self._closing:
                e = TransferError("peer", "link closed")
            else:
                self.error = self.error or e
                log.warning("cuda_ipc sender link failed: %s", e)
            self.pool.fail(e)

    def open(self, header: TransferHeader) -> "IpcSender":
        if self.error is not None or self._closing:
            raise TransferError("peer", f"link is not usable: {self.error or 'closed'}")
        if self._current is not None and not self._current.closed:
            raise TransferError("protocol", "previous transfer still open on this link (finish or abort it first)")
        check_fits(header, self.slot_bytes, self.max_layers)
        slot = self.pool.acquire(header.request_id, self.slot_timeout)
        self._current = IpcSender(self, header, slot)
        return self._current

    def close(self) -> None:
        if self._current is not None and not self._current.closed:
            self._current.abort("link closed")
        self._closing = True
        self.chan.close()
        self._reader.join(timeout=1.0)


class IpcSender(KVSender):
    def __init__(self, link: SenderLink, header: TransferHeader, slot: int):
        self.link, self.header, self.slot = link, header, slot
        self.closed = False
        self._state = TransferState.WAITING
        self._next = 0
        self._keep: list[tuple[torch.Tensor, ...]] = []  # sources stay alive until their copies are done
        self._ended = False
        self._events = link.layer_events[slot]
        self._dst = slot_view(link.slots[slot], header).unbind(0)  # per layer: (2, batch, kv_heads, seq, head_dim)
        link.ops.side_wait(link.release_events[slot])  # the decode side's reads of the slot's last cache go first
        self._send(Header(header.request_id, slot, header.seq_len, header.num_layers, header.kv_heads,
                          header.head_dim, header.batch, DTYPE_CODES[header.dtype]))

    def _send(self, m) -> None:
        self._send_frame(encode(m))

    def _send_frame(self, data: bytes) -> None:
        try:
            self.link.chan.send_frame(data)
        except TransferError as e:
            self.link.error = self.link.error or e
            self._close(TransferState.FAILED)
            raise

    def send_layer(self, layer_idx, key, value):
        if self.closed:
            raise TransferError("protocol", f"send_layer after the transfer ended ({self._state.name})")
        check_layer(self.header, self._next, layer_idx, key, value)
        if key.device != self.link.device or value.device != self.link.device:
            raise TransferError("protocol", f"layer {layer_idx} is on {key.device}/{value.device}; "
                                f"this link sends from {self.link.device}")
        if self.link.pool.gave_up[self.slot] == self.header.request_id:
            self.abort("receiver gave up")
            raise TransferError("aborted", f"receiver gave up on request {self.header.request_id}")
        kv = kv_pair_view(key, value)  # (2, b, h, s, d) when V follows K in memory (StreamingCache): one copy
        srcs = (key, value) if kv is None else (kv,)
        self.link.ops.copy(self._dst[layer_idx], srcs, self._events[layer_idx])
        self._keep.append(srcs)
        self._next += 1
        self._state = TransferState.TRANSFERRING
        self._send_frame(encode_landed(self.header.request_id, layer_idx))  # after the record: the event is ours

    def finish(self, timeout=None):
        if self._state == TransferState.FAILED:
            raise TransferError("aborted", "finish after abort")
        if self._state == TransferState.SUCCESS:
            return
        rid, n = self.header.request_id, self.header.num_layers
        if self._next != n:
            raise TransferError("protocol", f"finish after {self._next} of {n} layers")
        self._send(Trailer(rid, TRAILER_OK, b""))
        deadline = None if timeout is None else time.monotonic() + timeout
        while not self.link.ops.done(self._events[n - 1]):  # one side stream: the last copy done => all done
            if deadline is not None and time.monotonic() > deadline:
                self._close(TransferState.FAILED)
                raise TransferError("timeout", f"request {rid}: copies into the receive slot took over {timeout} s")
            time.sleep(_POLL_S)
        gave_up = self.link.pool.gave_up[self.slot] == rid
        self._close(TransferState.FAILED if gave_up else TransferState.SUCCESS)
        if gave_up:
            raise TransferError("aborted", f"receiver gave up on request {rid} before it completed")

    def abort(self, reason):
        if self.closed:
            return
        try:
            self._send(Trailer(self.header.request_id, TRAILER_ABORTED, reason.encode()[:512]))
        except TransferError:
            pass  # the link is broken (recorded on it); the receiver learns from the closed channel
        self._close(TransferState.FAILED)

    def _close(self, state: TransferState) -> None:
        self.closed, self._state = True, state
        if self._ended:
            return
        self._ended = True
        if self._next:
            self.link.ops.retire([t for srcs in self._keep for t in srcs], self._events[self._next - 1])
        self._keep = []
        self.link.pool.sender_done(self.slot)

    def status(self):
        return self._state
