"""torch.distributed backend: NCCL between GPUs (NVLink, RDMA, TCP), gloo between CPUs.

Why this shape: one ordered point-to-point stream per prefill/decode pair. Each request
is a frame: a fixed-size header (request id, shapes, layers per message), the layers
(K and V adjacent, `layers_per_message` layers per message), and a one-element trailer
that says OK or ABORTED. The receiver finds its memory from the header (the destination
provider; process groups receive into contiguous memory only, so a scattered destination
is filled from a staging block, one device-local copy per layer), so concurrent requests
can never land in each other's buffers, and an abort stays in-band: the sender pads the
frame and the stream stays in step for the next request. There is no back channel: a
receiver that gives up drains the rest of its frame.

`isend` waits for the *current* stream at call time and then runs on the group's own
stream, so calling it from the cache hook orders it after layer i's compute without a
host sync; the Work objects and tensors are kept alive until the trailer is through.
"""

from __future__ import annotations

import datetime
import time

import torch

from kvtransfer.transport import base
from kvtransfer.transport.base import KVReceiver, TransferError, TransferHeader, TransferState
from kvtransfer.transport.frames import header_fields, make_header
from kvtransfer.transport.landing import Placement, destination_for
from kvtransfer.transport.layout import kv_pair_view, run_or_stack
from kvtransfer.transport.options import DistOptions
from kvtransfer.transport.sender import BaseSender

TRAILER_OK, TRAILER_ABORTED = 1, 2
HEADER_INTS = 8  # header_fields (7) + layers per message


IDLE_WAIT_S = 7 * 24 * 3600.0  # a receive posted while idle (the next frame's header) may wait this long


def _wait_all(works, device: torch.device, deadline: float | None, what: str) -> None:
    """Host-wait for works, polling so that a deadline always ends the wait.

    gloo: a Work must be waited once only (a second wait waits for another message).
    CUDA: poll `is_completed()` first and only then `wait()` (which makes the current
    stream wait for the group's stream): calling `wait()` on a receive that is still
    pending would make this thread's stream wait for it, and any later synchronizing
    call on that stream would hang until the peer sends.
    """
    if device.type != "cuda":
        for w in works:
            if w.is_completed():
                continue
            left = IDLE_WAIT_S if deadline is None else max(deadline - time.monotonic(), 0.001)
            try:
                w.wait(timeout=datetime.timedelta(seconds=left))
            except RuntimeError as e:
                raise TransferError("timeout" if "imed out" in str(e) else "peer", f"{what}: {e}") from e
        return
    pause = 20e-6
    for w in works:
        while not w.is_completed():
            if deadline is not None and time.monotonic() > deadline:
                raise TransferError("timeout", f"{what} did not complete in time")
            time.sleep(pause)
            pause = min(pause * 2, 1e-3)
        w.wait()  # complete already: only orders the current stream after it


def _messages(header: TransferHeader, group: int) -> list[range]:
    return [range(a, min(a + group, header.num_layers)) for a in range(0, header.num_layers, group)]


def sender_link(device, options: DistOptions, address: str = "", peer: int = 1, connect_timeout_s: float = 0.0,
                group=None) -> "SenderLink":
    """Rank 0's link in the pairing's joined two-rank `group` (rendezvous.join_pair; the decode side is rank 1)."""
    return SenderLink(device, peer=peer, layers_per_message=options.layers_per_message, group=group)


def receiver_link(device, options: DistOptions, address: str = "", max_bytes: int = 64 << 30,
                  max_layers: int = 4096, peer: int = 0, group=None) -> "ReceiverLink":
    """Rank 1's link in the pairing's joined two-rank `group`."""
    return ReceiverLink(device, peer=peer, max_bytes=max_bytes, group=group, max_layers=max_layers)


class SenderLink(base.SenderLink):
    survives_failed_request = False  # a timeout or a dead peer leaves the ordered stream out of step
    abort_reaches_sender = False  # no back channel

    def __init__(self, device: torch.device, peer: int = 1, layers_per_message: int = 1, group=None):
        if layers_per_message < 1:
            raise ValueError("layers_per_message must be >= 1")
        self.device, self.peer, self.group, self.per_msg = torch.device(device), peer, group, layers_per_message
        self._current: DistSender | None = None

    def open(self, header: TransferHeader) -> "DistSender":
        if self._current is not None and not self._current.closed:
            raise TransferError("protocol", "previous transfer still open on this link (finish or abort it first)")
        self._current = DistSender(self, header)
        return self._current

    def close(self) -> None:
        if self._current is not None:
            self._current.abort("link closed")  # nothing once it has ended


