"""gRPC backend, sender side: one request = one client stream per channel, layers chunked over them.

Why this shape: one gRPC channel in Python carries far less than the link (or a raw TCP
socket) can, and channels add up, so a request's bytes are spread over `channels` channels,
each its own TCP connection (`use_local_subchannel_pool`).
The payload is raw bytes behind a fixed struct (no protobuf copy). `send_layer` only checks
(sender.py) and enqueues (on CUDA it also queues the D2H copy on a side stream); one shipping thread
per request waits for each layer's copy, digests it and cuts it into chunk descriptors,
and each stream's request iterator (run by gRPC's own thread) takes the next descriptor
from a shared queue: fast channels take more chunks. Every stream ends with a typed
trailer, OK or ABORTED, so an abort stays in-band; the receiver's reply (or its status
code) is the end-to-end acknowledgement that `finish` waits for.

The decode (receiver) side listens (`ReceiverLink`, listener.py); the prefill side
connects to its address.
"""

from __future__ import annotations

import itertools
import queue
import secrets
import threading
import time

import grpc

from kvtransfer.transport import base
from kvtransfer.transport.base import TransferError, TransferHeader
from kvtransfer.transport.errors import TlsRefused
from kvtransfer.transport.grpc import frames as wire
from kvtransfer.transport.grpc.listener import ReceiverLink
from kvtransfer.transport.grpc.staging import D2HStager, wait_event
from kvtransfer.transport.layout import byte_view, kv_pair_view
from kvtransfer.transport.options import CHECKSUMS, Checksum, GrpcOptions
from kvtransfer.transport.sender import BaseSender

_FINISH = object()


def sender_link(device, options: GrpcOptions, address: str, connect_timeout_s: float = 30.0) -> "SenderLink":
    from kvtransfer.rpc.security import channel_credentials
    o = options
    return SenderLink(address, channels=o.channels, chunk_bytes=o.chunk_bytes, checksum=CHECKSUMS[o.checksum],
                      corrupt_layer=None if o.corrupt_layer < 0 else o.corrupt_layer,
                      connect_timeout_s=connect_timeout_s, abort_cancel_s=o.abort_cancel_s,
                      credentials=channel_credentials(o.tls_ca, o.tls_cert, o.tls_key, "data-tls"))


def receiver_link(device, options: GrpcOptions, address: str, max_bytes: int, max_layers: int) -> ReceiverLink:
    from kvtransfer.rpc.security import server_credentials
    o = options
    return ReceiverLink(address or "127.0.0.1:0", device, max_bytes=max_bytes, max_workers=o.listener_workers,
                        credentials=server_credentials(o.tls_cert, o.tls_key, o.tls_ca))


TLS_FAILURES = ("ssl", "tls", "handshake", "certificate", "verification")  # in gRPC's reason for a channel not ready


def _why_not_ready(channel: grpc.Channel) -> str:
    """gRPC's reason a channel is not connected: the details of one call that cannot connect (a method nobody
    serves, so a channel that did connect answers UNIMPLEMENTED at once); "" when it connected meanwhile."""
    try:
        channel.unary_unary("/kvtransfer.data.Probe/Connect")(b"", timeout=1.0)
    except grpc.RpcError as e:
        return "" if e.code() == grpc.StatusCode.UNIMPLEMENTED else (e.details() or e.code().name)
    return ""


