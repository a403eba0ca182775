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
channel (channel.py) carries typed struct frames only; the slot bookkeeping
(pool.py) keeps a slot out of use while a copy into it may still be issued or the
decode side holds its cache; the CUDA calls are in device.py; the decode side is in
receiver.py; the sender's states are sender.py's. A received cache is a view into its slot: the slot goes back when
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
from kvtransfer.transport.base import TransferError, TransferHeader
from kvtransfer.transport.cuda_ipc.channel import Channel, check_hello, connect, expect
from kvtransfer.transport.cuda_ipc.device import CudaOps, LocalOps, slot_view
from kvtransfer.transport.cuda_ipc.messages import (
    MAGIC,
    ROLE_RECEIVER,
    ROLE_SENDER,
    TRAILER_ABORTED,
    TRAILER_OK,
    VERSION,
    Events,
    Header,
    Hello,
    Pool,
    Ready,
    Release,
    Slot,
    Trailer,
    encode,
    encode_landed,
)
from kvtransfer.transport.cuda_ipc.pool import SlotPool, check_fits
from kvtransfer.transport.cuda_ipc.receiver import IpcReceiver, ReceiverLink
from kvtransfer.transport.layout import kv_pair_view
from kvtransfer.transport.options import IpcOptions
from kvtransfer.transport.sender import BaseSender

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
        if self._current is not None:
            self._current.abort("link closed")  # nothing once it has ended
        self._closing = True
        self.chan.close()
        self._reader.join(timeout=1.0)


class IpcSender(BaseSender):
    def __init__(self, link: SenderLink, header: TransferHeader, slot: int):
        super().__init__(header)
        self.link, self.slot = link, slot
        self._keep: list[tuple[torch.Tensor, ...]] = []  # per layer copied: its sources, alive until the copy is done
        self._events = link.layer_events[slot]
        self._dst = slot_view(link.slots[slot], header).unbind(0)  # per layer: (2, batch, kv_heads, seq, head_dim)
        link.ops.side_wait(link.release_events[slot])  # the decode side's reads of the slot's last cache go first
        self._run(self._send_frame, encode(Header(header.request_id, slot, header.seq_len, header.num_layers,
                                                  header.kv_heads, header.head_dim, header.batch,
                                                  DTYPE_CODES[header.dtype])))  # a failure gives the slot back

    def _send_frame(self, data: bytes) -> None:
        try:
            self.link.chan.send_frame(data)
        except TransferError as e:
            self.link.error = self.link.error or e  # the control channel is broken: so is the link
            raise

    # --- how bytes move (sender.py keeps the state) ---

    def _check(self, layer_idx, key, value):
        if key.device != self.link.device or value.device != self.link.device:
            raise TransferError("protocol", f"layer {layer_idx} is on {key.device}/{value.device}; "
                                f"this link sends from {self.link.device}")

    def _heard(self):
        """An early RELEASE of this request's slot: the receiver gave up."""
        if self.link.pool.gave_up[self.slot] == self.header.request_id:
            return TransferError("aborted", f"receiver gave up on request {self.header.request_id}")
        return None

    def _send(self, layer_idx, key, value):
        kv = kv_pair_view(key, value)  # (2, b, h, s, d) when V follows K in memory (StreamingCache): one copy
        srcs = (key, value) if kv is None else (kv,)
        self.link.ops.copy(self._dst[layer_idx], srcs, self._events[layer_idx])
        self._keep.append(srcs)
        self._send_frame(encode_landed(self.header.request_id, layer_idx))  # after the record: the event is ours

    def _finish(self, timeout):
        rid, n = self.header.request_id, self.header.num_layers
        self._send_frame(encode(Trailer(rid, TRAILER_OK, b"")))
        deadline = None if timeout is None else time.monotonic() + timeout
        while not self.link.ops.done(self._events[n - 1]):  # one side stream: the last copy done => all done
            if deadline is not None and time.monotonic() > deadline:
                raise TransferError("timeout", f"request {rid}: copies into the receive slot took over {timeout} s")
            time.sleep(_POLL_S)
        if self._heard() is not None:
            raise TransferError("aborted", f"receiver gave up on request {rid} before it completed")

    def _abort(self, reason):
        try:
            self._send_frame(encode(Trailer(self.header.request_id, TRAILER_ABORTED, reason.encode()[:512])))
        except TransferError:
            pass  # the link is broken (recorded on it); the receiver learns from the closed channel

    def _end(self, error):
        """No more copies into the slot will be issued: the sources may go, the slot goes back to the pool."""
        if self._keep:  # copies in order on one side stream: the last one issued done => all done
            self.link.ops.retire([t for srcs in self._keep for t in srcs], self._events[len(self._keep) - 1])
        self._keep = []
        self.link.pool.sender_done(self.slot)
