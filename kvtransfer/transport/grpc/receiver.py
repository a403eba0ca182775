"""gRPC backend, one request on the receiving end: chunks land in host memory, layers move to the device.

Why this shape: chunks from all of a request's streams are copied straight into its host
buffer (pinned on CUDA, the final block on CPU), in parallel (numpy copies release the GIL).
A layer whose bytes are all in is verified (optional xxh3) and moved to the device on a side
stream. The request is complete when every stream has sent its OK trailer and every layer
has landed. A failure found by a stream handler ends that stream with a status code the
sender maps back to the same TransferError cause; a local abort or timeout cancels the
request's streams so the sender hears of it at once.
"""

from __future__ import annotations

import threading
import time

import numpy as np

from kvtransfer.transport.base import KVReceiver, TransferError, TransferHeader, TransferState
from kvtransfer.transport.grpc import frames as wire
from kvtransfer.transport.grpc.staging import Landing
from kvtransfer.transport.options import Checksum
from proto import kvdata_pb2 as pb


class GrpcReceiver(KVReceiver):
    def __init__(self, link, key, header: TransferHeader, m: pb.FrameHeader):
        self.link, self.key, self.header = link, key, header
        self._landing = Landing(header, link.device)  # host bytes; the destination is bound at accept
        self._frame = _frame_fields(m)
        self._streams, self._checksum = m.num_streams, Checksum(m.checksum)
        n = header.num_layers
        self._got, self._digest, self._landed = [0] * n, [None] * n, [False] * n
        self._seen: set[int] = set()
        self._ok = self._closed = 0
        self._contexts: list = []
        self._cv = threading.Condition()
        self._state = TransferState.TRANSFERRING
        self._error: TransferError | None = None

    # --- consumer's side ---

    def _bind(self, destinations) -> None:
        """accept(): from now on layers land in the provider's destination (a failing provider fails us)."""
        err = self._landing.bind(destinations)
        if err is not None:
            self._fail(err, cancel=True)

    def wait_for_layer(self, layer_idx, timeout=None):
        if not 0 <= layer_idx < self.header.num_layers:
            raise TransferError("protocol", f"layer {layer_idx} outside 0..{self.header.num_layers - 1}")
        self._wait(lambda: self._landed[layer_idx], timeout, f"layer {layer_idx}")
        return self._landing.layer(layer_idx)

    def finish(self, timeout=None):
        self._wait(self._complete, timeout, "the whole cache")
        with self._cv:
            if self._error is not None:  # e.g. the link closed in between
                raise self._error
            self._state = TransferState.SUCCESS
        return [self._landing.layer(i) for i in range(self.header.num_layers)]

    def abort(self, reason):
        if self._state != TransferState.SUCCESS:
            self._fail(TransferError("aborted", f"receiver aborted: {reason}"), cancel=True)

    def status(self):
        return self._state

    def _complete(self) -> bool:
        return self._ok == self._streams and all(self._landed)

    def _wait(self, ready, timeout: float | None, what: str) -> None:
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._cv:
            while self._error is None and not ready():
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    break
                self._cv.wait(left)
            if self._error is None and ready():
                return
        self._fail(TransferError("timeout", f"request {self.header.request_id}: {what} did not arrive within "
                                 f"{timeout} s"), cancel=True)
        raise self._error  # the timeout, or a failure that won the race

    def _fail(self, err: TransferError, cancel: bool) -> None:
        """First failure wins. `cancel`: end the request's streams too (a local abort or timeout)."""
        with self._cv:
            if self._error is not None or self._state == TransferState.SUCCESS:
                return
            self._error, self._state = err, TransferState.FAILED
            self._cv.notify_all()
            contexts = list(self._contexts) if cancel else []
        for c in contexts:
            c.cancel()
        self.link._retire(self.key, err)

    # --- stream handlers' side ---

    def _add_stream(self, m: pb.FrameHeader, context) -> None:
        with self._cv:
            if _frame_fields(m) != self._frame:
                raise TransferError("protocol", f"request {m.request_id}: stream {m.stream_index}'s header "
                                    "differs from the request's first stream")
            if m.stream_index in self._seen:
                raise TransferError("protocol", f"request {m.request_id}: stream {m.stream_index} arrived twice")
            self._seen.add(m.stream_index)
            self._contexts.append(context)

    def _chunk(self, msg: bytes) -> None:
        _, i, offset, digest = wire.CHUNK.unpack_from(msg)
        n, lb = len(msg) - wire.CHUNK.size, self._landing.layer_bytes
        if i >= self.header.num_layers or n < 1 or offset + n > lb:
            raise TransferError("protocol", f"chunk of {n} bytes at layer {i} offset {offset} is outside the frame")
        if self._state != TransferState.TRANSFERRING:
            raise self._error or TransferError("protocol", "chunk after the request completed")
        base = i * lb + offset
        self._landing.flat[base:base + n] = np.frombuffer(msg, np.uint8, n, wire.CHUNK.size)  # the one copy
        with self._cv:
            if self._digest[i] is None:
                self._digest[i] = digest
            elif self._digest[i] != digest:
                raise TransferError("protocol", f"layer {i}'s chunks disagree on its digest")
            self._got[i] += n
            if self._got[i] > lb:
                raise TransferError("protocol", f"layer {i} received {self._got[i]} bytes, expected {lb}")
            if self._got[i] < lb:
                return
        self._verify(i)
        self._landing.land(i)  # H2D on a side stream (CUDA); nothing to do on CPU
        with self._cv:
            self._landed[i] = True
            self._cv.notify_all()

    def _verify(self, i: int) -> None:
        lb = self._landing.layer_bytes
        got = wire.layer_digest(self._checksum, [self._landing.flat[i * lb:(i + 1) * lb]])
        if got != self._digest[i]:
            raise TransferError("data_loss", f"request {self.header.request_id} layer {i}: {self._checksum.name} "
                                f"{got:#018x} != sender's {self._digest[i]:#018x}")

    def _end(self, t: pb.Trailer) -> None:
        if t.status == pb.END_ABORTED:
            self._fail(TransferError("aborted", f"sender aborted request {self.header.request_id}: {t.reason}"),
                       cancel=False)
            return
        with self._cv:
            if self._error is not None:
                raise self._error  # every stream reports the request's failure, not only the one that saw it
            self._ok += 1
            if self._ok == self._streams and any(g != self._landing.layer_bytes for g in self._got):
                missing = [i for i, g in enumerate(self._got) if g != self._landing.layer_bytes]
                raise TransferError("protocol", f"request {self.header.request_id}: all streams ended but "
                                    f"layers {missing} are incomplete")
            self._cv.notify_all()

    def _stream_closed(self) -> bool:
        """True when this was the request's last stream to end."""
        with self._cv:
            self._closed += 1
            return self._closed == self._streams


def _frame_fields(m: pb.FrameHeader) -> tuple:
    return (m.request_id, m.seq_len, m.num_layers, m.kv_heads, m.head_dim, m.batch, m.dtype, m.checksum,
            m.num_streams)