class SenderLink(base.SenderLink):
    """Connects `channels` gRPC channels to a ReceiverLink at `address` ("host:port").

    A request uses min(channels, its chunk count) streams. `open` may be called from several
    threads; requests are independent. chunk_bytes: payload per message. checksum: per-layer digest the receiver verifies.
    corrupt_layer: fault injection, flips one byte of that layer on the wire (after the digest).
    credentials: TLS for the data plane (plaintext when None). abort_cancel_s: GrpcOptions.
    """

    survives_failed_request = True
    abort_reaches_sender = True

    def __init__(self, address: str, channels: int = 4, chunk_bytes: int = 4 << 20,
                 checksum: Checksum = Checksum.XXH3_64, corrupt_layer: int | None = None,
                 connect_timeout_s: float = 30.0, credentials: grpc.ChannelCredentials | None = None,
                 abort_cancel_s: float = 5.0):
        if not 1 <= channels <= wire.MAX_STREAMS:
            raise ValueError(f"channels must be 1..{wire.MAX_STREAMS}, got {channels}")
        if not 1 <= chunk_bytes <= wire.MAX_CHUNK_BYTES:
            raise ValueError(f"chunk_bytes must be 1..{wire.MAX_CHUNK_BYTES}, got {chunk_bytes}")
        self.address, self.chunk_bytes, self.checksum = address, chunk_bytes, Checksum(checksum)
        self.corrupt_layer, self.connect_timeout_s, self.abort_cancel_s = corrupt_layer, connect_timeout_s, abort_cancel_s
        self.link_id = secrets.randbits(64)
        self._seq = itertools.count()
        self._channels = [grpc.insecure_channel(address, options=wire.CHANNEL_OPTIONS) if credentials is None
                          else grpc.secure_channel(address, credentials, options=wire.CHANNEL_OPTIONS)
                          for _ in range(channels)]
        self._push = [ch.stream_unary(wire.PUSH_PATH) for ch in self._channels]  # no (de)serializers: raw bytes
        self.tls = credentials is not None
        self._connected = False
        self.stager = D2HStager()

    def _connect(self) -> None:
        """Every channel ready, within connect_timeout_s. A channel not ready within a second is asked why (one
        call's failure carries gRPC's reason): a failed TLS handshake will not heal by waiting, so it ends the
        wait at once, saying so; anything else (nothing listening yet) is waited out, and the timeout names the
        last reason."""
        deadline = time.monotonic() + self.connect_timeout_s
        for ch in self._channels:
            while True:
                left = deadline - time.monotonic()
                try:
                    grpc.channel_ready_future(ch).result(timeout=max(min(left, 1.0), 0.001))
                    break
                except grpc.FutureTimeoutError:
                    why = _why_not_ready(ch)
                if self.tls and any(w in why.lower() for w in TLS_FAILURES):
                    raise TlsRefused(f"the TLS handshake with the gRPC receiver at {self.address} "
                                        f"failed ({why}): the decode side's --data-tls-cert must name the address "
                                        "this side connects to (its --data-listen host), signed by this side's "
                                        "--data-tls-ca")
                if left <= 1.0:
                    raise TransferError("peer", f"no gRPC receiver at {self.address} after "
                                        f"{self.connect_timeout_s} s" + (f" ({why})" if why else ""))
        self._connected = True

    def open(self, header: TransferHeader) -> "GrpcSender":
        if not self._connected:
            self._connect()
        return GrpcSender(self, header, next(self._seq))

    def close(self) -> None:
        for ch in self._channels:
            ch.close()


