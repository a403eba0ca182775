"""The one frame spec: what every backend's header carries, and one validator.

Why one: a header is the receiver's only description of what is coming, so it is checked
before anything is allocated, against the same limits, whatever the backend. Backends
only encode and decode `TransferHeader` (a tensor of int64 for nccl/gloo, a protobuf for
gRPC, a struct for cuda_ipc); their own extras (layers per message, stream counts, slots)
travel in their own header fields beside it and are checked by the backend.
Where the layers land is landing.py's job.
"""

from __future__ import annotations

from kvtransfer.geometry import CODE_DTYPES, DTYPE_CODES
from kvtransfer.transport.base import TransferError, TransferHeader

MAX_LAYERS = 4096  # no model has more; a larger count is a corrupt header
DIMS = ("seq_len", "num_layers", "kv_heads", "head_dim", "batch")


def make_header(request_id: int, seq_len: int, num_layers: int, kv_heads: int, head_dim: int, dtype_code: int,
                batch: int, max_bytes: int, max_layers: int = MAX_LAYERS) -> TransferHeader:
    """Decoded wire fields -> a checked TransferHeader: sane fields, a known dtype, within the limits."""
    fields = dict(seq_len=seq_len, num_layers=num_layers, kv_heads=kv_heads, head_dim=head_dim, batch=batch)
    bad = [f"{k}={v}" for k, v in fields.items() if v < 1]
    if bad:
        raise TransferError("protocol", f"request {request_id}: header fields must be >= 1 ({', '.join(bad)})")
    if dtype_code not in CODE_DTYPES:
        raise TransferError("protocol", f"request {request_id}: unknown dtype code {dtype_code}")
    if num_layers > max_layers:
        raise TransferError("protocol", f"request {request_id}: {num_layers} layers exceed {max_layers}")
    h = TransferHeader(request_id=request_id, dtype=CODE_DTYPES[dtype_code], **fields)
    if h.total_bytes() > max_bytes:
        raise TransferError("protocol", f"request {request_id}: transfer of {h.total_bytes()} bytes exceeds the "
                            f"receive limit max_bytes={max_bytes}")
    return h


def check_header(h: TransferHeader, max_bytes: int, max_layers: int = MAX_LAYERS) -> TransferHeader:
    """The validator for a header built locally (sender side, or a backend that decoded one itself)."""
    if h.dtype not in DTYPE_CODES:
        raise TransferError("protocol", f"request {h.request_id}: unsupported dtype {h.dtype}")
    return make_header(h.request_id, h.seq_len, h.num_layers, h.kv_heads, h.head_dim, DTYPE_CODES[h.dtype],
                       h.batch, max_bytes, max_layers)


def header_fields(h: TransferHeader) -> list[int]:
    """The header as wire integers, in make_header's argument order (without the limits)."""
    return [h.request_id, h.seq_len, h.num_layers, h.kv_heads, h.head_dim, DTYPE_CODES[h.dtype], h.batch]
