"""The one transfer interface: per request a sender and a receiver (five verbs), per connection a link.

Why this small: every backend (fake, nccl/gloo, grpc, cuda_ipc) implements exactly these and
passes the same contract suite; the wire frame is frames.py, memory views are layout.py,
building links is registry.py. State is an ordered enum, so the worst of many is `min()`.
The receiving side decides where layers land: `accept` takes a destination provider.
"""

from __future__ import annotations

import enum
from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import ClassVar

import torch


class TransferState(enum.IntEnum):
    FAILED = 0
    WAITING = 2  # opened/accepted, nothing moved yet
    TRANSFERRING = 3
    SUCCESS = 4


class Cause(enum.StrEnum):
    """Why a transfer failed; kvtransfer.rpc.status maps each to the gRPC status a request ends with."""
    ABORTED = "aborted"      # one side gave up (abort, or the receiver let go)
    TIMEOUT = "timeout"      # a deadline passed
    PEER = "peer"            # the other side or the connection is gone
    PROTOCOL = "protocol"    # a frame or a call that breaks the contract
    DATA_LOSS = "data_loss"  # bytes arrived corrupted (checksum)


class TransferError(RuntimeError):
    def __init__(self, cause: Cause | str, message: str):
        self.cause = Cause(cause)
        super().__init__(f"{self.cause.value}: {message}")


@dataclass(frozen=True)
class TransferHeader:
    """Sent before any layer, so the receiver sizes (or finds) the right memory for the right request."""
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

    def total_bytes(self) -> int:
        return self.layer_bytes() * self.num_layers


# Per layer (k, v), each with header.layer_shape() and header.dtype, on the receiving device. They MAY be
# non-contiguous views (e.g. a slice of a KV pool laid out (slots, kv_heads, max_seq, head_dim)).
Destination = Sequence[tuple[torch.Tensor, torch.Tensor]]
DestinationProvider = Callable[[TransferHeader], Destination]  # may raise TransferError: the frame is drained


def fresh_destination(header: TransferHeader, device) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """The default: one contiguous (layers, 2, batch, kv_heads, seq, head_dim) block, K/V adjacent."""
    block = torch.empty((header.num_layers, 2, *header.layer_shape()), dtype=header.dtype, device=device)
    return [(block[i, 0], block[i, 1]) for i in range(header.num_layers)]


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
    """Decode side of one request: layers land in the destination its link's `accept` was given."""
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


class SenderLink(ABC):
    """Prefill side of one connection; `open` starts one request's transfer."""
    survives_failed_request: ClassVar[bool]  # after one request fails, the link still carries the next
    abort_reaches_sender: ClassVar[bool]  # its receiver's abort fails the sender (False: the frame drains)

    @abstractmethod
    def open(self, header: TransferHeader) -> KVSender: ...
    @abstractmethod
    def close(self) -> None: ...


class ReceiverLink(ABC):
    """Decode side of one connection; `accept` yields the next request's receiver, its header checked."""
    survives_failed_request: ClassVar[bool]
    abort_reaches_sender: ClassVar[bool]  # a receiver's abort fails its sender (False: the frame is drained)
    address: str = ""  # what the prefill side connects to ("" for process-group links)

    @abstractmethod
    def accept(self, timeout: float | None = None, destinations: DestinationProvider | None = None) -> KVReceiver:
        """None: the backend's own fresh memory (cuda_ipc: views into its receive slot)."""

    @abstractmethod
    def close(self) -> None: ...

    def inflight(self) -> int:
        """Requests holding receive memory before `accept` hands them out (leak checks)."""
        return 0
