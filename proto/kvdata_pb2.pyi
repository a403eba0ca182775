from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class DType(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    DTYPE_UNSPECIFIED: _ClassVar[DType]
    DTYPE_FLOAT32: _ClassVar[DType]
    DTYPE_BFLOAT16: _ClassVar[DType]
    DTYPE_FLOAT16: _ClassVar[DType]

class Checksum(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    CHECKSUM_NONE: _ClassVar[Checksum]
    CHECKSUM_XXH3_64: _ClassVar[Checksum]

class EndStatus(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    END_UNSPECIFIED: _ClassVar[EndStatus]
    END_OK: _ClassVar[EndStatus]
    END_ABORTED: _ClassVar[EndStatus]

class Cause(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    CAUSE_UNSPECIFIED: _ClassVar[Cause]
    CAUSE_ABORTED: _ClassVar[Cause]
    CAUSE_TIMEOUT: _ClassVar[Cause]
    CAUSE_PEER: _ClassVar[Cause]
    CAUSE_PROTOCOL: _ClassVar[Cause]
    CAUSE_DATA_LOSS: _ClassVar[Cause]
DTYPE_UNSPECIFIED: DType
DTYPE_FLOAT32: DType
DTYPE_BFLOAT16: DType
DTYPE_FLOAT16: DType
CHECKSUM_NONE: Checksum
CHECKSUM_XXH3_64: Checksum
END_UNSPECIFIED: EndStatus
END_OK: EndStatus
END_ABORTED: EndStatus
CAUSE_UNSPECIFIED: Cause
CAUSE_ABORTED: Cause
CAUSE_TIMEOUT: Cause
CAUSE_PEER: Cause
CAUSE_PROTOCOL: Cause
CAUSE_DATA_LOSS: Cause

class FrameHeader(_message.Message):
    __slots__ = ("link_id", "seq", "request_id", "seq_len", "num_layers", "kv_heads", "head_dim", "batch", "dtype", "checksum", "num_streams", "stream_index")
    LINK_ID_FIELD_NUMBER: _ClassVar[int]
    SEQ_FIELD_NUMBER: _ClassVar[int]
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    SEQ_LEN_FIELD_NUMBER: _ClassVar[int]
    NUM_LAYERS_FIELD_NUMBER: _ClassVar[int]
    KV_HEADS_FIELD_NUMBER: _ClassVar[int]
    HEAD_DIM_FIELD_NUMBER: _ClassVar[int]
    BATCH_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    CHECKSUM_FIELD_NUMBER: _ClassVar[int]
    NUM_STREAMS_FIELD_NUMBER: _ClassVar[int]
    STREAM_INDEX_FIELD_NUMBER: _ClassVar[int]
    link_id: int
    seq: int
    request_id: int
    seq_len: int
    num_layers: int
    kv_heads: int
    head_dim: int
    batch: int
    dtype: DType
    checksum: Checksum
    num_streams: int
    stream_index: int
    def __init__(self, link_id: _Optional[int] = ..., seq: _Optional[int] = ..., request_id: _Optional[int] = ..., seq_len: _Optional[int] = ..., num_layers: _Optional[int] = ..., kv_heads: _Optional[int] = ..., head_dim: _Optional[int] = ..., batch: _Optional[int] = ..., dtype: _Optional[_Union[DType, str]] = ..., checksum: _Optional[_Union[Checksum, str]] = ..., num_streams: _Optional[int] = ..., stream_index: _Optional[int] = ...) -> None: ...

class Trailer(_message.Message):
    __slots__ = ("status", "reason")
    STATUS_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    status: EndStatus
    reason: str
    def __init__(self, status: _Optional[_Union[EndStatus, str]] = ..., reason: _Optional[str] = ...) -> None: ...

class Failure(_message.Message):
    __slots__ = ("cause",)
    CAUSE_FIELD_NUMBER: _ClassVar[int]
    cause: Cause
    def __init__(self, cause: _Optional[_Union[Cause, str]] = ...) -> None: ...
