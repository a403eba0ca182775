"""In-process fake backend: the contract without a wire (the sender's state machine is sender.py).

Why: the contract suite, the servers' request bookkeeping and the fault paths are tested
on CPU in milliseconds against this, and the same suite keeps the real backends honest.
It copies every tensor it is handed into the receiver's destination (a real wire would),
has a back channel (a receiver's abort fails its sender, as gRPC's cancel and cuda_ipc's
early release do), and can drop layers to play a peer that died mid-stream
(`drop_after_layers`).
"""

from __future__ import annotations

import queue
import threading
import time

import torch

from kvtransfer.transport import base
from kvtransfer.transport.base import KVReceiver, TransferError, TransferHeader, TransferState
from kvtransfer.transport.frames import check_header
from kvtransfer.transport.landing import Placement, destination_for
from kvtransfer.transport.options import FakeOptions
from kvtransfer.transport.sender import BaseSender

_OK, _ABORT = "ok", "abort"


class FakeWire:
    """One in-process connection: a queue of requests, each with its own message queue and back channel."""

    def __init__(self):
        self.requests: queue.Queue = queue.Queue()
        self.closed = threading.Event()  # the receiving side closed (or died): senders fail "peer"


_WIRES: dict[str, FakeWire] = {}  # address -> wire, so the registry can build both ends in one process


def receiver_link(device, options: FakeOptions, address: str, max_bytes: int, max_layers: int) -> "ReceiverLink":
    _WIRES[address] = wire = FakeWire()
    return ReceiverLink(wire, device, max_bytes)


def sender_link(device, options: FakeOptions, address: str, connect_timeout_s: float = 0.0) -> "SenderLink":
    if address not in _WIRES:
        raise TransferError("peer", f"no fake receiver at {address!r}")
    drop = None if options.drop_after_layers < 0 else options.drop_after_layers
    return SenderLink(_WIRES[address], drop)


class SenderLink(base.SenderLink):
    survives_failed_request = True
    abort_reaches_sender = True

    def __init__(self, wire: FakeWire, drop_after_layers: int | None = None):
        self.wire = wire
        self.drop_after_layers = drop_after_layers

    def open(self, header: TransferHeader) -> "FakeSender":
        return FakeSender(self.wire, header, self.drop_after_layers)

    def close(self) -> None:
        pass


class ReceiverLink(base.ReceiverLink):
    survives_failed_request = True
    abort_reaches_sender = True

    def __init__(self, wire: FakeWire, device="cpu", max_bytes: int = 64 << 30):
        self.wire, self.device, self.max_bytes = wire, torch.device(device), max_bytes

    def accept(self, timeout=None, destinations=None) -> "FakeReceiver":
        if self.wire.closed.is_set():
            raise TransferError("peer", "receiver link closed")
        try:
            header, messages, gave_up = self.wire.requests.get(timeout=timeout)
        except queue.Empty:
            raise TransferError("timeout", f"no transfer arrived within {timeout} s") from None
        try:
            check_header(header, self.max_bytes)
        except TransferError:
            gave_up.set()
            raise
        dest, error = destination_for(header, self.device, destinations)
        return FakeReceiver(header, messages, gave_up, Placement(header, self.device, dest), error)

    def close(self) -> None:
        self.wire.closed.set()


class FakeSender(BaseSender):
    def __init__(self, wire: FakeWire, header: TransferHeader, drop_after_layers: int | None):
        super().__init__(header)
        self._messages: queue.Queue = queue.Queue()
        self._gave_up = threading.Event()  # the back channel: set by the receiver when it lets go
        self._drop_after = drop_after_layers
        self._wire = wire
        if wire.closed.is_set():
            raise TransferError("peer", "the receiver link is closed")
        wire.requests.put((header, self._messages, self._gave_up))

    def _heard(self):
        if self._wire.closed.is_set():
            return TransferError("peer", "the receiver link closed")
        if self._gave_up.is_set():
            return TransferError("aborted", f"the receiver gave up on request {self.header.request_id}")
        return None

    def _send(self, layer_idx, key, value):
        if self._drop_after is None or layer_idx < self._drop_after:
            self._messages.put((layer_idx, key.clone(), value.clone()))

    def _finish(self, timeout):
        if self._drop_after is None:
            self._messages.put((_OK, None, None))

    def _abort(self, reason):
        self._messages.put((_ABORT, reason, None))


class FakeReceiver(KVReceiver):
    def __init__(self, header: TransferHeader, messages: queue.Queue, gave_up: threading.Event,
                 placement: Placement, error: TransferError | None):
        self.header, self.placement = header, placement
        self._messages, self._gave_up = messages, gave_up
        self._landed = [False] * header.num_layers
        self._state = TransferState.TRANSFERRING
        self._error: TransferError | None = None
        self._done = False
        self._lock = threading.Lock()
        if error is not None:
            self._fail(error)

    def _pump(self, until, deadline: float | None) -> None:
        """Take messages until `until()` holds; raise on abort, timeout or a local abort."""
        while not until():
            if self._error is not None:
                raise self._error
            left = None if deadline is None else deadline - time.monotonic()
            if left is not None and left <= 0:
                self._fail(TransferError("timeout", f"{sum(self._landed)} of {self.header.num_layers} layers "
                                         "arrived in time"))
                raise self._error
            try:
                tag, a, b = self._messages.get(timeout=0.05 if left is None else min(left, 0.05))
            except queue.Empty:
                continue
            if tag == _OK:
                if not all(self._landed):
                    self._fail(TransferError("protocol", f"trailer OK with layers missing "
                                             f"({sum(self._landed)} of {self.header.num_layers})"))
                self._done = True
            elif tag == _ABORT:
                self._fail(TransferError("aborted", f"sender aborted: {a}"))
            elif not 0 <= tag < self.header.num_layers or self._landed[tag]:
                self._fail(TransferError("protocol", f"layer {tag} arrived twice or outside the frame"))
            else:
                self.placement.block[tag, 0].copy_(a)
                self.placement.block[tag, 1].copy_(b)
                self.placement.place(tag)
                self._landed[tag] = True

    def _fail(self, err: TransferError) -> None:
        if self._error is None:
            self._error = err
            self._state = TransferState.FAILED
            self._gave_up.set()

    def wait_for_layer(self, layer_idx, timeout=None):
        if not 0 <= layer_idx < self.header.num_layers:
            raise TransferError("protocol", f"layer {layer_idx} outside 0..{self.header.num_layers - 1}")
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._lock:
            self._pump(lambda: self._landed[layer_idx], deadline)
        return self.placement.layer(layer_idx)

    def finish(self, timeout=None):
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._lock:
            self._pump(lambda: self._done, deadline)
            if self._error is not None:
                raise self._error
            self._state = TransferState.SUCCESS
        return [self.placement.layer(i) for i in range(self.header.num_layers)]

    def abort(self, reason):
        if self._state != TransferState.SUCCESS:
            self._fail(TransferError("aborted", f"receiver aborted: {reason}"))

    def status(self):
        return self._state


def pair(drop_after_layers: int | None = None, device="cpu") -> tuple[SenderLink, ReceiverLink]:
    wire = FakeWire()
    return SenderLink(wire, drop_after_layers), ReceiverLink(wire, device)
