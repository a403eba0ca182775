"""The gRPC data plane's wire format: message kinds, the chunk struct, typed headers, limits.

Why a module of its own: sender and receiver must agree on every byte, and the receiver
must check a header *before* it allocates anything. The KV payload travels as raw bytes
behind a fixed 24-byte struct (a protobuf `bytes` field would cost a copy and is 2-3x
slower); the per-request header and trailer are typed protobuf messages (proto/kvdata.proto).
Nothing here is pickled and nothing is parsed out of a string.
"""

from __future__ import annotations

import enum
import struct

import grpc
import xxhash
from google.protobuf.message import DecodeError

from proto import kvdata_pb2 as pb

from ..geometry import CODE_DTYPES, DTYPE_CODES
from .base import TransferError, TransferHeader

SERVICE, METHOD = "kvtransfer.data.v1.KVData", "Push"
PUSH_PATH = f"/{SERVICE}/{METHOD}"  # stream-unary, raw bytes in both directions

KIND_HEADER, KIND_CHUNK, KIND_END = 1, 2, 3
CHUNK = struct.Struct("<B3xIQQ")  # kind, layer, byte offset in the layer, layer digest (0: none)

MAX_STREAMS = 64
MAX_LAYERS = 4096
MAX_CHUNK_BYTES = 64 << 20
MAX_MESSAGE_BYTES = MAX_CHUNK_BYTES + 4096  # the receive limit both sides set (default is 4 MiB)

CHANNEL_OPTIONS = [
    ("grpc.use_local_subchannel_pool", 1),  # one TCP connection per channel, not one shared
    ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
    ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
]
SERVER_OPTIONS = CHANNEL_OPTIONS[1:]


class Checksum(enum.IntEnum):
    """Per-layer integrity check; values are the wire's `Checksum` enum."""

    NONE = pb.CHECKSUM_NONE
    XXH3_64 = pb.CHECKSUM_XXH3_64


def layer_digest(algo: Checksum, views) -> int:
    """Digest of one layer's bytes, given as buffers in wire order (K then V). 0 when off."""
    if algo == Checksum.NONE:
        return 0
    h = xxhash.xxh3_64()
    for v in views:
        h.update(v)
    return h.intdigest()


def header_message(h: TransferHeader, link_id: int, seq: int, checksum: Checksum, streams: int, index: int) -> bytes:
    m = pb.FrameHeader(link_id=link_id, seq=seq, request_id=h.request_id, seq_len=h.seq_len,
                       num_layers=h.num_layers, kv_heads=h.kv_heads, head_dim=h.head_dim, batch=h.batch,
                       dtype=DTYPE_CODES[h.dtype], checksum=int(checksum), num_streams=streams, stream_index=index)
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
    """Sanity and size limits on a received header, before anything is allocated for it."""
    dims = {"seq_len": m.seq_len, "num_layers": m.num_layers, "kv_heads": m.kv_heads,
            "head_dim": m.head_dim, "batch": m.batch}
    bad = [f"{k}={v}" for k, v in dims.items() if v < 1]
    if bad:
        raise TransferError("protocol", f"request {m.request_id}: header fields must be >= 1 ({', '.join(bad)})")
    if m.dtype not in CODE_DTYPES:
        raise TransferError("protocol", f"request {m.request_id}: unknown dtype code {m.dtype}")
    if m.checksum not in tuple(Checksum):
        raise TransferError("protocol", f"request {m.request_id}: unknown checksum code {m.checksum}")
    if not 1 <= m.num_streams <= MAX_STREAMS or m.stream_index >= m.num_streams:
        raise TransferError("protocol", f"request {m.request_id}: stream {m.stream_index} of {m.num_streams} "
                            f"(1..{MAX_STREAMS} streams)")
    if m.num_layers > MAX_LAYERS:
        raise TransferError("protocol", f"request {m.request_id}: {m.num_layers} layers exceed {MAX_LAYERS}")
    h = TransferHeader(request_id=m.request_id, seq_len=m.seq_len, num_layers=m.num_layers, kv_heads=m.kv_heads,
                       head_dim=m.head_dim, dtype=CODE_DTYPES[m.dtype], batch=m.batch)
    total = h.layer_bytes() * h.num_layers
    if total > max_bytes:
        raise TransferError("protocol", f"request {m.request_id}: transfer of {total} bytes exceeds the receive "
                            f"limit max_bytes={max_bytes}")
    return h


# --- errors across the wire: the receiver answers with a status code, the sender maps it back ---

_CODE_OF_CAUSE = {"aborted": grpc.StatusCode.ABORTED, "timeout": grpc.StatusCode.DEADLINE_EXCEEDED,
                  "protocol": grpc.StatusCode.INVALID_ARGUMENT, "data_loss": grpc.StatusCode.DATA_LOSS,
                  "peer": grpc.StatusCode.UNAVAILABLE}
_CAUSE_OF_CODE = {grpc.StatusCode.DATA_LOSS: "data_loss", grpc.StatusCode.INVALID_ARGUMENT: "protocol",
                  grpc.StatusCode.RESOURCE_EXHAUSTED: "protocol", grpc.StatusCode.FAILED_PRECONDITION: "protocol",
                  grpc.StatusCode.UNIMPLEMENTED: "protocol", grpc.StatusCode.OUT_OF_RANGE: "protocol",
                  grpc.StatusCode.ABORTED: "aborted", grpc.StatusCode.CANCELLED: "aborted",
                  grpc.StatusCode.DEADLINE_EXCEEDED: "timeout"}


def status_code(err: TransferError) -> grpc.StatusCode:
    return _CODE_OF_CAUSE.get(err.cause, grpc.StatusCode.UNKNOWN)


def error_from_rpc(e: grpc.RpcError, address: str) -> TransferError:
    code, details = e.code(), e.details()
    if code == grpc.StatusCode.CANCELLED:
        details = f"the receiver cancelled the request (it aborted or gave up waiting): {details}"
    return TransferError(_CAUSE_OF_CODE.get(code, "peer"), f"receiver {address}: {code.name}: {details}")
