"""The gRPC data plane's wire format: message kinds, the chunk struct, typed headers, limits.

Why a module of its own: sender and receiver must agree on every byte, and the receiver
must check a header *before* it allocates anything. The KV payload travels as raw bytes
behind a fixed 24-byte struct (a protobuf `bytes` field would cost a copy of every chunk);
the per-request header and trailer are typed protobuf messages (proto/kvdata.proto).
Nothing here is pickled and nothing is parsed out of a string.
"""

from __future__ import annotations

import struct

import grpc
import xxhash
from google.protobuf.message import DecodeError

from kvtransfer.transport.base import Cause, TransferError, TransferHeader
from kvtransfer.transport.frames import MAX_LAYERS, header_fields, make_header
from kvtransfer.transport.options import Checksum
from kvtransfer.transport.status import CAUSE_STATUS, cause_of_status
from proto import kvdata_pb2 as pb

SERVICE, METHOD = "kvtransfer.data.v1.KVData", "Push"
PUSH_PATH = f"/{SERVICE}/{METHOD}"  # stream-unary, raw bytes in both directions

KIND_HEADER, KIND_CHUNK, KIND_END = 1, 2, 3
CHUNK = struct.Struct("<B3xIQQ")  # kind, layer, byte offset in the layer, layer digest (0: none)

MAX_STREAMS = 64
MAX_CHUNK_BYTES = 64 << 20
MAX_MESSAGE_BYTES = MAX_CHUNK_BYTES + 4096  # the receive limit both sides set (default is 4 MiB)

CHANNEL_OPTIONS = [
    ("grpc.use_local_subchannel_pool", 1),  # one TCP connection per channel, not one shared
    ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
    ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
]
SERVER_OPTIONS = CHANNEL_OPTIONS[1:] + [("grpc.so_reuseport", 0)]  # one listener per port


def layer_digest(algo: Checksum, views) -> int:
    """Digest of one layer's bytes, given as buffers in wire order (K then V). 0 when off."""
    if algo == Checksum.NONE:
        return 0
    h = xxhash.xxh3_64()
    for v in views:
        h.update(v)
    return h.intdigest()


def header_message(h: TransferHeader, link_id: int, seq: int, checksum: Checksum, streams: int, index: int) -> bytes:
    rid, seq_len, layers, heads, dim, dtype, batch = header_fields(h)
    m = pb.FrameHeader(link_id=link_id, seq=seq, request_id=rid, seq_len=seq_len, num_layers=layers,
                       kv_heads=heads, head_dim=dim, batch=batch, dtype=dtype, checksum=int(checksum),
                       num_streams=streams, stream_index=index)
    return bytes((KIND_HEADER,)) + m.SerializeToString()


def trailer_message(ok: bool, reason: str = "") -> bytes:
    m = pb.Trailer(status=pb.END_OK if ok else pb.END_ABORTED, reason=reason[:1000])
    return bytes((KIND_END,)) + m.SerializeToString()


def parse_header(msg: bytes) -> pb.FrameHeader:
    if not msg or msg[0] != KIND_HEADER:
        raise TransferError("protocol", f"stream must start with a frame header, got kind {msg[:1]!r}")
    m = pb.FrameHeader()
    try:
        m.ParseFromString(msg[1:])
    except DecodeError as e:
        raise TransferError("protocol", f"unreadable frame header: {e}") from None
    return m


def parse_trailer(msg: bytes) -> pb.Trailer:
    m = pb.Trailer()
    try:
        m.ParseFromString(msg[1:])
    except DecodeError as e:
        raise TransferError("protocol", f"unreadable trailer: {e}") from None
    if m.status not in (pb.END_OK, pb.END_ABORTED):
        raise TransferError("protocol", f"trailer status {m.status} is neither OK nor ABORTED")
    return m


def check_header(m: pb.FrameHeader, max_bytes: int) -> TransferHeader:
    """The frame spec's validator (frames.make_header) plus this backend's own fields, before any allocation."""
    if m.checksum not in tuple(Checksum):
        raise TransferError("protocol", f"request {m.request_id}: unknown checksum code {m.checksum}")
    if not 1 <= m.num_streams <= MAX_STREAMS or m.stream_index >= m.num_streams:
        raise TransferError("protocol", f"request {m.request_id}: stream {m.stream_index} of {m.num_streams} "
                            f"(1..{MAX_STREAMS} streams)")
    return make_header(m.request_id, m.seq_len, m.num_layers, m.kv_heads, m.head_dim, m.dtype, m.batch,
                       max_bytes, MAX_LAYERS)


# --- errors across the wire: the receiver ends a stream with the cause's status (kvtransfer.transport.status) and the
# cause itself in trailing metadata (a typed `Failure`), so the sender gets back exactly the cause ---

FAILURE_KEY = "kvt-failure-bin"
_CAUSE_PROTO = {c: i + 1 for i, c in enumerate(Cause)}  # kvdata.proto's Cause: CAUSE_ABORTED = 1, ...


def abort_stream(context, err: TransferError) -> None:
    context.set_trailing_metadata(((FAILURE_KEY, pb.Failure(cause=_CAUSE_PROTO[err.cause]).SerializeToString()),))
    context.abort(CAUSE_STATUS[err.cause], str(err))


def error_from_rpc(e: grpc.RpcError, address: str) -> TransferError:
    code, details = e.code(), e.details()
    cause = None
    for key, value in (e.trailing_metadata() or ()) if hasattr(e, "trailing_metadata") else ():
        if key == FAILURE_KEY:
            f = pb.Failure()
            try:
                f.ParseFromString(value)
                cause = list(Cause)[f.cause - 1] if 1 <= f.cause <= len(Cause) else None
            except DecodeError:
                cause = None
    if code == grpc.StatusCode.CANCELLED:
        details = f"the receiver cancelled the request (it aborted or gave up waiting): {details}"
    return TransferError(cause or cause_of_status(code), f"receiver {address}: {code.name}: {details}")