class GrpcSender(BaseSender):
    def __init__(self, link: SenderLink, header: TransferHeader, seq: int):
        super().__init__(header)
        self.link = link
        self._ended = threading.Event()  # failed or aborted: iterators and the shipper stop
        self._layers: queue.SimpleQueue = queue.SimpleQueue()  # send_layer -> shipper
        self._work: queue.SimpleQueue = queue.SimpleQueue()  # shipper -> stream iterators
        # a stream costs an RPC set-up: no more streams than chunks; rotate so small requests spread out
        c = len(link._push)
        n = max(1, min(c, -(-header.layer_bytes() * header.num_layers // link.chunk_bytes)))
        pushes = [link._push[(seq + j) % c] for j in range(n)]
        heads = [wire.header_message(header, link.link_id, seq, link.checksum, n, j) for j in range(n)]
        # no wait_for_ready: a receiver that is down fails the request at once ("peer"), not at the timeout
        self._calls = [push.future(self._stream(head)) for push, head in zip(pushes, heads)]
        for c in self._calls:
            c.add_done_callback(self._on_done)
        threading.Thread(target=self._ship, name=f"kv-ship-{header.request_id}", daemon=True).start()

    # --- how bytes move (sender.py keeps the state) ---

    def _send(self, layer_idx, key, value):
        if key.device.type == "cuda":
            stage, ev = self.link.stager.stage(key, value)
            views = [memoryview(stage.numpy())]
        else:
            kv = kv_pair_view(key, value)  # (2, b, h, s, d) when V directly follows K
            views, ev = ([byte_view(kv)] if kv is not None else [byte_view(key), byte_view(value)]), None
        self._layers.put((layer_idx, views, ev))

    def _finish(self, timeout):
        self._layers.put(_FINISH)
        deadline = None if timeout is None else time.monotonic() + timeout
        for c in self._calls:
            left = None if deadline is None else max(deadline - time.monotonic(), 0.0)
            try:
                c.result(timeout=left)
            except grpc.FutureTimeoutError:
                raise TransferError("timeout", f"request {self.header.request_id}: the receiver did not "
                                    f"acknowledge within {timeout} s") from None
            except grpc.FutureCancelledError:  # we cancelled it after a failure: that failure is what finish raises
                raise TransferError("aborted", f"request {self.header.request_id}: stream cancelled") from None
            except grpc.RpcError as e:
                raise wire.error_from_rpc(e, self.link.address) from None

    def _abort(self, reason):
        self._ended.set()
        for _ in self._calls:
            self._work.put(None)  # wake every stream: each sends the ABORTED trailer and ends
        timer = threading.Timer(self.link.abort_cancel_s, self._cancel)  # a silent receiver must not hold us
        timer.daemon = True
        timer.start()

    def _end(self, error):
        self._ended.set()
        if error is not None:
            self._cancel()

    def _cancel(self) -> None:
        for c in self._calls:
            c.cancel()

    def _on_done(self, call) -> None:
        """A stream ended (gRPC's thread): its error fails the request, unless it has ended already."""
        if not call.cancelled() and call.exception() is not None:
            self._fail(wire.error_from_rpc(call.exception(), self.link.address))

    # --- threads: the shipper, and one request iterator per stream (run by gRPC) ---

    def _ship(self) -> None:
        """Waits for each layer's bytes (D2H event on CUDA), digests them, queues chunk descriptors."""
        link, step = self.link, self.link.chunk_bytes
        while not self._ended.is_set():
            try:
                item = self._layers.get(timeout=0.5)
            except queue.Empty:
                continue
            if item is _FINISH:
                for _ in self._calls:
                    self._work.put(_FINISH)
                return
            i, views, ev = item
            if ev is not None and not wait_event(ev, self._ended.is_set):
                return
            digest = wire.layer_digest(link.checksum, views)
            offset = 0
            for v in views:  # K then V (one view when adjacent)
                for a in range(0, len(v), step):
                    self._work.put((i, offset + a, v[a:a + step], digest))
                offset += len(v)

    def _stream(self, head: bytes):
        yield head
        corrupt = self.link.corrupt_layer
        while True:
            try:
                item = self._work.get(timeout=0.5)
            except queue.Empty:
                item = None
            if self._aborted is not None:
                yield wire.trailer_message(False, self._aborted)
                return
            if self._error is not None:
                return
            if item is _FINISH:
                yield wire.trailer_message(True)
                return
            if item is None:
                continue
            i, offset, view, digest = item
            msg = wire.CHUNK.pack(wire.KIND_CHUNK, i, offset, digest) + view  # the one copy: tensor bytes -> message
            if i == corrupt and offset == 0:
                msg = _flip_first_payload_byte(msg)
            yield msg


def _flip_first_payload_byte(msg: bytes) -> bytes:
    b = bytearray(msg)
    b[wire.CHUNK.size] ^= 0xFF
    return bytes(b)
