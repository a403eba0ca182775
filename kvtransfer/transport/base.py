"""The one transfer interface: a per-request sender and receiver, five verbs each.

Why this small: every backend (fake, nccl/gloo, grpc, cuda_ipc) implements exactly these
verbs and passes the same contract suite; optional features live beside it, not in it.
State is an ordered enum so the worst state of many layers or peers is `min()`.
"""

from __future__ import annotations

import enum
from abc import ABC, abstractmethod
from dataclasses import dataclass

import torch

from ..geometry import CODE_DTYPES, DTYPE_CODES


class TransferState(enum.IntEnum):
    FAILED = 0
    BOOTSTRAPPING = 1
    WAITING = 2
    TRANSFERRING = 3
    SUCCESS = 4


class TransferError(RuntimeError):
    """A transfer that cannot complete. `cause` is one of: aborted, timeout, peer, protocol, data_loss."""

    def __init__(self, cause: str, message: str):
        super().__init__(f"{cause}: {message}")
        self.cause = cause


HEADER_FIELDS = 8  # int64 slots on the wire; see TransferHeader.to_tensor


@dataclass(frozen=True)
class TransferHeader:
    """Sent before any layer, so the receiver sizes its buffers for the right request."""

    request_id: int
    seq_len: int
    num_layers: int
    kv_heads: int
    head_dim: int
    dtype: torch.dtype
    batch: int = 1

    def layer_shape(self) -> tuple[int, int, int, int]:
        return (self.batch, self.kv_heads, self.seq_len, self.head_dim)  # (batch, kv_heads, seq, head_dim)

    def layer_bytes(self) -> int:
        """Bytes of one layer's K plus V."""
        b, h, s, d = self.layer_shape()
        return 2 * b * h * s * d * torch.empty((), dtype=self.dtype).element_size()

    def to_tensor(self) -> torch.Tensor:
        return torch.tensor([self.request_id, self.seq_len, self.num_layers, self.kv_heads, self.head_dim,
                             DTYPE_CODES[self.dtype], self.batch, 0], dtype=torch.int64)

    @classmethod
    def from_tensor(cls, t: torch.Tensor) -> "TransferHeader":
        v = t.tolist()
        if len(v) != HEADER_FIELDS or v[5] not in CODE_DTYPES:
            raise TransferError("protocol", f"malformed transfer header {v}")
        return cls(request_id=v[0], seq_len=v[1], num_layers=v[2], kv_heads=v[3], head_dim=v[4],
                   dtype=CODE_DTYPES[v[5]], batch=v[6])


def check_layer(header: TransferHeader, expected_idx: int, idx: int, k: torch.Tensor, v: torch.Tensor) -> None:
    """Shared sender-side validation: layer order, shapes and dtype match the header."""
    if idx != expected_idx:
        raise TransferError("protocol", f"layer {idx} sent, layer {expected_idx} expected (send in order)")
    want = header.layer_shape()
    for name, t in (("key", k), ("value", v)):
        if tuple(t.shape) != want or t.dtype != header.dtype:
            raise TransferError("protocol", f"layer {idx} {name} is {tuple(t.shape)} {t.dtype}, "
                                f"header says {want} {header.dtype}")


class KVSender(ABC):
    """Prefill side of one request. `send_layer` must not block the compute stream."""

    header: TransferHeader

    @abstractmethod
    def send_layer(self, layer_idx: int, key: torch.Tensor, value: torch.Tensor) -> None: ...

    @abstractmethod
    def finish(self, timeout: float | None = None) -> None:
        """Block until every layer has left (or raise TransferError)."""

    @abstractmethod
    def abort(self, reason: str) -> None: ...

    @abstractmethod
    def status(self) -> TransferState: ...


class KVReceiver(ABC):
    """Decode side of one request."""

    header: TransferHeader

    @abstractmethod
    def wait_for_layer(self, layer_idx: int, timeout: float | None = None) -> tuple[torch.Tensor, torch.Tensor]: ...

    @abstractmethod
    def finish(self, timeout: float | None = None) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Block until every layer has landed; return them in layer order (or raise TransferError)."""

    @abstractmethod
    def abort(self, reason: str) -> None: ...

    @abstractmethod
    def status(self) -> TransferState: ...
