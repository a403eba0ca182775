"""cuda_ipc control messages: typed fields, struct-packed, framed as (tag u8, length u32).

Why not pickle or protobuf: the messages are few and tiny, the per-layer one is on the
prefill hot path, and both ends are this package. Each message is a fixed struct of typed
fields followed by length-prefixed byte strings; decoding checks every length and refuses
unknown tags, short or over-long payloads with TransferError("protocol").
"""

from __future__ import annotations

import dataclasses
import struct
from typing import ClassVar

from kvtransfer.transport.base import TransferError

MAGIC, VERSION = b"KVIP", 1
ROLE_SENDER, ROLE_RECEIVER = 1, 2
TRAILER_OK, TRAILER_ABORTED = 1, 2
FRAME = struct.Struct("<BI")  # tag, payload length
MAX_PAYLOAD = 1 << 20
_BLOB_LEN = struct.Struct("<I")


@dataclasses.dataclass(frozen=True, slots=True)
class Message:
    TAG: ClassVar[int]
    FIXED: ClassVar[struct.Struct]  # the leading fields; the rest are byte strings
    NFIXED: ClassVar[int]


_BY_TAG: dict[int, type[Message]] = {}


def _message(tag: int, fixed: str):
    def register(cls):
        cls = dataclasses.dataclass(frozen=True, slots=True)(cls)
        cls.TAG, cls.FIXED = tag, struct.Struct("<" + fixed)
        cls.NFIXED = len(struct.unpack("<" + fixed, bytes(cls.FIXED.size)))
        cls.NAMES = tuple(f.name for f in dataclasses.fields(cls))
        _BY_TAG[tag] = cls
        return cls
    return register


@_message(1, "4sHBI")
class Hello(Message):
    magic: bytes
    version: int
    role: int
    pid: int
    device_uuid: bytes  # the GPU this side uses; the peer maps it to its own device index


@_message(2, "IQI")
class Pool(Message):
    slots: int
    slot_bytes: int
    max_layers: int


@_message(3, "IQqq?")
class Slot(Message):
    """One receive slot's CUDA IPC memory handle: the fields of `storage._share_cuda_()` minus the device."""
    slot: int
    size: int                  # storage size in bytes
    offset: int                # storage offset in bytes inside the shared allocation
    ref_counter_offset: int
    event_sync_required: bool
    handle: bytes              # the allocator's shareable handle (cudaIpcMemHandle plus a version prefix)
    ref_counter: bytes         # name of the shared-memory ref-counter file
    event_handle: bytes        # cudaIpcEventHandle for the producer's "data ready" event
    release_event: bytes       # this slot's release event (receiver records it when it lets go)


@_message(4, "I")
class Events(Message):
    slot: int
    handles: bytes  # max_layers x 64-byte cudaIpcEventHandle: "layer i landed" in this slot


@_message(5, "")
class Ready(Message):
    pass


@_message(6, "qIIIIIIB")
class Header(Message):
    request_id: int
    slot: int
    seq_len: int
    num_layers: int
    kv_heads: int
    head_dim: int
    batch: int
    dtype_code: int


@_message(7, "qI")
class Landed(Message):
    request_id: int
    layer: int


@_message(8, "qB")
class Trailer(Message):
    request_id: int
    code: int  # TRAILER_OK or TRAILER_ABORTED
    reason: bytes


@_message(9, "qI?")
class Release(Message):
    request_id: int
    slot: int
    early: bool  # the receiver gave up before a successful finish (abort, timeout, error)


def encode(m: Message) -> bytes:
    vals = [getattr(m, n) for n in m.NAMES]
    parts = [m.FIXED.pack(*vals[:m.NFIXED])]
    for blob in vals[m.NFIXED:]:
        parts += (_BLOB_LEN.pack(len(blob)), blob)
    payload = b"".join(parts)
    return FRAME.pack(m.TAG, len(payload)) + payload


def decode(tag: int, payload: bytes) -> Message:
    cls = _BY_TAG.get(tag)
    if cls is None:
        raise TransferError("protocol", f"unknown control message tag {tag}")
    try:
        vals = list(cls.FIXED.unpack_from(payload, 0))
        pos = cls.FIXED.size
        for _ in cls.NAMES[cls.NFIXED:]:
            (n,) = _BLOB_LEN.unpack_from(payload, pos)
            pos += _BLOB_LEN.size
            if pos + n > len(payload):
                raise struct.error("byte string runs past the payload")
            vals.append(bytes(payload[pos:pos + n]))
            pos += n
    except struct.error as e:
        raise TransferError("protocol", f"malformed {cls.__name__} message: {e}") from None
    if pos != len(payload):
        raise TransferError("protocol", f"{cls.__name__} message has {len(payload) - pos} trailing bytes")
    return cls(*vals)


_LANDED = struct.Struct("<BI" + Landed.FIXED.format[1:])


def encode_landed(request_id: int, layer: int) -> bytes:
    """encode(Landed(request_id, layer)) without building the message: the per-layer path."""
    return _LANDED.pack(Landed.TAG, Landed.FIXED.size, request_id, layer)
