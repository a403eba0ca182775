"""The one frame spec: what every backend's header carries, one validator, and where layers land.

Why one: a header is the receiver's only description of what is coming, so it is checked
before anything is allocated, against the same limits, whatever the backend. Backends
only encode and decode `TransferHeader` (a tensor of int64 for nccl/gloo, a protobuf for
gRPC, a struct for cuda_ipc); their own extras (layers per message, stream counts, slots)
travel in their own header fields beside it and are checked by the backend.
`Placement` puts a request's layers into the caller's destination: the backend receives
straight into it when it is one contiguous block, else into a staging block and one
device-local copy per layer.
"""

from __future__ import annotations

import torch

from kvtransfer.geometry import CODE_DTYPES, DTYPE_CODES
from kvtransfer.transport.base import Destination, DestinationProvider, TransferError, TransferHeader, fresh_destination
from kvtransfer.transport.layout import contiguous_run, kv_block, kv_pair_view

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


def check_layer(header: TransferHeader, expected_idx: int, idx: int, k: torch.Tensor, v: torch.Tensor) -> None:
    """Sender-side validation shared by every backend: layer order, shapes and dtype match the header."""
    if idx != expected_idx:
        raise TransferError("protocol", f"layer {idx} sent, layer {expected_idx} expected (send in order)")
    want = header.layer_shape()
    for name, t in (("key", k), ("value", v)):
        if tuple(t.shape) != want or t.dtype != header.dtype:
            raise TransferError("protocol", f"layer {idx} {name} is {tuple(t.shape)} {t.dtype}, "
                                f"header says {want} {header.dtype}")


def check_destination(h: TransferHeader, device: torch.device, dest: Destination) -> list:
    """A provider's destination must hold exactly the header's layers, shapes and dtype, on `device`."""
    dest, device = list(dest), torch.device(device)
    if len(dest) != h.num_layers:
        raise TransferError("protocol", f"request {h.request_id}: destination has {len(dest)} layers, "
                            f"the frame {h.num_layers}")
    want = h.layer_shape()
    for i, kv in enumerate(dest):
        for name, t in zip(("key", "value"), kv):
            if tuple(t.shape) != want or t.dtype != h.dtype or t.device != device:
                raise TransferError("protocol", f"request {h.request_id}: destination layer {i} {name} is "
                                    f"{tuple(t.shape)} {t.dtype} on {t.device}; the frame needs {want} {h.dtype} "
                                    f"on {device}")
    return dest


def destination_for(h: TransferHeader, device: torch.device, destinations: DestinationProvider | None):
    """(destination, None), or (None, the provider's TransferError): that frame is drained and fails."""
    if destinations is None:
        return fresh_destination(h, device), None
    try:
        return check_destination(h, device, destinations(h)), None
    except TransferError as e:
        return None, e


class Placement:
    """Where one request's layers are received (`block`, (layers, 2, b, h, s, d)) and where they end up.

    dest None: a provider failed; the frame is drained into a scratch block and dropped.
    staging: the backend already received into this block (gRPC on CPU): always copy from it.
    """

    def __init__(self, h: TransferHeader, device: torch.device, dest: list | None, staging=None):
        self.dest = dest
        run = None
        if dest is not None and staging is None:
            pairs = [kv_pair_view(k, v) for k, v in dest]
            run = contiguous_run(pairs) if all(p is not None for p in pairs) else None
        self.direct = run is not None
        if run is None and staging is None:
            staging = kv_block(h.num_layers, h.layer_shape(), h.dtype, device)
        self.block = run if run is not None else staging
        self._placed = [self.direct or (dest is not None and dest[0][0].data_ptr() == staging[0, 0].data_ptr())
                        ] * h.num_layers

    def place(self, i: int) -> None:
        """Layer i is in `block[i]` (ordered before the current stream's work): copy it to its destination."""
        if self._placed[i] or self.dest is None:
            return
        k, v = self.dest[i]
        k.copy_(self.block[i, 0], non_blocking=True)  # device-local, on the current stream
        v.copy_(self.block[i, 1], non_blocking=True)
        self._placed[i] = True

    def layer(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        self.place(i)
        return self.dest[i]