class DistSender(BaseSender):
    def __init__(self, link: SenderLink, header: TransferHeader):
        super().__init__(header)
        self.link = link
        self._works: list = []
        self._keep: list[torch.Tensor] = []  # tensors must outlive their Work
        self._msgs = _messages(header, link.per_msg)
        self._pending: list[torch.Tensor] = []  # (2, b, h, s, d) per layer of the open message
        wire = torch.tensor([*header_fields(header), link.per_msg], dtype=torch.int64)
        self._isend(wire.to(link.device))

    def _isend(self, t: torch.Tensor) -> None:
        self._keep.append(t)
        try:
            self._works.append(self.link.group.send([t], self.link.peer, 0))
        except RuntimeError as e:  # gloo: "Connection closed by peer"
            raise TransferError("peer", f"send failed: {e}") from e

    def _send(self, layer_idx, key, value):
        kv = kv_pair_view(key, value)
        if kv is None:
            kv = torch.stack((key, value))  # (2, b, h, s, d): only when K and V are not adjacent
        self._pending.append(kv)
        if len(self._pending) == len(self._msgs[0]):
            self._msgs.pop(0)
            self._isend(run_or_stack(self._pending))
            self._pending = []

    def _finish(self, timeout):
        self._isend(torch.tensor([TRAILER_OK], dtype=torch.int64, device=self.link.device))
        deadline = None if timeout is None else time.monotonic() + timeout
        _wait_all(self._works, self.link.device, deadline, f"request {self.header.request_id} send")
        self._works, self._keep = [], []

    def _abort(self, reason):
        shape = self.header.layer_shape()
        for msg in self._msgs:  # the first may be partly filled by self._pending
            # pad the frame so the receiver's posted receives complete and the stream stays in step
            self._isend(torch.zeros((len(msg), 2, *shape), dtype=self.header.dtype, device=self.link.device))
        self._pending, self._msgs = [], []
        self._isend(torch.tensor([TRAILER_ABORTED], dtype=torch.int64, device=self.link.device))


class ReceiverLink(base.ReceiverLink):
    survives_failed_request = False
    abort_reaches_sender = False  # no back channel: the rest of the frame is drained

    def __init__(self, device: torch.device, peer: int = 0, max_bytes: int = 64 << 30, group=None,
                 max_layers: int = 4096):
        self.device, self.peer, self.group, self.max_bytes = torch.device(device), peer, group, max_bytes
        self.max_layers = max_layers

    def accept(self, timeout=None, destinations=None) -> "DistReceiver":
        wire = torch.empty(HEADER_INTS, dtype=torch.int64, device=self.device)
        work = self.group.recv([wire], self.peer, 0)
        deadline = None if timeout is None else time.monotonic() + timeout
        _wait_all([work], self.device, deadline, "transfer header")
        *fields, per_msg = wire.cpu().tolist()
        header = make_header(*fields, max_bytes=self.max_bytes, max_layers=self.max_layers)
        if per_msg < 1:
            raise TransferError("protocol", f"request {header.request_id}: {per_msg} layers per message")
        dest, error = destination_for(header, self.device, destinations)
        return DistReceiver(self, header, per_msg, Placement(header, self.device, dest), error)

    def close(self) -> None:
        pass


class DistReceiver(KVReceiver):
    def __init__(self, link: ReceiverLink, header: TransferHeader, per_msg: int, placement: Placement,
                 error: TransferError | None):
        self.link, self.header, self.placement = link, header, placement
        self.block = placement.block  # (layers, 2, batch, kv_heads, seq, head_dim): received here
        self._error = error  # the destination provider's: the frame is drained, then this is raised
        self._trailer = torch.zeros(1, dtype=torch.int64, device=link.device)
        self._msg_of: list[int] = []
        self._works = []
        for m, msg in enumerate(_messages(header, per_msg)):
            self._works.append(link.group.recv([self.block[msg.start:msg.stop]], link.peer, 0))
            self._msg_of += [m] * len(msg)
        self._works.append(link.group.recv([self._trailer], link.peer, 0))
        self._state = TransferState.TRANSFERRING
        self._reason: str | None = None

    def wait_for_layer(self, layer_idx, timeout=None):
        if not 0 <= layer_idx < self.header.num_layers:
            raise TransferError("protocol", f"layer {layer_idx} outside 0..{self.header.num_layers - 1}")
        self._check_alive()
        deadline = None if timeout is None else time.monotonic() + timeout
        work = self._works[self._msg_of[layer_idx]]
        if self.link.device.type == "cuda":
            work.wait()  # orders the current stream after the receive; no host sync
        else:
            _wait_all([work], self.link.device, deadline, f"layer {layer_idx}")
        return self.placement.layer(layer_idx)

    def finish(self, timeout=None):
        self._check_alive(drain=True)
        deadline = None if timeout is None else time.monotonic() + timeout
        try:
            _wait_all(self._works, self.link.device, deadline, f"request {self.header.request_id} receive")
        except TransferError:
            self._state = TransferState.FAILED
            raise
        code = int(self._trailer.item())
        if self._error is not None or code != TRAILER_OK:
            self._state = TransferState.FAILED
            raise self._error or TransferError("aborted", f"sender aborted request {self.header.request_id} "
                                               f"(trailer {code})")
        self._state = TransferState.SUCCESS
        return [self.placement.layer(i) for i in range(self.header.num_layers)]

    def _check_alive(self, drain: bool = False):
        """A local abort fails at once; a provider's error after the frame is drained (`finish`)."""
        if self._reason is not None:
            raise TransferError("aborted", f"receiver aborted: {self._reason}")
        if self._error is not None and not drain:
            raise self._error

    def abort(self, reason):
        # the posted receives stay posted (the stream must stay in step); their data is dropped
        if self._state != TransferState.SUCCESS:
            self._reason = reason
            self._state = TransferState.FAILED

    def status(self):
        return self._state
