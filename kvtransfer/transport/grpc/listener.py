"""gRPC backend, receiving end: the decode worker listens; each request arrives as N client streams.

Why the receiver listens: it owns the buffers, so it checks every header before it allocates
(size limit, sane fields) and refuses with a status code the sender maps to a TransferError.
The first stream of a request to arrive creates its receiver (receiver.py) and queues it
for `accept()` (arrival order); the others attach to it by (link id, sequence number), so
concurrent or repeated application request ids never mix. Ended requests leave a tombstone,
so a late stream cannot start them again.
"""

from __future__ import annotations

import logging
import queue
import threading
from collections import OrderedDict
from concurrent.futures import ThreadPoolExecutor

import grpc
import torch

from kvtransfer.transport import base
from kvtransfer.transport.base import TransferError, TransferState
from kvtransfer.transport.grpc import frames as wire
from kvtransfer.transport.grpc.receiver import GrpcReceiver
from proto import kvdata_pb2 as pb

log = logging.getLogger("kvtransfer.transport.grpc")

_CLOSED = object()
_TOMBSTONES = 1024  # ended requests remembered


class ReceiverLink(base.ReceiverLink):
    """A gRPC server on `address` ("host:port"; port 0 picks one: see `.address`) receiving onto `device`.

    max_bytes: largest request accepted (checked before allocating). max_workers bounds concurrent
    streams: it must be >= the sender's channels x requests in flight. credentials: TLS (plaintext when None).
    Requests arrive (and their chunks land in host memory) before `accept`; `accept` binds the
    destination, and layers that landed already are placed then.
    """

    survives_failed_request = True  # one request's failure leaves the listener usable
    abort_reaches_sender = True  # a receiver's abort cancels the request's streams

    def __init__(self, address: str = "127.0.0.1:0", device: torch.device | str = "cpu",
                 max_bytes: int = 64 << 30, max_workers: int = 64,
                 credentials: grpc.ServerCredentials | None = None):
        self.device, self.max_bytes = torch.device(device), max_bytes
        self._accepted: queue.Queue = queue.Queue()
        self._requests: OrderedDict = OrderedDict()  # (link_id, seq) -> GrpcReceiver | TransferError (ended)
        self._lock = threading.Lock()
        self._closed = False
        self._server = grpc.server(ThreadPoolExecutor(max_workers, thread_name_prefix="kv-recv"),
                                   options=wire.SERVER_OPTIONS)
        self._server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(
            wire.SERVICE, {wire.METHOD: grpc.stream_unary_rpc_method_handler(self._push)}),))  # raw bytes
        try:
            self.port = (self._server.add_insecure_port(address) if credentials is None
                         else self._server.add_secure_port(address, credentials))
        except RuntimeError as e:
            raise ValueError(f"cannot listen on {address}: {e}") from None
        self.address = f"{address.rsplit(':', 1)[0]}:{self.port}"
        self._server.start()

    def accept(self, timeout=None, destinations=None) -> "GrpcReceiver":
        """The next request in arrival order. A refused header raises its TransferError here; the link stays usable."""
        try:
            item = self._accepted.get(timeout=timeout)
        except queue.Empty:
            raise TransferError("timeout", f"no transfer arrived within {timeout} s") from None
        if item is _CLOSED:
            self._accepted.put(_CLOSED)
            raise TransferError("peer", "receiver link closed")
        if isinstance(item, TransferError):
            raise item
        item._bind(destinations)
        return item

    def inflight(self) -> int:
        with self._lock:
            return sum(isinstance(r, GrpcReceiver) and r.status() not in (TransferState.SUCCESS, TransferState.FAILED)
                       for r in self._requests.values())

    def close(self) -> None:
        with self._lock:
            self._closed = True
            live = [r for r in self._requests.values() if isinstance(r, GrpcReceiver)]
        for r in live:
            r._fail(TransferError("peer", "receiver link closed"), cancel=True)
        self._server.stop(grace=0.5)
        self._accepted.put(_CLOSED)

    # --- stream handlers (gRPC server threads) ---

    def _push(self, requests, context) -> bytes:
        rx, registered = None, False
        try:
            it = iter(requests)
            m = wire.parse_header(next(it, b""))
            rx = self._attach(m)
            rx._add_stream(m, context)
            registered = True
            if rx._error is not None:
                raise rx._error
            for msg in it:
                kind = msg[0] if msg else 0
                if kind == wire.KIND_CHUNK:
                    rx._chunk(msg)
                elif kind == wire.KIND_END:
                    rx._end(wire.parse_trailer(msg))
                    return b""
                else:
                    raise TransferError("protocol", f"unknown message kind {kind} on a data stream")
            # our sender always ends with a trailer; without one it cancelled or its connection dropped
            raise TransferError("peer", f"request {rx.header.request_id}: stream ended before its trailer "
                                "(sender lost)")
        except TransferError as e:
            if rx is not None:
                rx._fail(e, cancel=False)
            wire.abort_stream(context, e)
        except grpc.RpcError:  # the sender went away mid-stream
            if rx is not None:
                rx._fail(TransferError("peer", f"request {rx.header.request_id}: sender connection lost"), cancel=False)
            return b""
        except Exception as e:  # a bug here must still end the request, loudly
            log.exception("gRPC receive handler failed")
            if rx is not None:
                rx._fail(TransferError("protocol", f"receiver error: {e!r}"), cancel=False)
            context.abort(grpc.StatusCode.INTERNAL, f"receiver error: {e!r}")
        finally:
            if registered and rx._stream_closed():
                self._retire(rx.key, TransferError("protocol", f"request {rx.header.request_id} has already ended"))

    def _attach(self, m: pb.FrameHeader) -> "GrpcReceiver":
        """The request this stream belongs to; a new one is checked, allocated and queued for accept()."""
        key = (m.link_id, m.seq)
        with self._lock:
            entry = self._requests.get(key)
            if entry is None:
                if self._closed:
                    raise TransferError("peer", "receiver link closed")
                try:
                    h = wire.check_header(m, self.max_bytes)
                except TransferError as e:
                    self._requests[key] = e
                    self._trim()
                    self._accepted.put(e)
                    raise
                entry = self._requests[key] = GrpcReceiver(self, key, h, m)
                self._accepted.put(entry)
        if isinstance(entry, TransferError):
            raise entry
        return entry

    def _retire(self, key, err: TransferError) -> None:
        """The request ended: drop it (and its buffers) from the table; late streams get `err`."""
        with self._lock:
            if not isinstance(self._requests.get(key), TransferError):
                self._requests[key] = err
            self._trim()

    def _trim(self) -> None:
        ended = [k for k, v in self._requests.items() if isinstance(v, TransferError)]
        for k in ended[:max(len(ended) - _TOMBSTONES, 0)]:
            del self._requests[k]
