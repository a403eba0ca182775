from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class Mode(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    MODE_AUTO: _ClassVar[Mode]
    MODE_LAYERWISE: _ClassVar[Mode]
    MODE_BULK: _ClassVar[Mode]
    MODE_COLOCATED: _ClassVar[Mode]
    MODE_RECOMPUTE: _ClassVar[Mode]

class Transport(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    TRANSPORT_UNSPECIFIED: _ClassVar[Transport]
    TRANSPORT_NCCL: _ClassVar[Transport]
    TRANSPORT_GLOO: _ClassVar[Transport]
    TRANSPORT_GRPC: _ClassVar[Transport]
    TRANSPORT_CUDA_IPC: _ClassVar[Transport]

class CacheTier(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    CACHE_TIER_NONE: _ClassVar[CacheTier]
    CACHE_TIER_DEVICE: _ClassVar[CacheTier]
    CACHE_TIER_HOST: _ClassVar[CacheTier]

class FinishReason(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    FINISH_REASON_UNSPECIFIED: _ClassVar[FinishReason]
    FINISH_REASON_LENGTH: _ClassVar[FinishReason]
    FINISH_REASON_STOP: _ClassVar[FinishReason]
MODE_AUTO: Mode
MODE_LAYERWISE: Mode
MODE_BULK: Mode
MODE_COLOCATED: Mode
MODE_RECOMPUTE: Mode
TRANSPORT_UNSPECIFIED: Transport
TRANSPORT_NCCL: Transport
TRANSPORT_GLOO: Transport
TRANSPORT_GRPC: Transport
TRANSPORT_CUDA_IPC: Transport
CACHE_TIER_NONE: CacheTier
CACHE_TIER_DEVICE: CacheTier
CACHE_TIER_HOST: CacheTier
FINISH_REASON_UNSPECIFIED: FinishReason
FINISH_REASON_LENGTH: FinishReason
FINISH_REASON_STOP: FinishReason

class Sampling(_message.Message):
    __slots__ = ("temperature", "top_p", "top_k", "seed")
    TEMPERATURE_FIELD_NUMBER: _ClassVar[int]
    TOP_P_FIELD_NUMBER: _ClassVar[int]
    TOP_K_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    temperature: float
    top_p: float
    top_k: int
    seed: int
    def __init__(self, temperature: _Optional[float] = ..., top_p: _Optional[float] = ..., top_k: _Optional[int] = ..., seed: _Optional[int] = ...) -> None: ...

class GenerateRequest(_message.Message):
    __slots__ = ("token_ids", "max_new_tokens", "mode", "return_logits_digest", "return_cache_digest", "stop_on_eos", "sampling", "stop_token_ids", "skip_prefix_cache")
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    MAX_NEW_TOKENS_FIELD_NUMBER: _ClassVar[int]
    MODE_FIELD_NUMBER: _ClassVar[int]
    RETURN_LOGITS_DIGEST_FIELD_NUMBER: _ClassVar[int]
    RETURN_CACHE_DIGEST_FIELD_NUMBER: _ClassVar[int]
    STOP_ON_EOS_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    STOP_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    SKIP_PREFIX_CACHE_FIELD_NUMBER: _ClassVar[int]
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    max_new_tokens: int
    mode: Mode
    return_logits_digest: bool
    return_cache_digest: bool
    stop_on_eos: bool
    sampling: Sampling
    stop_token_ids: _containers.RepeatedScalarFieldContainer[int]
    skip_prefix_cache: bool
    def __init__(self, token_ids: _Optional[_Iterable[int]] = ..., max_new_tokens: _Optional[int] = ..., mode: _Optional[_Union[Mode, str]] = ..., return_logits_digest: _Optional[bool] = ..., return_cache_digest: _Optional[bool] = ..., stop_on_eos: _Optional[bool] = ..., sampling: _Optional[_Union[Sampling, _Mapping]] = ..., stop_token_ids: _Optional[_Iterable[int]] = ..., skip_prefix_cache: _Optional[bool] = ...) -> None: ...

class LoadRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class LoadResponse(_message.Message):
    __slots__ = ("running_requests", "running_tokens", "remaining_tokens", "waiting_requests", "waiting_tokens", "free_slots", "cached_slots", "serving", "queued_requests", "free_blocks", "cached_blocks", "preemptions", "shared_blocks")
    RUNNING_REQUESTS_FIELD_NUMBER: _ClassVar[int]
    RUNNING_TOKENS_FIELD_NUMBER: _ClassVar[int]
    REMAINING_TOKENS_FIELD_NUMBER: _ClassVar[int]
    WAITING_REQUESTS_FIELD_NUMBER: _ClassVar[int]
    WAITING_TOKENS_FIELD_NUMBER: _ClassVar[int]
    FREE_SLOTS_FIELD_NUMBER: _ClassVar[int]
    CACHED_SLOTS_FIELD_NUMBER: _ClassVar[int]
    SERVING_FIELD_NUMBER: _ClassVar[int]
    QUEUED_REQUESTS_FIELD_NUMBER: _ClassVar[int]
    FREE_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    CACHED_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    PREEMPTIONS_FIELD_NUMBER: _ClassVar[int]
    SHARED_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    running_requests: int
    running_tokens: int
    remaining_tokens: int
    waiting_requests: int
    waiting_tokens: int
    free_slots: int
    cached_slots: int
    serving: bool
    queued_requests: int
    free_blocks: int
    cached_blocks: int
    preemptions: int
    shared_blocks: int
    def __init__(self, running_requests: _Optional[int] = ..., running_tokens: _Optional[int] = ..., remaining_tokens: _Optional[int] = ..., waiting_requests: _Optional[int] = ..., waiting_tokens: _Optional[int] = ..., free_slots: _Optional[int] = ..., cached_slots: _Optional[int] = ..., serving: _Optional[bool] = ..., queued_requests: _Optional[int] = ..., free_blocks: _Optional[int] = ..., cached_blocks: _Optional[int] = ..., preemptions: _Optional[int] = ..., shared_blocks: _Optional[int] = ...) -> None: ...

class InfoRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class InfoResponse(_message.Message):
    __slots__ = ("model", "vocab_size", "context_length", "max_seq_len", "max_new_tokens", "max_prompt_tokens", "eos_token_ids", "prefix_block_tokens", "max_waiting", "kv_block_tokens", "kv_blocks", "max_batch")
    MODEL_FIELD_NUMBER: _ClassVar[int]
    VOCAB_SIZE_FIELD_NUMBER: _ClassVar[int]
    CONTEXT_LENGTH_FIELD_NUMBER: _ClassVar[int]
    MAX_SEQ_LEN_FIELD_NUMBER: _ClassVar[int]
    MAX_NEW_TOKENS_FIELD_NUMBER: _ClassVar[int]
    MAX_PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    EOS_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    PREFIX_BLOCK_TOKENS_FIELD_NUMBER: _ClassVar[int]
    MAX_WAITING_FIELD_NUMBER: _ClassVar[int]
    KV_BLOCK_TOKENS_FIELD_NUMBER: _ClassVar[int]
    KV_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    MAX_BATCH_FIELD_NUMBER: _ClassVar[int]
    model: str
    vocab_size: int
    context_length: int
    max_seq_len: int
    max_new_tokens: int
    max_prompt_tokens: int
    eos_token_ids: _containers.RepeatedScalarFieldContainer[int]
    prefix_block_tokens: int
    max_waiting: int
    kv_block_tokens: int
    kv_blocks: int
    max_batch: int
    def __init__(self, model: _Optional[str] = ..., vocab_size: _Optional[int] = ..., context_length: _Optional[int] = ..., max_seq_len: _Optional[int] = ..., max_new_tokens: _Optional[int] = ..., max_prompt_tokens: _Optional[int] = ..., eos_token_ids: _Optional[_Iterable[int]] = ..., prefix_block_tokens: _Optional[int] = ..., max_waiting: _Optional[int] = ..., kv_block_tokens: _Optional[int] = ..., kv_blocks: _Optional[int] = ..., max_batch: _Optional[int] = ...) -> None: ...

class Timing(_message.Message):
    __slots__ = ("prefill_ms", "cache_ready_ms", "first_token_ms", "second_token_ms", "transfer_bytes", "total_ms", "mode", "reused_tokens", "reuse_tier", "reload_bytes")
    PREFILL_MS_FIELD_NUMBER: _ClassVar[int]
    CACHE_READY_MS_FIELD_NUMBER: _ClassVar[int]
    FIRST_TOKEN_MS_FIELD_NUMBER: _ClassVar[int]
    SECOND_TOKEN_MS_FIELD_NUMBER: _ClassVar[int]
    TRANSFER_BYTES_FIELD_NUMBER: _ClassVar[int]
    TOTAL_MS_FIELD_NUMBER: _ClassVar[int]
    MODE_FIELD_NUMBER: _ClassVar[int]
    REUSED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    REUSE_TIER_FIELD_NUMBER: _ClassVar[int]
    RELOAD_BYTES_FIELD_NUMBER: _ClassVar[int]
    prefill_ms: float
    cache_ready_ms: float
    first_token_ms: float
    second_token_ms: float
    transfer_bytes: float
    total_ms: float
    mode: Mode
    reused_tokens: int
    reuse_tier: CacheTier
    reload_bytes: float
    def __init__(self, prefill_ms: _Optional[float] = ..., cache_ready_ms: _Optional[float] = ..., first_token_ms: _Optional[float] = ..., second_token_ms: _Optional[float] = ..., transfer_bytes: _Optional[float] = ..., total_ms: _Optional[float] = ..., mode: _Optional[_Union[Mode, str]] = ..., reused_tokens: _Optional[int] = ..., reuse_tier: _Optional[_Union[CacheTier, str]] = ..., reload_bytes: _Optional[float] = ...) -> None: ...

class GenerateResponse(_message.Message):
    __slots__ = ("token_id", "index", "logits_digest", "timing", "cache_digest", "finish_reason")
    TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    INDEX_FIELD_NUMBER: _ClassVar[int]
    LOGITS_DIGEST_FIELD_NUMBER: _ClassVar[int]
    TIMING_FIELD_NUMBER: _ClassVar[int]
    CACHE_DIGEST_FIELD_NUMBER: _ClassVar[int]
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    token_id: int
    index: int
    logits_digest: str
    timing: Timing
    cache_digest: str
    finish_reason: FinishReason
    def __init__(self, token_id: _Optional[int] = ..., index: _Optional[int] = ..., logits_digest: _Optional[str] = ..., timing: _Optional[_Union[Timing, _Mapping]] = ..., cache_digest: _Optional[str] = ..., finish_reason: _Optional[_Union[FinishReason, str]] = ...) -> None: ...

class Compat(_message.Message):
    __slots__ = ("model", "dtype", "weights_fingerprint", "geometry_digest", "num_layers", "kv_heads", "head_dim", "layout", "protocol_version", "deterministic", "batch_invariant")
    MODEL_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    WEIGHTS_FINGERPRINT_FIELD_NUMBER: _ClassVar[int]
    GEOMETRY_DIGEST_FIELD_NUMBER: _ClassVar[int]
    NUM_LAYERS_FIELD_NUMBER: _ClassVar[int]
    KV_HEADS_FIELD_NUMBER: _ClassVar[int]
    HEAD_DIM_FIELD_NUMBER: _ClassVar[int]
    LAYOUT_FIELD_NUMBER: _ClassVar[int]
    PROTOCOL_VERSION_FIELD_NUMBER: _ClassVar[int]
    DETERMINISTIC_FIELD_NUMBER: _ClassVar[int]
    BATCH_INVARIANT_FIELD_NUMBER: _ClassVar[int]
    model: str
    dtype: str
    weights_fingerprint: str
    geometry_digest: str
    num_layers: int
    kv_heads: int
    head_dim: int
    layout: str
    protocol_version: int
    deterministic: bool
    batch_invariant: bool
    def __init__(self, model: _Optional[str] = ..., dtype: _Optional[str] = ..., weights_fingerprint: _Optional[str] = ..., geometry_digest: _Optional[str] = ..., num_layers: _Optional[int] = ..., kv_heads: _Optional[int] = ..., head_dim: _Optional[int] = ..., layout: _Optional[str] = ..., protocol_version: _Optional[int] = ..., deterministic: _Optional[bool] = ..., batch_invariant: _Optional[bool] = ...) -> None: ...

class HandshakeRequest(_message.Message):
    __slots__ = ("compat", "transport", "max_receive_bytes", "data_address", "instance_id")
    COMPAT_FIELD_NUMBER: _ClassVar[int]
    TRANSPORT_FIELD_NUMBER: _ClassVar[int]
    MAX_RECEIVE_BYTES_FIELD_NUMBER: _ClassVar[int]
    DATA_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    INSTANCE_ID_FIELD_NUMBER: _ClassVar[int]
    compat: Compat
    transport: Transport
    max_receive_bytes: int
    data_address: str
    instance_id: int
    def __init__(self, compat: _Optional[_Union[Compat, _Mapping]] = ..., transport: _Optional[_Union[Transport, str]] = ..., max_receive_bytes: _Optional[int] = ..., data_address: _Optional[str] = ..., instance_id: _Optional[int] = ...) -> None: ...

class HandshakeResponse(_message.Message):
    __slots__ = ("compat", "transport", "instance_id", "epoch", "max_prompt_tokens")
    COMPAT_FIELD_NUMBER: _ClassVar[int]
    TRANSPORT_FIELD_NUMBER: _ClassVar[int]
    INSTANCE_ID_FIELD_NUMBER: _ClassVar[int]
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    MAX_PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    compat: Compat
    transport: Transport
    instance_id: int
    epoch: int
    max_prompt_tokens: int
    def __init__(self, compat: _Optional[_Union[Compat, _Mapping]] = ..., transport: _Optional[_Union[Transport, str]] = ..., instance_id: _Optional[int] = ..., epoch: _Optional[int] = ..., max_prompt_tokens: _Optional[int] = ...) -> None: ...

class PrefillRequest(_message.Message):
    __slots__ = ("request_id", "token_ids", "mode", "return_logits_digest", "sampling", "decode_instance")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    MODE_FIELD_NUMBER: _ClassVar[int]
    RETURN_LOGITS_DIGEST_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    DECODE_INSTANCE_FIELD_NUMBER: _ClassVar[int]
    request_id: int
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    mode: Mode
    return_logits_digest: bool
    sampling: Sampling
    decode_instance: int
    def __init__(self, request_id: _Optional[int] = ..., token_ids: _Optional[_Iterable[int]] = ..., mode: _Optional[_Union[Mode, str]] = ..., return_logits_digest: _Optional[bool] = ..., sampling: _Optional[_Union[Sampling, _Mapping]] = ..., decode_instance: _Optional[int] = ...) -> None: ...

class PrefillResponse(_message.Message):
    __slots__ = ("first_token", "first_logits_digest", "prefill_ms", "send_done_ms", "mode", "queued_tokens")
    FIRST_TOKEN_FIELD_NUMBER: _ClassVar[int]
    FIRST_LOGITS_DIGEST_FIELD_NUMBER: _ClassVar[int]
    PREFILL_MS_FIELD_NUMBER: _ClassVar[int]
    SEND_DONE_MS_FIELD_NUMBER: _ClassVar[int]
    MODE_FIELD_NUMBER: _ClassVar[int]
    QUEUED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    first_token: int
    first_logits_digest: str
    prefill_ms: float
    send_done_ms: float
    mode: Mode
    queued_tokens: int
    def __init__(self, first_token: _Optional[int] = ..., first_logits_digest: _Optional[str] = ..., prefill_ms: _Optional[float] = ..., send_done_ms: _Optional[float] = ..., mode: _Optional[_Union[Mode, str]] = ..., queued_tokens: _Optional[int] = ...) -> None: ...
