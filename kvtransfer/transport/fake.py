"""In-process fake backend: the state machine without a wire.

Why: the contract suite, the servers' request bookkeeping and the fault paths are tested
on CPU in milliseconds against this, and the same suite keeps the real backends honest.
It copies every tensor it is handed (a real wire would), and can drop layers to play a
peer that died mid-stream (`drop_after_layers`).
"""

from __future__ import annotations

import queue
import threading
import time

import torch

from .base import KVReceiver, KVSender, TransferError, TransferHeader, TransferState, check_layer

_OK, _ABORT = "ok", "abort"


class FakeWire:
    """One in-process connection: a queue of requests, each with its own message queue."""

    def __init__(self):
        self.requests: queue.Queue = queue.Queue()


class SenderLink:
    def __init__(self, wire: FakeWire, drop_after_layers: int | None = None):
        self.wire = wire
        self.drop_after_layers = drop_after_layers

    def open(self, header: TransferHeader) -> "FakeSender":
        return FakeSender(self.wire, header, self.drop_after_layers)

    def close(self) -> None:
        pass


class ReceiverLink:
    def __init__(self, wire: FakeWire):
        self.wire = wire

    def accept(self, timeout: float | None = None) -> "FakeReceiver":
        try:
            header, messages = self.wire.requests.get(timeout=timeout)
        except queue.Empty:
            raise TransferError("timeout", f"no transfer arrived within {timeout} s") from None
        return FakeReceiver(header, messages)

    def close(self) -> None:
        pass


class FakeSender(KVSender):
    def __init__(self, wire: FakeWire, header: TransferHeader, drop_after_layers: int | None):
        self.header = header
        self._messages: queue.Queue = queue.Queue()
        self._next = 0
        self._drop_after = drop_after_layers
        self._state = TransferState.WAITING
        wire.requests.put((header, self._messages))

    def send_layer(self, layer_idx, key, value):
        if self._state <= TransferState.FAILED or self._state == TransferState.SUCCESS:
            raise TransferError("protocol", f"send_layer after the transfer ended ({self._state.name})")
        check_layer(self.header, self._next, layer_idx, key, value)
        self._next += 1
        self._state = TransferState.TRANSFERRING
        if self._drop_after is None or layer_idx < self._drop_after:
            self._messages.put((layer_idx, key.clone(), value.clone()))

    def finish(self, timeout=None):
        if self._state == TransferState.FAILED:
            raise TransferError("aborted", "finish after abort")
        if self._next != self.header.num_layers:
            raise TransferError("protocol", f"finish after {self._next} of {self.header.num_layers} layers")
        if self._drop_after is None:
            self._messages.put((_OK, None, None))
        self._state = TransferState.SUCCESS

    def abort(self, reason):
        if self._state != TransferState.SUCCESS:
            self._state = TransferState.FAILED
            self._messages.put((_ABORT, reason, None))

    def status(self):
        return self._state


class FakeReceiver(KVReceiver):
    def __init__(self, header: TransferHeader, messages: queue.Queue):
        self.header = header
        self._messages = messages
        self._layers: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        self._state = TransferState.TRANSFERRING
        self._error: TransferError | None = None
        self._done = False
        self._lock = threading.Lock()

    def _pump(self, until, deadline: float | None) -> None:
        """Take messages until `until()` holds; raise on abort, timeout or a local abort."""
        while not until():
            if self._error is not None:
                raise self._error
            left = None if deadline is None else deadline - time.monotonic()
            if left is not None and left <= 0:
                self._fail(TransferError("timeout", f"layer {len(self._layers)} of {self.header.num_layers} "
                                         "did not arrive in time"))
                raise self._error
            try:
                tag, a, b = self._messages.get(timeout=0.05 if left is None else min(left, 0.05))
            except queue.Empty:
                continue
            if tag == _OK:
                self._done = True
            elif tag == _ABORT:
                self._fail(TransferError("aborted", f"sender aborted: {a}"))
            else:
                self._layers[tag] = (a, b)

    def _fail(self, err: TransferError) -> None:
        self._error = err
        self._state = TransferState.FAILED

    def wait_for_layer(self, layer_idx, timeout=None):
        if not 0 <= layer_idx < self.header.num_layers:
            raise TransferError("protocol", f"layer {layer_idx} outside 0..{self.header.num_layers - 1}")
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._lock:
            self._pump(lambda: layer_idx in self._layers, deadline)
        return self._layers[layer_idx]

    def finish(self, timeout=None):
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._lock:
            self._pump(lambda: self._done, deadline)
            self._state = TransferState.SUCCESS
        return [self._layers[i] for i in range(self.header.num_layers)]

    def abort(self, reason):
        if self._state != TransferState.SUCCESS:
            self._fail(TransferError("aborted", f"receiver aborted: {reason}"))

    def status(self):
        return self._state


def pair(drop_after_layers: int | None = None) -> tuple[SenderLink, ReceiverLink]:
    wire = FakeWire()
    return SenderLink(wire, drop_after_layers), ReceiverLink(wire)
